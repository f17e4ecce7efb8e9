"""A candidate prefill MoE path for issue 22, off the product path until an H200 run says it is
faster: the layer's int4 rows dequantized to the activation dtype by one Triton launch per
weight (`dequant_rows`: kernels/triton/dequant.py; spec `dequant_rows_ref`, the spec's
`(v - 8) * s + z` in fp32 then rounded, so the weights the grouped kernels multiply), then the
routed products as two vendor grouped GEMMs (`torch._grouped_mm`: CUTLASS on sm_90, a loop on
the CPU) over the pairs sorted by expert, and the pairs combined by `combine_pairs` (each
token's rows in slot order, no atomics). The products' blocking is the library's, so the bits differ from
`prefill.moe_prefill`'s and from the spec within rounding; the experts' outputs are rounded to
the activation dtype as the spec's are.

Why try it: the grouped Triton kernels take 1.6-1.8 ms a layer at 64-512 tokens, 0.04-0.07 of
the HBM rate for the int4 rows they read (docs/gpu.md, "GPU prefill"); writing and reading the layer
once as bf16 (1.2 GB at Qwen3-30B-A3B's shapes) is ~0.6 ms of HBM time, and the GEMMs are the
library's. The cost: a scratch of E x 3 x D x I values, all experts dequantized whatever the
prompt touches (so it only pays from some tens of tokens on). `bench_prefill_grouped.py`
measures both paths side by side."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moestream.kernels.triton.decode import combine_pairs
from moestream.kernels.triton.dequant import dequant_int4_rows
from moestream.kernels.triton.layout import NAMES, StackedExperts


def dequant_rows(experts: StackedExperts, name: str, dtype: torch.dtype, bk: int = 256,
                 src: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """An int4 rows layer's weight `name` ("w13" / "w2") -> [E, N, K] in dtype, every expert
    (kernels/triton/dequant.py, one launch); `src` [C]: [C, N, K], the experts src names (-1:
    left unwritten)."""
    assert experts.rows, "int4 in the GPU's row layout (StackedExperts.to_rows)"
    q, words = experts.sections[f"{name}.q"], experts.sections[f"{name}.rz"]
    out = None
    if src is not None:
        out = torch.empty(src.numel(), q.shape[1], 2 * q.shape[2], device=q.device, dtype=dtype)
    return dequant_int4_rows(q, words, experts.scheme.group_size, dtype, out=out, bk=bk, src=src)


def dequant_rows_ref(experts: StackedExperts, name: str, dtype: torch.dtype) -> torch.Tensor:
    """The spec of dequant_rows: kernels/ref.py's dequantize of each expert's store layout."""
    from moestream.kernels.ref import dequantize

    g = experts.scheme.group_size
    return torch.stack(
        [dequantize(experts.expert(e), name, g, dtype) for e in range(experts.num_experts)]
    )


def layer_weights(experts: StackedExperts, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """(w13 [E, 2I, D], w2 [E, D, I]) in dtype: int4 rows dequantized, bf16 as it is."""
    if experts.rows:
        return tuple(dequant_rows(experts, n, dtype) for n in NAMES)
    assert experts.scheme.name == "bf16", "int4 rows or bf16 experts"
    return tuple(experts.sections[f"{n}.q"].to(dtype) for n in NAMES)


def routed_groups(flat: torch.Tensor, n: int, groups: int):
    """flat [P] matrix ids (< n) -> (src [groups] int32: the matrix of each group in ascending id
    order, -1 past the routed ones; offs [groups] int32: the groups' row ends). No host sync."""
    counts = torch.zeros(n, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    used = counts > 0
    rank = torch.where(used, torch.cumsum(used, 0) - 1, groups)  # unrouted -> a dump entry
    src = torch.full((groups + 1,), -1, dtype=torch.int32, device=flat.device)
    src.scatter_(0, rank, torch.arange(n, dtype=torch.int32, device=flat.device))
    size = torch.zeros(groups + 1, dtype=torch.int64, device=flat.device)
    size.scatter_(0, rank, counts)  # the dump entry's value is never read
    return src[:groups], torch.cumsum(size[:groups], 0).to(torch.int32)


def moe_prefill_grouped(x, ids, weights, experts: StackedExperts, out=None,
                        w: tuple[torch.Tensor, torch.Tensor] | None = None,
                        touched: bool = True) -> torch.Tensor:  # fmt: skip
    """x [T, D], ids [T, K], weights [T, K] -> [T, D] in x's dtype. `touched`: int4 rows
    dequantize only the routed experts, into groups in ascending expert order (else every
    expert, one group each). `w`: the layer already dequantized (layer_weights), to time the
    GEMMs alone."""
    T, K = ids.shape
    E, I = experts.num_experts, experts.inter
    flat = ids.reshape(-1).to(torch.int64)
    order = torch.sort(flat, stable=True).indices  # pairs by expert: by group, either way
    if w is None and touched and experts.rows:
        groups = min(E, flat.numel())
        src, offs = routed_groups(flat, E, groups)
        w13, w2 = (dequant_rows(experts, n, x.dtype, src=src) for n in NAMES)
    else:
        w13, w2 = w if w is not None else layer_weights(experts, x.dtype)
        counts = torch.zeros(E, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        offs = torch.cumsum(counts, 0).to(torch.int32)  # group ends, no host sync
    xs = x[order // K]  # [P, D]
    gu = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)  # [P, 2I] in x's dtype
    h = (F.silu(gu[:, :I].float()) * gu[:, I:].float()).to(x.dtype)  # rounded once
    y = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)  # [P, D]
    rows = torch.empty(flat.numel(), y.shape[1], device=x.device, dtype=torch.float32)
    rows[order] = y.float() * weights.reshape(-1)[order, None].float()  # back in pair order
    return combine_pairs(rows, K, x.dtype, out=out)
