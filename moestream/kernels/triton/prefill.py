"""Prefill-path Triton kernels: tokens grouped by expert, each expert's weights read once per block
of BLOCK_M (token, slot) pairs and multiplied with tl.dot (tensor cores).

`align_blocks` groups the pairs on the device without a host sync (scatter-add counts, cumsum,
searchsorted, scatter): every expert's pairs are padded to a multiple of BLOCK_M, blocks past the used ones get
expert -1 and exit. Accumulation is fp32; weight tiles are dequantized to the activation dtype
right before the dot. Two families (`PrefillConfig.block_n`; a tiles.json row may name the
family for prompts up to some length, "short": `default_config` takes the call's token count):
- weight rows on the dot's M side (`_gate_up_wm`, `_down_wm`; block_n > 0, the default for bf16,
  int8 and int4 rows): a program takes block_n rows of one expert and the block's pairs on N, so
  each weight is dequantized by one thread (on sm_90 the dot is a wgmma with the weights from
  registers); gate/up writes h = silu(g) * u in the dot's dtype;
- tokens on M (`_gate_up_grouped`, `_down_grouped`; block_n 0, and always for the store's int4
  layout): the weight tile is the dot's B operand, converted in its layout (each warp along M
  repeats the dequant).
int4 rows (the GPU pool's layout), q4_0 and q4_1 (the same bytes, an fp16 d a 32-block, and
q4_1's fp16 m) are read as each row's contiguous bytes and split by nibble:
two dots per K step, over the inputs k % 32 < 16 and k % 32 >= 16 (sums in another order, the
same products). A pair's row never meets another pair's row in a dot, so pair rows from chunks
of pairs give the bits of one call (`moe_pairs`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moestream.kernels.triton import tuned
from moestream.kernels.triton.decode import (
    INT4_ROWS,
    QUANT_CODE,
    ROW_QUANTS,
    SCALE_SECTION,
    combine_pairs,
)
from moestream.kernels.triton.dequant import row_weights
from moestream.kernels.triton.layout import kernel_sections


@dataclass(frozen=True, slots=True)
class PrefillConfig:
    block_m: int = 32
    half: int = 32  # rows per half block; int4 needs 32
    bk: int = 64
    num_warps: int = 4
    # > 0: weight rows on the dot's M side, block_n rows a program, the block's pairs on N
    # (`_gate_up_wm`); 0: tokens on M (`_gate_up_grouped`, and always for the store's int4)
    block_n: int = 0

    def __post_init__(self):
        assert self.block_n == 0 or self.block_n >= 16 and self.block_n & (self.block_n - 1) == 0, (
            f"block_n must be 0 or a power of two >= 16, got {self.block_n}"
        )
        for name in ("block_m", "half", "bk"):
            v = getattr(self, name)
            assert v >= 16 and v & (v - 1) == 0, f"{name} must be a power of two >= 16, got {v}"


def align_blocks(ids: torch.Tensor, num_experts: int, block_m: int):
    """ids [T, K] -> (pair_of_row [R] int32 (P = padding), block_expert [B] int32 (-1 = unused))."""
    flat = ids.reshape(-1).to(torch.int64)
    P = flat.numel()
    n_blocks = triton.cdiv(P, block_m) + min(num_experts, P)  # upper bound: one partial per expert
    # [E]; a scatter, not torch.bincount, whose CUDA version reads the ids' max on the host
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    sorted_e, order = torch.sort(flat, stable=True)
    start = torch.cumsum(counts, 0) - counts  # first sorted position of each expert
    rank = torch.arange(P, device=ids.device) - start[sorted_e]
    rows = (pad_end - padded)[sorted_e] + rank
    pair_of_row = torch.full((n_blocks * block_m,), P, dtype=torch.int32, device=ids.device)
    pair_of_row[rows] = order.to(torch.int32)
    first_row = torch.arange(n_blocks, device=ids.device) * block_m
    block_expert = torch.searchsorted(pad_end, first_row, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return pair_of_row, block_expert


@triton.jit
def _w_tiles(
    q_ptr,
    s_ptr,
    e,
    n0,
    n_end,
    k0,
    N: tl.constexpr,
    K: tl.constexpr,
    QUANT: tl.constexpr,
    G: tl.constexpr,
    BK: tl.constexpr,
    HALF: tl.constexpr,
    DT: tl.constexpr,
):
    """Expert e's weight rows [n0, n0 + HALF) and [n0 + HALF, n0 + 2 HALF), inputs [k0, k0 + BK),
    dequantized and transposed to two [BK, HALF] tiles in dtype DT (bf16, int8, the store's int4;
    the row layouts go through _rows_tiles)."""
    kk = k0 + tl.arange(0, BK)[:, None]  # [BK, 1]
    di = tl.arange(0, HALF)[None, :]  # [1, HALF]
    if QUANT == 2:
        b = tl.load(q_ptr + e * (N * (K // 2)) + (n0 // 64) * (K * 32) + kk * 32 + di).to(tl.int32)
        sp = s_ptr + e * ((K // G) * N * 2) + ((kk // G) * N + n0 + di) * 2  # [BK, 32]
        s_lo = tl.load(sp).to(tl.float32)
        s_hi = tl.load(sp + 64).to(tl.float32)
        w_lo = ((b & 15).to(tl.float32) - 8.0) * s_lo + tl.load(sp + 1).to(tl.float32)
        w_hi = ((b >> 4).to(tl.float32) - 8.0) * s_hi + tl.load(sp + 65).to(tl.float32)
    else:
        r_lo = n0 + di
        r_hi = r_lo + HALF
        w = q_ptr + e * (N * K) + kk
        w_lo = tl.load(w + r_lo * K, mask=r_lo < n_end, other=0.0).to(tl.float32)
        w_hi = tl.load(w + r_hi * K, mask=r_hi < n_end, other=0.0).to(tl.float32)
        if QUANT == 1:
            sp = s_ptr + e * (N * (K // G)) + kk // G
            w_lo = w_lo * tl.load(sp + r_lo * (K // G), mask=r_lo < n_end, other=0.0)
            w_hi = w_hi * tl.load(sp + r_hi * (K // G), mask=r_hi < n_end, other=0.0)
    return w_lo.to(DT), w_hi.to(DT)


@triton.jit
def _split_cols(k0, BK: tl.constexpr):
    """Inputs [k0, k0 + BK) in int4 rows' nibble order: the low nibbles' k (k % 32 < 16) and the
    high nibbles' (k + 16), each [BK // 2]; byte j of a row's tile holds both."""
    j = tl.arange(0, BK // 2)
    lo = k0 + (j // 16) * 32 + j % 16
    return lo, lo + 16


@triton.jit
def _rows_wm(
    q_ptr,
    s_ptr,
    e,
    r0,
    n_end,
    k0,
    N: tl.constexpr,
    K: tl.constexpr,
    QUANT: tl.constexpr,
    G: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    DT: tl.constexpr,
):
    """int4 rows (QUANT 3), q4_0 (4) or q4_1 (5): expert e's rows [r0, r0 + BN), inputs [k0, k0 + BK),
    read as each row's contiguous BK / 2 bytes (coalesced) and dequantized; returns the low and
    high nibbles' tiles [BN, BK / 2] each (the inputs of _split_cols), rows first."""
    # [BN, BK / 32, 16]: 16 bytes (32 inputs) of a row share one group's scales, loaded once
    r = r0 + tl.arange(0, BN)[:, None, None]
    blk = tl.arange(0, BK // 32)[None, :, None]
    j = tl.arange(0, 16)[None, None, :]
    m = r < n_end
    b = tl.load(q_ptr + e * (N * (K // 2)) + r * (K // 2) + k0 // 2 + blk * 16 + j, mask=m, other=0)
    at = e * (N * (K // G)) + r * (K // G) + (k0 + blk * 32) // G  # [BN, BK / 32, 1]: the group
    w_lo, w_hi = row_weights(b.to(tl.int32), s_ptr, at, m, QUANT)
    return tl.reshape(w_lo, [BN, BK // 2]).to(DT), tl.reshape(w_hi, [BN, BK // 2]).to(DT)


@triton.jit
def _rows_tiles(q_ptr, s_ptr, e, r0, n_end, k0, N: tl.constexpr, K: tl.constexpr,
                QUANT: tl.constexpr, G: tl.constexpr, BK: tl.constexpr, HALF: tl.constexpr,
                DT: tl.constexpr):  # fmt: skip
    """_rows_wm's tiles transposed for the tokens-on-M dot, [BK / 2, HALF] each."""
    w_lo, w_hi = _rows_wm(q_ptr, s_ptr, e, r0, n_end, k0, N, K, QUANT, G, HALF, BK, DT)
    return tl.trans(w_lo), tl.trans(w_hi)


@triton.jit
def _dense_wm(q_ptr, s_ptr, e, r0, n_end, k0, N: tl.constexpr, K: tl.constexpr,
              QUANT: tl.constexpr, G: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
              DT: tl.constexpr):  # fmt: skip
    """bf16 / int8: expert e's rows [r0, r0 + BN), inputs [k0, k0 + BK) in DT, [BN, BK]."""
    r = r0 + tl.arange(0, BN)[:, None]
    kk = k0 + tl.arange(0, BK)[None, :]
    m = r < n_end
    w = tl.load(q_ptr + e * (N * K) + r * K + kk, mask=m, other=0.0).to(tl.float32)
    if QUANT == 1:
        w = w * tl.load(s_ptr + e * (N * (K // G)) + r * (K // G) + kk // G, mask=m, other=0.0)
    return w.to(DT)


@triton.jit
def _rows_dots(xl, xh, acc, q_ptr, s_ptr, e, r0, n_end, k0, N: tl.constexpr, K: tl.constexpr,
               QUANT: tl.constexpr, G: tl.constexpr, BK: tl.constexpr, HALF: tl.constexpr,
               DT: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
    """acc [BM, HALF] += inputs (split by nibble, [BM, BK / 2] each) times rows [r0, r0 + HALF)."""
    wl, wh = _rows_tiles(q_ptr, s_ptr, e, r0, n_end, k0, N, K, QUANT, G, BK, HALF, DT)
    acc = tl.dot(xl, wl, acc, input_precision=PREC)
    return tl.dot(xh, wh, acc, input_precision=PREC)


@triton.jit
def _gate_up_grouped(
    x_ptr,
    pair_ptr,
    bexp_ptr,
    q_ptr,
    s_ptr,
    gu_ptr,
    TOPK,
    P,
    D: tl.constexpr,
    I: tl.constexpr,
    QUANT: tl.constexpr,
    G: tl.constexpr,
    BM: tl.constexpr,
    BK: tl.constexpr,
    HALF: tl.constexpr,
    DT: tl.constexpr,
    PREC: tl.constexpr,
):
    blk = tl.program_id(0)
    n0 = tl.program_id(1) * (2 * HALF)
    e = tl.load(bexp_ptr + blk).to(tl.int64)
    if e < 0:
        return
    N: tl.constexpr = 2 * I
    pair = tl.load(pair_ptr + blk * BM + tl.arange(0, BM))  # [BM]
    valid = pair < P
    tok = tl.where(valid, pair // TOPK, 0)
    g_lo = tl.zeros([BM, HALF], tl.float32)
    g_hi = tl.zeros([BM, HALF], tl.float32)
    u_lo = tl.zeros([BM, HALF], tl.float32)
    u_hi = tl.zeros([BM, HALF], tl.float32)
    for k0 in range(0, D, BK):
        if QUANT >= 3:  # int4 rows / q4_0: each row's bytes in a row, inputs split by nibble
            cl, ch = _split_cols(k0, BK)
            xl = tl.load(x_ptr + tok[:, None] * D + cl[None, :]).to(DT)  # [BM, BK / 2]
            xh = tl.load(x_ptr + tok[:, None] * D + ch[None, :]).to(DT)
            g_lo = _rows_dots(xl, xh, g_lo, q_ptr, s_ptr, e, n0, I, k0, N, D, QUANT, G, BK, HALF,
                              DT, PREC)  # fmt: skip
            g_hi = _rows_dots(xl, xh, g_hi, q_ptr, s_ptr, e, n0 + HALF, I, k0, N, D, QUANT, G, BK,
                              HALF, DT, PREC)  # fmt: skip
            u_lo = _rows_dots(xl, xh, u_lo, q_ptr, s_ptr, e, n0 + I, N, k0, N, D, QUANT, G, BK,
                              HALF, DT, PREC)  # fmt: skip
            u_hi = _rows_dots(xl, xh, u_hi, q_ptr, s_ptr, e, n0 + I + HALF, N, k0, N, D, QUANT, G,
                              BK, HALF, DT, PREC)  # fmt: skip
        else:
            xt = tl.load(x_ptr + tok[:, None] * D + k0 + tl.arange(0, BK)[None, :]).to(DT)
            a, b = _w_tiles(q_ptr, s_ptr, e, n0, I, k0, N, D, QUANT, G, BK, HALF, DT)
            g_lo = tl.dot(xt, a, g_lo, input_precision=PREC)
            g_hi = tl.dot(xt, b, g_hi, input_precision=PREC)
            a, b = _w_tiles(q_ptr, s_ptr, e, n0 + I, N, k0, N, D, QUANT, G, BK, HALF, DT)
            u_lo = tl.dot(xt, a, u_lo, input_precision=PREC)
            u_hi = tl.dot(xt, b, u_hi, input_precision=PREC)
    di = tl.arange(0, HALF)[None, :]
    out = gu_ptr + pair[:, None].to(tl.int64) * N + n0 + di
    m_lo = valid[:, None] & (n0 + di < I)
    m_hi = valid[:, None] & (n0 + HALF + di < I)
    tl.store(out, g_lo, mask=m_lo)
    tl.store(out + HALF, g_hi, mask=m_hi)
    tl.store(out + I, u_lo, mask=m_lo)
    tl.store(out + I + HALF, u_hi, mask=m_hi)


@triton.jit
def _silu_up(row, kk, I: tl.constexpr, DT: tl.constexpr):
    """silu(gate) * up of each slot's row at inputs kk, rounded to DT for the dot."""
    g = tl.load(row + kk)
    u = tl.load(row + I + kk)
    return (g / (1.0 + tl.exp(-g)) * u).to(DT)


@triton.jit
def _down_grouped(
    gu_ptr,
    pair_ptr,
    bexp_ptr,
    rw_ptr,
    q_ptr,
    s_ptr,
    out_ptr,
    TOPK,
    P,
    D: tl.constexpr,
    I: tl.constexpr,
    QUANT: tl.constexpr,
    G: tl.constexpr,
    BM: tl.constexpr,
    BK: tl.constexpr,
    HALF: tl.constexpr,
    DT: tl.constexpr,
    PREC: tl.constexpr,
):
    blk = tl.program_id(0)
    n0 = tl.program_id(1) * (2 * HALF)
    e = tl.load(bexp_ptr + blk).to(tl.int64)
    if e < 0:
        return
    pair = tl.load(pair_ptr + blk * BM + tl.arange(0, BM))
    valid = pair < P
    safe = tl.where(valid, pair, 0).to(tl.int64)
    rw = tl.load(rw_ptr + safe, mask=valid, other=0.0).to(tl.float32)  # [BM]
    acc_lo = tl.zeros([BM, HALF], tl.float32)
    acc_hi = tl.zeros([BM, HALF], tl.float32)
    row = gu_ptr + safe[:, None] * (2 * I)
    for k0 in range(0, I, BK):
        if QUANT >= 3:  # int4 rows / q4_0: h at the low and the high nibbles' inputs
            cl, ch = _split_cols(k0, BK)
            hl = _silu_up(row, cl[None, :], I, DT)
            hh = _silu_up(row, ch[None, :], I, DT)
            acc_lo = _rows_dots(hl, hh, acc_lo, q_ptr, s_ptr, e, n0, D, k0, D, I, QUANT, G, BK,
                                HALF, DT, PREC)  # fmt: skip
            acc_hi = _rows_dots(hl, hh, acc_hi, q_ptr, s_ptr, e, n0 + HALF, D, k0, D, I, QUANT, G,
                                BK, HALF, DT, PREC)  # fmt: skip
        else:
            h = _silu_up(row, k0 + tl.arange(0, BK)[None, :], I, DT)  # [BM, BK]
            a, b = _w_tiles(q_ptr, s_ptr, e, n0, D, k0, D, I, QUANT, G, BK, HALF, DT)
            acc_lo = tl.dot(h, a, acc_lo, input_precision=PREC)
            acc_hi = tl.dot(h, b, acc_hi, input_precision=PREC)
    di = tl.arange(0, HALF)[None, :]
    out = out_ptr + safe[:, None] * D + n0 + di  # the pair's fp32 row (combined in slot order)
    tl.store(out, acc_lo * rw[:, None], mask=valid[:, None] & (n0 + di < D))
    tl.store(out + HALF, acc_hi * rw[:, None], mask=valid[:, None] & (n0 + HALF + di < D))


@triton.jit
def _gate_up_wm(
    x_ptr,
    pair_ptr,
    bexp_ptr,
    q_ptr,
    s_ptr,
    h_ptr,
    TOPK,
    P,
    D: tl.constexpr,
    I: tl.constexpr,
    QUANT: tl.constexpr,
    G: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    DT: tl.constexpr,
    PREC: tl.constexpr,
):
    """h = silu(gate) * up [P, I] in DT for one block of BM pairs (one expert) and rows
    [n0, n0 + BN) of gate and up. Weight rows sit on the dot's M side (each weight dequantized
    by one thread: no warp repeats it), the pairs' inputs transposed [BK, BM] on N."""
    blk = tl.program_id(0)
    n0 = tl.program_id(1) * BN
    e = tl.load(bexp_ptr + blk).to(tl.int64)
    if e < 0:
        return
    N: tl.constexpr = 2 * I
    pair = tl.load(pair_ptr + blk * BM + tl.arange(0, BM))  # [BM]
    valid = pair < P
    tok = tl.where(valid, pair // TOPK, 0).to(tl.int64)
    g = tl.zeros([BN, BM], tl.float32)
    u = tl.zeros([BN, BM], tl.float32)
    for k0 in range(0, D, BK):
        if QUANT >= 3:  # int4 rows / q4_0: two dots per K step, the inputs split by nibble
            cl, ch = _split_cols(k0, BK)
            xl = tl.load(x_ptr + tok[None, :] * D + cl[:, None]).to(DT)  # [BK / 2, BM]
            xh = tl.load(x_ptr + tok[None, :] * D + ch[:, None]).to(DT)
            wl, wh = _rows_wm(q_ptr, s_ptr, e, n0, I, k0, N, D, QUANT, G, BN, BK, DT)
            g = tl.dot(wh, xh, tl.dot(wl, xl, g, input_precision=PREC), input_precision=PREC)
            wl, wh = _rows_wm(q_ptr, s_ptr, e, n0 + I, N, k0, N, D, QUANT, G, BN, BK, DT)
            u = tl.dot(wh, xh, tl.dot(wl, xl, u, input_precision=PREC), input_precision=PREC)
        else:
            xt = tl.load(x_ptr + tok[None, :] * D + k0 + tl.arange(0, BK)[:, None]).to(DT)
            w = _dense_wm(q_ptr, s_ptr, e, n0, I, k0, N, D, QUANT, G, BN, BK, DT)
            g = tl.dot(w, xt, g, input_precision=PREC)
            w = _dense_wm(q_ptr, s_ptr, e, n0 + I, N, k0, N, D, QUANT, G, BN, BK, DT)
            u = tl.dot(w, xt, u, input_precision=PREC)
    h = g / (1.0 + tl.exp(-g)) * u  # [BN, BM]; _silu_up's arithmetic
    r = n0 + tl.arange(0, BN)[:, None]
    tl.store(h_ptr + pair[None, :].to(tl.int64) * I + r, h.to(DT), mask=valid[None, :] & (r < I))


@triton.jit
def _down_wm(
    h_ptr,
    pair_ptr,
    bexp_ptr,
    rw_ptr,
    q_ptr,
    s_ptr,
    out_ptr,
    TOPK,
    P,
    D: tl.constexpr,
    I: tl.constexpr,
    QUANT: tl.constexpr,
    G: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    DT: tl.constexpr,
    PREC: tl.constexpr,
):
    """Pair rows out [P, D] fp32 (weight times down(h)) for one block of BM pairs and output
    rows [n0, n0 + BN); weight rows on M as in _gate_up_wm."""
    blk = tl.program_id(0)
    n0 = tl.program_id(1) * BN
    e = tl.load(bexp_ptr + blk).to(tl.int64)
    if e < 0:
        return
    pair = tl.load(pair_ptr + blk * BM + tl.arange(0, BM))
    valid = pair < P
    safe = tl.where(valid, pair, 0).to(tl.int64)
    rw = tl.load(rw_ptr + safe, mask=valid, other=0.0).to(tl.float32)  # [BM]
    acc = tl.zeros([BN, BM], tl.float32)
    row = h_ptr + safe[None, :] * I  # [1, BM]
    for k0 in range(0, I, BK):
        if QUANT >= 3:
            cl, ch = _split_cols(k0, BK)
            hl = tl.load(row + cl[:, None])  # [BK / 2, BM]
            hh = tl.load(row + ch[:, None])
            wl, wh = _rows_wm(q_ptr, s_ptr, e, n0, D, k0, D, I, QUANT, G, BN, BK, DT)
            acc = tl.dot(wh, hh, tl.dot(wl, hl, acc, input_precision=PREC), input_precision=PREC)
        else:
            ht = tl.load(row + k0 + tl.arange(0, BK)[:, None])  # [BK, BM]
            w = _dense_wm(q_ptr, s_ptr, e, n0, D, k0, D, I, QUANT, G, BN, BK, DT)
            acc = tl.dot(w, ht, acc, input_precision=PREC)
    r = n0 + tl.arange(0, BN)[:, None]
    tl.store(out_ptr + safe[None, :] * D + r, acc * rw[None, :], mask=valid[None, :] & (r < D))


def default_config(quant: str, hidden: int, inter: int, device: str | None,
                   tokens: int | None = None) -> PrefillConfig:  # fmt: skip
    """The tiles for this device name and shape (tuned.py: configs/tiles.json) for a call of
    `tokens` tokens: a row's "short" entry (fields with "max_tokens") replaces its fields up to
    that many tokens, where the other family is faster (None: the long row)."""
    long, short, max_tokens = _configs(quant, hidden, inter, device)
    return short if tokens is not None and tokens <= max_tokens else long


@functools.cache
def _configs(quant: str, hidden: int, inter: int, device: str | None):
    """(the long row's config, the short one's or None, its max_tokens or -1), read once."""
    row = tuned.settings("prefill", quant, hidden, inter, device)
    fields = {k: v for k, v in row.items() if k != "short"}
    if "short" not in row:
        return PrefillConfig(**fields), None, -1
    short = {k: v for k, v in row["short"].items() if k != "max_tokens"}
    return PrefillConfig(**fields), PrefillConfig(**{**fields, **short}), row["short"]["max_tokens"]


def check_shapes(quant: str, hidden: int, inter: int, group: int, cfg: PrefillConfig) -> str | None:
    """None when the grouped kernels take these shapes, else why not."""
    if hidden % cfg.bk or inter % cfg.bk or cfg.bk % group and quant != "bf16":
        return f"D={hidden} and I={inter} must be multiples of BK={cfg.bk} (itself of G={group})"
    if quant == "int4" and (inter % INT4_ROWS or hidden % INT4_ROWS or cfg.half != 32):
        return f"int4 needs D and I multiples of {INT4_ROWS} and half=32"
    if quant in ROW_QUANTS and (group % 32 or cfg.bk % 32):
        return f"{quant} needs groups and BK of a multiple of 32 (G={group}, BK={cfg.bk})"
    return None


def moe_prefill(x, ids, weights, experts, cfg: PrefillConfig | None = None, out=None,
                combine: bool = True, tokens: int | None = None) -> torch.Tensor:  # fmt: skip
    """x [T, D], ids [T, K], weights [T, K] -> [T, D] in x's dtype, tokens grouped by expert.
    `combine=False` returns the fp32 pair rows [T * K, D] (weight times expert output): each row
    is computed alone (a row of the dot never meets another row), so rows from chunks of pairs,
    added by `combine_pairs`, give the bits of one call, when the chunks pass that call's token
    count as `tokens` (it picks the tiles, and so the summation order). No atomics."""
    quant = experts.kernel_quant
    T, D = x.shape
    K = ids.shape[1]
    P, I, G = T * K, experts.inter, experts.scheme.group_size
    cfg = cfg or default_config(quant, D, I, tuned.device_name(x.device), tokens or T)
    why = check_shapes(quant, D, I, G, cfg)
    assert why is None, why
    pair_of_row, block_expert = align_blocks(ids, experts.num_experts, cfg.block_m)
    sec = {
        k: v.view(torch.int32) if k.endswith(".rz") else v
        for k, v in kernel_sections(experts).items()
    }
    scale = SCALE_SECTION[quant]
    y = torch.empty(P, D, device=x.device, dtype=torch.float32)
    x, weights = x.contiguous(), weights.contiguous()
    f32 = x.dtype == torch.float32
    meta = dict(
        QUANT=QUANT_CODE[quant], G=G, BM=cfg.block_m, BK=cfg.bk, HALF=cfg.half,
        DT=tl.float32 if f32 else tl.bfloat16, PREC="ieee" if f32 else "tf32",
        num_warps=cfg.num_warps,
    )  # fmt: skip
    nb = block_expert.numel()
    if cfg.block_n and quant != "int4":  # weight rows on M; h in the dot's dtype
        del meta["HALF"]
        h = torch.empty(P, I, device=x.device, dtype=torch.float32 if f32 else torch.bfloat16)
        _gate_up_wm[(nb, triton.cdiv(I, cfg.block_n))](
            x, pair_of_row, block_expert, sec["w13.q"], sec[f"w13.{scale}"], h, K, P, D, I,
            BN=cfg.block_n, **meta)  # fmt: skip
        _down_wm[(nb, triton.cdiv(D, cfg.block_n))](
            h, pair_of_row, block_expert, weights, sec["w2.q"], sec[f"w2.{scale}"], y, K, P, D,
            I, BN=cfg.block_n, **meta)  # fmt: skip
    else:
        gu = torch.empty(P, 2 * I, device=x.device, dtype=torch.float32)
        grid = (nb, triton.cdiv(I, 2 * cfg.half))
        _gate_up_grouped[grid](x, pair_of_row, block_expert, sec["w13.q"], sec[f"w13.{scale}"],
                               gu, K, P, D, I, **meta)  # fmt: skip
        grid = (nb, triton.cdiv(D, 2 * cfg.half))
        _down_grouped[grid](gu, pair_of_row, block_expert, weights, sec["w2.q"],
                            sec[f"w2.{scale}"], y, K, P, D, I, **meta)  # fmt: skip
    if not combine:
        return y
    return combine_pairs(y, K, x.dtype, out=out)
