"""int4 rows (the GPU's row-major repack, quant.int4_to_rows; or q4_0 / q4_1, the same row bytes
with an fp16 d a 32-block and q4_1's m) dequantized into the activation dtype by one launch: the weights a prompt's
F.linear multiplies (QuantLinear with kernel "triton" above the GEMV's 8 tokens), a prompt's
routed experts for the grouped GEMMs (grouped.py) and the grouped-GEMM prefill ablation
(benchmarks/ablations/prefill_grouped.py). Spec: kernels/ref.py's dequantize, `(v - 8) * s + z`
in fp32 rounded to nearest even, so the values are that spec's bit for bit (tests: test_triton_dense.py,
test_triton_ablations.py). The torch reference this replaces runs ~8 elementwise passes over
fp32 intermediates.

Also an embedding's looked-up rows from its table as stored (`dequant_table_rows`): int4 in the
store's 64-row blocks, int8 / q8_0 (a value times its group's scale), q4_0, q4_1, q5_0 and
GGUF's q4_k / q5_k / q6_k blocks decoded in the kernel, one launch where the reference's gather and unpacking
take 9-51 small kernels, which a captured decode step would run every token. Spec:
ref.dequantize_rows; each product is exact in fp32 or (int8's fp32 scale) rounded once in both,
so the bits are the same."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from moestream.kernels.triton.decode import QUANT_CODE
from moestream.kernels.triton.kquant import (
    byte_at,
    f16_at,
    kquant_value,
    q5_0_value,
    q6_value,
    scale_min,
)
from moestream.kernels.triton.layout import ROW_QUANTS, per_expert
from moestream.quant import INT4_BLOCK_N, KQUANT_BYTES, KQUANT_OF_BYTES, QK_K

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
def row_weights(b, w_ptr, at, m, QUANT: tl.constexpr):
    """A row layout's bytes b (int32; input i of a 32-block in the low nibble, i + 16 in the high)
    -> the (low, high) nibbles' weights in fp32, with their group's scales at index `at` of w_ptr
    (masked by m). QUANT (decode.QUANT_CODE): 3 int4 rows, the bf16 (scale, zero) word:
    (v - 8) s + z; 4 q4_0, fp16 d: (v - 8) d; 5 q4_1, fp16 (d, m) pairs: v d + m. Each product is
    exact in fp32, so a fused add rounds once, as the spec's (ref.dequantize): its bits."""
    v_lo, v_hi = (b & 15).to(tl.float32), ((b >> 4) & 15).to(tl.float32)
    if QUANT == 4:
        d = tl.load(w_ptr + at, mask=m, other=0).to(tl.float32)
        return (v_lo - 8.0) * d, (v_hi - 8.0) * d
    elif QUANT == 5:
        d = tl.load(w_ptr + 2 * at, mask=m, other=0).to(tl.float32)
        mn = tl.load(w_ptr + 2 * at + 1, mask=m, other=0).to(tl.float32)
        return v_lo * d + mn, v_hi * d + mn
    else:
        w = tl.load(w_ptr + at, mask=m, other=0)
        s = (w << 16).to(tl.float32, bitcast=True)
        z = (w & -65536).to(tl.float32, bitcast=True)
        return (v_lo - 8.0) * s + z, (v_hi - 8.0) * s + z


