"""A prompt's routed experts on tensor cores through the vendor's grouped GEMM (the row layouts).

The routed experts of a layer are dequantized to bf16 (kernels/triton/dequant.py, only the
experts the prompt routes to, into one group each in ascending expert order), then the pairs,
sorted by expert, run as two `torch._grouped_mm` calls (CUTLASS on sm_90): gate/up, h = silu(g)
* u rounded to x's dtype, down; each pair's fp32 row (weight times expert output) is combined in
slot order by `combine_pairs`, no atomics. Everything stays on the device (no host sync).

Why: the grouped Triton kernels (prefill.py) dequantize inside the dot and reach 0.04-0.07 of
the HBM rate; dequantize + CUTLASS was 1.07-1.86x faster per layer at 16-2048 tokens on the
H200 (`benchmarks/ablations/bench_prefill_grouped.py`, docs/gpu.md; not yet end to end). The cost: a bf16 scratch of
the routed experts (up to E x 3 x D x I values, 1.2 GB at Qwen3-30B-A3B's shapes) while the
layer runs, held by torch's caching allocator after it.

Bits: a pair's row depends only on its expert's rows in the call (its group), whatever else is
in the call: tested on the H200 (`test_grouped_mm_rows_do_not_depend_on_the_call_cuda`: fewer
groups, empty groups, the library's small and large tile configs). So a prompt's pool path,
which runs chunks of a layer's experts, gives the bits of the resident call, as with the Triton
kernels. The products are the library's (bf16 in, fp32 accumulate), so the bits differ from
prefill.py's within rounding (float64 spec tests)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from moestream.kernels.triton import arch_unsupported
from moestream.kernels.triton.decode import SCALE_SECTION, combine_pairs
from moestream.kernels.triton.dequant import (
    dequant_blocks32,
    dequant_int4_rows,
    dequant_kquant_blocks,
)
from moestream.kernels.triton.layout import KQUANTS, NAMES, ROW_QUANTS, StackedExperts
from moestream.quant import make_scheme


def unsupported(experts: StackedExperts, x: torch.Tensor) -> str | None:
    """Why this layer's prompt cannot take the grouped-GEMM path (None when it can)."""
    if experts.kernel_quant not in (*ROW_QUANTS, *KQUANTS):
        return ("the grouped-GEMM prefill reads int4 rows (the GPU pool's int4 layout), q4_0, "
                "q4_1 or K-quants")  # fmt: skip
    if x.is_cuda:
        if x.dtype != torch.bfloat16:
            return "torch._grouped_mm takes bf16 activations on CUDA"
        why = arch_unsupported(torch.cuda.get_device_capability(x.device))
        if why:
            return why
    if experts.hidden % 16 or experts.inter % 16:  # the GEMMs' 16-byte strides
        return f"D={experts.hidden} and I={experts.inter} must be multiples of 16"
    return None


@triton.jit
def _groups_kernel(ids_ptr, src_ptr, offs_ptr, P, groups, EB: tl.constexpr, BP: tl.constexpr,
                   NP: tl.constexpr, NG: tl.constexpr):  # fmt: skip
    """One program: the pairs' matrix ids [P] -> src [groups] (the routed matrices in ascending
    order, -1 past them) and offs [groups] (each group's row end; P past them). The loops run
    NP >= P / BP and NG >= groups / EB blocks (constexpr: Triton 3.6's interpreter cannot take
    a launch argument as a range bound; NP is a power of two, so few compiles)."""
    acc = tl.zeros([EB], dtype=tl.int32)
    for i in range(0, NP):
        o = i * BP + tl.arange(0, BP)
        acc += tl.histogram(tl.load(ids_ptr + o, mask=o < P, other=0).to(tl.int32), EB)
    e = tl.arange(0, EB)
    acc -= tl.where(e == 0, NP * BP - P, 0)  # the padding counted as matrix 0
    used = acc > 0
    rank = tl.cumsum(used.to(tl.int32), 0) - 1
    ends = tl.cumsum(acc, 0)  # unrouted matrices add nothing: a routed one's end is its group's
    n_used = tl.sum(used.to(tl.int32), 0)
    for j in range(0, NG):  # the groups past the routed ones: empty, no matrix
        g = j * EB + e
        rest = (g >= n_used) & (g < groups)
        tl.store(src_ptr + g, tl.full([EB], -1, tl.int32), mask=rest)
        tl.store(offs_ptr + g, tl.zeros([EB], dtype=tl.int32) + P, mask=rest)
    ok = used & (rank < groups)  # always, when `groups` bounds the distinct ids (memory safety)
    tl.store(src_ptr + rank, e, mask=ok)
    tl.store(offs_ptr + rank, ends, mask=ok)


