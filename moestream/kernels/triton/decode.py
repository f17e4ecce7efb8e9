"""Decode-path Triton kernels (1-8 tokens): one program per (token, slot) pair and row block, so
only the routed experts' bytes are read and no host-side grouping runs on the hot path.

Two launches after one memset:
  _gate_up_kernel  gu[p] = x[t] @ w13[e].T (gate and up rows of the same block, one pass over the
                   shared token input); split along D into SPLIT programs (fp32 atomics) when the
                   row blocks alone would not fill the GPU.
  _down_kernel     out[t] += weights[t, k] * (silu(g) * u)[p] @ w2[e].T; each slot has its own
                   activation (down is per slot, seed 001); slots meet in an fp32 atomic add.
Everything accumulates in fp32; tiles are [KG groups, G, HALF rows] so a group's scale multiplies a
32-wide partial sum, not each weight. int4 uses the store layout: a block of 64 rows is
[K, 32] bytes (row d low nibble, row d + 32 high nibble), so HALF is 32 and w = (q - 8) s + z
becomes s * sum(q x) + (z - 8 s) * sum(x) per group.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

QUANT_CODE = {"bf16": 0, "int8": 1, "int4": 2}
INT4_ROWS = 64  # rows per packed int4 block (quant.INT4_BLOCK_N)


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    half: int = 8  # rows per half block (block = 2 * half rows); int4 forces 32
    kg: int = 4  # groups of G inputs per K step (BK = kg * G)
    split: int = 1  # programs along D for gate/up
    num_warps: int = 4
    elem: bool = False  # accumulate [KG, G, HALF] products, reduce once after the K loop

    def __post_init__(self):
        for name in ("half", "kg", "split"):
            v = getattr(self, name)
            assert v > 0 and v & (v - 1) == 0, f"{name} must be a power of two, got {v}"


DEFAULT_CONFIGS = {
    # Best of the first H200 sweep at T=1 (half 8 / kg 8 / split 2 beat 8/4/1 by 1.4x).
    "bf16": DecodeConfig(half=8, kg=8, split=2, num_warps=4),
    "int8": DecodeConfig(half=8, kg=8, split=2, num_warps=4),
    # H200 (benchmarks/results/gpu_moe.jsonl): reducing every K step left int4 compute-bound
    # (0.06 of roofline); elementwise accumulation with kg 4 / split 4 was best of the second sweep.
    "int4": DecodeConfig(half=32, kg=4, split=4, num_warps=4, elem=True),
}


@triton.jit
def _tile_dot(
    q_ptr,
    s_ptr,
    e,
    n0,
    n_end,
    k0,
    x3,
    xs,
    N: tl.constexpr,
    K: tl.constexpr,
    QUANT: tl.constexpr,
    G: tl.constexpr,
    KG: tl.constexpr,
    HALF: tl.constexpr,
):
    """Rows [n0, n0 + HALF) and [n0 + HALF, n0 + 2 HALF) of expert e's [N, K] weight times the
    input tile x3 [KG, G, 1] (xs [KG, 1] its group sums) -> two fp32 [HALF] partial sums."""
    gi = tl.arange(0, KG)[:, None, None]
    kk = k0 + gi * G + tl.arange(0, G)[None, :, None]  # [KG, G, 1]
    di = tl.arange(0, HALF)
    kg = k0 // G + tl.arange(0, KG)[:, None]  # [KG, 1]
    if QUANT == 2:
        base = q_ptr + e * (N * (K // 2)) + (n0 // 64) * (K * 32)
        b = tl.load(base + kk * 32 + di[None, None, :]).to(tl.int32)  # [KG, G, 32]
        lo = tl.sum((b & 15).to(tl.float32) * x3, 1)  # [KG, 32]
        hi = tl.sum((b >> 4).to(tl.float32) * x3, 1)
        sp = s_ptr + e * ((K // G) * N * 2) + (kg * N + n0 + di[None, :]) * 2  # [KG, 32]
        s_lo = tl.load(sp).to(tl.float32)
        z_lo = tl.load(sp + 1).to(tl.float32)
        s_hi = tl.load(sp + 64).to(tl.float32)
        z_hi = tl.load(sp + 65).to(tl.float32)
        acc_lo = tl.sum(s_lo * lo + (z_lo - 8.0 * s_lo) * xs, 0)
        acc_hi = tl.sum(s_hi * hi + (z_hi - 8.0 * s_hi) * xs, 0)
    else:
        r_lo = n0 + di[None, None, :]  # [1, 1, HALF]
        r_hi = r_lo + HALF
        m_lo = r_lo < n_end
        m_hi = r_hi < n_end
        w = q_ptr + e * (N * K) + kk
        p_lo = tl.sum(tl.load(w + r_lo * K, mask=m_lo, other=0.0).to(tl.float32) * x3, 1)
        p_hi = tl.sum(tl.load(w + r_hi * K, mask=m_hi, other=0.0).to(tl.float32) * x3, 1)
        if QUANT == 1:
            sp = s_ptr + e * (N * (K // G)) + kg
            r2 = n0 + di[None, :]  # [1, HALF]
            p_lo = p_lo * tl.load(sp + r2 * (K // G), mask=r2 < n_end, other=0.0)
            p_hi = p_hi * tl.load(sp + (r2 + HALF) * (K // G), mask=r2 + HALF < n_end, other=0.0)
        acc_lo = tl.sum(p_lo, 0)
        acc_hi = tl.sum(p_hi, 0)
    return acc_lo, acc_hi


@triton.jit
def _tile_prod(
    q_ptr,
    s_ptr,
    e,
    n0,
    n_end,
    k0,
    x3,
    N: tl.constexpr,
    K: tl.constexpr,
    QUANT: tl.constexpr,
    G: tl.constexpr,
    KG: tl.constexpr,
    HALF: tl.constexpr,
):
    """As _tile_dot, but the dequantized weights times x3, unreduced: two [KG, G, HALF]."""
    gi = tl.arange(0, KG)[:, None, None]
    kk = k0 + gi * G + tl.arange(0, G)[None, :, None]  # [KG, G, 1]
    d3 = tl.arange(0, HALF)[None, None, :]
    kg3 = k0 // G + gi  # [KG, 1, 1]
    if QUANT == 2:
        base = q_ptr + e * (N * (K // 2)) + (n0 // 64) * (K * 32)
        b = tl.load(base + kk * 32 + d3).to(tl.int32)  # [KG, G, 32]
        sp = s_ptr + e * ((K // G) * N * 2) + (kg3 * N + n0 + d3) * 2  # [KG, 1, 32]
        s_lo = tl.load(sp).to(tl.float32)
        s_hi = tl.load(sp + 64).to(tl.float32)
        z_lo = tl.load(sp + 1).to(tl.float32) - 8.0 * s_lo
        z_hi = tl.load(sp + 65).to(tl.float32) - 8.0 * s_hi
        w_lo = (b & 15).to(tl.float32) * s_lo + z_lo
        w_hi = (b >> 4).to(tl.float32) * s_hi + z_hi
    else:
        r_lo = n0 + d3
        r_hi = r_lo + HALF
        w = q_ptr + e * (N * K) + kk
        w_lo = tl.load(w + r_lo * K, mask=r_lo < n_end, other=0.0).to(tl.float32)
        w_hi = tl.load(w + r_hi * K, mask=r_hi < n_end, other=0.0).to(tl.float32)
        if QUANT == 1:
            sp = s_ptr + e * (N * (K // G)) + kg3  # [KG, 1, 1]
            w_lo = w_lo * tl.load(sp + r_lo * (K // G), mask=r_lo < n_end, other=0.0)
            w_hi = w_hi * tl.load(sp + r_hi * (K // G), mask=r_hi < n_end, other=0.0)
    return w_lo * x3, w_hi * x3


@triton.jit
def _gate_up_kernel(
    x_ptr,
    ids_ptr,
    q_ptr,
    s_ptr,
    gu_ptr,
    TOPK,
    D: tl.constexpr,
    I: tl.constexpr,
    K_LEN: tl.constexpr,
    QUANT: tl.constexpr,
    G: tl.constexpr,
    KG: tl.constexpr,
    HALF: tl.constexpr,
    SPLIT: tl.constexpr,
    ELEM: tl.constexpr,
):
    p = tl.program_id(0)
    n0 = tl.program_id(1) * (2 * HALF)
    sk = tl.program_id(2)
    t = p // TOPK
    e = tl.load(ids_ptr + p).to(tl.int64)
    N: tl.constexpr = 2 * I
    if ELEM:
        g_lo = tl.zeros([KG, G, HALF], tl.float32)
        g_hi = tl.zeros([KG, G, HALF], tl.float32)
        u_lo = tl.zeros([KG, G, HALF], tl.float32)
        u_hi = tl.zeros([KG, G, HALF], tl.float32)
    else:
        g_lo = tl.zeros([HALF], tl.float32)
        g_hi = tl.zeros([HALF], tl.float32)
        u_lo = tl.zeros([HALF], tl.float32)
        u_hi = tl.zeros([HALF], tl.float32)
    kx = tl.arange(0, KG)[:, None, None] * G + tl.arange(0, G)[None, :, None]  # [KG, G, 1]
    for kb in range(0, K_LEN, KG * G):  # K_LEN = D // SPLIT
        k0 = sk * K_LEN + kb
        x3 = tl.load(x_ptr + t * D + k0 + kx).to(tl.float32)
        if ELEM:
            a, b = _tile_prod(q_ptr, s_ptr, e, n0, I, k0, x3, N, D, QUANT, G, KG, HALF)
            c, d = _tile_prod(q_ptr, s_ptr, e, n0 + I, N, k0, x3, N, D, QUANT, G, KG, HALF)
        else:
            xs = tl.sum(x3, 1)
            a, b = _tile_dot(q_ptr, s_ptr, e, n0, I, k0, x3, xs, N, D, QUANT, G, KG, HALF)
            c, d = _tile_dot(q_ptr, s_ptr, e, n0 + I, N, k0, x3, xs, N, D, QUANT, G, KG, HALF)
        g_lo += a
        g_hi += b
        u_lo += c
        u_hi += d
    if ELEM:
        g_lo = tl.sum(tl.sum(g_lo, 1), 0)
        g_hi = tl.sum(tl.sum(g_hi, 1), 0)
        u_lo = tl.sum(tl.sum(u_lo, 1), 0)
        u_hi = tl.sum(tl.sum(u_hi, 1), 0)
    di = tl.arange(0, HALF)
    out = gu_ptr + p * N + n0 + di
    m_lo = n0 + di < I
    m_hi = n0 + HALF + di < I
    if SPLIT == 1:
        tl.store(out, g_lo, mask=m_lo)
        tl.store(out + HALF, g_hi, mask=m_hi)
        tl.store(out + I, u_lo, mask=m_lo)
        tl.store(out + I + HALF, u_hi, mask=m_hi)
    else:
        tl.atomic_add(out, g_lo, mask=m_lo, sem="relaxed")
        tl.atomic_add(out + HALF, g_hi, mask=m_hi, sem="relaxed")
        tl.atomic_add(out + I, u_lo, mask=m_lo, sem="relaxed")
        tl.atomic_add(out + I + HALF, u_hi, mask=m_hi, sem="relaxed")


@triton.jit
def _down_kernel(
    gu_ptr,
    ids_ptr,
    rw_ptr,
    q_ptr,
    s_ptr,
    out_ptr,
    TOPK,
    D: tl.constexpr,
    I: tl.constexpr,
    QUANT: tl.constexpr,
    G: tl.constexpr,
    KG: tl.constexpr,
    HALF: tl.constexpr,
    ELEM: tl.constexpr,
):
    p = tl.program_id(0)
    n0 = tl.program_id(1) * (2 * HALF)
    t = p // TOPK
    e = tl.load(ids_ptr + p).to(tl.int64)
    rw = tl.load(rw_ptr + p).to(tl.float32)
    if ELEM:
        acc_lo = tl.zeros([KG, G, HALF], tl.float32)
        acc_hi = tl.zeros([KG, G, HALF], tl.float32)
    else:
        acc_lo = tl.zeros([HALF], tl.float32)
        acc_hi = tl.zeros([HALF], tl.float32)
    kx = tl.arange(0, KG)[:, None, None] * G + tl.arange(0, G)[None, :, None]
    row = gu_ptr + p * (2 * I)
    for k0 in range(0, I, KG * G):
        g = tl.load(row + k0 + kx)
        u = tl.load(row + I + k0 + kx)
        h = g / (1.0 + tl.exp(-g)) * u  # silu(gate) * up, [KG, G, 1]
        if ELEM:
            a, b = _tile_prod(q_ptr, s_ptr, e, n0, D, k0, h, D, I, QUANT, G, KG, HALF)
        else:
            a, b = _tile_dot(q_ptr, s_ptr, e, n0, D, k0, h, tl.sum(h, 1), D, I, QUANT, G, KG, HALF)
        acc_lo += a
        acc_hi += b
    if ELEM:
        acc_lo = tl.sum(tl.sum(acc_lo, 1), 0)
        acc_hi = tl.sum(tl.sum(acc_hi, 1), 0)
    di = tl.arange(0, HALF)
    out = out_ptr + t * D + n0 + di
    tl.atomic_add(out, acc_lo * rw, mask=n0 + di < D, sem="relaxed")
    tl.atomic_add(out + HALF, acc_hi * rw, mask=n0 + HALF + di < D, sem="relaxed")


def check_shapes(quant: str, hidden: int, inter: int, group: int, cfg: DecodeConfig) -> str | None:
    """None when the kernels take these shapes, else why not (the dispatcher falls back)."""
    bk = cfg.kg * group
    if hidden % (bk * cfg.split) or inter % bk:
        return f"D={hidden} (split {cfg.split}) and I={inter} must be multiples of BK={bk}"
    if quant == "int4" and (inter % INT4_ROWS or hidden % INT4_ROWS or cfg.half != 32):
        return f"int4 needs D and I multiples of {INT4_ROWS} and half=32"
    return None


def fit_config(quant: str, hidden: int, inter: int, group: int, cfg: DecodeConfig):
    """Halve split, then kg, until the shapes fit (small models); None when nothing does."""
    while check_shapes(quant, hidden, inter, group, cfg) and cfg.split > 1:
        cfg = replace(cfg, split=cfg.split // 2)
    while check_shapes(quant, hidden, inter, group, cfg) and cfg.kg > 1:
        cfg = replace(cfg, kg=cfg.kg // 2)
    return None if check_shapes(quant, hidden, inter, group, cfg) else cfg


def moe_decode(x, ids, weights, experts, cfg: DecodeConfig | None = None, out=None) -> torch.Tensor:
    """x [T, D], ids [T, K], weights [T, K] (device tensors) -> [T, D] in x's dtype (into `out`
    when given)."""
    quant = experts.scheme.name
    T, D = x.shape
    K = ids.shape[1]
    P, I, G = T * K, experts.inter, experts.scheme.group_size
    cfg = cfg or fit_config(quant, D, I, G, DEFAULT_CONFIGS[quant]) or DEFAULT_CONFIGS[quant]
    why = check_shapes(quant, D, I, G, cfg)
    assert why is None, why
    sec = experts.sections
    scale = {"bf16": "q", "int8": "s", "int4": "sz"}[quant]
    ws = torch.zeros(P * 2 * I + T * D, device=x.device, dtype=torch.float32)
    gu, acc = ws[: P * 2 * I], ws[P * 2 * I :].view(T, D)
    x, ids, weights = x.contiguous(), ids.contiguous(), weights.contiguous()
    meta = dict(QUANT=QUANT_CODE[quant], G=G, KG=cfg.kg, HALF=cfg.half, ELEM=cfg.elem)
    meta["num_warps"] = cfg.num_warps
    w13q, w13s = sec["w13.q"], sec[f"w13.{scale}"]
    grid = (P, triton.cdiv(I, 2 * cfg.half), cfg.split)
    _gate_up_kernel[grid](x, ids, w13q, w13s, gu, K, D, I, D // cfg.split, SPLIT=cfg.split, **meta)
    w2q, w2s = sec["w2.q"], sec[f"w2.{scale}"]
    grid = (P, triton.cdiv(D, 2 * cfg.half))
    _down_kernel[grid](gu, ids, weights, w2q, w2s, acc, K, D, I, **meta)
    if out is not None:
        return out.copy_(acc)
    return acc if x.dtype == torch.float32 else acc.to(x.dtype)
