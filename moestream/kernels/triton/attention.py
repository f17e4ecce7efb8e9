"""One decode token's attention core in one Triton launch (`decode_attend`): the q/k head norm,
RoPE, the KV cache write and GQA attention over the valid positions only.

The torch code (`models/layers.Attention.forward`: `_head_norm`, `apply_rope`, `cache.update`,
`gqa_attention`) is the reference. A captured step ran it as ~8 kernels per layer (a norm + RoPE
kernel, two cache writes, two cuBLAS GEMMs and the mask/softmax kernels), its GEMMs over the whole
KV bucket with later positions masked. Here one program per query head:
- normalises and rotates its q head and its group's new k head, rounding where the torch code
  rounds (norm in fp32, cast, times the weight, cast; x*cos and roll(x)*sin cast, then added);
- the first head of each group writes the new k and v rows at `pos`;
- scores of positions [lo, pos) from the cache, the new key from registers (no program reads
  the row being written), each rounded like bmm's output and its scaling;
- softmax in fp32 with the probabilities rounded to the cache dtype before they weight V (as
  `softmax_fp32` then bmm): the first FIRST positions are loaded up front, before q is known,
  and held in registers, so a context that short takes one round trip to memory; positions past
  them take two loops (max and sum, then probabilities times V).
Sums run in another order than cuBLAS's, so outputs differ from the torch code's in the last bits.
The position is an int (eager) or a device tensor [1] (a captured step: the loop bounds are read
on the device, so the step reads only the valid length whatever the bucket).

A cache of SPLIT_CAP positions or more (a long context's bucket) is split over the positions
instead (flash-decoding), since one program per head walks its positions serially: heads x
chunks programs each take `split_chunk(capacity)` positions in three launches. The first gives each
chunk's max and sum of exponentials (and writes the new row), the second combines them into the
head's max and sum, rounds its chunk's probabilities with them as above and weighs V, and the
third adds the chunks' fp32 partials. The probabilities are the same numbers; only fp32 sums run
in another order. A captured step's bucket fixes the launch count. Each step of the loops is a
round trip to memory, so a chunk is one step while the programs fit the GPU (`split_chunk`).
Measured on the H200 (bench_gpu_attention.py, Qwen3-30B-A3B's heads, results/gpu_attention.jsonl,
5d6e30c): the one launch takes 15 / 32 / 69 / 140 us at 256 / 512 / 1024 / 2048 positions, the
split of 64-position chunks 15 / 16 / 18 / 23 us, hence SPLIT_CAP = 512.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FIRST = 128  # cache positions loaded up front (a context this long takes one round trip)
BLOCK_S = 64  # cache positions per step of the loops over longer contexts
SPLIT_CAP = 512  # caches this long are split over the positions (three launches, not one)
CHUNK = 64  # positions per program of the split, at least: one BLOCK_S step (see below)
MAX_CHUNKS = 32  # chunks per head, at most: longer caches take longer chunks
SUM_BLOCK = 16  # chunk partials per load of the split's last launch
_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _round(x, DT: tl.constexpr):
    """x rounded to the activation dtype, back in fp32 (the torch code's casts)."""
    return x.to(DT).to(tl.float32)


@triton.jit
def _norm_rope(x_ptr, w_ptr, cos_ptr, sin_ptr, eps, HD: tl.constexpr, HAS_NORM: tl.constexpr,
               DT: tl.constexpr):  # fmt: skip
    """One head [HD]: w * rms_norm(x) then x*cos + roll(x, HD/2)*sin (sin signed: layers.Rope)."""
    d = tl.arange(0, HD)
    dr = (d + HD // 2) % HD  # roll by HD/2: out[i] = x[(i + HD/2) mod HD]
    x = tl.load(x_ptr + d).to(tl.float32)
    xr = tl.load(x_ptr + dr).to(tl.float32)
    if HAS_NORM:
        inv = tl.rsqrt(tl.sum(x * x, 0) / HD + eps)
        x = _round(tl.load(w_ptr + d).to(tl.float32) * _round(x * inv, DT), DT)
        xr = _round(tl.load(w_ptr + dr).to(tl.float32) * _round(xr * inv, DT), DT)
    c = tl.load(cos_ptr + d).to(tl.float32)
    s = tl.load(sin_ptr + d).to(tl.float32)
    return _round(_round(x * c, DT) + _round(xr * s, DT), DT)


@triton.jit
def _scores(k_row_ptr, q, idx, ok, scaling, HD: tl.constexpr, DT: tl.constexpr):
    """Scores [BLOCK] of cache rows idx against q, rounded as bmm's output times the scaling;
    -inf where not ok."""
    d = tl.arange(0, HD)
    k = tl.load(k_row_ptr + idx[:, None] * HD + d[None, :], mask=ok[:, None], other=0.0)
    s = _round(_round(tl.sum(k.to(tl.float32) * q[None, :], 1), DT) * scaling, DT)
    return tl.where(ok, s, float("-inf"))


@triton.jit
def _position(pos_ptr, pos_arg, window, POS_PTR: tl.constexpr):
    """The new token's position (a device tensor in a captured step, else the argument) and the
    first position it attends to (past a sliding window's, none are)."""
    if POS_PTR:
        pos = tl.load(pos_ptr).to(tl.int32)
    else:
        pos = pos_arg
    return pos, tl.where(window > 0, tl.maximum(pos - window + 1, 0), 0)


@triton.jit
def _decode_attend_kernel(qkv_ptr, w_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, pos_ptr, out_ptr,
                          pos_arg, window, cap, eps, scaling, H: tl.constexpr, HKV: tl.constexpr,
                          HD: tl.constexpr, FIRST: tl.constexpr, BS: tl.constexpr,
                          HAS_NORM: tl.constexpr, POS_PTR: tl.constexpr,
                          DT: tl.constexpr):  # fmt: skip
    h = tl.program_id(0)
    kvh = h // (H // HKV)
    d = tl.arange(0, HD)
    pos, lo = _position(pos_ptr, pos_arg, window, POS_PTR)
    k_rows = k_ptr + kvh.to(tl.int64) * cap * HD
    v_rows = v_ptr + kvh.to(tl.int64) * cap * HD
    # The first FIRST cached keys and values, loaded before q is known (a short context is done
    # in one round trip); longer ones take the loops below, BS positions a step.
    i0 = lo + tl.arange(0, FIRST)
    ok0 = i0 < pos
    k0 = tl.load(k_rows + i0[:, None] * HD + d[None, :], mask=ok0[:, None], other=0.0)
    v0 = tl.load(v_rows + i0[:, None] * HD + d[None, :], mask=ok0[:, None], other=0.0)
    q = _norm_rope(qkv_ptr + h * HD, w_ptr + h * HD, cos_ptr, sin_ptr, eps, HD, HAS_NORM, DT)
    kn = _norm_rope(qkv_ptr + (H + kvh) * HD, w_ptr + (H + kvh) * HD, cos_ptr, sin_ptr, eps, HD,
                    HAS_NORM, DT)  # fmt: skip
    vn = tl.load(qkv_ptr + (H + HKV + kvh) * HD + d).to(tl.float32)
    if h % (H // HKV) == 0:  # one writer per group; nobody reads row pos from memory
        tl.store(k_rows + pos * HD + d, kn.to(DT))
        tl.store(v_rows + pos * HD + d, vn.to(DT))
    s_new = _round(_round(tl.sum(kn * q, 0), DT) * scaling, DT)
    s0 = _round(_round(tl.sum(k0.to(tl.float32) * q[None, :], 1), DT) * scaling, DT)
    s0 = tl.where(ok0, s0, float("-inf"))
    m = tl.maximum(s_new, tl.max(s0, 0))
    total = tl.exp(s_new - m) + tl.sum(tl.exp(s0 - m), 0)  # sum of exp(s - m)
    j = tl.arange(0, BS)
    for b in range(lo + FIRST, pos, BS):  # pass 1 over later keys: max and sum
        idx = b + j
        s = _scores(k_rows, q, idx, idx < pos, scaling, HD, DT)
        m_next = tl.maximum(m, tl.max(s, 0))
        total = total * tl.exp(m - m_next) + tl.sum(tl.exp(s - m_next), 0)
        m = m_next
    # probabilities rounded to the activation dtype, then times V (softmax_fp32, then bmm)
    acc = _round(tl.exp(s_new - m) / total, DT) * vn
    p0 = _round(tl.exp(s0 - m) / total, DT)
    acc += tl.sum(p0[:, None] * v0.to(tl.float32), 0)
    for b in range(lo + FIRST, pos, BS):  # pass 2 over later keys
        idx = b + j
        ok = idx < pos
        p = _round(tl.exp(_scores(k_rows, q, idx, ok, scaling, HD, DT) - m) / total, DT)
        v = tl.load(v_rows + idx[:, None] * HD + d[None, :], mask=ok[:, None], other=0.0)
        acc += tl.sum(p[:, None] * v.to(tl.float32), 0)
    tl.store(out_ptr + h * HD + d, acc.to(DT))


@triton.jit
def _chunk_setup(qkv_ptr, w_ptr, cos_ptr, sin_ptr, pos_ptr, pos_arg, window, eps, scaling, CH,
                 H: tl.constexpr, HKV: tl.constexpr, HD: tl.constexpr, HAS_NORM: tl.constexpr,
                 POS_PTR: tl.constexpr, DT: tl.constexpr):  # fmt: skip
    """A split program's head, its chunk [start, stop) of the valid positions, its q, and the
    new key's k, v and score (the split's chunk 0 takes the new key)."""
    h = tl.program_id(0)
    kvh = h // (H // HKV)
    d = tl.arange(0, HD)
    pos, lo = _position(pos_ptr, pos_arg, window, POS_PTR)
    start = lo + tl.program_id(1) * CH
    stop = tl.minimum(start + CH, pos)
    q = _norm_rope(qkv_ptr + h * HD, w_ptr + h * HD, cos_ptr, sin_ptr, eps, HD, HAS_NORM, DT)
    kn = _norm_rope(qkv_ptr + (H + kvh) * HD, w_ptr + (H + kvh) * HD, cos_ptr, sin_ptr, eps, HD,
                    HAS_NORM, DT)  # fmt: skip
    vn = tl.load(qkv_ptr + (H + HKV + kvh) * HD + d).to(tl.float32)
    s_new = _round(_round(tl.sum(kn * q, 0), DT) * scaling, DT)
    return h, kvh, pos, start, stop, q, kn, vn, s_new


@triton.jit
def _split_stats_kernel(qkv_ptr, w_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, pos_ptr, stats_ptr,
                        pos_arg, window, cap, eps, scaling, CH, H: tl.constexpr,
                        HKV: tl.constexpr, HD: tl.constexpr, BS: tl.constexpr,
                        HAS_NORM: tl.constexpr, POS_PTR: tl.constexpr,
                        DT: tl.constexpr):  # fmt: skip
    """Pass 1 of the split: the chunk's max and sum of exp(s - max) -> stats[h, j] (-inf, 0 for
    an empty chunk); the group's first head writes the new k and v rows (nobody reads them)."""
    h, kvh, pos, start, stop, q, kn, vn, s_new = _chunk_setup(
        qkv_ptr, w_ptr, cos_ptr, sin_ptr, pos_ptr, pos_arg, window, eps, scaling, CH, H, HKV, HD,
        HAS_NORM, POS_PTR, DT)  # fmt: skip
    j = tl.program_id(1)
    d = tl.arange(0, HD)
    k_rows = k_ptr + kvh.to(tl.int64) * cap * HD
    first = j == 0
    if first & (h % (H // HKV) == 0):
        tl.store(k_rows + pos * HD + d, kn.to(DT))
        tl.store(v_ptr + kvh.to(tl.int64) * cap * HD + pos * HD + d, vn.to(DT))
    m = tl.where(first, s_new, float("-inf"))
    total = tl.where(first, 1.0, 0.0)
    i = tl.arange(0, BS)
    for b in range(start, stop, BS):
        idx = b + i
        s = _scores(k_rows, q, idx, idx < stop, scaling, HD, DT)
        m_next = tl.maximum(m, tl.max(s, 0))
        total = total * tl.exp(m - m_next) + tl.sum(tl.exp(s - m_next), 0)
        m = m_next
    n = tl.num_programs(1)
    tl.store(stats_ptr + (h * n + j) * 2, m)
    tl.store(stats_ptr + (h * n + j) * 2 + 1, total)


@triton.jit
def _split_out_kernel(qkv_ptr, w_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, pos_ptr, stats_ptr,
                      part_ptr, pos_arg, window, cap, eps, scaling, CH, H: tl.constexpr,
                      HKV: tl.constexpr, HD: tl.constexpr, BS: tl.constexpr, NS: tl.constexpr,
                      HAS_NORM: tl.constexpr, POS_PTR: tl.constexpr,
                      DT: tl.constexpr):  # fmt: skip
    """Pass 2: the head's max and sum from every chunk's, then the chunk's probabilities rounded
    to the activation dtype times V -> part[h, j] (fp32)."""
    h, kvh, pos, start, stop, q, kn, vn, s_new = _chunk_setup(
        qkv_ptr, w_ptr, cos_ptr, sin_ptr, pos_ptr, pos_arg, window, eps, scaling, CH, H, HKV, HD,
        HAS_NORM, POS_PTR, DT)  # fmt: skip
    j = tl.program_id(1)
    n = tl.num_programs(1)
    c = tl.arange(0, NS)
    mc = tl.load(stats_ptr + (h * n + c) * 2, mask=c < n, other=float("-inf"))
    tc = tl.load(stats_ptr + (h * n + c) * 2 + 1, mask=c < n, other=0.0)
    m = tl.max(mc, 0)
    total = tl.sum(tl.where(tc > 0, tc * tl.exp(mc - m), 0.0), 0)
    d = tl.arange(0, HD)
    k_rows = k_ptr + kvh.to(tl.int64) * cap * HD
    v_rows = v_ptr + kvh.to(tl.int64) * cap * HD
    acc = tl.where(j == 0, _round(tl.exp(s_new - m) / total, DT), 0.0) * vn
    i = tl.arange(0, BS)
    for b in range(start, stop, BS):
        idx = b + i
        ok = idx < stop
        p = _round(tl.exp(_scores(k_rows, q, idx, ok, scaling, HD, DT) - m) / total, DT)
        v = tl.load(v_rows + idx[:, None] * HD + d[None, :], mask=ok[:, None], other=0.0)
        acc += tl.sum(p[:, None] * v.to(tl.float32), 0)
    tl.store(part_ptr + (h * n + j) * HD + d, acc)


@triton.jit
def _split_sum_kernel(part_ptr, out_ptr, n, HD: tl.constexpr, SB: tl.constexpr,
                      DT: tl.constexpr):  # fmt: skip
    """Pass 3: a head's output, its chunks' partials added SB chunks a load (a long context's
    hundred chunks are a few round trips, not a hundred)."""
    h = tl.program_id(0)
    d = tl.arange(0, HD)
    c = tl.arange(0, SB)
    acc = tl.zeros([HD], dtype=tl.float32)
    for j in range(0, n, SB):
        ok = (j + c) < n
        acc += tl.sum(tl.load(part_ptr + (h * n + j + c[:, None]) * HD + d[None, :],
                              mask=ok[:, None], other=0.0), 0)  # fmt: skip
    tl.store(out_ptr + h * HD + d, acc.to(DT))


def split_chunk(cap: int) -> int:
    """Positions per program of a split cache: one loop step while that keeps the chunks per head
    at MAX_CHUNKS or fewer, else cap / MAX_CHUNKS (at 4096+ positions, 32 heads x 64-position
    chunks were slower than 128 and 256: more programs than the SMs hold, each a round trip)."""
    return max(CHUNK, cap // MAX_CHUNKS)


def unsupported(heads: int, kv_heads: int, head_dim: int, rotary_dim: int, dtype) -> str | None:
    """Why `decode_attend` cannot take this attention (None when it can)."""
    if head_dim & (head_dim - 1) or head_dim < 16:
        return f"head dim {head_dim} is not a power of two >= 16"
    if rotary_dim != head_dim:
        return "partial rotary"
    if heads % kv_heads:
        return "query heads not a multiple of the KV heads"
    if dtype not in _TL:
        return f"activations in {dtype}"
    return None


def attend_impl(qkv: torch.Tensor, qk_w: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                pos_t: torch.Tensor | None, pos: int, eps: float, scaling: float, window: int,
                heads: int, kv_heads: int) -> torch.Tensor:  # fmt: skip
    """qkv [1, (H + 2 Hkv) hd] (q heads, k heads, v heads), qk_w [H + Hkv, hd] (q_norm's rows,
    then k_norm's) or None, cos/sin [1, hd] of the position, the layer's cache kc/vc
    [Hkv, capacity, hd] -> [1, H hd] in qkv's dtype; writes k/v at the position (`pos_t` [1] on
    the device, else `pos`). window: the sliding window, 0 for none."""
    hd, cap = kc.shape[-1], kc.shape[1]
    assert (
        qkv.shape == (1, (heads + 2 * kv_heads) * hd) and kc.is_contiguous() and vc.is_contiguous()
    )
    assert kc.dtype == vc.dtype == qkv.dtype == cos.dtype, "one activation dtype throughout"
    out = torch.empty(1, heads * hd, dtype=qkv.dtype, device=qkv.device)
    qkv = qkv.contiguous()
    w = qkv if qk_w is None else qk_w.contiguous()
    # both forms take these: the position's pointer argument is a placeholder when it is an int
    head = (qkv, w, cos.contiguous(), sin.contiguous(), kc, vc, kc if pos_t is None else pos_t)
    flags = dict(H=heads, HKV=kv_heads, HD=hd, BS=BLOCK_S, HAS_NORM=qk_w is not None,
                 POS_PTR=pos_t is not None, DT=_TL[qkv.dtype])  # fmt: skip
    if cap >= SPLIT_CAP:  # a long context: split over the positions
        chunk = split_chunk(cap)
        n = triton.cdiv(cap, chunk)
        stats = torch.empty(heads, n, 2, dtype=torch.float32, device=qkv.device)
        part = torch.empty(heads, n, hd, dtype=torch.float32, device=qkv.device)
        tail = (pos, window, cap, eps, scaling, chunk)
        _split_stats_kernel[(heads, n)](*head, stats, *tail, **flags, num_warps=4)
        _split_out_kernel[(heads, n)](*head, stats, part, *tail, NS=triton.next_power_of_2(n),
                                      **flags, num_warps=4)  # fmt: skip
        _split_sum_kernel[(heads,)](part, out, n, HD=hd, SB=SUM_BLOCK, DT=flags["DT"],
                                    num_warps=4)  # fmt: skip
        return out
    _decode_attend_kernel[(heads,)](*head, out, pos, window, cap, eps, scaling, FIRST=FIRST,
                                    **flags, num_warps=8)  # fmt: skip
    return out


@torch.library.custom_op("moestream::decode_attend", mutates_args=("kc", "vc"))
def decode_attend_op(qkv: torch.Tensor, qk_w: torch.Tensor | None, cos: torch.Tensor,
                     sin: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                     pos_t: torch.Tensor | None, pos: int, eps: float, scaling: float,
                     window: int, heads: int, kv_heads: int) -> torch.Tensor:  # fmt: skip
    """`attend_impl` as one opaque op for torch.compile (it writes the cache in place)."""
    return attend_impl(qkv, qk_w, cos, sin, kc, vc, pos_t, pos, eps, scaling, window, heads,
                       kv_heads)  # fmt: skip


@decode_attend_op.register_fake
def _(qkv, qk_w, cos, sin, kc, vc, pos_t, pos, eps, scaling, window, heads, kv_heads):
    return qkv.new_empty((1, heads * kc.shape[-1]))


def decode_attend(*args) -> torch.Tensor:
    """The custom op inside a compiled step, the plain function eagerly (as dense.gemv)."""
    fn = decode_attend_op if torch.compiler.is_compiling() else attend_impl
    return fn(*args)
