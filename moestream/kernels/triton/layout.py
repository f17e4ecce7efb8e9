"""One MoE layer's experts stacked on the device in the store's record layout, and its reference.

`StackedExperts` holds every section of quant.py with a leading expert axis E:
  bf16: w13.q bf16 [E, 2I, D]              w2.q bf16 [E, D, I]
  int8: w13.q int8 [E, 2I, D], w13.s fp32 [E, 2I, D/g]   (w2 likewise)
  int4: w13.q uint8 [E, 2I, D/2] in the store's packed layout, w13.sz bf16 [E, 2I * D/g, 2]
        blocked as the store keeps it, or (a GPU pool and its mirror) [E, D/g, 2I, 2], the order
        the store-layout kernels read (kernel_sections)
  int4 rows (the GPU pool's layout, `kernel_quant` "int4r"): w13.q uint8 [E, 2I, D/2] row-major,
        per 32 inputs 16 bytes (input i low nibble, i + 16 high, as q4_0), w13.rz int32
        [E, 2I, D/g] the (scale, zero) bf16 pair of each row's group (quant.int4_to_rows)
In the store layout a block of 64 rows is [K, 32] bytes with row d in the low and row d + 32 in
the high nibble: a K-tile of one block is BK*32 contiguous bytes, but a thread then holds one
input of 32 rows and needs every row's scale and zero per weight (the kernels ran at 0.2 of
their roofline). The row layout is the int8 kernels' structure with half the bytes; records are
repacked once as they enter the pool or its pinned mirror (`rows_sections`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moestream.kernels.ref import dequantize, moe_ref
from moestream.quant import (
    QuantScheme,
    int4_from_rows,
    int4_sz_blocked,
    int4_sz_kn,
    int4_to_rows,
    quantize,
)

NAMES = ("w13", "w2")
# the row layouts (`StackedExperts.kernel_quant`): 16 bytes a row's 32 inputs (input i low nibble,
# i + 16 high): int4 rows, and a GGUF's q4_0 / q4_1 blocks as stored
ROW_QUANTS = ("int4r", "q4_0", "q4_1")
# a GGUF's K-quant super-blocks as stored (quant.KQUANT_BYTES: [N, K/256, B] bytes, the scales
# inside): the decode kernels' super-block steps and the grouped GEMMs' block dequant read them
KQUANTS = ("q4_k", "q5_k", "q6_k")
# a K-quant layer's down projection where 256 does not divide the experts' width (DeepSeek-V2-
# Lite's and Qwen1.5-MoE's 1408): llama-quantize's fallbacks, Q5_0 for Q4_K and Q8_0 for Q6_K,
# kept as q5_0 blocks and int8 (quant.py). The GPU reads them only there, below K-quant gate/up.
DOWN_FALLBACKS = ("q5_0", "int8")


@dataclass(frozen=True, slots=True)
class StackedExperts:
    scheme: QuantScheme
    sections: dict[str, torch.Tensor]  # "w13.q" -> [E, ...]
    # the most distinct matrices one call routes to: a slot pool's layer expert count (a call's
    # ids are one layer's experts); None: all of them (the grouped prefill sizes its scratch so)
    routed: int | None = None
    # w2's scheme where it differs from w13's (a GGUF's K-quant layer, e.g. Q4_K_M's q4_k gate/up
    # and q6_k down, or a fallback of DOWN_FALLBACKS where 256 does not divide I)
    down: QuantScheme | None = None

    def __post_init__(self):
        if "b13" in self.sections:  # the kernels and moe_stacked_ref would drop them silently
            raise NotImplementedError(
                "experts with biases and the clamped SwiGLU (gpt_oss) are not supported by the "
                "Triton kernels yet; run them with a CPU provider"
            )
        if self.down is not None:
            assert self.scheme.name in KQUANTS and self.down.name in (*KQUANTS, *DOWN_FALLBACKS), (
                f"w13 {self.scheme.name} and w2 {self.down.name}: projections of different "
                "schemes are K-quant gate/up over a K-quant or a fallback down"
            )
        q = self.sections["w13.q"]
        e, n2 = q.shape[:2]
        assert n2 % 2 == 0, f"w13 has an odd number of rows {n2}"
        for name, t in self.sections.items():
            assert t.shape[0] == e, f"{name}: {t.shape[0]} experts, w13.q has {e}"
            # each expert's section contiguous; only a K-quant pool's smaller layouts are views
            # into slots of its largest record (per-layer layouts), whose stride the kernels take
            # (block formats only: their scales are in the blocks)
            assert t.is_contiguous() or (
                name.endswith(".q")
                and self.quant_of(name[:-2]) in (*KQUANTS, "q5_0")
                and per_expert(t)
            ), f"{name} must be contiguous"

    @property
    def num_experts(self) -> int:
        return self.sections["w13.q"].shape[0]

    @property
    def hidden(self) -> int:
        return self.sections["w2.q"].shape[1]

    @property
    def inter(self) -> int:
        return self.sections["w13.q"].shape[1] // 2

    @property
    def rows(self) -> bool:
        """int4 in the GPU's row layout (w13.rz) rather than the store's."""
        return "w13.rz" in self.sections

    @property
    def kernel_quant(self) -> str:
        """The layout the kernels read: the scheme's name, or "int4r" for int4 rows."""
        return "int4r" if self.rows else self.scheme.name

    def quant_of(self, name: str) -> str:
        """The layout the kernels read for projection name ("w13" or "w2")."""
        return self.down_quant if name == "w2" else self.kernel_quant

    def scheme_of(self, name: str) -> QuantScheme:
        """Projection name's ("w13" or "w2") scheme: w2's own where it differs."""
        return self.down if name == "w2" and self.down is not None else self.scheme

    @property
    def down_quant(self) -> str:
        """The layout the down kernels read: kernel_quant, or w2's own K-quant."""
        return self.kernel_quant if self.down is None else self.down.name

    def expert(self, e: int) -> dict[str, torch.Tensor]:
        """Expert e's sections in the store layout, as a record's `RecordLayout.views` gives them
        (views; an int4 rows pool's are unpacked back, a copy)."""
        if not self.rows:  # (a pool's int4 sz in the kernels' order: blocked again, a copy)
            return {
                name: int4_sz_blocked(t[e]) if name.endswith(".sz") and t.dim() == 4 else t[e]
                for name, t in self.sections.items()
            }
        out = {}
        for n in NAMES:
            q, sz = int4_from_rows(self.sections[f"{n}.q"][e], self.sections[f"{n}.rz"][e])
            out.update({f"{n}.q": q, f"{n}.sz": sz})
        return out

    def to_rows(self) -> StackedExperts:
        """This int4 layer in the GPU's row layout (the same numbers)."""
        assert self.scheme.name == "int4" and not self.rows
        return StackedExperts(self.scheme, rows_sections(self.scheme, self.sections), self.routed)

    def expert_bytes(self) -> int:
        """Bytes of one expert's sections (what a kernel must read per routed expert)."""
        return sum(t[0].numel() * t.element_size() for t in self.sections.values())

    def to(self, device) -> StackedExperts:
        secs = {k: v.to(device) for k, v in self.sections.items()}
        return StackedExperts(self.scheme, secs, self.routed, self.down)


