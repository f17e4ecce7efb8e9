"""Quantized dense GEMV on CUDA for decode (1-8 tokens): y = x W^T (+ b) straight from the store's
int8 / int4 / q4_0 sections of W (quant.py), so VRAM holds only those and a token reads only them
(at vocab 151936 the output layer is 350 MB per token in int8, 194 MB in int4, instead of a
bf16 copy's 622 MB).

Two kernels, one program per (block of BN output rows, split of K), picked by `gemv_config`:
  fma (1 token): a memory-bound GEMV on CUDA cores. Each K step loads a [BN, BK] tile of the raw
     integers (16 bytes a thread: int8 [BN, BK/32, 32], q4_0 [BN, BK/32, 16] bytes, int4 the
     block's [BK, 32] bytes), converts them exactly to fp32 (byte permutes, decode.py), multiplies
     by the token in fp32; int8 / q4_0 sum each group of 32 and scale it into [BN, BK/32]
     accumulators, int4 dequantizes each weight (s (q - 8) + z) into per-element ones; one
     reduction along K at the end. A small N takes fewer rows per program, then split K, so
     about FMA_PROGRAMS programs run. Several tokens go through the same code, each token's sums
     selected into its accumulator row (a sweep candidate, not the rule's pick).
  mma (2-8 tokens): per group one tensor-core dot of the tokens [16 rows, T used, G] by the
     group's raw integers converted exactly to the activation dtype, the group's scale applied in
     fp32 to the [16, BN] sums (int4 adds zero * sum(x over the group)).
With SPLIT > 1 each split stores fp32 partials and `_sum_kernel` adds them in split order
(deterministic); the bias is added in fp32 before the one rounding to the output dtype. int4
rows come in the store's packed blocks of 64 (a block is [K, 32] bytes: row d low nibble, row
d + 32 high); a shorter last block ([K, b/2] bytes) takes its own launch.

Numerics: fma multiplies the exact fp32 integers (int8 q, q4_0 q - 8) by the fp32 activations,
sums each group of 32 and scales it; int4 (and int4 rows with `elem`) multiplies s (q - 8) + z
(rounded once to fp32); mma
multiplies the raw integers (at most 8 bits) by the activations, exact in fp32 for bf16 / fp16
(fp32 ones round each product, "ieee" dots). Sums are fp32 in either kernel, so the result is
sum(dequantized weight x activation) up to fp32 rounding, rounded once to x's dtype. The
reference (`QuantLinear` kernel "ref": dequantize into x's dtype
+ F.linear) rounds every dequantized weight to bf16 first and sums in cuBLAS's order, so bf16
outputs differ from it in the last bit or so (tests/test_triton_dense.py bounds the GEMV against
a float64 spec of the stored numbers).

Tiles come from a rule on (quant, N, K, T) (`gemv_config`), not triton.autotune (it syncs and
benchmarks at the first call, which a CUDA graph capture cannot take). The rule is untuned: it
waits for a device run of benchmarks/bench_gpu_dense.py --sweep, which times `gemv_candidates`. `dense_gemv` is a torch custom op, so a
torch.compile'd decode step (engine/graph.py) calls it as one opaque node instead of tracing the
launcher; it allocates only through torch's caching allocator and never syncs (capturable).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from moestream.kernels.triton import decode as dk
from moestream.kernels.triton import kept
from moestream.kernels.triton.decode import _s8_f32, _u4_dt, _u4_f32
from moestream.quant import KQUANT_BYTES

MAX_TOKENS = 8  # decode; a prompt's rows go to the dequantized weight and F.linear (tensor cores)
SCHEMES = ("int8", "int4", "q4_0")
# a GGUF's q4_k / q5_k blocks as stored, through the MoE decode kernels' steps (_kquant_gemv; a
# q6_k weight runs as its exact int8, kernels/dense.py: triton_form: 8.5 bits a weight against
# q6_k's step at 3x q4_k's instructions)
GEMV_KQUANTS = ("q4_k", "q5_k")
# int4_rows: int4 weights repacked row-major (quant.int4_to_rows), 1-8 tokens on the fma kernel
QUANT_CODE = {"int8": 1, "int4": 2, "q4_0": 3, "int4_rows": 4}
INT4_ROWS = 64  # rows per packed int4 block (quant.INT4_BLOCK_N)
M = 16  # token rows of one dot (tl.dot's minimum; T <= MAX_TOKENS of them are used)
TARGET_PROGRAMS = 512  # mma, untuned: about 4 programs per SM of an H200 (132 SMs)
FMA_PROGRAMS = 1024  # fma, untuned: about 8 per SM (small programs keep more bytes in flight)
MIN_SPLIT_GROUPS = 8  # a split keeps at least this many groups of K
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


FMA_TOKENS = {"int8": 1, "q4_0": 1, "int4": 1, "int4_rows": MAX_TOKENS}  # T above: mma
FMA_ROWS = (16, 4)  # untuned: int8 / q4_0 rows per fma program, most first, fewest for a small N


@dataclass(frozen=True, slots=True)
class GemvConfig:
    bn: int = 64  # output rows per program (int4: 64, one packed block)
    gps: int = 8  # mma: groups per K step
    split: int = 1  # programs along K (fp32 partials, summed in order by _sum_kernel)
    num_warps: int = 4
    stages: int = 3  # mma: software pipelining of the K loop
    fma: bool = False  # CUDA-core kernel (_gemv_fma_kernel) instead of the tensor-core one
    bk: int = 512  # fma: inputs per K step
    unroll: int = 4  # fma: K steps unrolled (int4 fully unrolled spills: sm_90 compile, 32 steps)
    # fma, int4 rows: each weight dequantized once (s (q - 8) + z, one fp32 rounding) and summed
    # per element, one reduction at the end (sm_90 SASS: 7.6 instructions a weight against the
    # per-group sums' 9.25; a sweep candidate: on the H200 at cccae40 q/k/v 5.5 us as the rule's,
    # o 6.3 against 6.5: not taken, it would change the bits for ~3% of one GEMV)
    elem: bool = False
    # fma, row-major layouts, split K: the last split program of a row block adds the partials
    # (in split order: _sum_kernel's bits) instead of a second launch; the rule's choice for a
    # split fma GEMV (_fma_config)
    fold: bool = False
    # fma, int4 rows, per-group sums: each nibble read as 0.5 + q / 256 by one byte permute, the
    # offset folded into the zero term (decode.DecodeConfig.half's arithmetic): no subtract a
    # weight. Exact values; the sums round differently from half=False's.
    half: bool = False


# Measured on the H200 (benchmarks/results/gpu_dense.jsonl, CUDA graphs): at one token the GEMV
# beats bf16 F.linear for int8 (1.3-1.6x) and q4_0 (1.5-1.8x) at every Qwen3-30B shape, but the
# store's int4 layout (64-row blocks, k-major: a thread holds one k of 32 rows, so every weight
# needs its row's scale and zero) ran at 0.54-0.79x of bf16 at the attention shapes and 1.17x on
# the output layer (e8ec9b1). So int4 weights are repacked once into q4_0's row-major nibble
# order with their (scale, zero) words row-major (`quant.int4_to_rows`, the sections' size), and the GEMV
# runs q4_0's loop with the zero term per group (s * sum((q - 8) x) + z * sum(x)): 311579e,
# q 4096x2048 5.2 us (bf16 7.1, store layout 11.3), o 6.5 (9.3, 12.4), output layer 151936
# rows 87.2 (149.9, 127.6).


def rows_layout(quant: str, n: int, group: int) -> bool:
    """Whether an [n, K] weight of this scheme runs from the row-major repack (quant.int4_to_rows)."""
    return quant == "int4" and group % 32 == 0


def unsupported(quant: str, n: int, k: int, group: int, tokens: int) -> str | None:
    """Why the GEMV cannot take this weight at this token count (None when it can)."""
    if tokens > MAX_TOKENS:
        return f"{tokens} tokens: the GEMV takes at most {MAX_TOKENS} (decode)"
    if quant in GEMV_KQUANTS:  # the MoE decode kernels' super-block steps (_kquant_gemv_kernel)
        return None if k % 256 == 0 else f"{quant} with K={k}: super-blocks of 256"
    if quant == "int4_rows" and group % 32:
        return f"group size {group}: the int4 row repack needs a multiple of 32"
    if quant not in SCHEMES + ("int4_rows",):
        return f"{quant} weights have no GEMV (it reads {', '.join(SCHEMES)})"
    if group < 16 or group & (group - 1) or k % group:
        return f"group size {group} (K={k}): the GEMV needs a power of two >= 16 dividing K"
    if quant == "int4" and n % 2:
        return f"int4 with an odd number of rows ({n})"
    return None


def _split(programs: int, steps: int) -> int:
    """fma splits of K (powers of two, each whole K steps) until about FMA_PROGRAMS programs."""
    split = 1
    while programs * split < FMA_PROGRAMS and steps % (2 * split) == 0:
        split *= 2
    return split


@functools.cache
def gemv_config(quant: str, n: int, k: int, group: int, tokens: int = 1) -> GemvConfig:
    """Tiles for an [n, k] weight at `tokens` rows, untuned (see the module docstring): the fma
    kernel up to FMA_TOKENS[quant] tokens (`_fma_config`), else the tensor-core one
    (`_mma_config`)."""
    if tokens <= FMA_TOKENS[quant]:
        return _fma_config(quant, n, k, group)
    return _mma_config(quant, n, k, group)


def _fma_config(quant: str, n: int, k: int, group: int) -> GemvConfig:
    """K steps of up to 512 inputs (int4 64: its per-element accumulators; int4 rows at the fewest
    rows 1024), int8 / q4_0 FMA_ROWS rows (fewer when the row blocks alone leave SMs idle), int4
    one 64-row block; K split until about FMA_PROGRAMS programs."""
    bk = min(64 if quant == "int4" else 512, k & -k)  # largest power of two dividing K
    bk = max(bk, group if quant in ("int8", "int4") else 32)
    if quant == "int4":
        bn = INT4_ROWS
    else:
        bn = next((b for b in FMA_ROWS if triton.cdiv(n, b) >= FMA_PROGRAMS), FMA_ROWS[-1])
    if quant == "int4_rows" and bn == FMA_ROWS[-1]:
        # steps of 1024: 5.5 vs 6.1 us (q/k/v 5120x2048), 6.5 vs 6.6 (o 2048x4096) in two H200
        # runs of bench_gpu_dense.py --configs (16b7249); wider N (more rows a program) not swept
        bk = max(min(1024, k & -k), group)
    split = _split(triton.cdiv(n, bn), k // bk)
    # int4 rows at the fewest rows a program (the attention shapes) read their nibbles as
    # 0.5 + q / 256 (half): q 4096x2048 4.8 vs 5.0 us, q/k/v 5.4 vs 5.5, o 6.1 vs 6.2 in
    # interleaved repeats on the H200 (882c6de); at 16 rows (a 32000-row output layer) 24.3 vs
    # 23.0, so not there
    half = quant == "int4_rows" and bn == FMA_ROWS[-1]
    # a split K's partials added by its last program (fold): o 2048x4096 int4 rows 6.2 vs 6.5 us
    # in one H200 run (cccae40), the same bits as the sum kernel's second launch
    return GemvConfig(bn=bn, split=split, fma=True, bk=bk, fold=split > 1 and quant != "int4",
                      half=half)  # fmt: skip


def _mma_config(quant: str, n: int, k: int, group: int) -> GemvConfig:
    """64-row blocks, splits to about TARGET_PROGRAMS programs keeping >= MIN_SPLIT_GROUPS groups,
    up to 8 groups per K step."""
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


def gemv_candidates(quant: str, n: int, k: int, group: int, tokens: int) -> list[GemvConfig]:
    """gemv_config's tiles first, then the alternatives a device sweep times against them
    (benchmarks/bench_gpu_dense.py --sweep): the other kernel, and one fma variant (int4: steps
    of 128 inputs on 8 warps; int8 / q4_0: the other row count of FMA_ROWS, unrolled twice);
    int4 rows: the fma tiles with each weight dequantized once (`elem`) and with `half` flipped;
    a split K: the fma
    tiles with the partials summed by a second launch (not `fold`)."""
    fma = _fma_config(quant, n, k, group)
    if quant == "int4":
        bk = 2 * fma.bk if k % (2 * fma.bk) == 0 else fma.bk
        alt = replace(fma, bk=bk, num_warps=8, split=_split(triton.cdiv(n, INT4_ROWS), k // bk))
    else:
        other = FMA_ROWS[1] if fma.bn == FMA_ROWS[0] else FMA_ROWS[0]
        alt = replace(fma, bn=other, split=_split(triton.cdiv(n, other), k // fma.bk), unroll=2)
    out = [gemv_config(quant, n, k, group, tokens), fma, alt]
    if quant != "int4_rows":  # the tensor-core kernel reads the store's layouts only
        out.append(_mma_config(quant, n, k, group))
    else:  # each weight dequantized once (GemvConfig.elem), and the rule's nibble reads flipped
        out += [replace(fma, elem=True, half=False), replace(fma, half=not fma.half)]
    if fma.split > 1 and quant != "int4":  # the partials summed by a second launch instead
        out.append(replace(fma, fold=False))
    return list(dict.fromkeys(out))


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
    _split_sum(part_ptr, b_ptr, out_ptr, o, o < TN, TN, N, SPLIT, HAS_BIAS)


@triton.jit
def _split_sum(part_ptr, b_ptr, out_ptr, o, m, TN, N: tl.constexpr, SPLIT: tl.constexpr,
               HAS_BIAS: tl.constexpr):  # fmt: skip
    """out[o] (flat offsets t * N + row) = the partials at o added in split order (+ bias),
    rounded once: _sum_kernel's and a folding GEMV's last program's (GemvConfig.fold) one code,
    so both give the same bits. Loads skip L1 (.cg): the folding program reads other programs'
    partials."""
    tot = tl.zeros(o.shape, tl.float32)
    for i in tl.static_range(SPLIT):
        tot += tl.load(part_ptr + i * TN + o, mask=m, other=0.0, cache_modifier=".cg")
    if HAS_BIAS:
        tot += tl.load(b_ptr + o % N, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + o, tot.to(out_ptr.dtype.element_ty), mask=m)


# ---- CUDA-core kernel (fma): T <= FMA_TOKENS, raw integers -> fp32 FMAs ---------------------------
@triton.jit
def _x_rows(x_ptr, t, koff, K: tl.constexpr):
    """Token t's inputs at offsets koff (the weight tile's shape, so its register layout: no tile
    crosses shared memory; repeats are L1 hits)."""
    return tl.load(x_ptr + t * K + koff).to(tl.float32)


@triton.jit
def _add_token(acc, p, t, T: tl.constexpr, TP: tl.constexpr):
    """acc[t] += p: one token's sums into its row of the [TP, ...] accumulator by a select (p of
    rank 2 or 3). T=1 has no token axis: a leading one would give the accumulator the layout of
    the final store and a layout conversion per K step."""
    if T == 1:
        return acc + p
    elif len(p.shape) == 2:
        return acc + tl.where(tl.arange(0, TP)[:, None, None] == t, p[None], 0.0)
    else:
        return acc + tl.where(tl.arange(0, TP)[:, None, None, None] == t, p[None], 0.0)


@triton.jit
def _acc(shape, T: tl.constexpr):
    """Zero accumulators [TP, ...] (T=1: without the token axis, see _add_token)."""
    if T == 1:
        return tl.zeros(shape[1:], tl.float32)
    else:
        return tl.zeros(shape, tl.float32)


@triton.jit
def _tokens_rows(y, T: tl.constexpr):
    """Row sums as [TP, R] (T=1 puts the token axis back)."""
    if T == 1:
        return y[None, :]
    else:
        return y


@triton.jit
def _bf16_lo(v):
    """The bf16 in the low half of int32 words (an int4 scale), exactly as fp32."""
    return (v << 16).to(tl.float32, bitcast=True)


@triton.jit
def _bf16_hi(v):
    """The bf16 in the high half (an int4 zero)."""
    return (v & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _fma_rows(x_ptr, q_ptr, s_ptr, acc, rl, k0, T: tl.constexpr, TP: tl.constexpr,
              K: tl.constexpr, QUANT: tl.constexpr, G: tl.constexpr, BN: tl.constexpr,
              BK: tl.constexpr, FAST: tl.constexpr, ELEM: tl.constexpr,
              U4HALF: tl.constexpr = False):  # fmt: skip
    """int8 / q4_0 / int4 rows, one K step of rows rl: per group sum(q x) * scale -> acc
    [TP, BN, BK/G]; ELEM (int4 rows): (s (q - 8) + z) x per element -> acc [TP, BN, BK/32, 16]."""
    if QUANT == 1:
        NG: tl.constexpr = BK // G
        kk = k0 + tl.arange(0, NG)[:, None] * G + tl.arange(0, G)[None, :]  # [NG, G]
        koff = tl.zeros([BN, 1, 1], tl.int32) + kk[None]
        w = _s8_f32(tl.load(q_ptr + rl.to(tl.int64)[:, None, None] * K + kk[None]), FAST)
        s = tl.load(s_ptr + rl[:, None] * (K // G) + k0 // G + tl.arange(0, NG)[None, :])
        for t in tl.static_range(T):
            acc = _add_token(acc, tl.sum(w * _x_rows(x_ptr, t, koff, K), 2) * s, t, T, TP)
    else:  # q4_0 / int4 rows: a row's 32 inputs are 16 bytes, element i low nibble, i + 16 high
        NB: tl.constexpr = BK // 32
        kb = k0 // 32 + tl.arange(0, NB)[:, None]  # [NB, 1]
        i = tl.arange(0, 16)[None, :]
        koff = tl.zeros([BN, 1, 1], tl.int32) + (kb * 32 + i)[None]
        b = tl.load(q_ptr + rl.to(tl.int64)[:, None, None] * (K // 2) + (kb * 16 + i)[None])
        lo, hi = _u4_f32(b, FAST, U4HALF)  # q - 8 (U4HALF, int4 rows: 0.5 + q / 256) [BN, NB, 16]
        if QUANT == 3:
            d = tl.load(s_ptr + rl[:, None] * (K // 32) + kb.reshape([1, NB])).to(tl.float32)
        else:  # (scale, zero) words [N, K/G]: s (q - 8) + z summed as s * dot + z * sum(x)
            v = tl.load(s_ptr + rl[:, None] * (K // G) + (kb * 32 // G).reshape([1, NB]))
            sc, zp = _bf16_lo(v), _bf16_hi(v)
            if U4HALF:  # sum (q - 8) x = 256 sum f x - 136 sum x: the offset into the zero term
                sc, zp = sc * 256.0, zp - sc * 136.0
        if ELEM:  # int4 rows, each weight dequantized once: one FFMA each, then one per product
            w_lo = lo * sc[:, :, None] + zp[:, :, None]
            w_hi = hi * sc[:, :, None] + zp[:, :, None]
            for t in tl.static_range(T):
                acc = _add_token(acc, w_lo * _x_rows(x_ptr, t, koff, K), t, T, TP)
                acc = _add_token(acc, w_hi * _x_rows(x_ptr, t, koff + 16, K), t, T, TP)
        else:
            for t in tl.static_range(T):
                x_lo = _x_rows(x_ptr, t, koff, K)
                x_hi = _x_rows(x_ptr, t, koff + 16, K)
                p = tl.sum(lo * x_lo + hi * x_hi, 2)
                if QUANT == 3:
                    p = p * d
                else:
                    p = p * sc + tl.sum(x_lo + x_hi, 2) * zp
                acc = _add_token(acc, p, t, T, TP)
    return acc


@triton.jit
def _fma_int4(x_ptr, q_ptr, sz_ptr, acc_lo, acc_hi, n0, k0, T: tl.constexpr, TP: tl.constexpr,
              N: tl.constexpr, K: tl.constexpr, G: tl.constexpr, BK: tl.constexpr,
              HALF: tl.constexpr, FAST: tl.constexpr):  # fmt: skip
    """int4, one K step of the packed block at row n0 ([K, HALF] bytes): the weights dequantized
    (s (q - 8) + z) times the tokens, kept per element ([TP, NG, G, 32] each half: one reduction
    at the end, no per-step shuffles)."""
    NG: tl.constexpr = BK // G
    kk = k0 + tl.arange(0, NG)[:, None, None] * G + tl.arange(0, G)[None, :, None]  # [NG, G, 1]
    d = tl.arange(0, 32)[None, None, :]
    blk = q_ptr + n0.to(tl.int64) * (K // 2)  # 64-bit offsets
    sp = sz_ptr + (k0 // G + tl.arange(0, NG)[:, None, None]) * N + n0 + d  # [NG, 1, 32]
    if HALF == 32:
        b = tl.load(blk + kk * 32 + d)
        v_lo = tl.load(sp)  # (scale, zero) bf16 pairs as one int32 word
        v_hi = tl.load(sp + 32)
    else:  # the short last block: [K, HALF] bytes
        b = tl.load(blk + kk * HALF + d, mask=d < HALF, other=0)
        v_lo = tl.load(sp, mask=d < HALF, other=0)
        v_hi = tl.load(sp + HALF, mask=d < HALF, other=0)
    lo, hi = _u4_f32(b, FAST)
    w_lo = lo * _bf16_lo(v_lo) + _bf16_hi(v_lo)
    w_hi = hi * _bf16_lo(v_hi) + _bf16_hi(v_hi)
    for t in tl.static_range(T):
        xv = _x_rows(x_ptr, t, kk, K)  # [NG, G, 1]: contiguous along G, not the rows' axis
        acc_lo = _add_token(acc_lo, w_lo * xv, t, T, TP)
        acc_hi = _add_token(acc_hi, w_hi * xv, t, T, TP)
    return acc_lo, acc_hi


@triton.jit
def _fma_store(y, r, rmask, b_ptr, out_ptr, part_ptr, sk, T: tl.constexpr, TP: tl.constexpr,
               N: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr):  # fmt: skip
    """Row sums y [TP, R] of rows r: + bias, rounded into out[t, r] (SPLIT 1), else fp32 partials
    part[sk, t, r]; rows t >= T are not stored."""
    t = tl.arange(0, TP)[:, None]
    m = (t < T) & rmask[None, :]
    if SPLIT == 1:
        if HAS_BIAS:
            y += tl.load(b_ptr + r, mask=rmask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + t * N + r[None, :], y.to(out_ptr.dtype.element_ty), mask=m)
    else:
        tl.store(part_ptr + (sk * T + t) * N + r[None, :], y, mask=m)


@triton.jit
def _gemv_fma_kernel(x_ptr, q_ptr, s_ptr, b_ptr, out_ptr, part_ptr, T: tl.constexpr,
                     TP: tl.constexpr, N: tl.constexpr, K: tl.constexpr, ROW0: tl.constexpr,
                     QUANT: tl.constexpr, G: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     SPLIT: tl.constexpr, HALF: tl.constexpr, HAS_BIAS: tl.constexpr,
                     FAST: tl.constexpr, UNROLL: tl.constexpr, ELEM: tl.constexpr,
                     cnt_ptr, FOLD: tl.constexpr, U4HALF: tl.constexpr = False):  # fmt: skip
    """Program (row block, split sk): rows ROW0 + program_id(0) * BN ... (int4: one packed block)
    over K / SPLIT inputs, the K loop unrolled UNROLL times (the loads of those steps issue
    ahead; a fully unrolled int4 loop spills). FOLD: the row block's last split program (an
    int32 counter a block, reset by it) adds the partials into out."""
    n0 = ROW0 + tl.program_id(0) * BN
    sk = tl.program_id(1)
    KC: tl.constexpr = K // SPLIT
    if QUANT == 2:
        acc_lo = _acc([TP, BK // G, G, 32], T)
        acc_hi = _acc([TP, BK // G, G, 32], T)
        for kb in tl.range(0, KC, BK, loop_unroll_factor=UNROLL):
            acc_lo, acc_hi = _fma_int4(x_ptr, q_ptr, s_ptr, acc_lo, acc_hi, n0, sk * KC + kb, T,
                                       TP, N, K, G, BK, HALF, FAST)  # fmt: skip
        d = tl.arange(0, 32)
        dm = d < HALF
        y_lo = _tokens_rows(tl.sum(tl.sum(acc_lo, -2), -2), T)
        y_hi = _tokens_rows(tl.sum(tl.sum(acc_hi, -2), -2), T)
        _fma_store(y_lo, n0 + d, dm, b_ptr, out_ptr, part_ptr, sk, T, TP, N, SPLIT, HAS_BIAS)
        _fma_store(y_hi, n0 + HALF + d, dm, b_ptr, out_ptr, part_ptr, sk, T, TP, N, SPLIT,
                   HAS_BIAS)  # fmt: skip
    else:
        r = n0 + tl.arange(0, BN)
        rl = tl.minimum(r, N - 1)  # rows past N load row N - 1 (unmasked, vector loads; unstored)
        NG: tl.constexpr = BK // G if QUANT == 1 else BK // 32
        if ELEM:
            acc = _acc([TP, BN, NG, 16], T)
        else:
            acc = _acc([TP, BN, NG], T)
        for kb in tl.range(0, KC, BK, loop_unroll_factor=UNROLL):
            acc = _fma_rows(x_ptr, q_ptr, s_ptr, acc, rl, sk * KC + kb, T, TP, K, QUANT, G, BN,
                            BK, FAST, ELEM, U4HALF)  # fmt: skip
        if ELEM:
            y = tl.sum(tl.sum(acc, -1), -1)
        else:
            y = tl.sum(acc, -1)
        _fma_store(_tokens_rows(y, T), r, r < N, b_ptr, out_ptr, part_ptr, sk, T, TP, N, SPLIT,
                   HAS_BIAS)  # fmt: skip
        if FOLD:
            tl.debug_barrier()  # every thread's partials are stored before the release below
            nb = tl.program_id(0)
            if tl.atomic_add(cnt_ptr + nb, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
                t = tl.arange(0, TP)[:, None]
                _split_sum(part_ptr, b_ptr, out_ptr, t * N + r[None, :],
                           (t < T) & (r < N)[None, :], T * N, N, SPLIT, HAS_BIAS)  # fmt: skip
                tl.atomic_xchg(cnt_ptr + nb, 0, sem="relaxed", scope="gpu")  # the next call's


# ---- K-quants: the MoE decode kernels' super-block steps, one matrix ---------------------------
@triton.jit
def _kquant_gemv_kernel(x_ptr, q_ptr, b_ptr, out_ptr, N: tl.constexpr, K: tl.constexpr,
                        QUANT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        HAS_BIAS: tl.constexpr, FAST: tl.constexpr,
                        HALF: tl.constexpr):  # fmt: skip
    """Program (row block nb, token t): out[t, rows] = x[t] . W[rows] (+ bias) for a GGUF's
    K-quant blocks [N, K/256, B] as stored, through decode.py's _load_w / _step of one expert:
    fp32 sums of each 32-block's (d sc) dot + (off d sc - dmin m) sum(x) (q6_k: per 16), one
    rounding to the output dtype."""
    n0 = tl.program_id(0) * BN
    t = tl.program_id(1)
    xrow = x_ptr + t * K
    koff = dk._k_offsets(QUANT, 256, BN, BK)
    acc, _ = dk._acc_zeros(QUANT, 256, BN, BK, True)
    for k0 in tl.range(0, K, BK):
        w = dk._load_w(q_ptr, 0, n0, k0, N, K, QUANT, 256, BN, BK)
        xv = tl.load(xrow + k0 + koff).to(tl.float32)
        xh = dk._hi_inputs(xrow + k0 + koff, xv, QUANT)
        a, _ = dk._step(w, q_ptr, 0, n0, k0, xv, xh, N, K, QUANT, 256, BN, BK, True, FAST, HALF)
        acc += a
    y = tl.sum(acc, 1)
    r = n0 + tl.arange(0, BN)
    if HAS_BIAS:
        y += tl.load(b_ptr + r).to(tl.float32)
    tl.store(out_ptr + t * N + r, y.to(out_ptr.dtype.element_ty))


def _kquant_gemv(x: torch.Tensor, q: torch.Tensor, bias: torch.Tensor | None, quant: str,
                 n: int) -> torch.Tensor:  # fmt: skip
    """x [T, K] -> [T, n] from K-quant blocks q [n, K/256, B]. Tiles by an untuned rule: the MoE
    decode's rows (4, fewer where n asks) and K steps (512, else 256); q4_k's nibbles as the
    H200's MoE tiles read them (half)."""
    T, K = x.shape
    assert q.shape == (n, K // 256, KQUANT_BYTES[quant]) and q.is_contiguous(), q.shape
    bn = 4
    while n % bn:
        bn //= 2
    bk = 512 if K % 512 == 0 else 256
    gpu = x.device.type == "cuda"
    out = torch.empty(T, n, device=x.device, dtype=x.dtype)
    _kquant_gemv_kernel[(n // bn, T)](
        x.contiguous(), q, out if bias is None else bias, out, N=n, K=K,
        QUANT=dk.QUANT_CODE[quant], BN=bn, BK=bk, HAS_BIAS=bias is not None, FAST=gpu,
        HALF=gpu and quant in dk.HALF_QUANTS, num_warps=2,
    )  # fmt: skip
    return out


# ---- host side ----------------------------------------------------------------------------------
_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def gemv_impl(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, bias: torch.Tensor | None,
              quant: str, n: int, group: int, cfg: GemvConfig | None = None) -> torch.Tensor:  # fmt: skip
    """x [T, K] (T <= MAX_TOKENS) -> [T, n] in x's dtype, from the sections q and s (int8 `s`,
    int4 `sz`, q4_0 `d`) of an [n, K] weight; bias [n] or None. cfg: tiles other than
    gemv_config's (the benchmark's sweep, tests)."""
    T, K = x.shape
    why = unsupported(quant, n, K, group, T)
    assert why is None, why
    assert x.dtype in DTYPES, f"activations in {x.dtype}: the GEMV takes bf16, fp16 or fp32"
    if quant in GEMV_KQUANTS:  # (no tiles to sweep yet: its own launcher)
        assert cfg is None, "the K-quant GEMV takes no GemvConfig"
        return _kquant_gemv(x, q, bias, quant, n)
    cfg = cfg or gemv_config(quant, n, K, group, T)
    assert not cfg.elem or (cfg.fma and quant == "int4_rows"), "elem: the int4-rows fma kernel"
    assert not cfg.half or (cfg.fma and quant == "int4_rows" and not cfg.elem), (
        "half: the int4-rows fma kernel's per-group sums"
    )
    fold = cfg.fold
    assert not fold or (cfg.fma and quant != "int4" and cfg.split > 1), "fold: a split fma GEMV"
    x = x.contiguous()
    out = torch.empty(T, n, device=x.device, dtype=x.dtype)
    part = out if cfg.split == 1 else torch.empty(cfg.split, T, n, device=x.device)
    if quant == "int4":
        s = s.view(torch.int32)  # (scale, zero) bf16 pairs as one word: [K/G, N, 1]
    gpu, bf16 = x.device.type == "cuda", x.dtype == torch.bfloat16
    G = 32 if quant == "q4_0" else group
    kw = dict(N=n, K=K, QUANT=QUANT_CODE[quant], G=G, BN=cfg.bn, SPLIT=cfg.split,
              HAS_BIAS=bias is not None, num_warps=cfg.num_warps)  # fmt: skip
    if cfg.fma:
        kernel = _gemv_fma_kernel
        cnt = out  # fold: a counter a row block, zero between calls
        if fold:
            blocks = triton.cdiv(n, cfg.bn)
            cnt = kept(("gemv fold", str(x.device), blocks),
                       lambda: torch.zeros(blocks, dtype=torch.int32, device=x.device))  # fmt: skip
        kw |= dict(T=T, TP=triton.next_power_of_2(T), BK=cfg.bk, FAST=gpu, UNROLL=cfg.unroll,
                   ELEM=cfg.elem, FOLD=fold, cnt_ptr=cnt, U4HALF=cfg.half)  # fmt: skip
    else:
        kernel = _gemv_kernel
        kw |= dict(
            T=T, GPS=cfg.gps, DT=_TL[x.dtype], PREC="ieee" if x.dtype == torch.float32 else "tf32",
            FAST=gpu and (bf16 or quant == "int8"),  # PTX conversions (interpreter: plain casts)
            STAGES=cfg.stages,
        )  # fmt: skip
    b = out if bias is None else bias
    full = n - n % INT4_ROWS if quant == "int4" else n
    if full:
        grid = (triton.cdiv(full, cfg.bn), cfg.split)
        kernel[grid](x, q, s, b, out, part, ROW0=0, HALF=32, **kw)
    if full < n:  # int4's shorter last block: [K, (n - full) / 2] bytes
        kernel[(1, cfg.split)](x, q, s, b, out, part, ROW0=full, HALF=(n - full) // 2, **kw)
    if cfg.split > 1 and not fold:
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
