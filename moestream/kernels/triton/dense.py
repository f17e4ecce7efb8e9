"""Quantized dense GEMV on CUDA for decode (1-8 tokens): y = x W^T (+ b) straight from the store's
int8 / int4 / q4_0 sections of W (quant.py), so VRAM holds only those and a token reads only them
(at vocab 151936 the output layer is 350 MB per token in int8, 194 MB in int4, instead of a
bf16 copy's 622 MB).

One program per (block of BN output rows, split of K). Each K step takes GPS groups; per group
one tensor-core dot of the tokens [16 rows, T used, G] by the group's raw integer weights
converted exactly to the activation dtype (int8 q, int4 q - 8, q4_0 q - 8: exact in bf16, fp16
and fp32), then the group's scale is applied in fp32 to the [16, BN] sums (int4 adds
zero * sum(x over the group)). With SPLIT > 1 each split stores fp32 partials and `_sum_kernel`
adds them in split order (deterministic); the bias is added in fp32 before the one rounding to
the output dtype. int4 rows come in the store's packed blocks of 64 (a block is [K, 32] bytes:
row d low nibble, row d + 32 high); a shorter last block ([K, b/2] bytes) takes its own launch.

Numerics: the dots multiply the raw integers (at most 8 bits) by the activations, products that
are exact in fp32 for bf16 / fp16 activations (fp32 ones round each product, "ieee" fp32 dots);
sums are fp32 (the dot accumulators, then per group times the fp32 scale, int4 plus the zero
term), so the result is sum(dequantized weight x activation) up to fp32 summation rounding,
rounded once to x's dtype. The reference (`QuantLinear` kernel "ref": dequantize into x's dtype
+ F.linear) rounds every dequantized weight to bf16 first and sums in cuBLAS's order, so bf16
outputs differ from it in the last bit or so (tests/test_triton_dense.py bounds the GEMV against
a float64 spec of the stored numbers).

Tiles come from a rule on (N, K) (`gemv_config`), not triton.autotune (it syncs and benchmarks
at the first call, which a CUDA graph capture cannot take). The rule is untuned: it waits for a
device run of benchmarks/bench_gpu_dense.py. `dense_gemv` is a torch custom op, so a
torch.compile'd decode step (engine/graph.py) calls it as one opaque node instead of tracing the
launcher; it allocates only through torch's caching allocator and never syncs (capturable).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moestream.kernels.triton.decode import _s8_f32, _u4_dt

MAX_TOKENS = 8  # decode; a prompt's rows go to the dequantized weight and F.linear (tensor cores)
SCHEMES = ("int8", "int4", "q4_0")
QUANT_CODE = {"int8": 1, "int4": 2, "q4_0": 3}
INT4_ROWS = 64  # rows per packed int4 block (quant.INT4_BLOCK_N)
M = 16  # token rows of one dot (tl.dot's minimum; T <= MAX_TOKENS of them are used)
TARGET_PROGRAMS = 512  # untuned: about 4 programs per SM of an H200 (132 SMs)
MIN_SPLIT_GROUPS = 8  # a split keeps at least this many groups of K
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True, slots=True)
class GemvConfig:
    bn: int = 64  # output rows per program (int4: 64, one packed block)
    gps: int = 8  # groups per K step
    split: int = 1  # programs along K (fp32 partials, summed in order by _sum_kernel)
    num_warps: int = 4
    stages: int = 3  # software pipelining of the K loop


def unsupported(quant: str, n: int, k: int, group: int, tokens: int) -> str | None:
    """Why the GEMV cannot take this weight at this token count (None when it can)."""
    if tokens > MAX_TOKENS:
        return f"{tokens} tokens: the GEMV takes at most {MAX_TOKENS} (decode)"
    if quant not in SCHEMES:
        return f"{quant} weights have no GEMV (it reads {', '.join(SCHEMES)})"
    if group < 16 or group & (group - 1) or k % group:
        return f"group size {group} (K={k}): the GEMV needs a power of two >= 16 dividing K"
    if quant == "int4" and n % 2:
        return f"int4 with an odd number of rows ({n})"
    return None


@functools.cache
def gemv_config(quant: str, n: int, k: int, group: int) -> GemvConfig:
    """Tiles for an [n, k] weight: 64-row blocks; K split until about TARGET_PROGRAMS programs run
    (a small N alone would leave most SMs idle), each split keeping >= MIN_SPLIT_GROUPS groups;
    up to 8 groups per K step. Untuned (see the module docstring)."""
    bn = INT4_ROWS if quant == "int4" else 64
    blocks, groups, split = triton.cdiv(n, bn), k // group, 1
    while (
        blocks * split < TARGET_PROGRAMS
        and groups % (2 * split) == 0
        and groups // (2 * split) >= MIN_SPLIT_GROUPS
    ):
        split *= 2
    gps = 8
    while (groups // split) % gps:
        gps //= 2
    return GemvConfig(bn=bn, gps=gps, split=split)


# ---- one group of K: [M, BN] sums of raw weights times the tokens, scaled -------------------------
@triton.jit
def _tokens(x_ptr, kk, T, K: tl.constexpr):
    """Token rows [M, len(kk)] of x at inputs kk (rows >= T zero)."""
    t = tl.arange(0, 16)[:, None]
    return tl.load(x_ptr + t * K + kk[None, :], mask=t < T, other=0.0)


@triton.jit
def _group_int8(x_ptr, q_ptr, s_ptr, r, rmask, kg, T, K: tl.constexpr, G: tl.constexpr,
                DT: tl.constexpr, PREC: tl.constexpr, FAST: tl.constexpr):  # fmt: skip
    """int8 group kg of rows r: (x_g . q) * s -> [M, BN]."""
    kk = kg * G + tl.arange(0, G)
    xg = _tokens(x_ptr, kk, T, K).to(DT)
    rows = q_ptr + r.to(tl.int64)[:, None] * K  # 64-bit offsets: N * K may pass 2^31
    w = tl.load(rows + kk[None, :], mask=rmask[:, None], other=0)  # [BN, G]
    c = tl.dot(xg, tl.trans(_s8_f32(w, FAST).to(DT)), input_precision=PREC)
    s = tl.load(s_ptr + r * (K // G) + kg, mask=rmask, other=0.0)
    return c * s[None, :]


@triton.jit
def _group_q4_0(x_ptr, q_ptr, d_ptr, r, rmask, kg, T, K: tl.constexpr, DT: tl.constexpr,
                PREC: tl.constexpr, FAST: tl.constexpr):  # fmt: skip
    """q4_0 block kg (32 inputs) of rows r: 16 bytes per row, element i low nibble, i + 16 high:
    (x_lo . lo + x_hi . hi) * d -> [M, BN]."""
    j = tl.arange(0, 16)
    rows = q_ptr + r.to(tl.int64)[:, None] * (K // 2)  # 64-bit offsets
    b = tl.load(rows + kg * 16 + j[None, :], mask=rmask[:, None], other=0)
    lo, hi = _u4_dt(b, FAST, DT)  # q - 8, [BN, 16] each
    x_lo = _tokens(x_ptr, kg * 32 + j, T, K).to(DT)
    x_hi = _tokens(x_ptr, kg * 32 + 16 + j, T, K).to(DT)
    c = tl.dot(x_lo, tl.trans(lo), input_precision=PREC)
    c += tl.dot(x_hi, tl.trans(hi), input_precision=PREC)
    d = tl.load(d_ptr + r * (K // 32) + kg, mask=rmask, other=0.0).to(tl.float32)
    return c * d[None, :]


@triton.jit
def _group_int4(x_ptr, q_ptr, sz_ptr, n0, kg, T, N: tl.constexpr, K: tl.constexpr,
                G: tl.constexpr, HALF: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
                FAST: tl.constexpr):  # fmt: skip
    """int4 group kg of the packed block at row n0 (HALF = its rows / 2): -> ([M, 32] low rows
    n0 + d, [M, 32] high rows n0 + HALF + d), each s * (x_g . (q - 8)) + z * sum(x_g)."""
    d = tl.arange(0, 32)
    dm = d < HALF
    kk = kg * G + tl.arange(0, G)
    blk = q_ptr + n0.to(tl.int64) * (K // 2)  # 64-bit offsets
    b = tl.load(blk + kk[:, None] * HALF + d[None, :], mask=dm[None, :], other=0)
    lo, hi = _u4_dt(b, FAST, DT)  # [G, 32]
    xg = _tokens(x_ptr, kk, T, K)
    xd = xg.to(DT)
    xs = tl.sum(xg.to(tl.float32), 1)[:, None]  # the zero points' factor, [M, 1]
    c_lo = tl.dot(xd, lo, input_precision=PREC)
    c_hi = tl.dot(xd, hi, input_precision=PREC)
    sp = sz_ptr + kg * N + n0 + d  # (scale, zero) bf16 pairs as one int32 word, [K/G, N]
    v_lo = tl.load(sp, mask=dm, other=0)
    v_hi = tl.load(sp + HALF, mask=dm, other=0)
    s_lo = (v_lo << 16).to(tl.float32, bitcast=True)[None, :]
    z_lo = (v_lo & -65536).to(tl.float32, bitcast=True)[None, :]
    s_hi = (v_hi << 16).to(tl.float32, bitcast=True)[None, :]
    z_hi = (v_hi & -65536).to(tl.float32, bitcast=True)[None, :]
    return c_lo * s_lo + xs * z_lo, c_hi * s_hi + xs * z_hi


@triton.jit
def _finish(acc, r, rmask, b_ptr, out_ptr, part_ptr, sk, T, N: tl.constexpr,
            SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr):  # fmt: skip
    """Rows r of the [M, BN] sums: + bias, rounded into out[t, r] (SPLIT 1), else fp32 partials
    part[sk, t, r]."""
    t = tl.arange(0, 16)[:, None]
    m = (t < T) & rmask[None, :]
    if SPLIT == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + r, mask=rmask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + t * N + r[None, :], acc.to(out_ptr.dtype.element_ty), mask=m)
    else:
        tl.store(part_ptr + (sk * T + t) * N + r[None, :], acc, mask=m)


@triton.jit
def _gemv_kernel(x_ptr, q_ptr, s_ptr, b_ptr, out_ptr, part_ptr, T, N: tl.constexpr,
                 K: tl.constexpr, ROW0: tl.constexpr, QUANT: tl.constexpr, G: tl.constexpr,
                 BN: tl.constexpr, GPS: tl.constexpr, SPLIT: tl.constexpr, HALF: tl.constexpr,
                 HAS_BIAS: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
                 FAST: tl.constexpr, STAGES: tl.constexpr):  # fmt: skip
    """Program (row block nb, split sk): rows ROW0 + nb * BN ... over groups of split sk."""
    n0 = ROW0 + tl.program_id(0) * BN
    sk = tl.program_id(1)
    KG: tl.constexpr = K // G // SPLIT  # groups per split
    g0 = sk * KG
    if QUANT == 2:
        acc_lo = tl.zeros([16, 32], tl.float32)
        acc_hi = tl.zeros([16, 32], tl.float32)
        for kb in tl.range(0, KG, GPS, num_stages=STAGES):
            for g in tl.static_range(GPS):
                a, b = _group_int4(x_ptr, q_ptr, s_ptr, n0, g0 + kb + g, T, N, K, G, HALF, DT,
                                   PREC, FAST)  # fmt: skip
                acc_lo += a
                acc_hi += b
        d = tl.arange(0, 32)
        dm = d < HALF
        _finish(acc_lo, n0 + d, dm, b_ptr, out_ptr, part_ptr, sk, T, N, SPLIT, HAS_BIAS)
        _finish(acc_hi, n0 + HALF + d, dm, b_ptr, out_ptr, part_ptr, sk, T, N, SPLIT, HAS_BIAS)
    else:
        r = n0 + tl.arange(0, BN)
        rmask = r < N
        acc = tl.zeros([16, BN], tl.float32)
        for kb in tl.range(0, KG, GPS, num_stages=STAGES):
            for g in tl.static_range(GPS):
                if QUANT == 1:
                    acc += _group_int8(x_ptr, q_ptr, s_ptr, r, rmask, g0 + kb + g, T, K, G, DT,
                                       PREC, FAST)  # fmt: skip
                else:
                    acc += _group_q4_0(x_ptr, q_ptr, s_ptr, r, rmask, g0 + kb + g, T, K, DT,
                                       PREC, FAST)  # fmt: skip
        _finish(acc, r, rmask, b_ptr, out_ptr, part_ptr, sk, T, N, SPLIT, HAS_BIAS)


@triton.jit
def _sum_kernel(part_ptr, b_ptr, out_ptr, TN, N: tl.constexpr, SPLIT: tl.constexpr,
                HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """out = the SPLIT fp32 partials [SPLIT, T, N] added in split order (+ bias), rounded once."""
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < TN
    tot = tl.zeros([BLOCK], tl.float32)
    for i in tl.static_range(SPLIT):
        tot += tl.load(part_ptr + i * TN + o, mask=m, other=0.0)
    if HAS_BIAS:
        tot += tl.load(b_ptr + o % N, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + o, tot.to(out_ptr.dtype.element_ty), mask=m)


# ---- host side ----------------------------------------------------------------------------------
_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def gemv_impl(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, bias: torch.Tensor | None,
              quant: str, n: int, group: int) -> torch.Tensor:  # fmt: skip
    """x [T, K] (T <= MAX_TOKENS) -> [T, n] in x's dtype, from the sections q and s (int8 `s`,
    int4 `sz`, q4_0 `d`) of an [n, K] weight; bias [n] or None."""
    T, K = x.shape
    why = unsupported(quant, n, K, group, T)
    assert why is None, why
    assert x.dtype in DTYPES, f"activations in {x.dtype}: the GEMV takes bf16, fp16 or fp32"
    cfg = gemv_config(quant, n, K, group)
    x = x.contiguous()
    out = torch.empty(T, n, device=x.device, dtype=x.dtype)
    part = out if cfg.split == 1 else torch.empty(cfg.split, T, n, device=x.device)
    if quant == "int4":
        s = s.view(torch.int32)  # (scale, zero) bf16 pairs as one word: [K/G, N, 1]
    gpu, bf16 = x.device.type == "cuda", x.dtype == torch.bfloat16
    kw = dict(
        T=T, N=n, K=K, QUANT=QUANT_CODE[quant], G=32 if quant == "q4_0" else group, BN=cfg.bn,
        GPS=cfg.gps, SPLIT=cfg.split, HAS_BIAS=bias is not None, DT=_TL[x.dtype],
        PREC="ieee" if x.dtype == torch.float32 else "tf32",
        FAST=gpu and (bf16 or quant == "int8"),  # the PTX conversions (interpreter: plain casts)
        STAGES=cfg.stages, num_warps=cfg.num_warps,
    )  # fmt: skip
    b = out if bias is None else bias
    full = n - n % INT4_ROWS if quant == "int4" else n
    if full:
        grid = (triton.cdiv(full, cfg.bn), cfg.split)
        _gemv_kernel[grid](x, q, s, b, out, part, ROW0=0, HALF=32, **kw)
    if full < n:  # int4's shorter last block: [K, (n - full) / 2] bytes
        _gemv_kernel[(1, cfg.split)](x, q, s, b, out, part, ROW0=full, HALF=(n - full) // 2, **kw)
    if cfg.split > 1:
        block = 1024
        _sum_kernel[(triton.cdiv(T * n, block),)](
            part, b, out, T * n, N=n, SPLIT=cfg.split, HAS_BIAS=bias is not None, BLOCK=block
        )
    return out


@torch.library.custom_op("moestream::dense_gemv", mutates_args=())
def dense_gemv(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, bias: torch.Tensor | None,
               quant: str, n: int, group: int) -> torch.Tensor:  # fmt: skip
    """`gemv_impl` as one opaque op for torch.compile."""
    return gemv_impl(x, q, s, bias, quant, n, group)


@dense_gemv.register_fake
def _(x, q, s, bias, quant, n, group):
    return x.new_empty((x.shape[0], n))


def gemv(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, bias: torch.Tensor | None,
         quant: str, n: int, group: int) -> torch.Tensor:  # fmt: skip
    """y = x W^T (+ bias): the custom op inside a compiled step, the plain function eagerly (the
    dispatcher's overhead is host time per call; a captured graph has neither)."""
    fn = dense_gemv if torch.compiler.is_compiling() else gemv_impl
    return fn(x, q, s, bias, quant, n, group)
