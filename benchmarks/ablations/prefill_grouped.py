"""A candidate prefill MoE path for issue 22, off the product path until an H200 run says it is
faster: the layer's int4 rows dequantized to the activation dtype by one Triton launch per
weight (`dequant_rows`, spec `dequant_rows_ref`: the spec's `(v - 8) * s + z` in fp32, then
rounded, so the same weights the grouped kernels multiply), then the routed products as two
vendor grouped GEMMs (`torch._grouped_mm`: CUTLASS on sm_90, a loop on the CPU) over the pairs
sorted by expert, and the pairs combined by `combine_pairs` (each token's rows in slot order, no
atomics). The products' blocking is the library's, so the bits differ from
`prefill.moe_prefill`'s and from the spec within rounding; the experts' outputs are rounded to
the activation dtype as the spec's are.

Why try it: the grouped Triton kernels take 1.6-1.8 ms a layer at 64-512 tokens, 12-18x the
floor of the int4 rows they read (docs/gpu.md, "GPU prefill"); writing and reading the layer
once as bf16 (1.2 GB at Qwen3-30B-A3B's shapes) is ~0.6 ms of HBM time, and the GEMMs are the
library's. The cost: a scratch of E x 3 x D x I values, all experts dequantized whatever the
prompt touches (so it only pays from some tens of tokens on). `bench_prefill_grouped.py`
measures both paths side by side."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from moestream.kernels.triton.decode import combine_pairs
from moestream.kernels.triton.layout import NAMES, StackedExperts


@triton.jit
def _round(v, DT: tl.constexpr):
    """fp32 -> DT rounded to nearest even, as torch's .to: for bf16 by integer ops on the bits
    (Triton's interpreter truncates in .to; finite values only, as dequantized weights are)."""
    if DT == tl.bfloat16:
        b = v.to(tl.int32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
        v = b.to(tl.float32, bitcast=True)
    return v.to(DT)


@triton.jit
def _dequant_rows_kernel(q_ptr, w_ptr, out_ptr, N: tl.constexpr, K: tl.constexpr,
                         G: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                         DT: tl.constexpr):  # fmt: skip
    """Program (e, n block, k block): rows n0.. of expert e, inputs k0 .. k0 + BK - 1. A row's
    16 bytes per 32 inputs hold input i in the low nibble and i + 16 in the high one; the word of
    (row, group) holds its bf16 scale (low half) and zero (high half)."""
    e = tl.program_id(0).to(tl.int64)
    n0 = tl.program_id(1) * BN
    k0 = tl.program_id(2) * BK
    r = n0 + tl.arange(0, BN)[:, None, None]  # [BN, 1, 1]
    c = tl.arange(0, BK // 32)[None, :, None]  # 32-input chunks of the block
    j = tl.arange(0, 16)[None, None, :]
    m = r < N
    b = tl.load(q_ptr + e * (N * K // 2) + r * (K // 2) + k0 // 2 + c * 16 + j, mask=m, other=0)
    b = b.to(tl.int32)
    g = (k0 + c * 32) // G  # both nibbles of a chunk are in one group (G % 32 == 0)
    w = tl.load(w_ptr + e * (N * (K // G)) + r * (K // G) + g, mask=m, other=0)
    s = (w << 16).to(tl.float32, bitcast=True)
    z = (w & -65536).to(tl.float32, bitcast=True)
    # (v - 8) * s is exact in fp32 (4 x 8 significant bits), so a fused add rounds as the spec's
    lo = ((b & 15) - 8).to(tl.float32) * s + z
    hi = ((b >> 4) - 8).to(tl.float32) * s + z
    at = out_ptr + e * (N * K) + r * K + k0 + c * 32 + j
    tl.store(at, _round(lo, DT), mask=m)
    tl.store(at + 16, _round(hi, DT), mask=m)


def dequant_rows(experts: StackedExperts, name: str, dtype: torch.dtype,
                 out: torch.Tensor | None = None, bn: int = 16, bk: int = 256) -> torch.Tensor:  # fmt: skip
    """An int4 rows layer's weight `name` ("w13" / "w2") -> [E, N, K] in dtype, every expert."""
    assert experts.rows, "int4 in the GPU's row layout (StackedExperts.to_rows)"
    q, words = experts.sections[f"{name}.q"], experts.sections[f"{name}.rz"]
    E, N, K2 = q.shape
    K, G = 2 * K2, experts.scheme.group_size
    bk = math.gcd(K, bk)
    assert G % 32 == 0 and bk % G == 0, f"K={K} and BK={bk} must be multiples of G={G} (of 32)"
    if out is None:
        out = torch.empty(E, N, K, device=q.device, dtype=dtype)
    dt = {torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[dtype]
    grid = (E, triton.cdiv(N, bn), K // bk)
    _dequant_rows_kernel[grid](q, words, out, N=N, K=K, G=G, BN=bn, BK=bk, DT=dt, num_warps=4)
    return out


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
    """x [T, D], ids [T, K], weights [T, K] -> [T, D] in x's dtype. `w`: the layer already
    dequantized (layer_weights), to time the GEMMs alone."""
    T, K = ids.shape
    E, I = experts.num_experts, experts.inter
    w13, w2 = w if w is not None else layer_weights(experts, x.dtype)
    flat = ids.reshape(-1).to(torch.int64)
    order = torch.sort(flat, stable=True).indices  # pairs by expert
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
