"""Frozen float experts for training on a GPU (train-recovery): every expert of a layer over every
token of the call in batched GEMMs, the unrouted ones weighted 0.

A GPU step of the per-expert loop (`kernels/moe_cpu.moe_grouped`, `kernels/ref.moe_ref`) is ~10
launches per expert and layer, forward and backward: for a small model, launches rather than
FLOPs bound it. Here a layer is three GEMMs and a weighted sum whatever E is, for E/K times the
FLOPs: the same sum over the routed experts (exact zeros for the others), rounded in another
order. Weights stay float (a store's records dequantized once, `from_store`: the values its `ref`
kernel recomputes on every call), so they suit a model that fits the device in float.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moestream.experts.base import ExpertProvider
from moestream.kernels.ref import ExpertActivation, dequantize

Weights = dict[int, torch.Tensor]


class BatchedExperts(ExpertProvider):
    """w13 [E, 2I, D] and w2 [E, D, I] per layer (gate rows then up rows), optional biases b13
    [E, 2I], b2 [E, D], and gpt_oss's clamped activation (None: silu)."""

    def __init__(
        self,
        w13: Weights,
        w2: Weights,
        b13: Weights | None = None,
        b2: Weights | None = None,
        act: ExpertActivation | None = None,
    ):
        self.w13, self.w2, self.b13, self.b2, self.act = w13, w2, b13, b2, act

    @staticmethod
    def from_store(store, dtype: torch.dtype) -> BatchedExperts:
        """Every record of a store dequantized once into `dtype` (on the CPU)."""
        w13, w2, b13, b2 = {}, {}, {}, {}
        for layer, crcs in sorted(store.crc.items()):
            lay = store.layouts[layer]
            g13, g2 = lay.groups
            recs = [lay.views(torch.frombuffer(bytearray(store.read_record(layer, e)),
                                               dtype=torch.uint8)) for e in range(len(crcs))]  # fmt: skip
            w13[layer] = torch.stack([dequantize(r, "w13", g13, dtype) for r in recs])
            w2[layer] = torch.stack([dequantize(r, "w2", g2, dtype) for r in recs])
            if "b13" in recs[0]:  # stored unquantized
                b13[layer] = torch.stack([r["b13"].to(dtype) for r in recs])
                b2[layer] = torch.stack([r["b2"].to(dtype) for r in recs])
        return BatchedExperts(
            w13, w2, b13 or None, b2 or None, ExpertActivation.from_args(store.args)
        )

    def to(self, device: str | torch.device) -> BatchedExperts:
        def moved(d: Weights | None) -> Weights | None:
            return None if d is None else {k: v.to(device) for k, v in d.items()}

        return BatchedExperts(
            moved(self.w13), moved(self.w2), moved(self.b13), moved(self.b2), self.act
        )

    def describe(self) -> dict:
        return {"experts": "batched (every expert, float)", "quant": "none (dequantized)"}

    def experts(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """x [T, D], ids/weights [T, K] -> [T, D]: sum_k weights[t, k] * expert_{ids[t, k]}(x[t])."""
        w13, w2 = self.w13[layer], self.w2[layer]
        E, I2, D = w13.shape
        h = (x @ w13.reshape(E * I2, D).t()).view(-1, E, I2)  # [T, E, 2I]
        if self.b13 is not None:
            h = h + self.b13[layer]
        gate, up = h.chunk(2, dim=-1)
        a = F.silu(gate) * up if self.act is None else self.act(gate, up)  # [T, E, I]
        y = torch.bmm(a.transpose(0, 1), w2.transpose(1, 2))  # [E, T, D]
        if self.b2 is not None:
            y = y + self.b2[layer][:, None]
        # each token's gate weights over all E experts, 0 where unrouted [T, E]
        dense = (F.one_hot(ids, E).to(x.dtype) * weights[..., None].to(x.dtype)).sum(1)
        return torch.bmm(dense[:, None, :], y.transpose(0, 1)).squeeze(1)
