"""The expert-provider interface the MoE blocks call, and the resident provider (all experts in RAM).

`experts(layer, x, ids, weights)` computes the routed experts' weighted sum for the tokens x. A
provider decides where the weights come from (RAM, a streamed slot cache, a GPU pool); models do not.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from moestream.kernels.ref import ExpertActivation, expert_ffn


class ExpertProvider(Protocol):
    def experts(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """x [T, D], ids [T, K] int64, weights [T, K] -> [T, D]."""
        ...


class ResidentExperts:
    """All experts of every MoE layer held in memory as w13 [E, 2I, D] and w2 [E, D, I], plus
    (gpt_oss) biases b13 [E, 2I], b2 [E, D] and a clamped activation."""

    def __init__(
        self,
        w13: dict[int, torch.Tensor],
        w2: dict[int, torch.Tensor],
        b13: dict[int, torch.Tensor] | None = None,
        b2: dict[int, torch.Tensor] | None = None,
        act: ExpertActivation | None = None,
    ):
        self.w13, self.w2, self.act = w13, w2, act
        # Per-expert views in Python lists: indexing a list costs no torch op on the decode path.
        # An entry is (w13, w2) or, with biases, (w13, w2, b13, b2).
        self._experts = {}
        for layer in w13:
            parts = [w13[layer], w2[layer]]
            if b13 is not None:
                parts += [b13[layer], b2[layer]]
            self._experts[layer] = list(zip(*(t.unbind(0) for t in parts)))

    def experts(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        table = self._experts[layer]
        if x.shape[0] == 1:
            return moe_decode(x, ids, weights, table.__getitem__, self.act)
        return moe_grouped(x, ids, weights, table.__getitem__, self.act)


def moe_decode(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    get_expert,
    act: ExpertActivation | None = None,
) -> torch.Tensor:
    """One token: its K experts in ascending id order (the summation order of transformers), each
    down projection accumulated in place with the gate weight as the GEMM's alpha (6 ops/expert
    in fp32). get_expert(e) -> (w13, w2) or (w13, w2, b13, b2); biased or clamped experts run the
    reference expert_ffn."""
    out = torch.zeros_like(x)
    fused = x.dtype == torch.float32  # low precision keeps transformers' rounding steps instead
    for e, w in sorted(zip(ids[0].tolist(), weights[0].tolist())):
        w13, w2, *bias = get_expert(e)
        if bias or act is not None:
            out += expert_ffn(x, w13, w2, *bias, act=act) * w
            continue
        gate, up = F.linear(x, w13).chunk(2, dim=-1)
        if fused:
            out.addmm_(F.silu(gate) * up, w2.t(), alpha=w)
        else:
            out += F.linear(F.silu(gate) * up, w2) * w
    return out


def moe_grouped(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    get_expert,
    act: ExpertActivation | None = None,
) -> torch.Tensor:
    """Prefill: group tokens by expert (one sort instead of a Python loop over tokens)."""
    T, K = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=1).tolist()
    tok = order // K
    slot = order % K
    out = torch.zeros_like(x)
    begin = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        t, s = tok[begin : begin + n], slot[begin : begin + n]
        begin += n
        w13, w2, *bias = get_expert(e)
        y = expert_ffn(x[t], w13, w2, *bias, act=act) * weights[t, s, None]
        out.index_add_(0, t, y.to(out.dtype))
    return out