def per_expert(t: torch.Tensor) -> bool:
    """Each t[i] is contiguous, and the experts do not overlap (a view of padded slots)."""
    inner = torch.empty(t.shape[1:], device="meta").stride()
    return t.stride()[1:] == inner and t.stride(0) >= t[0].numel()


def padded_view(t: torch.Tensor, shape: tuple, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Slots t [n, ...] read as [n, *shape] of dtype (default t's) packed at each slot's start (a
    smaller record layout in a pool of its largest record's slots: a q5_0 down's uint8 blocks in
    an int8 down's slots)."""
    flat = t.view(t.shape[0], -1)
    if dtype is not None and dtype != t.dtype:
        flat = flat.view(torch.uint8).view(dtype)
    return flat[:, : torch.Size(shape).numel()].view(t.shape[0], *shape)


def kernel_sections(experts: StackedExperts) -> dict[str, torch.Tensor]:
    """The sections as the store-layout Triton kernels index them: int4's sz in torch's tinygemm
    order [E, K/G, N, 2]. The GPU pool and its mirror hold it so (rows_sections, rows False);
    records stacked in the store's blocked order [E, N * K/G, 2] (tests, benchmarks) are reordered
    here, a copy per call."""
    if experts.rows or experts.scheme.name != "int4" or experts.sections["w13.sz"].dim() == 4:
        return experts.sections
    return rows_sections(experts.scheme, experts.sections, rows=False)


def rows_sections(
    scheme: QuantScheme, sections: dict[str, torch.Tensor], rows: bool = True
) -> dict[str, torch.Tensor]:
    """Stacked sections [m, ...] in the store layout -> the kernels' pool layout: int4's q and sz
    as rows and rz (quant.int4_to_rows), or (`rows` False) its sz in the store-layout kernels'
    [m, K/G, N, 2] order (quant.int4_sz_kn, once as records enter the pool); other schemes as
    they are."""
    if scheme.name != "int4":
        return sections
    if not rows:
        return {
            k: int4_sz_kn(v, sections[k[:-3] + ".q"].shape[1]) if k.endswith(".sz") else v
            for k, v in sections.items()
        }
    out = {}
    for n in NAMES:
        out[f"{n}.q"], out[f"{n}.rz"] = int4_to_rows(
            sections[f"{n}.q"], sections[f"{n}.sz"], scheme.group_size
        )
    return out


def pool_shapes(
    scheme: QuantScheme, shapes: dict[str, tuple], rows: bool = True
) -> dict[str, tuple]:
    """A record's sections name -> (shape, dtype) in the pool layout (rows_sections): int4's sz
    [N * K/G, 2] bf16 becomes rz [N, K/G] int32, or (`rows` False) sz [K/G, N, 2]; other schemes
    as they are."""
    if scheme.name != "int4":
        return shapes
    out = {}
    for n, (sh, dt) in shapes.items():
        if n.endswith(".sz"):
            n_rows = shapes[n[:-3] + ".q"][0][0]
            if rows:
                out[n[:-3] + ".rz"] = ((n_rows, sh[0] // n_rows), torch.int32)
            else:
                out[n] = ((sh[0] // n_rows, n_rows, 2), dt)
        else:
            out[n] = (sh, dt)
    return out


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
    where = None
    if expert_ids is not None:
        where = dict(zip(expert_ids.reshape(-1).tolist(), ids.reshape(-1).tolist()))
        ids = expert_ids

    def get(e):
        sec = experts.expert(e if where is None else where[e])
        return tuple(
            dequantize(sec, n, experts.scheme_of(n).group_size, x.dtype).cpu() for n in NAMES
        )

    out = moe_ref(x.cpu(), ids.cpu(), weights.cpu(), get)
    return out.to(x.device)