@triton.jit
def _dequant_rows_kernel(q_ptr, w_ptr, out_ptr, src_ptr, N: tl.constexpr, K: tl.constexpr,
                         G: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                         DT: tl.constexpr, SRC: tl.constexpr, QUANT: tl.constexpr):  # fmt: skip
    """Program (d, n block, k block): rows n0.. of out[d], inputs k0 .. k0 + BK - 1 of a row
    layout (QUANT: row_weights'). SRC: out[d] is matrix src[d], and nothing is read or written
    where src[d] < 0 (the loads are masked off)."""
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
    lo, hi = row_weights(b, w_ptr, e * (N * (K // G)) + r * (K // G) + g, m, QUANT)
    at = out_ptr + d * (N * K) + r * K + k0 + c * 32 + j
    tl.store(at, _round(lo, DT), mask=m)
    tl.store(at + 16, _round(hi, DT), mask=m)


def dequant_int4_rows(rows: torch.Tensor, words: torch.Tensor, group: int, dtype: torch.dtype,
                      out: torch.Tensor | None = None, bn: int = 16, bk: int = 256,
                      src: torch.Tensor | None = None, fmt: str = "int4r") -> torch.Tensor:  # fmt: skip
    """rows [..., N, K/2] uint8 and words [..., N, K/G] int32 (one weight, or [E] stacked) ->
    [..., N, K] in dtype; `fmt` "q4_0": words are its fp16 d [..., N, K/32] (no zero), "q4_1":
    its fp16 (d, m) [..., N, K/32, 2] (the same row bytes).
    `src` [C] int (stacked weights): out [C, N, K], out[c] is matrix src[c], and out[c] is left
    as it was (nothing read) where src[c] < 0, so a prompt dequantizes only the experts it
    routes to. Runs on the current stream, syncs nothing."""
    lead = rows.shape[:-2]
    N, K = rows.shape[-2], 2 * rows.shape[-1]
    bk = math.gcd(K, bk)
    assert group % 32 == 0 and bk % group == 0, f"K={K}, BK={bk}: multiples of G={group} (of 32)"
    assert fmt in ROW_QUANTS, fmt
    pair = (2,) if fmt == "q4_1" else ()  # q4_1's (d, m)
    assert words.shape == (*lead, N, K // group, *pair), f"{fmt} words {tuple(words.shape)}"
    assert rows.is_contiguous() and words.is_contiguous()
    assert words.dtype == (torch.int32 if fmt == "int4r" else torch.float16) and (
        fmt == "int4r" or group == 32
    ), f"{fmt}: {words.dtype} words, G={group}"
    shape = (*lead, N, K) if src is None else (src.numel(), N, K)
    assert src is None or (len(lead) == 1 and src.dim() == 1), "src [C] names stacked weights"
    if out is None:
        out = torch.empty(shape, device=rows.device, dtype=dtype)
    assert out.shape == shape and out.dtype == dtype and out.is_contiguous()
    grid = (math.prod(shape[:-2]), triton.cdiv(N, bn), K // bk)
    _dequant_rows_kernel[grid](rows, words, out, src if src is not None else rows, N=N, K=K,
                               G=group, BN=bn, BK=bk, DT=DTYPES[dtype],
                               SRC=src is not None, QUANT=QUANT_CODE[fmt], num_warps=4)  # fmt: skip
    return out


@triton.jit
def _dequant_blocks_kernel(q_ptr, out_ptr, src_ptr, N: tl.constexpr, K: tl.constexpr,
                           B: tl.constexpr, ES: tl.constexpr, BN: tl.constexpr,
                           DT: tl.constexpr, SRC: tl.constexpr):  # fmt: skip
    """Program (d, n block, super-block sb): rows n0 .. n0 + BN - 1 of out[d], inputs 256 sb ..
    of K-quant blocks [.., N, K/256, B] (kquant.py's layouts), matrix d at byte d * ES; SRC as
    _dequant_rows_kernel's. The tile is shaped by the block's own axes, so each byte of values
    is loaded once and each sub-block's scale and min once a row (an input-wise lookup, as
    kquant_value does for an embedding's few rows, loads ~8 bytes for every weight); the
    values are kquant_value's, the same products and one rounding: the spec's bits."""
    d = tl.program_id(0).to(tl.int64)
    sb = tl.program_id(2)
    e = d
    rows = N
    if SRC:
        e = tl.load(src_ptr + d).to(tl.int64)
        rows = tl.where(e >= 0, N, 0)  # no rows of an unnamed matrix
    if B == 210:  # q6_k: [BN, half h, quarter c, 16-group s, lane t], input 128h + 32c + 16s + t
        r = tl.program_id(1) * BN + tl.arange(0, BN)[:, None, None, None, None]
        h = tl.arange(0, 2)[None, :, None, None, None]
        c = tl.arange(0, 4)[None, None, :, None, None]
        s = tl.arange(0, 2)[None, None, None, :, None]
        lane = 16 * s + tl.arange(0, 16)[None, None, None, None, :]
        m = r < rows
        blk = q_ptr + e * ES + (r * (K // 256) + sb) * B
        lo = byte_at(blk + 64 * h + 32 * (c % 2) + lane, m)
        q = q6_value(lo | (byte_at(blk + 128 + 32 * h + lane, m) << 8), c) - 32
        sc = tl.load(blk + 192 + 8 * h + 2 * c + s, mask=m, other=0).to(tl.int8, bitcast=True)
        w = (f16_at(blk + 208, m) * sc.to(tl.float32)) * q.to(tl.float32)
        j = 128 * h + 32 * c + lane
    else:  # q4_k / q5_k: [BN, chunk c, nibble i, lane], input 64c + 32i + lane, sub-block 2c + i
        r = tl.program_id(1) * BN + tl.arange(0, BN)[:, None, None, None]
        c = tl.arange(0, 4)[None, :, None, None]
        i = tl.arange(0, 2)[None, None, :, None]
        lane = tl.arange(0, 32)[None, None, None, :]
        m = r < rows
        blk = q_ptr + e * ES + (r * (K // 256) + sb) * B
        q = (byte_at(blk + B - 128 + 32 * c + lane, m) >> (4 * i)) & 15
        if B == 176:  # bit 2c + i of qh[lane] on top
            q = q | (((byte_at(blk + 16 + lane, m) >> (2 * c + i)) & 1) << 4)
        sc, mn = scale_min(blk, 2 * c + i, m)
        ds, dm = f16_at(blk, m) * sc.to(tl.float32), f16_at(blk + 2, m) * mn.to(tl.float32)
        w = ds * q.to(tl.float32) - dm
        j = 64 * c + 32 * i + lane
    tl.store(out_ptr + d * (N * K) + r * K + sb * 256 + j, _round(w, DT), mask=m & (j >= 0))


def dequant_kquant_blocks(q: torch.Tensor, dtype: torch.dtype, src: torch.Tensor | None = None,
                          bn: int = 16) -> torch.Tensor:  # fmt: skip
    """K-quant blocks q [..., N, K/256, B] uint8 (one weight, or [E] stacked) -> [..., N, K] in
    dtype, the spec's values (ref.dequantize_kquant) bit for bit; `src` as dequant_int4_rows'
    (out[c] is matrix src[c], left as it was where src[c] < 0). One launch, no sync."""
    lead, (N, nb, B) = q.shape[:-3], q.shape[-3:]
    K = nb * QK_K
    assert B in KQUANT_OF_BYTES and q.dtype == torch.uint8, q.shape
    # each matrix contiguous (a pool of per-layer layouts: its slots padded, layout.padded_view)
    assert q.is_contiguous() or (len(lead) == 1 and per_expert(q)), "contiguous matrices"
    assert src is None or (len(lead) == 1 and src.dim() == 1), "src [C] names stacked weights"
    shape = (*lead, N, K) if src is None else (src.numel(), N, K)
    out = torch.empty(shape, device=q.device, dtype=dtype)
    grid = (math.prod(shape[:-2]), triton.cdiv(N, bn), nb)
    es = q.stride(0) if len(lead) == 1 else N * nb * B
    _dequant_blocks_kernel[grid](q, out, src if src is not None else q, N=N, K=K, B=B, ES=es,
                                 BN=bn, DT=DTYPES[dtype], SRC=src is not None,
                                 num_warps=4)  # fmt: skip
    return out


@triton.jit
def _dequant_blocks32_kernel(q_ptr, s_ptr, out_ptr, src_ptr, N: tl.constexpr, K: tl.constexpr,
                             ES: tl.constexpr, Q50: tl.constexpr, BN: tl.constexpr,
                             BK: tl.constexpr, DT: tl.constexpr, SRC: tl.constexpr):  # fmt: skip
    """Program (d, n block, k block): rows n0.. of out[d], inputs k0 .. k0 + BK - 1 of a K-quant
    layer's fallback down (DOWN_FALLBACKS): Q50 q5_0 blocks [.., N, K/32, 22] (matrix d at byte
    d * ES), else int8 values [.., N, K] times fp32 scales [.., N, K/32] (packed). SRC as
    _dequant_rows_kernel's. Values: q5_0_value's, and int8's one product: the spec's bits."""
    d = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1) * BN + tl.arange(0, BN)[:, None]
    k = tl.program_id(2) * BK + tl.arange(0, BK)[None, :]
    e = d
    rows = N
    if SRC:
        e = tl.load(src_ptr + d).to(tl.int64)
        rows = tl.where(e >= 0, N, 0)  # no rows of an unnamed matrix
    m = (r < rows) & (k < K)
    if Q50:
        v = q5_0_value(q_ptr + e * ES + (r * (K // 32) + k // 32) * 22, k % 32, m)
    else:
        q = tl.load(q_ptr + e * (N * K) + r * K + k, mask=m, other=0).to(tl.float32)
        v = q * tl.load(s_ptr + e * (N * (K // 32)) + r * (K // 32) + k // 32, mask=m, other=0)
    tl.store(out_ptr + d * (N * K) + r * K + k, _round(v, DT), mask=m)


def dequant_blocks32(fmt: str, q: torch.Tensor, s: torch.Tensor | None, dtype: torch.dtype,
                     src: torch.Tensor | None = None, bn: int = 16, bk: int = 128) -> torch.Tensor:  # fmt: skip
    """A K-quant layer's fallback down projection (layout.DOWN_FALLBACKS), stacked [E, N, ...]:
    q5_0 blocks q [E, N, K/32, 22] uint8 (s None; a pool of per-layer layouts: its slots padded,
    layout.padded_view) or int8 q [E, N, K] with fp32 scales s [E, N, K/32] -> [E, N, K] in
    dtype, the spec's values bit for bit; `src` as dequant_int4_rows'. One launch, no sync."""
    q50 = fmt == "q5_0"
    E, N = q.shape[:2]
    K = q.shape[2] * 32 if q50 else q.shape[2]
    if q50:
        assert q.dtype == torch.uint8 and q.shape[3] == 22 and s is None, q.shape
        assert q.is_contiguous() or per_expert(q), "each matrix contiguous"
    else:
        assert fmt == "int8" and q.is_contiguous() and s.shape == (E, N, K // 32), fmt
        assert s.dtype == torch.float32 and s.is_contiguous(), s.dtype
    assert src is None or src.dim() == 1, "src [C] names stacked weights"
    shape = (E, N, K) if src is None else (src.numel(), N, K)
    out = torch.empty(shape, device=q.device, dtype=dtype)
    grid = (shape[0], triton.cdiv(N, bn), triton.cdiv(K, bk))
    _dequant_blocks32_kernel[grid](q, q if s is None else s, out, src if src is not None else q,
                                   N=N, K=K, ES=q.stride(0), Q50=q50, BN=bn, BK=bk,
                                   DT=DTYPES[dtype], SRC=src is not None, num_warps=4)  # fmt: skip
    return out


# formats dequant_table_rows decodes in the kernel (scheme name -> the kernel's FMT)
TABLE_FORMATS = {"int8": 1, "q8_0": 1, "q4_0": 2, "q4_k": 3, "q5_k": 4, "q6_k": 5, "int4": 6,
                 "q4_1": 7, "q5_0": 8}  # fmt: skip
# inputs a column of a table's q section holds (its second dim; q5_0 and K-quants: blocks)
_PER_COLUMN = {"int8": 1, "q8_0": 1, "q4_0": 2, "q4_1": 2, "int4": 2, "q5_0": 32,
               **dict.fromkeys(KQUANT_BYTES, QK_K)}  # fmt: skip


@triton.jit
def _table_rows_kernel(q_ptr, s_ptr, ids_ptr, out_ptr, V, K: tl.constexpr, G: tl.constexpr,
                       FMT: tl.constexpr, B: tl.constexpr, BK: tl.constexpr,
                       DT: tl.constexpr):  # fmt: skip
    """Program (t, k block): out[t, k0 .. k0 + BK - 1] = row ids[t] of the table, dequantized.
    FMT 1: int8 values q [V, K] times s [V, K/G] (float); 2: q4_0, nibble bytes [V, K/2] (input i
    of a 32-block low, i + 16 high) times fp16 d [V, K/G] after - 8; 3-5: q4_k / q5_k / q6_k
    super-blocks [V, K/256, B bytes] as ggml lays them out (quant.unpack_kquant); 6: int4 in the
    store's blocks of B rows (quant.pack_int4: byte [k, d] of a block holds row d low, row d +
    b / 2 high) with bf16 (scale, zero) pairs s [V * K/G, 2] in the same blocks: (v - 8) s + z;
    7: q4_1, q4_0's nibbles times d plus m, fp16 pairs s [V, K/G, 2]; 8: q5_0, blocks [V, K/32,
    22] of fp16 d, the 32 fifth bits, q4_0's nibbles: (v - 16) d."""
    t = tl.program_id(0)
    r = tl.load(ids_ptr + t).to(tl.int64)
    k = tl.program_id(1) * BK + tl.arange(0, BK)
    m = k < K
    if FMT == 1:
        q = tl.load(q_ptr + r * K + k, mask=m, other=0).to(tl.float32)
        v = q * tl.load(s_ptr + r * (K // G) + k // G, mask=m, other=0).to(tl.float32)
    elif FMT == 6:
        r0 = r - r % B  # the row's block, of b rows (the last one may be shorter)
        half = tl.minimum(V - r0, B) // 2
        lo = r - r0 < half
        byte = tl.load(q_ptr + r0 * (K // 2) + k * half + (r - r0) % half, mask=m, other=0)
        v = tl.where(lo, byte & 15, byte >> 4).to(tl.int32) - 8
        at = 2 * (r0 * (K // G) + (k // G) * (2 * half) + (r - r0))  # its group's pair
        sc = tl.load(s_ptr + at, mask=m, other=0).to(tl.float32)
        z = tl.load(s_ptr + at + 1, mask=m, other=0).to(tl.float32)
        v = v.to(tl.float32) * sc + z  # the product exact (4 x 8 bits): fused or not, one rounding
    elif FMT == 7:
        j = k % 32
        b = tl.load(q_ptr + r * (K // 2) + (k // 32) * 16 + j % 16, mask=m, other=0).to(tl.int32)
        at = s_ptr + 2 * (r * (K // G) + k // G)
        d = tl.load(at, mask=m, other=0).to(tl.float32)
        v = ((b >> (4 * (j // 16))) & 15).to(tl.float32) * d + tl.load(at + 1, mask=m, other=0).to(
            tl.float32
        )  # q d exact (4 x 11 bits): fused or not, one rounding
    elif FMT == 8:
        v = q5_0_value(q_ptr + r * (K // 32 * 22) + (k // 32) * 22, k % 32, m)
    elif FMT == 2:
        j = k % 32
        b = tl.load(q_ptr + r * (K // 2) + (k // 32) * 16 + j % 16, mask=m, other=0).to(tl.int32)
        q = ((b >> (4 * (j // 16))) & 15) - 8
        v = q.to(tl.float32) * tl.load(s_ptr + r * (K // G) + k // G, mask=m, other=0).to(
            tl.float32
        )
    else:
        blk = q_ptr + r * (K // 256 * B) + (k // 256) * B  # each input's super-block
        v = kquant_value(blk, k % 256, m, B)
    tl.store(out_ptr + t * K + k, _round(v, DT), mask=m)


def dequant_table_rows(fmt: str, q: torch.Tensor, s: torch.Tensor | None, ids: torch.Tensor,
                       group: int, dtype: torch.dtype, bk: int = 512) -> torch.Tensor:  # fmt: skip
    """Rows `ids` [T] of a [V, K] table stored as scheme `fmt` (TABLE_FORMATS) -> [T, K] in dtype,
    one launch: q its `q` section, s its scales (`s` for int8, `d` for q8_0 / q4_0, `sz` for
    int4, `dm` for q4_1, None for q5_0 and K-quants: in their blocks), group its scheme's group. The reference's bits
    (ref.dequantize_rows). Runs on the current stream, syncs nothing: capturable."""
    code = TABLE_FORMATS[fmt]
    V = q.shape[0]
    K = q.shape[1] * _PER_COLUMN[fmt]
    assert q.is_contiguous() and (s is None or s.is_contiguous()) and ids.dim() == 1
    if fmt == "q5_0" or fmt in KQUANT_BYTES:  # scales inside the blocks
        assert s is None, fmt
    else:
        want = {"int4": (V * (K // group), 2), "q4_1": (V, K // group, 2)}.get(fmt, (V, K // group))
        assert s is not None and s.shape == want, (fmt, want)
    out = torch.empty(ids.numel(), K, device=q.device, dtype=dtype)
    if ids.numel():
        bk = min(bk, triton.next_power_of_2(K))
        _table_rows_kernel[(ids.numel(), triton.cdiv(K, bk))](
            q, q if s is None else s, ids, out, V, K=K, G=group, FMT=code,
            B=INT4_BLOCK_N if fmt == "int4" else KQUANT_BYTES.get(fmt, 0), BK=bk,
            DT=DTYPES[dtype], num_warps=4)  # fmt: skip
    return out
