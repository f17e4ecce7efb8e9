"""A GGUF K-quant super-block's fields in Triton: the decode kernels' super-block steps
(decode.py) and the dequant kernels (dequant.py: an embedding's rows, a prompt's routed experts)
read the same bytes the same way. ggml's layouts of 256 inputs (quant.unpack_kquant):

  q4_k, 144 bytes: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins of 8 sub-blocks of 32,
        128 bytes of nibbles: chunk c of 64 inputs is bytes 16 + 32c .., input 64c + l in byte
        l's low nibble, 64c + 32 + l in its high one; w = (d sc) q - (dmin m)
  q5_k, 176 bytes: q4_k's with 32 bytes of fifth bits at 16 (input 64c + 32i + l: bit 2c + i of
        byte l) and the nibbles at 48
  q6_k, 210 bytes: 128 bytes of low nibbles, 64 of 2-bit high pairs at 128, 16 int8 scales of 16
        inputs at 192, fp16 d at 208: half h, quarter c (32 inputs), lane l: low nibble of byte
        64h + 32 (c % 2) + l shifted 4 (c // 2), high bits (byte 128 + 32h + l) >> 2c;
        w = (d sc) (q - 32)
Every product of two fields is exact in fp32 (<= 22 significant bits)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def byte_at(ptr, m):
    """The bytes at ptr as int32 (0 where the mask m is off; m None: no mask)."""
    if m is None:
        return tl.load(ptr).to(tl.int32)
    else:
        return tl.load(ptr, mask=m, other=0).to(tl.int32)


@triton.jit
def f16_at(ptr, m):
    """The little-endian fp16 at bytes ptr, ptr + 1 -> fp32 (exact); 0 where m is off."""
    v = byte_at(ptr, m) | (byte_at(ptr + 1, m) << 8)
    return v.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def scale_min(blk, sb, m):
    """Sub-block sb's (0-7) 6-bit scale and min (int32) of the q4_k / q5_k block at blk, as ggml's
    get_scale_min_k4 packs them: sub-blocks 0-3 in the low 6 bits of bytes 4-7 and 8-11, 4-7 in
    the nibbles of bytes 12-15 with their top 2 bits in bytes 4-11's."""
    lo4 = sb < 4
    a = byte_at(blk + 4 + sb % 4, m)
    b = byte_at(blk + 8 + sb % 4, m)
    e = byte_at(blk + 12 + sb % 4, m)
    sc = tl.where(lo4, a & 63, (e & 15) | ((a >> 2) & 48))
    mn = tl.where(lo4, b & 63, (e >> 4) | ((b >> 2) & 48))
    return sc, mn


@triton.jit
def q6_value(w, c):
    """q6_k's 6-bit value (0-63) of quarter c from w = its low-nibble byte | its high-pair byte
    << 8 (int32): the pair's bits 8 + 2c, 9 + 2c shifted down to 4, 5 (no left shift)."""
    return ((w >> (4 * (c // 2))) & 15) | ((w >> (4 + 2 * c)) & 48)


@triton.jit
def kquant_value(blk, j, m, B: tl.constexpr):
    """Input j (0-255) of the K-quant super-block at blk (B bytes: 144 q4_k, 176 q5_k, 210 q6_k)
    as fp32, ggml's dequantize_row_q*_K: each product of fields exact, so the one rounding is
    the subtraction's (q4_k / q5_k), fused or not: the spec's bits (ref.dequantize_kquant)."""
    if B == 210:  # q6_k: half h, quarter c, lane l; 16 scales of 16 inputs, d at 208
        h, c, lane = j // 128, (j % 128) // 32, j % 32
        lo = byte_at(blk + 64 * h + 32 * (c % 2) + lane, m)
        q = q6_value(lo | (byte_at(blk + 128 + 32 * h + lane, m) << 8), c) - 32
        sc = tl.load(blk + 192 + j // 16, mask=m, other=0).to(tl.int8, bitcast=True)
        return (f16_at(blk + 208, m) * sc.to(tl.float32)) * q.to(tl.float32)
    else:  # q4_k / q5_k: chunk c of 64 (low nibbles, then high), sub-block 2c + i of 32
        c, i, lane = j // 64, (j % 64) // 32, j % 32
        q = (byte_at(blk + B - 128 + 32 * c + lane, m) >> (4 * i)) & 15
        if B == 176:  # bit 2c + i of qh[lane] on top
            q = q | (((byte_at(blk + 16 + lane, m) >> (2 * c + i)) & 1) << 4)
        sc, mn = scale_min(blk, 2 * c + i, m)
        ds, dm = f16_at(blk, m) * sc.to(tl.float32), f16_at(blk + 2, m) * mn.to(tl.float32)
        return ds * q.to(tl.float32) - dm


@triton.jit
def q5_0_value(blk, j, m):
    """Input j (0-31) of the q5_0 block at blk (22 bytes: fp16 d, the 32 fifth bits, then q4_0's
    nibbles: input j < 16 in byte 6 + j's low nibble, j + 16 in its high one) as fp32, ggml's
    dequantize_row_q5_0: d (q - 16), one exact product (the spec's bits, ref.dequantize)."""
    b = byte_at(blk + 6 + j % 16, m)
    bit = (byte_at(blk + 2 + j // 8, m) >> (j % 8)) & 1
    q = (((b >> (4 * (j // 16))) & 15) | (bit << 4)) - 16
    return q.to(tl.float32) * f16_at(blk, m)
