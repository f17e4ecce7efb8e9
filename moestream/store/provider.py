"""The expert-provider interface the MoE blocks call, and the resident provider (all experts in RAM).

`experts(layer, x, ids, weights)` computes the routed experts' weighted sum for the tokens x. A
provider decides where the weights come from (RAM, a streamed slot cache, a GPU pool); models do not.
"""

from __future__ import annotations

from typing import Protocol

import torch

from moestream.kernels.ref import expert_ffn


class ExpertProvider(Protocol):
    def experts(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """x [T, D], ids [T, K] int64, weights [T, K] -> [T, D]."""
        ...


class ResidentExperts:
    """All experts of every MoE layer held in memory as w13 [E, 2I, D] and w2 [E, D, I]."""

    def __init__(self, w13: dict[int, torch.Tensor], w2: dict[int, torch.Tensor]):
        self.w13, self.w2 = w13, w2

    def experts(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        w13, w2 = self.w13[layer], self.w2[layer]
        if x.shape[0] == 1:
            # Decode: K experts of one token; ascending id order keeps the sum order of transformers.
            out = torch.zeros_like(x)
            for e, k in sorted(zip(ids[0].tolist(), range(ids.shape[1]))):
                out += (expert_ffn(x, w13[e], w2[e]) * weights[:, k : k + 1]).to(x.dtype)
            return out
        return moe_grouped(x, ids, weights, lambda e: (w13[e], w2[e]))


def moe_grouped(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, get_expert
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
        w13, w2 = get_expert(e)
        y = expert_ffn(x[t], w13, w2) * weights[t, s, None]
        out.index_add_(0, t, y.to(out.dtype))
    return out
