"""int4 rows (the GPU's row-major repack, quant.int4_to_rows) dequantized into the activation
dtype by one launch: the weights a prompt's F.linear multiplies (QuantLinear with kernel
"triton" above the GEMV's 8 tokens) and the grouped-GEMM prefill ablation
(benchmarks/ablations/prefill_grouped.py). Spec: kernels/ref.py's dequantize, `(v - 8) * s + z`
in fp32 rounded to nearest even, so the values are that spec's bit for bit (tests: test_triton_dense.py,
test_triton_ablations.py). The torch reference this replaces runs ~8 elementwise passes over
fp32 intermediates."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


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
def _dequant_rows_kernel(q_ptr, w_ptr, out_ptr, src_ptr, N: tl.constexpr, K: tl.constexpr,
                         G: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                         DT: tl.constexpr, SRC: tl.constexpr):  # fmt: skip
    """Program (d, n block, k block): rows n0.. of out[d], inputs k0 .. k0 + BK - 1. A row's
    16 bytes per 32 inputs hold input i in the low nibble and i + 16 in the high one; the word of
    (row, group) holds its bf16 scale (low half) and zero (high half). SRC: out[d] is matrix
    src[d], and nothing is read or written where src[d] < 0 (the loads are masked off)."""
    d = tl.program_id(0).to(tl.int64)
    n0 = tl.program_id(1) * BN
    k0 = tl.program_id(2) * BK
    r = n0 + tl.arange(0, BN)[:, None, None]  # [BN, 1, 1]
    c = tl.arange(0, BK // 32)[None, :, None]  # 32-input chunks of the block
    j = tl.arange(0, 16)[None, None, :]
    e = d
    rows = N
    if SRC:
        e = tl.load(src_ptr + d).to(tl.int64)
        rows = tl.where(e >= 0, N, 0)  # no rows of an unnamed matrix
    m = r < rows
    b = tl.load(q_ptr + e * (N * K // 2) + r * (K // 2) + k0 // 2 + c * 16 + j, mask=m, other=0)
    b = b.to(tl.int32)
    g = (k0 + c * 32) // G  # both nibbles of a chunk are in one group (G % 32 == 0)
    w = tl.load(w_ptr + e * (N * (K // G)) + r * (K // G) + g, mask=m, other=0)
    s = (w << 16).to(tl.float32, bitcast=True)
    z = (w & -65536).to(tl.float32, bitcast=True)
    # (v - 8) * s is exact in fp32 (4 x 8 significant bits), so a fused add rounds as the spec's
    lo = ((b & 15) - 8).to(tl.float32) * s + z
    hi = ((b >> 4) - 8).to(tl.float32) * s + z
    at = out_ptr + d * (N * K) + r * K + k0 + c * 32 + j
    tl.store(at, _round(lo, DT), mask=m)
    tl.store(at + 16, _round(hi, DT), mask=m)


def dequant_int4_rows(rows: torch.Tensor, words: torch.Tensor, group: int, dtype: torch.dtype,
                      out: torch.Tensor | None = None, bn: int = 16, bk: int = 256,
                      src: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """rows [..., N, K/2] uint8 and words [..., N, K/G] int32 (one weight, or [E] stacked) ->
    [..., N, K] in dtype. `src` [C] int (stacked weights): out [C, N, K], out[c] is matrix
    src[c], and out[c] is left as it was (nothing read) where src[c] < 0, so a prompt
    dequantizes only the experts it routes to. Runs on the current stream, syncs nothing."""
    lead = rows.shape[:-2]
    N, K = rows.shape[-2], 2 * rows.shape[-1]
    bk = math.gcd(K, bk)
    assert group % 32 == 0 and bk % group == 0, f"K={K}, BK={bk}: multiples of G={group} (of 32)"
    assert words.shape == (*lead, N, K // group) and rows.is_contiguous() and words.is_contiguous()
    shape = (*lead, N, K) if src is None else (src.numel(), N, K)
    assert src is None or (len(lead) == 1 and src.dim() == 1), "src [C] names stacked weights"
    if out is None:
        out = torch.empty(shape, device=rows.device, dtype=dtype)
    assert out.shape == shape and out.dtype == dtype and out.is_contiguous()
    grid = (math.prod(shape[:-2]), triton.cdiv(N, bn), K // bk)
    _dequant_rows_kernel[grid](rows, words, out, src if src is not None else rows, N=N, K=K,
                               G=group, BN=bn, BK=bk, DT=DTYPES[dtype],
                               SRC=src is not None, num_warps=4)  # fmt: skip
    return out
