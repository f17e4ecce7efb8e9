"""The every-expert variant of the grouped-GEMM prompt path (the product's is
moestream/kernels/triton/grouped.py, which dequantizes only the routed experts): the layer's
int4 rows dequantized to the activation dtype by one Triton launch per weight (`dequant_rows`:
kernels/triton/dequant.py; spec `dequant_rows_ref`, the spec's `(v - 8) * s + z` in fp32 then
rounded), two vendor grouped GEMMs (`torch._grouped_mm`: CUTLASS on sm_90, a loop on the CPU)
over the pairs sorted by expert, one group per expert, and `combine_pairs`. Kept to measure
what dequantizing every expert costs against the routed ones (`bench_prefill_grouped.py`: on
the H200 it was faster at 512-2048 tokens at Qwen3-30B-A3B's shapes, where nearly every expert
is routed, and it needs no group bookkeeping); it cannot serve a slot pool (a scratch per slot)."""

from __future__ import annotations

import torch

from moestream.kernels.triton.decode import combine_pairs
from moestream.kernels.triton.dequant import dequant_int4_rows
from moestream.kernels.triton.grouped import grouped_rows
from moestream.kernels.triton.layout import NAMES, StackedExperts


def dequant_rows(experts: StackedExperts, name: str, dtype: torch.dtype, bk: int = 256,
                 src: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """An int4 rows layer's weight `name` ("w13" / "w2") -> [E, N, K] in dtype, every expert
    (kernels/triton/dequant.py, one launch); `src` [C]: [C, N, K], the experts src names (-1:
    left unwritten)."""
    assert experts.rows, "int4 in the GPU's row layout (StackedExperts.to_rows)"
    q, words = experts.sections[f"{name}.q"], experts.sections[f"{name}.rz"]
    return dequant_int4_rows(q, words, experts.scheme.group_size, dtype, bk=bk, src=src)


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


def moe_prefill_grouped(x, ids, weights, experts: StackedExperts, out=None,
                        w: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:  # fmt: skip
    """x [T, D], ids [T, K], weights [T, K] -> [T, D] in x's dtype, every expert dequantized
    (one group each; the product's kernels/triton/grouped.py dequantizes the routed ones only).
    `w`: the layer already dequantized (layer_weights), to time the GEMMs alone."""
    w13, w2 = w if w is not None else layer_weights(experts, x.dtype)
    flat = ids.reshape(-1).to(torch.int64)
    counts = torch.zeros(experts.num_experts, dtype=torch.int64, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    offs = torch.cumsum(counts, 0).to(torch.int32)  # one group per expert, no host sync
    rows = grouped_rows(x, flat, weights, ids.shape[1], w13, w2, offs)
    return combine_pairs(rows, ids.shape[1], x.dtype, out=out)
