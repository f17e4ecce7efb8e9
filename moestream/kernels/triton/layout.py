"""One MoE layer's experts stacked on the device in the store's record layout, and its reference.

`StackedExperts` holds every section of quant.py with a leading expert axis E:
  bf16: w13.q bf16 [E, 2I, D]              w2.q bf16 [E, D, I]
  int8: w13.q int8 [E, 2I, D], w13.s fp32 [E, 2I, D/g]   (w2 likewise)
  int4: w13.q uint8 [E, 2I, D/2] in the store's packed layout, w13.sz bf16 [E, D/g, 2I, 2]
The int4 bytes stay in the store layout (no repack): per block of 64 rows the bytes are [K, 32]
with row d in the low and row d + 32 in the high nibble, so a K-tile of one block is BK*32
contiguous bytes (coalesced) and a record can be copied from host to a VRAM slot as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moestream.kernels.ref import dequantize, moe_ref
from moestream.quant import QuantScheme, quantize

NAMES = ("w13", "w2")


@dataclass(frozen=True, slots=True)
class StackedExperts:
    scheme: QuantScheme
    sections: dict[str, torch.Tensor]  # "w13.q" -> [E, ...]

    def __post_init__(self):
        if "b13" in self.sections:  # the kernels and moe_stacked_ref would drop them silently
            raise NotImplementedError(
                "experts with biases and the clamped SwiGLU (gpt_oss) are not supported by the "
                "Triton kernels yet; run them with a CPU provider"
            )
        q = self.sections["w13.q"]
        e, n2, _ = q.shape
        assert n2 % 2 == 0, f"w13 has an odd number of rows {n2}"
        for name, t in self.sections.items():
            assert t.shape[0] == e, f"{name}: {t.shape[0]} experts, w13.q has {e}"
            assert t.is_contiguous(), f"{name} must be contiguous"

    @property
    def num_experts(self) -> int:
        return self.sections["w13.q"].shape[0]

    @property
    def hidden(self) -> int:
        return self.sections["w2.q"].shape[1]

    @property
    def inter(self) -> int:
        return self.sections["w13.q"].shape[1] // 2

    def expert(self, e: int) -> dict[str, torch.Tensor]:
        """Section views of expert e, as a record's `RecordLayout.views` gives them."""
        return {name: t[e] for name, t in self.sections.items()}

    def expert_bytes(self) -> int:
        """Bytes of one expert's sections (what a kernel must read per routed expert)."""
        return sum(t[0].numel() * t.element_size() for t in self.sections.values())

    def to(self, device) -> StackedExperts:
        return StackedExperts(self.scheme, {k: v.to(device) for k, v in self.sections.items()})


def stack_records(scheme: QuantScheme, records: list[dict[str, torch.Tensor]]) -> StackedExperts:
    """Per-expert section dicts (e.g. store record views) -> one StackedExperts."""
    names = records[0].keys()
    return StackedExperts(scheme, {n: torch.stack([r[n] for r in records]) for n in names})


def quantize_stacked(scheme: QuantScheme, w13: torch.Tensor, w2: torch.Tensor) -> StackedExperts:
    """Dense w13 [E, 2I, D], w2 [E, D, I] -> StackedExperts under scheme (quant.py's quantizers)."""
    records = []
    for a, b in zip(w13, w2):
        rec = {f"w13.{k}": v for k, v in quantize(scheme, a).items()}
        rec.update({f"w2.{k}": v for k, v in quantize(scheme, b).items()})
        records.append(rec)
    return stack_records(scheme, records)


def moe_stacked_ref(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    experts: StackedExperts,
    expert_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """The spec: kernels/ref.py's dequantize + moe_ref in x's dtype. moe_ref indexes with CPU
    tensors, so it runs on the CPU (only the routed experts are copied) and returns on x's device.
    `ids` index `experts`; when that is a slot pool, `expert_ids` (same shape) names the expert
    each slot holds, and experts are added in ascending expert id, as with every expert
    resident, so the bits do not depend on which slots hold them."""
    g = experts.scheme.group_size
    where = None
    if expert_ids is not None:
        where = dict(zip(expert_ids.reshape(-1).tolist(), ids.reshape(-1).tolist()))
        ids = expert_ids

    def get(e):
        sec = experts.expert(e if where is None else where[e])
        return tuple(dequantize(sec, n, g, x.dtype).cpu() for n in NAMES)

    out = moe_ref(x.cpu(), ids.cpu(), weights.cpu(), get)
    return out.to(x.device)
