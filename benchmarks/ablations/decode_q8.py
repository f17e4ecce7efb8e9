"""Ablation: int4 rows (the pool's layout) at decode with int8 activations and integer dot
products (dp4a), off the product path (`AblationConfig(q8=True)` in triton_decode.py).

The hypothesis. The exact kernels (moestream/kernels/triton/decode.py) turn every int4 weight into
fp32 and multiply it by the fp32 activation, 7-9 instructions a weight, so at one token they might
be bound by instructions rather than bytes (docs/gpu.md: 0.32 of the HBM roofline at
Qwen3-30B-A3B shapes). Here the activations entering each projection are quantized per block of
32, as the CPU's native kernels and llama.cpp's q8_1 do, and one `dp4a` multiplies four weight
nibbles by four int8 activations and adds them: a 32-input block of a row is 8 integer dot
instructions plus its masks.

Measured (H200, `bench_gpu_moe.py --quant int4r --configs "q8=1;..."`, graphs of 8 layers, L2
flushed; results/gpu_moe.jsonl, rows "q8wip" and later): Qwen3-30B-A3B 16.1 us per layer against
17.2 for the exact kernels at the same tiles (0.35 / 0.32 of the roofline), Qwen3.5-35B-A3B 14.7
against 13.3 (slower); wider tiles were slower for both. Counting the two extra launches
(~1.1 us each), the kernels themselves gain ~20%: the dequantisation's instructions are a part of
the time, not most of it; the bytes in flight per SM are the rest. Lossy (about 1/254 of a
block's maximum per activation, ~1.2% relative error of a layer against the exact result on
random weights) for at best 6% of a layer, so it is not the product's.

A layer is four launches (each PDL-launched behind the one before, so its weight loads start
while that one finishes):
  _quant_kernel    x [T, D] -> int8 q, fp32 d, int32 sum(q) per block of 32 (one program a row)
  _gate_up_kernel  decode.py's grid and finish (h = silu(g) * u, kept in fp32 here)
  _quant_kernel    h [P, I] -> its blocks, as x's
  _down_kernel     decode.py's grid and finish (pair rows, combine in slot order)

Numerics (spec: `moe_int4_q8_ref` below): per block of 32 activations d = amax / 127,
q = round-half-even(x / d) in fp32 (IEEE division and rounding: `div.rn`, `cvt.rni`), so q, d
are the bits of ref.quantize_act. A row's term for block b is d_b * (s * (dot_b - 8 * sum q_b)
+ z * sum q_b), dot_b the exact integer dot of the nibbles (0..15) with q_b, s and z the
(scale, zero) of the block's weight group: the formula of the CPU's native int4 kernel. Terms
are added in fp32 per K step, then across the step's blocks by a tree: the order differs from
the spec's, so results agree to fp32 rounding, except where an activation's rounding flips
between h computed here and in the spec (silu in a different order), one unit of that block's q.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from moestream.kernels.ref import quantize_act
from moestream.kernels.triton.decode import _down_finish, _gate_up_finish, _source

QBLOCK = 32  # activations per int8 block
_WS: dict = {}


@triton.jit
def _div_rn(a, b, FAST: tl.constexpr):
    """a / b rounded to nearest (Triton's fp32 division is the approximate div.full)."""
    if FAST:
        return tl.inline_asm_elementwise(
            "div.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return a / b


@triton.jit
def _rint(v, FAST: tl.constexpr):
    """Round half to even (fp32; |v| < 2**22 in the interpreter's form)."""
    if FAST:
        return tl.inline_asm_elementwise(
            "cvt.rni.f32.f32 $0, $1;", "=r,r", [v], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return (v + 12582912.0) - 12582912.0  # 1.5 * 2**23: the sum keeps no fraction


@triton.jit
def _dot8(w, xl, xh, FAST: tl.constexpr):
    """One int32 word of int4 rows (byte j: input 4m + j in the low nibble, 16 + 4m + j in the
    high one) times the int8 activations of those inputs (xl: 4m..4m+3, xh: 16+4m..): the exact
    integer dot of the 8 nibbles (0..15) with them."""
    if FAST:
        return tl.inline_asm_elementwise(
            """{
            .reg .b32 lo, hi, acc;
            and.b32 lo, $1, 0x0F0F0F0F;
            shr.u32 hi, $1, 4;
            and.b32 hi, hi, 0x0F0F0F0F;
            dp4a.u32.s32 acc, lo, $2, 0;
            dp4a.u32.s32 $0, hi, $3, acc;
            }""",
            "=r,r,r,r",
            [w, xl, xh],
            dtype=tl.int32,
            is_pure=True,
            pack=1,
        )
    else:
        acc = tl.zeros_like(w)
        for j in tl.static_range(4):
            a_lo = (w >> (8 * j)) & 15
            a_hi = (w >> (8 * j + 4)) & 15
            b_lo = (xl << (24 - 8 * j)) >> 24  # the signed byte j
            b_hi = (xh << (24 - 8 * j)) >> 24
            acc += a_lo * b_lo + a_hi * b_hi
        return acc


@triton.jit
def _quant_kernel(x_ptr, q_ptr, d_ptr, s_ptr, K: tl.constexpr, NBP: tl.constexpr,
                  FAST: tl.constexpr, PDL: tl.constexpr, WAIT: tl.constexpr):  # fmt: skip
    """Row program_id(0) of x [rows, K] -> q int8 [rows, K], d fp32 and sum(q) int32 [rows, K/32]
    (ref.quantize_act's d and q). PDL: lets the next kernel launch; WAIT: waits for the one
    before (x is its output)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if WAIT:
        tl.extra.cuda.gdc_wait()
    NB: tl.constexpr = K // 32
    t = tl.program_id(0).to(tl.int64)
    b = tl.arange(0, NBP)
    m = (b < NB)[:, None]
    off = t * K + b[:, None] * 32 + tl.arange(0, 32)[None, :]
    x = tl.load(x_ptr + off, mask=m, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), 1)
    d = _div_rn(amax, tl.full([NBP], 127.0, tl.float32), FAST)
    one = tl.full([NBP], 1.0, tl.float32)
    inv = tl.where(d > 0, _div_rn(one, tl.where(d > 0, d, one), FAST), 0.0)
    q = _rint(x * inv[:, None], FAST)
    q = tl.minimum(tl.maximum(q, -127.0), 127.0).to(tl.int32)
    tl.store(q_ptr + off, q.to(tl.int8), mask=m)
    tl.store(d_ptr + t * NB + b, d, mask=b < NB)
    tl.store(s_ptr + t * NB + b, tl.sum(q, 1), mask=b < NB)


@triton.jit
def _load_words(q_ptr, e, n0, k0, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr,
                BK: tl.constexpr):  # fmt: skip
    """Rows n0.. of expert e, inputs k0..k0+BK, as int32 words [BN, BK/32, 4] (K/8 a row)."""
    r = n0 + tl.arange(0, BN)[:, None, None]
    kb = k0 // 32 + tl.arange(0, BK // 32)[None, :, None]
    return tl.load(
        q_ptr + e * (N * (K // 8)) + r * (K // 8) + kb * 4 + tl.arange(0, 4)[None, None, :]
    )


@triton.jit
def _q8_step(w, s_ptr, e, n0, k0, xw_ptr, xd_ptr, xs_ptr, N: tl.constexpr, K: tl.constexpr,
             G: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FAST: tl.constexpr):  # fmt: skip
    """Words w from _load_words times one activation row's blocks (xw: its int8 as words, xd /
    xs: its blocks' d and sum q) -> the step's block terms [BN, BK/32] fp32."""
    NB: tl.constexpr = BK // 32
    kb = k0 // 32 + tl.arange(0, NB)
    # the inputs through offsets broadcast to the tile's shape: they take its register layout
    wo = tl.zeros([BN, 1, 1], tl.int32) + (kb[None, :, None] * 8 + tl.arange(0, 4)[None, None, :])
    dot = tl.sum(_dot8(w, tl.load(xw_ptr + wo), tl.load(xw_ptr + wo + 4), FAST), 2)  # [BN, NB]
    bo = tl.zeros([BN, 1], tl.int32) + kb[None, :]
    xd = tl.load(xd_ptr + bo)
    xs = tl.load(xs_ptr + bo)
    r = n0 + tl.arange(0, BN)[:, None]
    v = tl.load(s_ptr + e * (N * (K // G)) + r * (K // G) + (kb[None, :] * 32) // G)
    sc = (v << 16).to(tl.float32, bitcast=True)
    zp = (v & -65536).to(tl.float32, bitcast=True)
    return xd * (sc * (dot - 8 * xs).to(tl.float32) + zp * xs.to(tl.float32))


@triton.jit
def _gate_up_kernel(xw_ptr, xd_ptr, xs_ptr, ids_ptr, q_ptr, s_ptr, hq_ptr, hs_ptr, part_ptr,
                    cnt_ptr, h_ptr, P, D: tl.constexpr, I: tl.constexpr, G: tl.constexpr,
                    BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr, TOPK: tl.constexpr,
                    FAST: tl.constexpr, PDL: tl.constexpr, HOST: tl.constexpr):  # fmt: skip
    """Program (p, nb, sk): gate rows [n0, n0 + BN) and the same up rows of pair p's expert over
    D split sk -> h[p, n0 + r] (fp32) through decode.py's finish. The first step's weights are
    loaded before waiting for the activations' quantization."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    N: tl.constexpr = 2 * I
    p, nb, sk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_ptr, s_ptr, e = _source(ids_ptr, p, q_ptr, s_ptr, hq_ptr, hs_ptr, HOST)
    n0 = nb * BN
    KC: tl.constexpr = D // SPLIT
    t = (p // TOPK).to(tl.int64)
    xw, xd, xs = xw_ptr + t * (D // 4), xd_ptr + t * (D // 32), xs_ptr + t * (D // 32)
    wg0 = _load_words(q_ptr, e, n0, sk * KC, N, D, BN, BK)
    wu0 = _load_words(q_ptr, e, I + n0, sk * KC, N, D, BN, BK)
    if PDL:
        tl.extra.cuda.gdc_wait()  # the activations' blocks are written
    ga = tl.zeros([BN, BK // 32], tl.float32)
    ua = tl.zeros([BN, BK // 32], tl.float32)
    for kb in tl.static_range(0, KC, BK):
        k0 = sk * KC + kb
        if kb == 0:
            wg, wu = wg0, wu0
        else:
            wg = _load_words(q_ptr, e, n0, k0, N, D, BN, BK)
            wu = _load_words(q_ptr, e, I + n0, k0, N, D, BN, BK)
        ga += _q8_step(wg, s_ptr, e, n0, k0, xw, xd, xs, N, D, G, BN, BK, FAST)
        ua += _q8_step(wu, s_ptr, e, I + n0, k0, xw, xd, xs, N, D, G, BN, BK, FAST)
    g = tl.sum(ga, 1)
    u = tl.sum(ua, 1)
    _gate_up_finish(g, g, u, u, part_ptr, cnt_ptr, h_ptr, cnt_ptr, p, nb, sk, n0, P, I, 3, BN,
                    SPLIT, False)  # fmt: skip


@triton.jit
def _down_kernel(hw_ptr, hd_ptr, hs_ptr, ids_ptr, rw_ptr, q_ptr, s_ptr, hq_ptr, hsc_ptr,
                 dpart_ptr, cnt_ptr, out_ptr, P, D: tl.constexpr, I: tl.constexpr,
                 G: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, TOPK: tl.constexpr,
                 FAST: tl.constexpr, PDL: tl.constexpr, COMBINE: tl.constexpr,
                 HOST: tl.constexpr):  # fmt: skip
    """Program (p, nb): output rows [n0, n0 + BN) of pair p over all of I from h's int8 blocks,
    times the routing weight, through decode.py's finish (pair row, combine in slot order)."""
    p, nb = tl.program_id(0), tl.program_id(1)
    q_ptr, s_ptr, e = _source(ids_ptr, p, q_ptr, s_ptr, hq_ptr, hsc_ptr, HOST)
    n0 = nb * BN
    pw, pd, ps = hw_ptr + p * (I // 4), hd_ptr + p * (I // 32), hs_ptr + p * (I // 32)
    w0 = _load_words(q_ptr, e, n0, 0, D, I, BN, BK)  # weights need no wait
    if PDL:
        tl.extra.cuda.gdc_wait()  # h's blocks are written
    acc = tl.zeros([BN, BK // 32], tl.float32)
    for k0 in tl.static_range(0, I, BK):
        if k0 == 0:
            w = w0
        else:
            w = _load_words(q_ptr, e, n0, k0, D, I, BN, BK)
        acc += _q8_step(w, s_ptr, e, n0, k0, pw, pd, ps, D, I, G, BN, BK, FAST)
    y = tl.sum(acc, 1)
    _down_finish(y, y, rw_ptr, dpart_ptr, cnt_ptr, out_ptr, p, nb, n0, D, 3, BN, TOPK, COMBINE)


# ---- host side ----------------------------------------------------------------------------------
def _blocks(device, rows: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(int8 q [rows, k], fp32 d, int32 sum q [rows, k / 32]) buffers, cached per shape so a
    captured graph reuses them."""
    key = (str(device), rows, k)
    if key not in _WS:
        nb = rows * (k // QBLOCK)
        _WS[key] = (
            torch.empty(rows * k, device=device, dtype=torch.int8),
            torch.empty(nb, device=device, dtype=torch.float32),
            torch.empty(nb, device=device, dtype=torch.int32),
        )
    return _WS[key]


def quantize_rows(x: torch.Tensor, pdl: bool = False, wait: bool = False, out=None):
    """x [rows, K] (K a multiple of 32) -> (q int8 [rows * K], d fp32, sum q int32 [rows * K/32])
    in one launch; the bits of ref.quantize_act's q and d."""
    rows, k = x.shape
    q, d, s = out if out is not None else _blocks(x.device, rows, k)
    gpu = x.device.type == "cuda"
    _quant_kernel[(rows,)](
        x.contiguous(), q, d, s, K=k, NBP=triton.next_power_of_2(k // QBLOCK), FAST=gpu,
        PDL=gpu and pdl, WAIT=gpu and wait, num_warps=4,
        **({"launch_pdl": True} if gpu and wait else {}),
    )  # fmt: skip
    return q, d, s


def unsupported(quant: str, cfg) -> str | None:
    """Why these kernels cannot take the layer (None when they can)."""
    if quant != "int4r" or cfg.mma or cfg.bk % QBLOCK or cfg.bk_d % QBLOCK:
        return (
            f"int8 activations take int4 rows on CUDA cores with bk, bk_d multiples of 32 ({quant})"
        )
    return None


def moe_decode(x, ids, weights, experts, cfg, out=None, combine: bool = True) -> torch.Tensor:
    """decode.moe_decode's contract with int8 activations: h kept fp32 in the workspace."""
    from moestream.kernels.triton.decode import Launch

    why = unsupported(experts.kernel_quant, cfg)
    assert why is None, why
    launch = Launch.build(x, ids, weights, experts, cfg, out, combine, h_dtype=torch.float32)
    gate_up(launch)
    down(launch)
    return launch.result()


def gate_up(launch) -> None:
    """x's blocks, then the gate/up programs."""
    cfg, (part, h, _, cnt_g, _) = launch.cfg, launch.ws
    T, D = launch.x.shape
    gpu, pdl = launch.gpu, launch.gpu and cfg.pdl
    xq, xd, xs = quantize_rows(launch.x, pdl=pdl, out=_blocks(launch.x.device, T, D))
    q, s, hq, hs = launch.w13
    c = launch.common
    _gate_up_kernel[(launch.P, c["I"] // cfg.bn, cfg.split)](
        xq.view(torch.int32), xd, xs, launch.ids, q.view(torch.int32), s, hq.view(torch.int32),
        hs, part, cnt_g, h, launch.P, D=D, I=c["I"], G=c["G"], BN=cfg.bn, BK=cfg.bk,
        SPLIT=cfg.split, TOPK=c["TOPK"], FAST=gpu, PDL=pdl, HOST=c["HOST"],
        num_warps=cfg.num_warps, **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip


def down(launch) -> None:
    """h's blocks, then the down programs."""
    cfg, (_, h, dpart, _, cnt_d) = launch.cfg, launch.ws
    c, P = launch.common, launch.P
    gpu, pdl = launch.gpu, launch.gpu and launch.cfg.pdl
    hq, hd, hsum = quantize_rows(
        h.view(P, c["I"]), pdl=pdl, wait=pdl, out=_blocks(h.device, P, c["I"])
    )
    q, s, fq, fs = launch.w2
    _down_kernel[(P, c["D"] // cfg.bn_d)](
        hq.view(torch.int32), hd, hsum, launch.ids, launch.weights, q.view(torch.int32), s,
        fq.view(torch.int32), fs, dpart, cnt_d, launch.out, P, D=c["D"], I=c["I"], G=c["G"],
        BN=cfg.bn_d, BK=cfg.bk_d, TOPK=c["TOPK"], FAST=gpu, PDL=pdl, COMBINE=launch.combine,
        HOST=c["HOST"], num_warps=cfg.warps_d, **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip


# ---- the spec ------------------------------------------------------------------------------------
def qlinear_int4_q8(x: torch.Tensor, sec: dict, name: str, group_size: int) -> torch.Tensor:
    """x [T, K] -> [T, N] fp32 as the kernels compute an int4 projection (store sections `.q`,
    `.sz`): x quantized per block of 32 (quantize_act, whatever the weights' group), then per
    block d * (s * (dot - 8 * sum q) + z * sum q) with the exact integer dot of the nibbles
    (0..15) and the block's group (scale, zero), each product rounded to fp32, blocks added in
    order (the kernel adds them in another order: equal to fp32 rounding)."""
    from moestream.quant import int4_sz_kn, unpack_int4

    q8, d = quantize_act(x, 32, 127)  # [T, nb, 32], [T, nb]
    w = unpack_int4(sec[f"{name}.q"]).float()
    n, k = w.shape
    dots = torch.einsum("tbg,nbg->tnb", q8, w.view(n, k // 32, 32))
    sq = q8.sum(-1)[:, None, :]  # [T, 1, nb]
    sz = int4_sz_kn(sec[f"{name}.sz"], n).float().repeat_interleave(group_size // 32, 0)
    s, z = sz[..., 0].t()[None], sz[..., 1].t()[None]  # [1, N, nb]
    terms = d[:, None, :] * (s * (dots - 8 * sq) + z * sq)
    y = torch.zeros(terms.shape[:2])
    for b in range(terms.shape[2]):
        y = y + terms[..., b]
    return y


def moe_int4_q8_ref(x: torch.Tensor, secs: list[list[dict]], weights: torch.Tensor,
                    group_size: int) -> torch.Tensor:  # fmt: skip
    """The kernels' spec: x [T, D], per token its routed experts' store sections (slot order) and
    weights [T, K] -> [T, D] fp32: silu(gate) * up in fp32, both projections through
    qlinear_int4_q8, pair rows weight * y added in slot order."""
    out = torch.zeros(x.shape)
    for t, row in enumerate(secs):
        xt = x[t : t + 1].float()
        for i, sec in enumerate(row):
            gate, up = qlinear_int4_q8(xt, sec, "w13", group_size).chunk(2, dim=-1)
            y = qlinear_int4_q8(F.silu(gate) * up, sec, "w2", group_size)
            out[t] = out[t] + weights[t, i].float() * y[0]
    return out
