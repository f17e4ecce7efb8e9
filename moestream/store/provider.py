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
        # Transposed views for the decode path's `mm(out=)` calls: (w13ᵀ [D, 2I], w2ᵀ [I, D]).
        self._t = {}
        for layer in w13:
            parts = [w13[layer], w2[layer]]
            if b13 is not None:
                parts += [b13[layer], b2[layer]]
            self._experts[layer] = list(zip(*(t.unbind(0) for t in parts)))
            self._t[layer] = (
                w13[layer].transpose(1, 2).unbind(0),
                w2[layer].transpose(1, 2).unbind(0),
            )
        self.plain = b13 is None and act is None
        self._bufs = DecodeBuffers()

    def experts(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        if x.shape[0] == 1:
            if self.plain:
                w13t, w2t = self._t[layer]
                return moe_decode_plain(x, ids, weights, w13t, w2t, self._bufs)
            return moe_decode(x, ids, weights, self._experts[layer].__getitem__, self.act)
        return moe_grouped(x, ids, weights, self._experts[layer].__getitem__, self.act)


class DecodeBuffers:
    """Scratch for one decode step's K experts, kept between steps with its per-slot views: at
    one token every torch call is dispatch overhead (~1-3 us here), so the views are made once.
    Not shared between threads (the engine runs one forward pass at a time)."""

    def __init__(self):
        self._by_key: dict = {}

    def get(self, K: int, D: int, I: int, dtype: torch.dtype, device: torch.device):
        key = (K, D, I, dtype, device)
        b = self._by_key.get(key)
        if b is None:
            h = torch.empty(K, 1, 2 * I, dtype=dtype, device=device)  # gate | up per slot
            a = torch.empty(K, 1, I, dtype=dtype, device=device)  # silu(gate) * up
            y = torch.empty(K, 1, D, dtype=dtype, device=device)  # down per slot
            b = self._by_key[key] = (
                h.unbind(0),
                h[..., :I],
                h[..., I:],
                a,
                a.unbind(0),
                y,
                y.unbind(0),
                y.view(K, D),
            )
        return b


def moe_decode_plain(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13t,
    w2t,
    bufs: DecodeBuffers,
) -> torch.Tensor:
    """One token, plain SwiGLU experts in few torch calls: per expert one GEMM for gate|up and
    one for down written into fixed per-slot rows, one SiLU*up over all K slots, then the
    weighted sum. fp32 sums with one [1, K] @ [K, D] GEMM; lower precision keeps transformers'
    rounding steps (weight product in the weights' dtype, cast, then adds in ascending expert
    order), so bf16 stays bit-identical to its eager path."""
    K = ids.shape[1]
    I = w2t[0].shape[0]
    h, gate, up, a, a_rows, y, y_rows, y2d = bufs.get(K, x.shape[1], I, x.dtype, x.device)
    experts = ids.tolist()[0]
    for k, e in enumerate(experts):
        torch.mm(x, w13t[e], out=h[k])
    torch.mul(F.silu(gate), up, out=a)
    for k, e in enumerate(experts):
        torch.mm(a_rows[k], w2t[e], out=y_rows[k])
    if x.dtype == torch.float32:
        return torch.mm(weights, y2d)
    scaled = (y * weights.view(K, 1, 1)).to(x.dtype).unbind(0)
    order = sorted(range(K), key=experts.__getitem__)
    out = scaled[order[0]]
    for k in order[1:]:
        out = out + scaled[k]
    return out


def moe_decode(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    get_expert,
    act: ExpertActivation | None = None,
) -> torch.Tensor:
    """One token through experts with biases or a clamped activation (gpt_oss; plain SwiGLU
    experts take moe_decode_plain): the reference expert_ffn per expert, in ascending id order
    (the summation order of transformers). get_expert(e) -> (w13, w2, b13, b2) or (w13, w2)."""
    out = torch.zeros_like(x)
    for e, w in sorted(zip(ids[0].tolist(), weights[0].tolist())):
        out += expert_ffn(x, *get_expert(e), act=act) * w
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
