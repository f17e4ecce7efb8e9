"""The resident provider: every expert of every MoE layer in RAM as dense tensors (a Hugging Face
folder loaded directly, without a store)."""

from __future__ import annotations

import torch

from moestream.experts.base import ExpertProvider
from moestream.kernels.moe_cpu import DecodeBuffers, moe_decode, moe_decode_plain, moe_grouped
from moestream.kernels.ref import ExpertActivation


class ResidentExperts(ExpertProvider):
    """Experts as w13 [E, 2I, D] and w2 [E, D, I] per layer, plus (gpt_oss) biases b13 [E, 2I],
    b2 [E, D] and a clamped activation."""

    def __init__(
        self,
        w13: dict[int, torch.Tensor],
        w2: dict[int, torch.Tensor],
        b13: dict[int, torch.Tensor] | None = None,
        b2: dict[int, torch.Tensor] | None = None,
        act: ExpertActivation | None = None,
    ):
        self.w13, self.w2, self.b13, self.b2, self.act = w13, w2, b13, b2, act
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

    def describe(self) -> dict:
        return {"experts": "resident", "quant": "none (checkpoint weights)"}

    def experts(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        if x.shape[0] == 1:
            if self.plain:
                w13t, w2t = self._t[layer]
                return moe_decode_plain(x, ids, weights, w13t, w2t, self._bufs)
            return moe_decode(x, ids, weights, self._experts[layer].__getitem__, self.act)
        return moe_grouped(x, ids, weights, self._experts[layer].__getitem__, self.act)