def routed_groups(flat: torch.Tensor, n: int, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """flat [P] ids of n matrices (at most `groups` distinct) -> (src, offs) [groups] int32: the
    routed matrices in ascending order (-1 past them) and the groups' row ends. One launch."""
    src = torch.empty(groups, dtype=torch.int32, device=flat.device)
    offs = torch.empty(groups, dtype=torch.int32, device=flat.device)
    eb, bp, P = triton.next_power_of_2(max(n, 16)), 1024, flat.numel()
    _groups_kernel[(1,)](flat, src, offs, P, groups, EB=eb, BP=bp,
                         NP=triton.next_power_of_2(triton.cdiv(P, bp)),
                         NG=triton.cdiv(groups, eb), num_warps=4)  # fmt: skip
    return src, offs


def moe_grouped(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                experts: StackedExperts, out=None, combine: bool = True) -> torch.Tensor:  # fmt: skip
    """x [T, D], ids [T, K] (into `experts`), weights [T, K] -> [T, D] in x's dtype; with
    `combine=False` the fp32 pair rows [T * K, D] (chunks of a call's pairs give its rows)."""
    flat = ids.reshape(-1)
    groups = min(experts.routed or experts.num_experts, flat.numel())
    src, offs = routed_groups(flat, experts.num_experts, groups)
    w13, w2 = routed_weights(experts, src, x.dtype)
    rows = grouped_rows(x, flat, weights, ids.shape[1], w13, w2, offs)
    return combine_pairs(rows, ids.shape[1], x.dtype, out=out) if combine else rows


def routed_weights(experts: StackedExperts, src: torch.Tensor, dtype: torch.dtype):
    """w13 [C, 2I, D] and w2 [C, D, I] in dtype of the matrices src [C] names (routed_groups;
    nothing where src < 0): one dequant launch each (a K-quant projection in its own blocks)."""
    secs, g, quant = experts.sections, experts.scheme.group_size, experts.kernel_quant
    if quant in KQUANTS:
        down = experts.down_quant
        w13 = dequant_kquant_blocks(secs["w13.q"], dtype, src=src)
        if down in KQUANTS:
            return w13, dequant_kquant_blocks(secs["w2.q"], dtype, src=src)
        # a fallback down (q5_0 / int8 where 256 does not divide I)
        return w13, dequant_blocks32(down, secs["w2.q"], secs.get("w2.s"), dtype, src=src)
    scale = SCALE_SECTION[quant]  # int4 rows' (scale, zero) words, q4_0's d, q4_1's (d, m)
    return tuple(
        dequant_int4_rows(secs[f"{n}.q"], secs[f"{n}.{scale}"], g, dtype, src=src, fmt=quant)
        for n in NAMES
    )


def dequantized(experts: StackedExperts, ids: torch.Tensor,
                dtype: torch.dtype) -> tuple[StackedExperts, torch.Tensor]:  # fmt: skip
    """The routed experts of a K-quant layer in dtype, as a float StackedExperts (group g: the
    g-th smallest routed id), and ids renamed to their groups: the Triton prefill's (prefill.py's
    float kernels) input where the grouped GEMMs do not run. No sync."""
    n, flat = experts.num_experts, ids.reshape(-1)
    groups = min(experts.routed or n, flat.numel())
    src, _ = routed_groups(flat, n, groups)
    w13, w2 = routed_weights(experts, src, dtype)
    # each matrix's group: a scatter, the unnamed groups (src -1) into a slot past the n matrices
    group = torch.zeros(n + 1, dtype=torch.int64, device=ids.device)
    at = torch.where(src >= 0, src, n).long()
    group.scatter_(0, at, torch.arange(groups, device=ids.device))
    float_experts = StackedExperts(make_scheme("bf16"), {"w13.q": w13, "w2.q": w2})
    return float_experts, group[ids.long()].to(ids.dtype)


def grouped_rows(x: torch.Tensor, flat: torch.Tensor, weights: torch.Tensor, K: int,
                 w13: torch.Tensor, w2: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The pairs' fp32 rows [P, D] (weight times expert output) from the groups' weights (w13
    [G, 2I, D], w2 [G, D, I] in x's dtype, group g = the g-th smallest routed id) and their
    row ends `offs` [G]: the pairs sorted by id, two grouped GEMMs, h rounded once as the spec."""
    I = w2.shape[2]
    order = torch.sort(flat, stable=True).indices  # pairs by expert, a token's in slot order
    gu = torch._grouped_mm(x[order // K], w13.transpose(1, 2), offs=offs)  # [P, 2I]
    h = (F.silu(gu[:, :I].float()) * gu[:, I:].float()).to(x.dtype)  # rounded once, as the spec
    y = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)  # [P, D] in x's dtype
    rows = torch.empty(flat.numel(), y.shape[1], device=x.device, dtype=torch.float32)
    rows[order] = y.float() * weights.reshape(-1)[order, None].float()  # back in pair order
    return rows
