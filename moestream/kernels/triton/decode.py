"""Decode-path Triton kernels (1-8 tokens): only the routed experts' bytes are read, no host-side
grouping runs on the hot path, and a layer is two launches (no memset, no cast kernel).

  _gate_up_kernel  one program per (pair p = (token, slot), block of BN gate rows and the same up
                   rows, split of D): h[p] = silu(g) * u; with SPLIT > 1 the last program of a
                   block (fp32 partials, int32 counter) sums the splits. Lets the down kernel
                   launch early (programmatic dependent launch, PDL).
  _down_kernel     one program per (pair, block of BN output rows) over all of I: the weighted
                   expert output is stored as the pair's fp32 row; the last program of a (token,
                   row block) adds the token's K rows in slot order and writes the output dtype
                   (deterministic, no zeroed buffer). The pair rows do not depend on the call's
                   other pairs: a streamed prefill that runs its pairs in chunks (the pool cannot
                   hold all their experts) and `combine_pairs` them gives the resident bits.
Both kernels are thin wrappers over work-item helpers (`_gate_up_item`, `_down_item`, and the
`mma` twins). The experiments measured slower and off (one persistent launch per layer, an L2
prefetch of w2, per-step int4 row sums) live in benchmarks/ablations/triton_decode.py; they run
these helpers through the hooks READY, WAIT=2 and ELEM=False, which the product never sets.
Everything accumulates in fp32. int8 and int4 bytes become fp32 through byte permutes into the
mantissa of 2^23 (exact; `FAST`), not the quarter-rate integer-to-float conversion; int4 rows with
`DecodeConfig.half` (the H200's tiles) put the nibble's byte under 0.5's exponent byte instead
(0.5 + q / 256, exact, no subtract: the offset goes into the zero term). Inputs are
loaded through offsets broadcast to the weight tile's shape, so they take its register layout and no
tile goes through shared memory. int4 uses the store layout: a block of 64 rows is [K, 32] bytes
(row d low nibble, row d + 32 high nibble). Measurements and limits: docs/gpu.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from moestream.kernels.triton import kept, tuned
from moestream.kernels.triton.kquant import f16_at, q6_value, scale_min
from moestream.kernels.triton.layout import KQUANTS, ROW_QUANTS, StackedExperts, kernel_sections

# int4r: int4 rows (layout.py); q4_0 / q4_1: GGUF's Q4_0 / Q4_1 as the store keeps them, int4r's
# byte layout with an fp16 d a 32-block (q4_0: no zero; q4_1: an fp16 m, w = d q + m); q4_k,
# q5_k, q6_k: GGUF's K-quant super-blocks as stored (kquant.py); q5_0: GGUF's 22-byte blocks as
# stored (a K-quant layer's down where 256 does not divide I: layout.DOWN_FALLBACKS)
QUANT_CODE = {"bf16": 0, "int8": 1, "int4": 2, "int4r": 3, "q4_0": 4, "q4_1": 5, "q4_k": 6,
              "q5_k": 7, "q6_k": 8, "q5_0": 9}  # fmt: skip
# the section the kernels read through s_ptr (bf16, the K-quants and q5_0: none, q again)
SCALE_SECTION = {"bf16": "q", "int8": "s", "int4": "sz", "int4r": "rz", "q4_0": "d", "q4_1": "dm",
                 **dict.fromkeys((*KQUANTS, "q5_0"), "q")}  # fmt: skip
# the layouts whose step converts 4-bit nibbles (_u4_f32), which DecodeConfig.half changes
HALF_QUANTS = (*ROW_QUANTS, "q4_k")
INT4_ROWS = 64  # rows per packed int4 block (quant.INT4_BLOCK_N)
# Programs a block of a misses-only launch (pick mode 2; _picked): not yet timed on a GPU.
PICK_LANES = 2


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    bn: int = 16  # gate rows (and as many up rows) per gate/up program (int4: 64, a packed block)
    bk: int = 256  # inputs per K step (a multiple of the group size)
    split: int = 1  # gate/up programs along D (partials summed by the down kernel)
    bn_d: int = 16  # output rows per down program (int4: 64)
    bk_d: int = 256
    num_warps: int = 4  # gate/up programs
    warps_d: int = 4  # down programs
    pdl: bool = True  # down kernel launched as a programmatic dependent of gate/up
    mma: bool = False  # tensor cores: group sums of raw weights by tl.dot (_gate_up_mma_kernel)
    stages: int = 0  # mma gate/up: 0 = K loop unrolled, else software-pipelined with this depth
    # int4 rows on CUDA cores: each nibble read as 0.5 + q / 256 by one byte permute, the offset
    # folded into the zero term, so no subtract per weight (_u4_f32's HALF; 16% / 12% fewer gate/up /
    # down instructions at sm_90). Exact values; the sums differ in rounding from half=False's.
    # The nibble layouts' (HALF_QUANTS); a layer whose w2 is q5_k / q6_k below q4_k gate/up
    # (a Q4_K_M file's) reads those values as they are in its down launch.
    half: bool = False

    def __post_init__(self):
        for name in ("bn", "bk", "split", "bn_d", "bk_d"):
            v = getattr(self, name)
            assert v > 0 and v & (v - 1) == 0, f"{name} must be a power of two, got {v}"
        assert not (self.half and self.mma), "half is the CUDA-core kernels' int4 conversion"


# ---- exact byte -> fp32 conversions (sm_90 PTX; the interpreter takes the plain casts) --------
@triton.jit
def _s8_f32(q, FAST: tl.constexpr):
    """int8 -> fp32. FAST: xor 0x80 (offset binary), byte into the mantissa of 2^23, subtract."""
    if FAST:
        return tl.inline_asm_elementwise(
            """{
            .reg .b32 u, m;
            xor.b32 u, $4, 0x80808080;
            mov.b32 m, 0x4B000000;
            prmt.b32 $0, u, m, 0x7440;
            prmt.b32 $1, u, m, 0x7441;
            prmt.b32 $2, u, m, 0x7442;
            prmt.b32 $3, u, m, 0x7443;
            sub.f32 $0, $0, 0f4B000080;
            sub.f32 $1, $1, 0f4B000080;
            sub.f32 $2, $2, 0f4B000080;
            sub.f32 $3, $3, 0f4B000080;
            }""",
            "=r,=r,=r,=r,r",
            [q],
            dtype=tl.float32,
            is_pure=True,
            pack=4,
        )
    else:
        return q.to(tl.float32)


def _nibbles_ptx(magic: str, byte_sel: tuple[str, ...], sub: str | None) -> str:
    """PTX taking 4 packed int4 bytes ($8) to 8 fp32 ($0-$3 the low nibbles, $4-$7 the high):
    each nibble's byte permuted into `magic` by `byte_sel[i]` (byte i), then `sub` subtracted
    (None: the permuted values as they are)."""
    ops = ["and.b32 lo, $8, 0x0F0F0F0F;", "shr.b32 hi, $8, 4;", "and.b32 hi, hi, 0x0F0F0F0F;",
           f"mov.b32 m, {magic};"]  # fmt: skip
    ops += [f"prmt.b32 ${4 * h + i}, {src}, m, {sel};"
            for h, src in enumerate(("lo", "hi")) for i, sel in enumerate(byte_sel)]  # fmt: skip
    ops += [f"sub.f32 ${j}, ${j}, {sub};" for j in range(8)] if sub else []
    return "{\n.reg .b32 lo, hi, m;\n" + "\n".join(ops) + "\n}"


# byte i as the low mantissa byte of 2^23, minus 2^23 + 8: q - 8
_U4_SUB_PTX = tl.constexpr(_nibbles_ptx("0x4B000000", ("0x7440", "0x7441", "0x7442", "0x7443"),
                                        "0f4B000008"))  # fmt: skip
# byte i under 0.5's exponent byte (bits 16-19 of the mantissa): 0.5 + q / 256, no subtract
_U4_HALF_PTX = tl.constexpr(_nibbles_ptx("0x3F000000", ("0x7054", "0x7154", "0x7254", "0x7354"),
                                         None))  # fmt: skip


@triton.jit
def _u4_f32(b, FAST: tl.constexpr, HALF: tl.constexpr = False):
    """Packed int4 bytes -> (low, high) nibble values as fp32, exact: q - 8, or with HALF
    0.5 + q / 256 (FAST: each nibble's byte under 0.5's exponent byte, no subtract)."""
    if FAST:
        return tl.inline_asm_elementwise(
            _U4_HALF_PTX if HALF else _U4_SUB_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r", [b],
            dtype=(tl.float32, tl.float32), is_pure=True, pack=4,
        )  # fmt: skip
    else:
        w = b.to(tl.int32)
        lo, hi = (w & 15).to(tl.float32), (w >> 4).to(tl.float32)
        if HALF:
            return lo * 0.00390625 + 0.5, hi * 0.00390625 + 0.5
        else:
            return lo - 8.0, hi - 8.0


@triton.jit
def _small_f32(q, OFF: tl.constexpr):
    """q - OFF as fp32 for int32 0 <= q < 2^23 (the K-quants' 5- and 6-bit weights), exact and
    with no integer-to-float conversion (I2F / I2FP: 16 a clock an SM on sm_90, an eighth of
    fp32's rate): q as the mantissa under 2^23's exponent, minus 2^23 + OFF. The same bits as
    q.to(float32) - OFF. (A sub-block's scales keep their conversion: one per 16-32 weights,
    and the trick's or + subtract would add an instruction each.)"""
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + OFF)


# ---- tiles: offsets of the inputs a K step needs, and the step's products ----------------------
@triton.jit
def _k_offsets(QUANT: tl.constexpr, G: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Input offsets of one K step, broadcast to the weight tile's full shape: a load through them
    gets the weight tile's register layout, so no [BN, BK] tile is shuffled through shared
    memory to meet a [1, BK] input vector (the L1 serves the repeated reads)."""
    if QUANT == 0:
        return tl.zeros([BN, 1], tl.int32) + tl.arange(0, BK)[None, :]  # [BN, BK]
    elif QUANT == 1:
        kk = tl.arange(0, BK // G)[None, :, None] * G + tl.arange(0, G)[None, None, :]
        return tl.zeros([BN, 1, 1], tl.int32) + kk  # [BN, NG, G]
    elif QUANT == 8:  # q6_k: a half's quarters 0, 1 (low nibbles) as 4 groups of 16 (a scale
        # each); quarters 2, 3 (the same bytes' high nibbles) at + 64
        kk = (
            tl.arange(0, BK // 128)[None, :, None, None] * 128
            + tl.arange(0, 4)[None, None, :, None] * 16
            + tl.arange(0, 16)[None, None, None, :]
        )
        return tl.zeros([BN, 1, 1, 1], tl.int32) + kk  # [BN, NH, 4, 16]
    elif QUANT == 9 or (QUANT >= 3 and QUANT < 6):  # q5_0 and the row layouts: each 32-input
        # block's first 16 (low nibbles); the high ones are at + 16
        kk = tl.arange(0, BK // 32)[None, :, None] * 32 + tl.arange(0, 16)[None, None, :]
        return tl.zeros([BN, 1, 1], tl.int32) + kk  # [BN, NB, 16]
    elif QUANT >= 6:  # q4_k / q5_k: each 64-input chunk's first 32 (low nibbles); high at + 32
        kk = tl.arange(0, BK // 64)[None, :, None] * 64 + tl.arange(0, 32)[None, None, :]
        return tl.zeros([BN, 1, 1], tl.int32) + kk  # [BN, NC, 32]
    else:
        return tl.arange(0, BK // G)[:, None, None] * G + tl.arange(0, G)[None, :, None]


@triton.jit
def _acc_zeros(QUANT: tl.constexpr, G: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               ELEM: tl.constexpr):  # fmt: skip
    """Accumulators of one K step. int4: ELEM (the product's) keeps [groups, G, 32] products and
    reduces once at the end; ELEM=False (an ablation) sums rows per step."""
    if QUANT == 0:
        a = tl.zeros([BN, BK], tl.float32)
        return a, a
    elif QUANT == 1:
        a = tl.zeros([BN, BK // G], tl.float32)
        return a, a
    elif QUANT == 8:
        a = tl.zeros([BN, BK // 128], tl.float32)
        return a, a
    elif QUANT == 9 or (QUANT >= 3 and QUANT < 6):
        a = tl.zeros([BN, BK // 32], tl.float32)
        return a, a
    elif QUANT >= 6:
        a = tl.zeros([BN, BK // 64], tl.float32)
        return a, a
    elif ELEM:
        a = tl.zeros([BK // G, G, 32], tl.float32)
        return a, a
    else:
        a = tl.zeros([BK // G, 32], tl.float32)
        return a, a


@triton.jit
def _load_w(q_ptr, e, n0, k0, N: tl.constexpr, K: tl.constexpr, QUANT: tl.constexpr,
            G: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ES: tl.constexpr = 0):  # fmt: skip
    """Raw weight tile of expert e, rows from n0 (int4: the 64-row block at n0), inputs from k0."""
    if QUANT == 0:
        r = n0 + tl.arange(0, BN)[:, None]
        return tl.load(q_ptr + e * (N * K) + r * K + k0 + tl.arange(0, BK)[None, :])
    elif QUANT == 1:
        r = n0 + tl.arange(0, BN)[:, None, None]
        kk = k0 + tl.arange(0, BK // G)[None, :, None] * G + tl.arange(0, G)[None, None, :]
        return tl.load(q_ptr + e * (N * K) + r * K + kk)  # [BN, NG, G]
    elif QUANT == 8:  # q6_k: each nibble byte once | its lane's high-pair byte << 8, int32
        r = n0 + tl.arange(0, BN)[:, None, None]
        hb = k0 // 128 + tl.arange(0, BK // 128)[None, :, None]  # the row's halves
        g = tl.arange(0, 4)[None, None, :, None]  # group of quarter g // 2, lanes 16 (g % 2) ..
        t = tl.arange(0, 16)[None, None, None, :]
        blk = (_kq_block(q_ptr, e, r, hb // 2, N, K, QUANT, ES) + (hb % 2) * 64)[:, :, :, None]
        lo = tl.load(blk + 16 * g + t).to(tl.int32)
        hi = tl.load(blk + 128 - 32 * (hb % 2)[:, :, :, None] + 16 * (g % 2) + t)
        return lo | (hi.to(tl.int32) << 8)  # [BN, NH, 4, 16]
    elif QUANT == 9:  # q5_0: each nibble byte | the low inputs' fifth-bit byte << 8 | the high
        # inputs' << 16, int32 (lane j's bits are j % 8 of bytes 2 + j // 8 and 4 + j // 8)
        r = n0 + tl.arange(0, BN)[:, None, None]
        kb = k0 // 32 + tl.arange(0, BK // 32)[None, :, None]
        j = tl.arange(0, 16)[None, None, :]
        blk = _q5_0_block(q_ptr, e, r, kb, N, K, ES)
        qs = tl.load(blk + 6 + j).to(tl.int32)
        h_lo = tl.load(blk + 2 + j // 8).to(tl.int32)
        return qs | (h_lo << 8) | (tl.load(blk + 4 + j // 8).to(tl.int32) << 16)  # [BN, NB, 16]
    elif QUANT >= 6:  # q4_k: chunks' nibble bytes; q5_k: | the fifth bits' bytes << 8, int32
        r = n0 + tl.arange(0, BN)[:, None, None]
        c = k0 // 64 + tl.arange(0, BK // 64)[None, :, None]
        lane = tl.arange(0, 32)[None, None, :]
        blk = _kq_block(q_ptr, e, r, c // 4, N, K, QUANT, ES)
        if QUANT == 6:
            return tl.load(blk + 16 + (c % 4) * 32 + lane)  # [BN, NC, 32]
        else:
            qs = tl.load(blk + 48 + (c % 4) * 32 + lane).to(tl.int32)
            return qs | (tl.load(blk + 16 + lane).to(tl.int32) << 8)
    elif QUANT >= 3:
        r = n0 + tl.arange(0, BN)[:, None, None]
        kb = k0 // 32 + tl.arange(0, BK // 32)[None, :, None]
        j = tl.arange(0, 16)[None, None, :]
        return tl.load(q_ptr + e * (N * (K // 2)) + r * (K // 2) + kb * 16 + j)  # [BN, NB, 16]
    else:
        base = q_ptr + e * (N * (K // 2)) + (n0 // 64) * (K * 32)
        kk = k0 + _k_offsets(QUANT, G, 1, BK)
        return tl.load(base + kk * 32 + tl.arange(0, 32)[None, None, :])  # [NG, G, 32]


@triton.jit
def _kq_block(q_ptr, e, r, sb, N: tl.constexpr, K: tl.constexpr, QUANT: tl.constexpr,
              ES: tl.constexpr = 0):  # fmt: skip
    """The address of super-block sb of row r of expert e's K-quant matrix [N, K/256, B]; ES:
    the bytes from one expert's matrix to the next (0: N K/256 B, packed; a pool of per-layer
    layouts: its largest record's, Launch.build)."""
    B: tl.constexpr = 144 if QUANT == 6 else (176 if QUANT == 7 else 210)
    if ES == 0:
        return q_ptr + ((e * N + r) * (K // 256) + sb) * B
    else:
        return q_ptr + e * ES + (r * (K // 256) + sb) * B


@triton.jit
def _q5_0_block(q_ptr, e, r, kb, N: tl.constexpr, K: tl.constexpr, ES: tl.constexpr = 0):
    """The address of block kb (32 inputs, 22 bytes) of row r of expert e's q5_0 matrix [N, K/32,
    22]; ES as _kq_block's."""
    if ES == 0:
        return q_ptr + ((e * N + r) * (K // 32) + kb) * 22
    else:
        return q_ptr + e * ES + (r * (K // 32) + kb) * 22


@triton.jit
def _hi_inputs(ptr, xv, QUANT: tl.constexpr):
    """The inputs of a K step's high nibbles, at ptr (the low ones' offsets): + 16 for the row
    layouts, + 32 for q4_k / q5_k, + 64 for q6_k; xv for the others (unused)."""
    if QUANT == 6 or QUANT == 7:
        return tl.load(ptr + 32).to(tl.float32)
    elif QUANT == 8:  # q6_k: quarters 2, 3
        return tl.load(ptr + 64).to(tl.float32)
    elif QUANT == 9 or (QUANT >= 3 and QUANT < 6):
        return tl.load(ptr + 16).to(tl.float32)
    else:
        return xv


@triton.jit
def _chain(acc, a, b, c, d, BN: tl.constexpr, NB: tl.constexpr, W: tl.constexpr):
    """acc [BN, NB] + the sum over the last axis (W) of a * b + c * d ([BN, NB, W] each) as one
    chain of fused multiply-adds, in the order the axis is halved (tl.split: free, the axis is
    in-thread); tl.sum would multiply first and add the products in a tree. The chain ablation's
    step (_step's CHAIN hook; benchmarks/ablations/triton_decode.py)."""
    if W == 1:
        acc = tl.fma(tl.reshape(a, [BN, NB]), tl.reshape(b, [BN, NB]), acc)
        return tl.fma(tl.reshape(c, [BN, NB]), tl.reshape(d, [BN, NB]), acc)
    else:
        a0, a1 = tl.split(tl.reshape(a, [BN, NB, W // 2, 2]))
        b0, b1 = tl.split(tl.reshape(b, [BN, NB, W // 2, 2]))
        c0, c1 = tl.split(tl.reshape(c, [BN, NB, W // 2, 2]))
        d0, d1 = tl.split(tl.reshape(d, [BN, NB, W // 2, 2]))
        acc = _chain(acc, a0, b0, c0, d0, BN, NB, W // 2)
        return _chain(acc, a1, b1, c1, d1, BN, NB, W // 2)


@triton.jit
def _step(w, s_ptr, e, n0, k0, xv, xh, N: tl.constexpr, K: tl.constexpr, QUANT: tl.constexpr,
          G: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ELEM: tl.constexpr,
          FAST: tl.constexpr, HALF: tl.constexpr = False, CHAIN: tl.constexpr = False, ES: tl.constexpr = 0):  # fmt: skip
    """One K step: raw tile w times inputs xv (shaped by _k_offsets) -> accumulator increments.
    xh: int4 rows' high-nibble inputs (xv's + 16); the other layouts ignore it. HALF: int4 rows
    through _u4_f32's HALF (DecodeConfig.half); CHAIN: a block's products by _chain (the chain
    ablation's hook, benchmarks/ablations/triton_decode.py; measured slower, off here)."""
    NG: tl.constexpr = BK // G
    if QUANT == 0:
        p = w.to(tl.float32) * xv
        return p, p
    elif QUANT == 1:
        r = n0 + tl.arange(0, BN)[:, None]
        s = tl.load(s_ptr + e * (N * (K // G)) + r * (K // G) + k0 // G + tl.arange(0, NG)[None, :])
        p = tl.sum(_s8_f32(w, FAST) * xv, 2) * s  # [BN, NG]
        return p, p
    elif QUANT == 8:  # q6_k: (d sc) (q - 32) summed per group of 16 as (d sc) dot
        r = n0 + tl.arange(0, BN)[:, None, None]
        hb = k0 // 128 + tl.arange(0, BK // 128)[None, :, None]
        g = tl.arange(0, 4)[None, None, :]  # quarter g // 2's group g % 2; + 4: quarter + 2's
        blk = _kq_block(s_ptr, e, r, hb // 2, N, K, QUANT, ES)
        d = f16_at(blk + 208, None)
        sc = blk + 192 + 8 * (hb % 2) + g
        ds_lo = d * tl.load(sc).to(tl.int8, bitcast=True).to(tl.float32)
        ds_hi = d * tl.load(sc + 4).to(tl.int8, bitcast=True).to(tl.float32)
        # a byte's nibbles are quarters a = g // 2 and a + 2 (kquant.q6_value's c)
        a = (g // 2)[:, :, :, None]
        q_lo = q6_value(w, a)
        q_hi = q6_value(w, a + 2)
        dot_lo = tl.sum(_small_f32(q_lo, 32.0) * xv, 3)  # [BN, NH, 4]
        dot_hi = tl.sum(_small_f32(q_hi, 32.0) * xh, 3)
        p = tl.sum(dot_lo * ds_lo + dot_hi * ds_hi, 2)
        return p, p
    elif QUANT == 9:  # q5_0: d (q - 16) summed per 32-block as d dot
        r = n0 + tl.arange(0, BN)[:, None]
        kb = k0 // 32 + tl.arange(0, BK // 32)[None, :]
        d = f16_at(_q5_0_block(s_ptr, e, r, kb, N, K, ES), None)  # [BN, NB]
        s = (tl.arange(0, 16) % 8)[None, None, :]  # lane j's bit in its byte
        lo = _small_f32((w & 15) | ((w >> (4 + s)) & 16), 16.0)  # bit 8 + s -> 4
        hi = _small_f32(((w >> 4) & 15) | ((w >> (12 + s)) & 16), 16.0)  # bit 16 + s -> 4
        p = tl.sum(lo * xv + hi * xh, 2) * d
        return p, p
    elif QUANT >= 6:  # q4_k / q5_k: (d sc) q - dmin m per 32-block: (d sc) dot + z sum(x)
        r = n0 + tl.arange(0, BN)[:, None]
        c = k0 // 64 + tl.arange(0, BK // 64)[None, :]
        blk = _kq_block(s_ptr, e, r, c // 4, N, K, QUANT, ES)
        d, dmin = f16_at(blk, None), f16_at(blk + 2, None)
        sc, mn = scale_min(blk, 2 * (c % 4), None)  # the low nibbles' sub-block
        ds_lo, dm_lo = d * sc.to(tl.float32), dmin * mn.to(tl.float32)
        sc, mn = scale_min(blk, 2 * (c % 4) + 1, None)  # the high nibbles'
        ds_hi, dm_hi = d * sc.to(tl.float32), dmin * mn.to(tl.float32)
        if QUANT == 6:
            lo, hi = _u4_f32(w, FAST, HALF)  # q - 8, or HALF f = 0.5 + q / 256: [BN, NC, 32]
            if HALF:  # q = 256 f - 128
                a_lo, a_hi, off = ds_lo * 256.0, ds_hi * 256.0, -128.0
            else:  # q = (q - 8) + 8
                a_lo, a_hi, off = ds_lo, ds_hi, 8.0
        else:  # q5_k: the nibble and its fifth bit (2c + i of the bits' byte); q = (q - 16) + 16
            cs = 2 * (c % 4)[:, :, None]
            lo = _small_f32((w & 15) | ((w >> (4 + cs)) & 16), 16.0)
            hi = _small_f32(((w >> 4) & 15) | ((w >> (5 + cs)) & 16), 16.0)
            a_lo, a_hi, off = ds_lo, ds_hi, 16.0
        z_lo, z_hi = off * ds_lo - dm_lo, off * ds_hi - dm_hi
        p = (tl.sum(lo * xv, 2) * a_lo + tl.sum(hi * xh, 2) * a_hi + tl.sum(xv, 2) * z_lo
             + tl.sum(xh, 2) * z_hi)  # fmt: skip
        return p, p
    elif QUANT >= 3:  # s (q - 8) + z summed per 32-block as s * dot + z * sum(x) (q4_0: z = 0)
        NB: tl.constexpr = BK // 32
        r = n0 + tl.arange(0, BN)[:, None]
        kb = k0 // 32 + tl.arange(0, NB)[None, :]
        if QUANT == 3:
            kg = (k0 + tl.arange(0, NB)[None, :] * 32) // G
            v = tl.load(s_ptr + e * (N * (K // G)) + r * (K // G) + kg)  # (scale, zero) [BN, NB]
            sc = (v << 16).to(tl.float32, bitcast=True)
            zp = (v & -65536).to(tl.float32, bitcast=True)
        elif QUANT == 4:  # q4_0: fp16 d [N, K/32] per expert
            sc = tl.load(s_ptr + e * (N * (K // 32)) + r * (K // 32) + kb).to(tl.float32)
        else:  # q4_1: fp16 (d, m) [N, K/32, 2]; d q + m = d (q - 8) + (m + 8 d)
            dm = s_ptr + (e * (N * (K // 32)) + r * (K // 32) + kb) * 2
            sc = tl.load(dm).to(tl.float32)
            zp = tl.load(dm + 1).to(tl.float32) + sc * 8.0
        lo, hi = _u4_f32(w, FAST, HALF)  # q - 8, or HALF f = 0.5 + q / 256: [BN, NB, 16]
        if HALF:  # sum (q - 8) x = 256 sum f x - 136 sum x: the offset into the zero term
            if QUANT == 4:
                sc, zp = sc * 256.0, sc * -136.0
            else:
                sc, zp = sc * 256.0, zp - sc * 136.0
        if CHAIN:
            dot = _chain(tl.zeros([BN, NB], tl.float32), lo, xv, hi, xh, BN, NB, 16)
        else:
            dot = tl.sum(lo * xv + hi * xh, 2)
        if QUANT != 4 or HALF:
            p = dot * sc + tl.sum(xv + xh, 2) * zp
        else:  # q4_0's q - 8: no zero term
            p = dot * sc
        return p, p
    else:
        lo, hi = _u4_f32(w, FAST)  # q - 8, [NG, G, 32]
        # (scale, zero) bf16 pairs read as one int32: [K/G, N] words per expert
        if ELEM:
            j = tl.arange(0, 32)[None, None, :]
            kg = k0 // G + tl.arange(0, NG)[:, None, None]
        else:
            j = tl.arange(0, 32)[None, :]
            kg = k0 // G + tl.arange(0, NG)[:, None]
        sp = s_ptr + e * ((K // G) * N) + kg * N + n0 + j
        v_lo = tl.load(sp)
        v_hi = tl.load(sp + 32)
        s_lo = (v_lo << 16).to(tl.float32, bitcast=True)
        z_lo = (v_lo & -65536).to(tl.float32, bitcast=True)
        s_hi = (v_hi << 16).to(tl.float32, bitcast=True)
        z_hi = (v_hi & -65536).to(tl.float32, bitcast=True)
        if ELEM:
            return (lo * s_lo + z_lo) * xv, (hi * s_hi + z_hi) * xv
        else:
            xs = tl.sum(xv, 1)  # [NG, 1]
            return (tl.sum(lo * xv, 1) * s_lo + z_lo * xs, tl.sum(hi * xv, 1) * s_hi + z_hi * xs)


@triton.jit
def _reduce(a, b, QUANT: tl.constexpr, ELEM: tl.constexpr):
    """Accumulators -> row sums: [BN] (and a dummy), or int4's (low rows [32], high rows [32])."""
    if QUANT == 2:
        if ELEM:
            return tl.sum(tl.sum(a, 1), 0), tl.sum(tl.sum(b, 1), 0)
        else:
            return tl.sum(a, 0), tl.sum(b, 0)
    else:
        y = tl.sum(a, 1)
        return y, y


@triton.jit
def _rows_store(ptr, ya, yb, QUANT: tl.constexpr, BN: tl.constexpr):
    """Store row sums from _reduce at ptr[0:BN] (int4: low rows then high rows)."""
    if QUANT == 2:
        tl.store(ptr + tl.arange(0, 32), ya)
        tl.store(ptr + 32 + tl.arange(0, 32), yb)
    else:
        tl.store(ptr + tl.arange(0, BN), ya)


@triton.jit
def _silu_mul(g, u):
    return g / (1.0 + tl.exp(-g)) * u


@triton.jit
def _gate_up_finish(g_a, g_b, u_a, u_b, part_ptr, cnt_ptr, h_ptr, ready_ptr, p, nb, sk, n0, P,
                    I: tl.constexpr, QUANT: tl.constexpr, BN: tl.constexpr,
                    SPLIT: tl.constexpr, READY: tl.constexpr):  # fmt: skip
    """Row sums of program (p, nb, sk) -> h[p, n0:n0+BN] = silu(g) * u; with SPLIT > 1 through
    fp32 partials, the block's last program (int32 counter) adding them in split order. READY:
    the program that wrote the h block counts it in ready[p] (release), for the down items of
    the benchmarks' one-launch ablation."""
    N: tl.constexpr = 2 * I
    if SPLIT == 1:
        hd = h_ptr.dtype.element_ty
        _rows_store(
            h_ptr + p * I + n0, _silu_mul(g_a, u_a).to(hd), _silu_mul(g_b, u_b).to(hd), QUANT, BN
        )
        if READY:
            tl.debug_barrier()  # every thread's h rows are stored before the release below
            tl.atomic_add(ready_ptr + p, 1, sem="release", scope="gpu")
    else:
        mine = part_ptr + (sk * P + p) * N + n0
        _rows_store(mine, g_a, g_b, QUANT, BN)
        _rows_store(mine + I, u_a, u_b, QUANT, BN)
        cnt = cnt_ptr + p * (I // BN) + nb
        tl.debug_barrier()  # every thread's partial is stored before the release below
        if tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
            r = n0 + tl.arange(0, BN)
            g = tl.zeros([BN], tl.float32)
            u = tl.zeros([BN], tl.float32)
            for i in tl.static_range(SPLIT):
                g += tl.load(part_ptr + (i * P + p) * N + r, cache_modifier=".cg")
                u += tl.load(part_ptr + (i * P + p) * N + I + r, cache_modifier=".cg")
            tl.store(h_ptr + p * I + r, _silu_mul(g, u).to(h_ptr.dtype.element_ty))
            tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")  # ready for the next call
            if READY:
                tl.debug_barrier()
                tl.atomic_add(ready_ptr + p, 1, sem="release", scope="gpu")


@triton.jit
def _down_finish(ya, yb, rw_ptr, dpart_ptr, cnt_ptr, out_ptr, p, nb, n0, D: tl.constexpr,
                 QUANT: tl.constexpr, BN: tl.constexpr, TOPK: tl.constexpr,
                 COMBINE: tl.constexpr):  # fmt: skip
    """Pair p's rows times its routing weight -> its fp32 row of dpart; with COMBINE the last of
    the token's TOPK programs for this row block adds them in slot order into out."""
    rw = tl.load(rw_ptr + p).to(tl.float32)
    _rows_store(dpart_ptr + p * D + n0, ya * rw, yb * rw, QUANT, BN)
    if COMBINE:
        t = p // TOPK
        cnt = cnt_ptr + t * (D // BN) + nb
        tl.debug_barrier()  # every thread's row is stored before the release below
        if tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") == TOPK - 1:
            _combine_rows(dpart_ptr, out_ptr, t, n0 + tl.arange(0, BN), D, TOPK, BN)
            tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")  # ready for the next call


@triton.jit
def _source(ids_ptr, p, q_ptr, s_ptr, hq_ptr, hs_ptr, HOST: tl.constexpr):
    """Pair p's expert: slot e >= 0 of the VRAM pool (q_ptr, s_ptr); with HOST, a code e < 0 names
    record -1 - e of the pinned host mirror (hq_ptr, hs_ptr: the same section layout), which the
    loads read through unified addressing (PCIe), with the same arithmetic: the same bits."""
    e = tl.load(ids_ptr + p).to(tl.int64)
    if HOST:
        far = e < 0
        q_ptr = tl.where(far, hq_ptr, q_ptr)
        s_ptr = tl.where(far, hs_ptr, s_ptr)
        e = tl.where(far, -1 - e, e)
    return q_ptr, s_ptr, e


@triton.jit
def _gate_up_item(x_ptr, ids_ptr, q_ptr, s_ptr, hq_ptr, hs_ptr, part_ptr, cnt_ptr, h_ptr, ready_ptr,
                  p, nb, sk, P, D: tl.constexpr, I: tl.constexpr, QUANT: tl.constexpr,
                  G: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
                  TOPK: tl.constexpr, ELEM: tl.constexpr, FAST: tl.constexpr, READY: tl.constexpr,
                  HOST: tl.constexpr, HALF: tl.constexpr = False,
                  CHAIN: tl.constexpr = False, ES: tl.constexpr = 0):  # fmt: skip
    """Work item (p, nb, sk): gate rows [n0, n0 + BN) and the same up rows (I + n0 ...) of pair
    p's expert over D split sk -> h[p, n0 + r] = silu(g) * u (through split partials and a
    counter when SPLIT > 1)."""
    N: tl.constexpr = 2 * I
    q_ptr, s_ptr, e = _source(ids_ptr, p, q_ptr, s_ptr, hq_ptr, hs_ptr, HOST)
    n0 = nb * BN
    KC: tl.constexpr = D // SPLIT
    xrow = x_ptr + (p // TOPK) * D + sk * KC
    koff = _k_offsets(QUANT, G, BN, BK)
    ga, gb = _acc_zeros(QUANT, G, BN, BK, ELEM)
    ua, ub = _acc_zeros(QUANT, G, BN, BK, ELEM)
    for kb in tl.static_range(0, KC, BK):
        k0 = sk * KC + kb
        wg = _load_w(q_ptr, e, n0, k0, N, D, QUANT, G, BN, BK, ES)
        wu = _load_w(q_ptr, e, I + n0, k0, N, D, QUANT, G, BN, BK, ES)
        xv = tl.load(xrow + kb + koff).to(tl.float32)
        xh = _hi_inputs(xrow + kb + koff, xv, QUANT)
        a, b = _step(wg, s_ptr, e, n0, k0, xv, xh, N, D, QUANT, G, BN, BK, ELEM, FAST, HALF,
                     CHAIN, ES)  # fmt: skip
        ga += a
        gb += b
        a, b = _step(wu, s_ptr, e, I + n0, k0, xv, xh, N, D, QUANT, G, BN, BK, ELEM, FAST, HALF,
                     CHAIN, ES)  # fmt: skip
        ua += a
        ub += b
    g_a, g_b = _reduce(ga, gb, QUANT, ELEM)
    u_a, u_b = _reduce(ua, ub, QUANT, ELEM)
    _gate_up_finish(g_a, g_b, u_a, u_b, part_ptr, cnt_ptr, h_ptr, ready_ptr, p, nb, sk, n0, P, I,
                    QUANT, BN, SPLIT, READY)  # fmt: skip


@triton.jit
def _picked(sel_ptr, p, PICK: tl.constexpr):
    """Whether pair p runs in this launch: PICK 0 every pair; 1 only a pair whose code sel[p] is
    >= 0 (a VRAM slot: a hit), 2 only one whose code is < 0 (a miss, staged meanwhile): a layer
    in two launches, hits while the misses cross PCIe, then the misses (moe_decode's `pick`).
    A PICK 2 launch has PICK_LANES programs a block, not one a pair (the kernels' loops over
    `_picked` pairs p = lane, lane + PICK_LANES, ...): few of a layer's pairs miss, and a full
    grid of programs that return at once cost the launch about its hits' compute."""
    if PICK == 0:
        return True
    elif PICK == 1:
        return tl.load(sel_ptr + p) >= 0
    else:
        return tl.load(sel_ptr + p) < 0


@triton.jit
def _gate_up_kernel(
    x_ptr, ids_ptr, q_ptr, s_ptr, hq_ptr, hs_ptr, part_ptr, cnt_ptr, h_ptr, P,
    D: tl.constexpr, I: tl.constexpr, QUANT: tl.constexpr, G: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr, SPLIT: tl.constexpr, TOPK: tl.constexpr, ELEM: tl.constexpr,
    FAST: tl.constexpr, PDL: tl.constexpr, HOST: tl.constexpr, sel_ptr=None,
    PICK: tl.constexpr = 0, LANES: tl.constexpr = 1, HALF: tl.constexpr = False,
    CHAIN: tl.constexpr = False, ES: tl.constexpr = 0,
):  # fmt: skip
    """Program (p, nb, sk) = one _gate_up_item (of a pair _picked by this launch)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if PICK == 2:  # LANES programs a block walk the pairs (the misses' launch)
        for p in range(tl.program_id(0), P, LANES):
            if _picked(sel_ptr, p, PICK):
                _gate_up_item(x_ptr, ids_ptr, q_ptr, s_ptr, hq_ptr, hs_ptr, part_ptr, cnt_ptr,
                              h_ptr, cnt_ptr, p, tl.program_id(1), tl.program_id(2), P, D, I,
                              QUANT, G, BN, BK, SPLIT, TOPK, ELEM, FAST, False, HOST, HALF,
                              CHAIN, ES)  # fmt: skip
    elif _picked(sel_ptr, tl.program_id(0), PICK):
        _gate_up_item(x_ptr, ids_ptr, q_ptr, s_ptr, hq_ptr, hs_ptr, part_ptr, cnt_ptr, h_ptr,
                      cnt_ptr, tl.program_id(0), tl.program_id(1), tl.program_id(2), P, D, I,
                      QUANT, G, BN, BK, SPLIT, TOPK, ELEM, FAST, False, HOST, HALF,
                      CHAIN, ES)  # fmt: skip


@triton.jit
def _await(ready_ptr, p, WAIT: tl.constexpr, NBG: tl.constexpr):
    """Before reading h: WAIT 1 = the PDL-launched down kernel waits for the gate/up grid; 2 = a
    persistent kernel's down item (the benchmarks' one-launch ablation) spins until pair p's NBG
    h blocks are counted in ready[p] (atomics: polling loads with a sleep measured slower)."""
    if WAIT == 1:
        tl.extra.cuda.gdc_wait()  # h of the gate/up kernel complete and visible
    elif WAIT == 2:
        n = tl.atomic_add(ready_ptr + p, 0, sem="acquire", scope="gpu")
        while n < NBG:
            n = tl.atomic_add(ready_ptr + p, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()


@triton.jit
def _down_item(h_ptr, ids_ptr, rw_ptr, q_ptr, s_ptr, hq_ptr, hs_ptr, dpart_ptr, cnt_ptr, out_ptr,
               ready_ptr, p, nb, D: tl.constexpr, I: tl.constexpr, QUANT: tl.constexpr,
               G: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, TOPK: tl.constexpr,
               ELEM: tl.constexpr, FAST: tl.constexpr, WAIT: tl.constexpr, NBG: tl.constexpr,
               COMBINE: tl.constexpr, HOST: tl.constexpr, HALF: tl.constexpr = False,
               CHAIN: tl.constexpr = False, ES: tl.constexpr = 0):  # fmt: skip
    """Work item (p, nb): output rows [n0, n0 + BN) of pair p over all of I, times the routing
    weight, stored as pair p's fp32 row; with COMBINE the token's last item for the row block adds
    its TOPK rows in slot order and writes the output. The first weight tile is loaded before
    the wait for h (_await). The pair rows do not depend on the call's other pairs, so a
    prefill run in chunks of pairs gives the same bits."""
    q_ptr, s_ptr, e = _source(ids_ptr, p, q_ptr, s_ptr, hq_ptr, hs_ptr, HOST)
    n0 = nb * BN
    koff = _k_offsets(QUANT, G, BN, BK)
    w_first = _load_w(q_ptr, e, n0, 0, D, I, QUANT, G, BN, BK, ES)  # weights need no wait
    _await(ready_ptr, p, WAIT, NBG)
    acc_a, acc_b = _acc_zeros(QUANT, G, BN, BK, ELEM)
    for k0 in tl.static_range(0, I, BK):
        if k0 == 0:
            w = w_first
        else:
            w = _load_w(q_ptr, e, n0, k0, D, I, QUANT, G, BN, BK, ES)
        hv = tl.load(h_ptr + p * I + k0 + koff).to(tl.float32)
        hh = _hi_inputs(h_ptr + p * I + k0 + koff, hv, QUANT)
        a, b = _step(w, s_ptr, e, n0, k0, hv, hh, D, I, QUANT, G, BN, BK, ELEM, FAST, HALF, CHAIN,
                     ES)  # fmt: skip
        acc_a += a
        acc_b += b
    ya, yb = _reduce(acc_a, acc_b, QUANT, ELEM)
    _down_finish(ya, yb, rw_ptr, dpart_ptr, cnt_ptr, out_ptr, p, nb, n0, D, QUANT, BN, TOPK,
                 COMBINE)  # fmt: skip


@triton.jit
def _combine_rows(dpart_ptr, out_ptr, t, r, D: tl.constexpr, TOPK: tl.constexpr,
                  BN: tl.constexpr):  # fmt: skip
    """out[t, r] = the token's TOPK pair rows of dpart added in slot order (fp32, then the
    output dtype). Shared by the fused combine and `combine_pairs`, so both give the same bits."""
    tot = tl.zeros([BN], tl.float32)
    for i in range(TOPK):  # fixed order: deterministic
        tot += tl.load(dpart_ptr + (t * TOPK + i) * D + r, cache_modifier=".cg")
    tl.store(out_ptr + t * D + r, tot.to(out_ptr.dtype.element_ty))


@triton.jit
def _down_kernel(
    h_ptr, ids_ptr, rw_ptr, q_ptr, s_ptr, hq_ptr, hs_ptr, dpart_ptr, cnt_ptr, out_ptr, P,
    D: tl.constexpr, I: tl.constexpr, QUANT: tl.constexpr, G: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr, TOPK: tl.constexpr, ELEM: tl.constexpr, FAST: tl.constexpr,
    PDL: tl.constexpr, COMBINE: tl.constexpr, HOST: tl.constexpr, sel_ptr=None,
    PICK: tl.constexpr = 0, LANES: tl.constexpr = 1, HALF: tl.constexpr = False,
    CHAIN: tl.constexpr = False, ES: tl.constexpr = 0,
):  # fmt: skip
    """Program (p, nb) = one _down_item (PDL: waits for the gate/up grid), of a pair _picked by
    this launch: the combine counts only pairs that ran, so of a layer's two picked launches
    the last pair row of a block, in either, adds the TOPK rows."""
    if PICK == 2:  # LANES programs a block walk the pairs (the misses' launch)
        for p in range(tl.program_id(0), P, LANES):
            if _picked(sel_ptr, p, PICK):
                _down_item(h_ptr, ids_ptr, rw_ptr, q_ptr, s_ptr, hq_ptr, hs_ptr, dpart_ptr,
                           cnt_ptr, out_ptr, cnt_ptr, p, tl.program_id(1), D, I, QUANT, G, BN,
                           BK, TOPK, ELEM, FAST, 1 if PDL else 0, 0, COMBINE, HOST, HALF,
                           CHAIN, ES)  # fmt: skip
    elif _picked(sel_ptr, tl.program_id(0), PICK):
        _down_item(h_ptr, ids_ptr, rw_ptr, q_ptr, s_ptr, hq_ptr, hs_ptr, dpart_ptr, cnt_ptr,
                   out_ptr, cnt_ptr, tl.program_id(0), tl.program_id(1), D, I, QUANT, G, BN, BK,
                   TOPK, ELEM, FAST, 1 if PDL else 0, 0, COMBINE, HOST, HALF, CHAIN, ES)  # fmt: skip


@triton.jit
def _combine_kernel(dpart_ptr, out_ptr, D: tl.constexpr, TOPK: tl.constexpr, BN: tl.constexpr):
    t = tl.program_id(0)
    _combine_rows(dpart_ptr, out_ptr, t, tl.program_id(1) * BN + tl.arange(0, BN), D, TOPK, BN)


# ---- tensor-core variants (mma): group sums of raw integer weights on tensor cores -------------
# A K step multiplies a block-diagonal input xa [16, BK] (row g holds group g's inputs, zero
# elsewhere) by the raw weights converted exactly to the activation dtype (int8 -> q, int4 ->
# q - 8, both exact in bf16): one tl.dot gives every (group, row) sum, and the scales are applied
# on [16, rows] instead of on every weight. bf16 weights take the dot as they are (one group).
@triton.jit
def _u4_dt(b, FAST: tl.constexpr, DT: tl.constexpr):
    """Packed int4 bytes -> (low nibble - 8, high nibble - 8) in DT. FAST (bf16): the nibbles go
    into the mantissa of 128.0 by lop3 (two per instruction), then one bf16x2 fma subtracts 136."""
    if FAST:
        return tl.inline_asm_elementwise(
            """{
            .reg .b32 t0, t1, s0, s1, one, off, z, msk, mag;
            mov.b32 one, 0x3F803F80;
            mov.b32 off, 0xC308C308;
            mov.b32 z, 0;
            mov.b32 msk, 0x000F000F;
            mov.b32 mag, 0x43004300;
            prmt.b32 t0, $4, z, 0x4140;
            prmt.b32 t1, $4, z, 0x4342;
            shr.b32 s0, t0, 4;
            shr.b32 s1, t1, 4;
            lop3.b32 $0, t0, msk, mag, 0xEA;
            lop3.b32 $1, t1, msk, mag, 0xEA;
            lop3.b32 $2, s0, msk, mag, 0xEA;
            lop3.b32 $3, s1, msk, mag, 0xEA;
            fma.rn.bf16x2 $0, $0, one, off;
            fma.rn.bf16x2 $1, $1, one, off;
            fma.rn.bf16x2 $2, $2, one, off;
            fma.rn.bf16x2 $3, $3, one, off;
            }""",
            "=r,=r,=r,=r,r",
            [b],
            dtype=(tl.bfloat16, tl.bfloat16),
            is_pure=True,
            pack=4,
        )
    else:
        w = b.to(tl.int32)
        return ((w & 15) - 8).to(DT), ((w >> 4) - 8).to(DT)


@triton.jit
def _mma_load(q_ptr, s_ptr, e, n0, k0, N: tl.constexpr, K: tl.constexpr, QUANT: tl.constexpr,
              G: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    """Raw tiles of one K step: (weights, scales). bf16 and int8: weights [BN, BK] (rows n0...);
    int4: bytes [BK, 32] of the 64-row block at n0. Scales [16 groups, rows] (zero past the
    step's BK / G groups); int4: the (scale, zero) words of the low and the high rows."""
    gi = tl.arange(0, 16)[:, None]
    if QUANT == 2:
        kk = k0 + tl.arange(0, BK)[:, None]
        base = q_ptr + e * (N * (K // 2)) + (n0 // 64) * (K * 32)
        w = tl.load(base + kk * 32 + tl.arange(0, 32)[None, :])
        sp = s_ptr + e * ((K // G) * N) + (k0 // G + gi) * N + n0 + tl.arange(0, 32)[None, :]
        m = gi < BK // G
        return w, tl.load(sp, mask=m, other=0), tl.load(sp + 32, mask=m, other=0)
    else:
        r = n0 + tl.arange(0, BN)
        w = tl.load(q_ptr + e * (N * K) + r[:, None] * K + k0 + tl.arange(0, BK)[None, :])
        if QUANT == 1:
            sp = s_ptr + e * (N * (K // G)) + r[None, :] * (K // G) + k0 // G + gi
            s = tl.load(sp, mask=gi < BK // G, other=0.0)
            return w, s, s
        else:
            return w, w, w


@triton.jit
def _mma_step(w, sa, sb, xk, QUANT: tl.constexpr, G: tl.constexpr, BK: tl.constexpr,
              FAST: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
    """Raw tiles from _mma_load times the step's inputs xk [BK] -> accumulator increments
    [16, rows] (int4: low rows, high rows [16, 32]; else the same tile twice)."""
    GS: tl.constexpr = BK if QUANT == 0 else G  # bf16: one group
    gi = tl.arange(0, 16)[:, None]
    own = tl.arange(0, BK)[None, :] // GS == gi
    xa = tl.where(own, xk.to(tl.float32)[None, :], 0.0)  # [16, BK]
    xd = xa.to(DT)
    if QUANT == 2:
        lo, hi = _u4_dt(w, FAST, DT)  # [BK, 32]
        xs = tl.sum(xa, 1)[:, None]  # group sums of the inputs (the zero points' factor)
        c_lo = tl.dot(xd, lo, input_precision=PREC)
        c_hi = tl.dot(xd, hi, input_precision=PREC)
        s_lo = (sa << 16).to(tl.float32, bitcast=True)
        z_lo = (sa & -65536).to(tl.float32, bitcast=True)
        s_hi = (sb << 16).to(tl.float32, bitcast=True)
        z_hi = (sb & -65536).to(tl.float32, bitcast=True)
        return c_lo * s_lo + z_lo * xs, c_hi * s_hi + z_hi * xs
    elif QUANT == 1:
        c = tl.dot(xd, tl.trans(_s8_f32(w, FAST).to(DT)), input_precision=PREC)  # [16, BN]
        return c * sa, c
    else:
        c = tl.dot(xd, tl.trans(w.to(DT)), input_precision=PREC)
        return c, c


@triton.jit
def _gate_up_mma_step(q_ptr, s_ptr, e, n0, k0, xrow, ga, gb, ua, ub, N: tl.constexpr,
                      D: tl.constexpr, I: tl.constexpr, QUANT: tl.constexpr, G: tl.constexpr,
                      BN: tl.constexpr, BK: tl.constexpr, FAST: tl.constexpr, DT: tl.constexpr,
                      PREC: tl.constexpr):  # fmt: skip
    wg, sga, sgb = _mma_load(q_ptr, s_ptr, e, n0, k0, N, D, QUANT, G, BN, BK)
    wu, sua, sub = _mma_load(q_ptr, s_ptr, e, I + n0, k0, N, D, QUANT, G, BN, BK)
    xk = tl.load(xrow + k0 + tl.arange(0, BK))
    a, b = _mma_step(wg, sga, sgb, xk, QUANT, G, BK, FAST, DT, PREC)
    c, d = _mma_step(wu, sua, sub, xk, QUANT, G, BK, FAST, DT, PREC)
    return ga + a, gb + b, ua + c, ub + d


@triton.jit
def _gate_up_mma_item(x_ptr, ids_ptr, q_ptr, s_ptr, hq_ptr, hs_ptr, part_ptr, cnt_ptr, h_ptr,
                      ready_ptr, p, nb, sk, P, D: tl.constexpr, I: tl.constexpr,
                      QUANT: tl.constexpr, G: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      SPLIT: tl.constexpr, TOPK: tl.constexpr, FAST: tl.constexpr,
                      DT: tl.constexpr, PREC: tl.constexpr, STAGES: tl.constexpr,
                      READY: tl.constexpr, HOST: tl.constexpr):  # fmt: skip
    """_gate_up_item on tensor cores: the same outputs."""
    N: tl.constexpr = 2 * I
    W: tl.constexpr = 32 if QUANT == 2 else BN
    q_ptr, s_ptr, e = _source(ids_ptr, p, q_ptr, s_ptr, hq_ptr, hs_ptr, HOST)
    n0 = nb * BN
    KC: tl.constexpr = D // SPLIT
    xrow = x_ptr + (p // TOPK) * D
    ga = tl.zeros([16, W], tl.float32)
    gb = tl.zeros([16, W], tl.float32)
    ua = tl.zeros([16, W], tl.float32)
    ub = tl.zeros([16, W], tl.float32)
    if STAGES == 0:  # unrolled
        for kb in tl.static_range(0, KC, BK):
            ga, gb, ua, ub = _gate_up_mma_step(q_ptr, s_ptr, e, n0, sk * KC + kb, xrow, ga, gb,
                                               ua, ub, N, D, I, QUANT, G, BN, BK, FAST, DT,
                                               PREC)  # fmt: skip
    else:  # software-pipelined: the loads of STAGES - 1 later steps are in flight
        for kb in tl.range(0, KC, BK, num_stages=STAGES):
            ga, gb, ua, ub = _gate_up_mma_step(q_ptr, s_ptr, e, n0, sk * KC + kb, xrow, ga, gb,
                                               ua, ub, N, D, I, QUANT, G, BN, BK, FAST, DT,
                                               PREC)  # fmt: skip
    g_a, g_b = tl.sum(ga, 0), tl.sum(gb, 0)
    u_a, u_b = tl.sum(ua, 0), tl.sum(ub, 0)
    _gate_up_finish(g_a, g_b, u_a, u_b, part_ptr, cnt_ptr, h_ptr, ready_ptr, p, nb, sk, n0, P, I,
                    QUANT, BN, SPLIT, READY)  # fmt: skip


@triton.jit
def _gate_up_mma_kernel(
    x_ptr, ids_ptr, q_ptr, s_ptr, hq_ptr, hs_ptr, part_ptr, cnt_ptr, h_ptr, P,
    D: tl.constexpr, I: tl.constexpr, QUANT: tl.constexpr, G: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr, SPLIT: tl.constexpr, TOPK: tl.constexpr, FAST: tl.constexpr,
    PDL: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr, STAGES: tl.constexpr,
    HOST: tl.constexpr, sel_ptr=None, PICK: tl.constexpr = 0, LANES: tl.constexpr = 1,
):  # fmt: skip
    """Program (p, nb, sk) = one _gate_up_mma_item (of a pair _picked by this launch)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if PICK == 2:  # LANES programs a block walk the pairs (the misses' launch)
        for p in range(tl.program_id(0), P, LANES):
            if _picked(sel_ptr, p, PICK):
                _gate_up_mma_item(x_ptr, ids_ptr, q_ptr, s_ptr, hq_ptr, hs_ptr, part_ptr,
                                  cnt_ptr, h_ptr, cnt_ptr, p, tl.program_id(1), tl.program_id(2),
                                  P, D, I, QUANT, G, BN, BK, SPLIT, TOPK, FAST, DT, PREC, STAGES,
                                  False, HOST)  # fmt: skip
    elif _picked(sel_ptr, tl.program_id(0), PICK):
        _gate_up_mma_item(x_ptr, ids_ptr, q_ptr, s_ptr, hq_ptr, hs_ptr, part_ptr, cnt_ptr, h_ptr,
                          cnt_ptr, tl.program_id(0), tl.program_id(1), tl.program_id(2), P, D, I,
                          QUANT, G, BN, BK, SPLIT, TOPK, FAST, DT, PREC, STAGES, False,
                          HOST)  # fmt: skip


@triton.jit
def _down_mma_item(h_ptr, ids_ptr, rw_ptr, q_ptr, s_ptr, hq_ptr, hs_ptr, dpart_ptr, cnt_ptr,
                   out_ptr, ready_ptr, p, nb, D: tl.constexpr, I: tl.constexpr,
                   QUANT: tl.constexpr, G: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   TOPK: tl.constexpr, FAST: tl.constexpr, WAIT: tl.constexpr,
                   NBG: tl.constexpr, COMBINE: tl.constexpr, DT: tl.constexpr,
                   PREC: tl.constexpr, HOST: tl.constexpr):  # fmt: skip
    """_down_item on tensor cores: the same pair rows and combine."""
    q_ptr, s_ptr, e = _source(ids_ptr, p, q_ptr, s_ptr, hq_ptr, hs_ptr, HOST)
    n0 = nb * BN
    W: tl.constexpr = 32 if QUANT == 2 else BN
    w0, s0a, s0b = _mma_load(q_ptr, s_ptr, e, n0, 0, D, I, QUANT, G, BN, BK)  # before the wait
    _await(ready_ptr, p, WAIT, NBG)
    acc_a = tl.zeros([16, W], tl.float32)
    acc_b = tl.zeros([16, W], tl.float32)
    for k0 in tl.static_range(0, I, BK):
        if k0 == 0:
            w, sa, sb = w0, s0a, s0b
        else:
            w, sa, sb = _mma_load(q_ptr, s_ptr, e, n0, k0, D, I, QUANT, G, BN, BK)
        hk = tl.load(h_ptr + p * I + k0 + tl.arange(0, BK))
        a, b = _mma_step(w, sa, sb, hk, QUANT, G, BK, FAST, DT, PREC)
        acc_a += a
        acc_b += b
    _down_finish(tl.sum(acc_a, 0), tl.sum(acc_b, 0), rw_ptr, dpart_ptr, cnt_ptr, out_ptr, p, nb,
                 n0, D, QUANT, BN, TOPK, COMBINE)  # fmt: skip


@triton.jit
def _down_mma_kernel(
    h_ptr, ids_ptr, rw_ptr, q_ptr, s_ptr, hq_ptr, hs_ptr, dpart_ptr, cnt_ptr, out_ptr, P,
    D: tl.constexpr, I: tl.constexpr, QUANT: tl.constexpr, G: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr, TOPK: tl.constexpr, FAST: tl.constexpr, PDL: tl.constexpr,
    COMBINE: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr, HOST: tl.constexpr,
    sel_ptr=None, PICK: tl.constexpr = 0, LANES: tl.constexpr = 1,
):  # fmt: skip
    """Program (p, nb) = one _down_mma_item (PDL: waits for the gate/up grid), of a pair
    _picked by this launch (the combine as _down_kernel's)."""
    if PICK == 2:  # LANES programs a block walk the pairs (the misses' launch)
        for p in range(tl.program_id(0), P, LANES):
            if _picked(sel_ptr, p, PICK):
                _down_mma_item(h_ptr, ids_ptr, rw_ptr, q_ptr, s_ptr, hq_ptr, hs_ptr, dpart_ptr,
                               cnt_ptr, out_ptr, cnt_ptr, p, tl.program_id(1), D, I, QUANT, G,
                               BN, BK, TOPK, FAST, 1 if PDL else 0, 0, COMBINE, DT, PREC,
                               HOST)  # fmt: skip
    elif _picked(sel_ptr, tl.program_id(0), PICK):
        _down_mma_item(h_ptr, ids_ptr, rw_ptr, q_ptr, s_ptr, hq_ptr, hs_ptr, dpart_ptr, cnt_ptr,
                       out_ptr, cnt_ptr, tl.program_id(0), tl.program_id(1), D, I, QUANT, G, BN,
                       BK, TOPK, FAST, 1 if PDL else 0, 0, COMBINE, DT, PREC, HOST)  # fmt: skip


# ---- host side ----------------------------------------------------------------------------------
def check_shapes(quant: str, hidden: int, inter: int, group: int, cfg: DecodeConfig,
                 down: tuple[str, int] | None = None) -> str | None:  # fmt: skip
    """None when the kernels take these shapes, else why not (the dispatcher falls back). down:
    w2's (layout, group) where they differ from w13's (a K-quant layer's own down, or its
    fallback below a width 256 does not divide: DOWN_FALLBACKS); the down launch's rules take it."""
    down_quant, down_group = down or (quant, group)
    if quant == "int4":
        if inter % INT4_ROWS or hidden % INT4_ROWS or cfg.bn != 64 or cfg.bn_d != 64:
            return f"int4 needs D and I multiples of {INT4_ROWS} and bn = bn_d = 64"
    for q, g in dict.fromkeys([(quant, group), (down_quant, down_group)]):
        if q in (*ROW_QUANTS, "q5_0") and (g % 32 or cfg.mma):
            return f"{q} needs groups of a multiple of 32 (G={g}) and the CUDA-core kernels"
        if q in KQUANTS and cfg.mma:
            return f"{q} needs the CUDA-core kernels (its super-block step)"
    if cfg.half and quant not in HALF_QUANTS:
        return f"half is the nibble layouts' step ({', '.join(HALF_QUANTS)}), not {quant}'s"
    if cfg.bk % group or hidden % (cfg.bk * cfg.split):
        return f"D={hidden} (split {cfg.split}) vs bk={cfg.bk} (a multiple of {group})"
    if inter % cfg.bn or hidden % cfg.bn_d:
        return f"I={inter} must be a multiple of bn={cfg.bn}, D={hidden} of bn_d={cfg.bn_d}"
    if cfg.bk_d % down_group or inter % cfg.bk_d:
        return f"I={inter} must be a multiple of bk_d={cfg.bk_d} (itself of G={down_group})"
    if cfg.mma:
        if min(cfg.bk, cfg.bk_d) < 16 or (quant != "int4" and min(cfg.bn, cfg.bn_d) < 16):
            return "mma needs bk, bk_d >= 16 and (bf16/int8) bn, bn_d >= 16 (tl.dot sizes)"
        if quant != "bf16" and max(cfg.bk, cfg.bk_d) > 16 * group:
            return f"mma takes at most 16 groups per K step: bk, bk_d <= {16 * group}"
    return None


def own_down(experts: StackedExperts) -> tuple[str, int] | None:
    """check_shapes' `down` of a layer: w2's (layout, group) where its scheme differs."""
    if experts.down is None:
        return None
    return experts.down_quant, experts.down.group_size


def tuned_config(quant: str, hidden: int, inter: int, device: str | None) -> DecodeConfig:
    """The tuned tiles for this device name and shape (tuned.py: configs/tiles.json), as stored."""
    return DecodeConfig(**tuned.settings("decode", quant, hidden, inter, device))


@functools.cache
def default_config(quant: str, hidden: int, inter: int, group: int, device: str | None,
                   down: tuple[str, int] | None = None) -> DecodeConfig | None:  # fmt: skip
    """The tuned tiles fitted to the shape (fit_config); None when no tile fits."""
    tiles = tuned_config(quant, hidden, inter, device)
    return fit_config(quant, hidden, inter, group, tiles, down)


def fit_config(quant: str, hidden: int, inter: int, group: int, cfg: DecodeConfig,
               down: tuple[str, int] | None = None):  # fmt: skip
    """Halve the split, then K steps, then row blocks until the shapes fit (small models, or a
    width 256 does not divide); None when nothing does. down: check_shapes'."""
    down_group = down[1] if down else group
    # first bk_d to a divisor of I (1408 = 11 x 128), so an I that only bk_d misses keeps the split
    while inter % cfg.bk_d and cfg.bk_d > down_group:
        cfg = replace(cfg, bk_d=cfg.bk_d // 2)
    lows = (("split", 1), ("bk", group), ("bk_d", down_group), ("bn", 1), ("bn_d", 1))
    for name, low in lows:
        while check_shapes(quant, hidden, inter, group, cfg, down) and getattr(cfg, name) > low:
            if quant == "int4" and name in ("bn", "bn_d"):
                break
            cfg = replace(cfg, **{name: getattr(cfg, name) // 2})
    return None if check_shapes(quant, hidden, inter, group, cfg, down) else cfg


def _kernel_sections(experts: StackedExperts) -> dict[str, torch.Tensor]:
    """Sections as the kernels read them: int4's (scale, zero) bf16 pairs as one int32 word, in
    the [E, K/G, N] order of the store-layout kernels (layout.kernel_sections)."""
    return {
        k: v.view(torch.int32) if k.endswith(".sz") else v
        for k, v in kernel_sections(experts).items()
    }


def _expert_stride(q: torch.Tensor) -> int:
    """The kernels' ES: 0 for packed experts, else the elements from one expert's section to the
    next (a pool of per-layer K-quant layouts views each layer's records in slots of its largest
    record's bytes: StackedExperts)."""
    return 0 if q.is_contiguous() else q.stride(0)


def _workspace(device, split: int, P: int, I: int, T: int, D: int, nbg: int, nbd: int,
               h_dtype: torch.dtype):  # fmt: skip
    """fp32 gate/up partials [split, P, 2I], h [P, I] (activation dtype), fp32 pair rows [P, D]
    and int32 counters (gate/up [P, nbg], combine [T, nbd]; zero, and the program that completes
    a block resets its counter). Cached so CUDA graphs captured after a first call reuse the
    buffers."""

    def make():
        f32 = dict(device=device, dtype=torch.float32)
        cnt = torch.zeros(P * nbg + T * nbd, device=device, dtype=torch.int32)
        return (
            torch.empty(max(split, 2) * P * 2 * I, **f32),
            torch.empty(P * I, device=device, dtype=h_dtype),
            torch.empty(P * D, **f32),
            cnt[: P * nbg],
            cnt[P * nbg :],
        )

    return kept(("decode", str(device), split, P, I, T, D, nbg, nbd, h_dtype), make)


@dataclass(slots=True)
class Launch:
    """One call's device arguments, workspace and shared constexprs. `moe_decode` runs `gate_up`
    then `down`; the benchmarks launch one of them alone, or their ablation kernels, on it."""

    cfg: DecodeConfig
    x: torch.Tensor  # [T, D]
    ids: torch.Tensor  # [T, K]
    weights: torch.Tensor  # [T, K]
    w13: tuple  # gate/up (weights, scales, host weights, host scales)
    w2: tuple  # down (the same four)
    ws: tuple  # _workspace: part, h, dpart, cnt_g, cnt_d
    out: torch.Tensor | None
    combine: bool
    gpu: bool  # else the interpreter: plain casts, no PTX, no PDL
    common: dict  # constexprs both kernels take
    pick: dict  # moe_decode's `pick`: the pairs this launch runs ({} every pair)
    down_own: dict  # the down launch's constexprs where w2's scheme differs from w13's

    @property
    def P(self) -> int:
        return self.ids.numel()

    @property
    def lanes(self) -> int:
        """The grid's first axis: a program per pair, or PICK_LANES walking the misses."""
        return self.pick.get("LANES", self.P)

    @classmethod
    def build(cls, x, ids, weights, experts, cfg: DecodeConfig, out, combine: bool,
              host: StackedExperts | None = None, h_dtype: torch.dtype | None = None,
              pick: tuple[torch.Tensor, int] | None = None) -> Launch:  # fmt: skip
        """h_dtype: gate/up's output (default x's dtype; an ablation keeps it fp32); pick:
        moe_decode's."""
        quant, down = experts.kernel_quant, experts.down_quant
        T, D = x.shape
        P, I, G = ids.numel(), experts.inter, experts.scheme.group_size
        G2 = experts.scheme_of("w2").group_size
        why = check_shapes(quant, D, I, G, cfg, own_down(experts))
        assert why is None, why
        gpu = x.device.type == "cuda"
        sec = _kernel_sections(experts)
        far = sec if host is None else _kernel_sections(host)
        if host is not None:
            for k, v in sec.items():
                assert far[k].dtype == v.dtype and far[k].shape[1:] == v.shape[1:], k
                assert far[k].stride() == v.stride(), f"host {k}: the pool's strides"
        scale = SCALE_SECTION[quant]
        h_dtype = h_dtype or x.dtype
        ws = _workspace(x.device, cfg.split, P, I, T, D, I // cfg.bn, D // cfg.bn_d, h_dtype)
        if out is None and combine:
            out = torch.empty(T, D, device=x.device, dtype=x.dtype)
        assert not combine or (out.is_contiguous() and out.shape == (T, D))
        common = dict(D=D, I=I, QUANT=QUANT_CODE[quant], G=G, TOPK=ids.shape[1],
                      HOST=host is not None)  # fmt: skip
        es13, es2 = _expert_stride(sec["w13.q"]), _expert_stride(sec["w2.q"])
        if es13:  # (only then: the ablations' kernels take packed experts)
            common.update(ES=es13)
        if cfg.mma:  # bf16 activations: bf16 dots of exact weights; fp32 (tests): "ieee" fp32 dots
            bf16 = x.dtype == torch.bfloat16
            common.update(DT=tl.bfloat16 if bf16 else tl.float32, PREC="tf32" if bf16 else "ieee",
                          FAST=gpu and (bf16 or quant != "int4"))  # fmt: skip
        else:
            common.update(ELEM=True, FAST=gpu)
            if cfg.half:  # the product kernels' (an ablation's kernel never takes it)
                common.update(HALF=True)
        w13 = tuple(d[f"w13.{n}"] for d in (sec, far) for n in ("q", scale))
        w2 = tuple(d[f"w2.{n}"] for d in (sec, far) for n in ("q", SCALE_SECTION[down]))
        # w2 in its own K-quant (a Q4_K_M layer's q6_k down below q4_k gate/up) or fallback: its
        # step and group, and no nibble conversion to halve where it has none
        own = {"ES": es2} if es2 else {}
        if down != quant:
            own.update(QUANT=QUANT_CODE[down], G=G2, HALF=cfg.half and down in HALF_QUANTS)
        if pick is not None:
            sel, mode = pick
            assert mode in (1, 2) and sel.numel() == P and sel.is_contiguous()
            pick = {"sel_ptr": sel, "PICK": mode}
            if mode == 2:  # the misses' launch: a few programs a block walk the pairs
                pick["LANES"] = min(PICK_LANES, P)
        return cls(cfg, x.contiguous(), ids.contiguous(), weights.contiguous(), w13, w2, ws, out,
                   combine, gpu, common, pick or {}, own)  # fmt: skip

    def gate_up(self, kernel=None, **extra) -> None:
        """Gate/up programs (P, I / bn, split); `kernel` and `extra` arguments: an ablation's."""
        cfg, (part, h, _, cnt_g, _) = self.cfg, self.ws
        if kernel is None:
            kernel = _gate_up_mma_kernel if cfg.mma else _gate_up_kernel
            extra = {"STAGES": cfg.stages, **extra} if cfg.mma else extra
            extra = {**self.pick, **extra}
        else:
            assert not self.pick, "a picked launch runs the product kernels"
        kernel[(self.lanes, self.common["I"] // cfg.bn, cfg.split)](
            self.x, self.ids, *self.w13, part, cnt_g, h, P=self.P, BN=cfg.bn, BK=cfg.bk,
            SPLIT=cfg.split, PDL=self.gpu and cfg.pdl, num_warps=cfg.num_warps,
            **{**self.common, **extra},
        )  # fmt: skip

    def down(self, **extra) -> None:
        """Down programs (P, D / bn_d), PDL-launched: each pair's fp32 row, combined if asked."""
        cfg, (_, h, dpart, _, cnt_d) = self.cfg, self.ws
        pdl = self.gpu and cfg.pdl
        kernel = _down_mma_kernel if cfg.mma else _down_kernel
        kernel[(self.lanes, self.common["D"] // cfg.bn_d)](
            h, self.ids, self.weights, *self.w2, dpart, cnt_d, self.out, self.P,
            BN=cfg.bn_d, BK=cfg.bk_d, PDL=pdl, COMBINE=self.combine, num_warps=cfg.warps_d,
            **({"launch_pdl": True} if pdl else {}),
            **{**self.common, **self.down_own, **self.pick, **extra},
        )  # fmt: skip

    def result(self) -> torch.Tensor:
        """The output [T, D], or with combine=False the pair rows [P, D] (a workspace view)."""
        return self.out if self.combine else self.ws[2].view(self.P, self.common["D"])


def moe_decode(x, ids, weights, experts, cfg: DecodeConfig | None = None, out=None,
               combine: bool = True, host: StackedExperts | None = None,
               pick: tuple[torch.Tensor, int] | None = None,
               before_down: Callable[[], None] | None = None) -> torch.Tensor:  # fmt: skip
    """x [T, D], ids [T, K], weights [T, K] (device tensors) -> [T, D] in x's dtype (into `out`
    when given, which must be contiguous). `combine=False` returns the pair rows instead: fp32
    [T * K, D], weight times expert output (a workspace view, overwritten by the next call);
    `combine_pairs` of them gives the bits of the combined call. `host`: a second set of expert
    sections (pinned host memory on CUDA); an id e < 0 reads its record -1 - e. `pick` (codes
    [T * K], mode): only the pairs whose code is >= 0 (mode 1) or < 0 (mode 2) run; the two
    calls of one layer, in that order on one `out`, give the one call's output bit for bit (each
    pair row is its own; the last pair row of a block, in either call, adds them in slot order).
    `before_down`: called between the two launches (a side stream that writes what only the down
    kernel reads, joined there)."""
    quant, (_, D), I, G = experts.kernel_quant, x.shape, experts.inter, experts.scheme.group_size
    cfg = cfg or default_config(quant, D, I, G, tuned.device_name(x.device), own_down(experts))
    assert cfg is not None, f"no decode tile fits D={D}, I={I}"
    assert pick is None or out is not None or not combine, "two picked calls share one out"
    launch = Launch.build(x, ids, weights, experts, cfg, out, combine, host, pick=pick)
    launch.gate_up()
    if before_down is not None:
        before_down()
    launch.down()
    return launch.result()


def combine_pairs(y: torch.Tensor, topk: int, dtype: torch.dtype, out=None) -> torch.Tensor:
    """Pair rows y [T * topk, D] fp32 -> [T, D] in dtype: each token's rows added in slot order,
    the same arithmetic as the kernels' fused combine (equal bits)."""
    P, D = y.shape
    T = P // topk
    if out is None:
        out = torch.empty(T, D, device=y.device, dtype=dtype)
    bn = min(256, triton.next_power_of_2(D))
    while D % bn:
        bn //= 2
    _combine_kernel[(T, D // bn)](y.contiguous(), out, D=D, TOPK=topk, BN=bn, num_warps=4)
    return out
