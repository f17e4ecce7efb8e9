"""Top-k of a few router rows in one Triton launch (`topk_rows`): torch.topk on CUDA takes two
kernels (a radix select and a bitonic sort, ~9 us per MoE layer on the H200 at 128 experts, more
than the layer's attention GEMMs); here one program per row takes the maximum k times.
`route_rows` does the whole softmax top-k rule after the router's GEMM in that one launch: the
fp32 softmax, the top-k, the renormalisation and the cast to the combine dtype (three more
kernels in a captured step). `route_decode` also does the router's GEMM (cuBLAS took ~5 us for
[1, 2048] x [2048, 128] on the H200): programs of RB router rows each, and the last program to
finish (an int32 counter, reset by it) routes. Their reference is `SparseMoe.route`
(models/layers.py): the logits rounded to the activation dtype, as the router's nn.Linear.

Order: descending score; equal scores in ascending expert id (torch.topk leaves ties unspecified;
softmax probabilities of a trained router are practically never equal). Reference: torch.topk.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moestream.kernels.triton import kept

MAX_EXPERTS = 1024  # one row in registers


@triton.jit
def _topk_kernel(s_ptr, top_ptr, ids_ptr, E, K: tl.constexpr, EP: tl.constexpr):
    t = tl.program_id(0)
    j = tl.arange(0, EP)
    v = tl.load(s_ptr + t * E + j, mask=j < E, other=float("-inf"))
    for r in tl.static_range(K):
        m = tl.max(v, 0)
        first = tl.min(tl.where(v == m, j, EP), 0)
        tl.store(top_ptr + t * K + r, m)
        tl.store(ids_ptr + t * K + r, first.to(tl.int64))
        v = tl.where(j == first, float("-inf"), v)


def topk_rows(s: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """s [T, E] fp32 (E <= MAX_EXPERTS) -> (top [T, k] fp32, ids [T, k] int64), as torch.topk."""
    T, E = s.shape
    top = torch.empty(T, k, dtype=s.dtype, device=s.device)
    ids = torch.empty(T, k, dtype=torch.int64, device=s.device)
    _topk_kernel[(T,)](s.contiguous(), top, ids, E, K=k, EP=triton.next_power_of_2(E))
    return top, ids


@triton.jit
def _route_row(x_ptr, w_ptr, ids_ptr, t, E, K: tl.constexpr, KP: tl.constexpr,
               EP: tl.constexpr, RENORM: tl.constexpr, DT: tl.constexpr,
               PACKED: tl.constexpr = False):  # fmt: skip
    """Row t of logits x -> its K weights (fp32 softmax, top-k, renormalised if asked, in DT)
    and ids. PACKED: each round one max of a 64-bit key (the probability's bits, >= 0 so ordered
    as the values, above EP - 1 - id, so a tie goes to the lower id) instead of a max and a min:
    the same choice."""
    j = tl.arange(0, EP)
    x = tl.load(x_ptr + t * E + j, mask=j < E, other=float("-inf"), cache_modifier=".cg")
    x = x.to(tl.float32)
    e = tl.exp(x - tl.max(x, 0))
    p = tl.where(j < E, e / tl.sum(e, 0), float("-inf"))  # softmax in fp32, as the torch rule
    r = tl.arange(0, KP)
    picked = tl.zeros([KP], dtype=tl.float32)
    if PACKED:
        bits = p.to(tl.int32, bitcast=True).to(tl.int64)
        key = tl.where(j < E, (bits << 32) | (EP - 1 - j).to(tl.int64), -1)
        for i in tl.static_range(K):
            top = tl.max(key, 0)
            m = (top >> 32).to(tl.int32).to(tl.float32, bitcast=True)
            picked = tl.where(r == i, m, picked)
            tl.store(ids_ptr + t * K + i, (EP - 1 - top.to(tl.int32)).to(tl.int64))  # low half
            key = tl.where(key == top, -1, key)
    else:
        for i in tl.static_range(K):
            m = tl.max(p, 0)
            first = tl.min(tl.where(p == m, j, EP), 0)
            picked = tl.where(r == i, m, picked)
            tl.store(ids_ptr + t * K + i, first.to(tl.int64))
            p = tl.where(j == first, float("-inf"), p)
    if RENORM:
        picked = picked / tl.sum(picked, 0)
    tl.store(w_ptr + t * K + r, picked.to(DT), mask=r < K)


@triton.jit
def _route_kernel(x_ptr, w_ptr, ids_ptr, E, K: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr,
                  RENORM: tl.constexpr, DT: tl.constexpr, PACKED: tl.constexpr):  # fmt: skip
    _route_row(x_ptr, w_ptr, ids_ptr, tl.program_id(0), E, K, KP, EP, RENORM, DT, PACKED)


@triton.jit
def _router_kernel(x_ptr, g_ptr, logit_ptr, cnt_ptr, w_ptr, ids_ptr, E, T: tl.constexpr,
                   D: tl.constexpr, RB: tl.constexpr, BK: tl.constexpr, K: tl.constexpr,
                   KP: tl.constexpr, EP: tl.constexpr, RENORM: tl.constexpr,
                   XDT: tl.constexpr, DT: tl.constexpr, PACKED: tl.constexpr):  # fmt: skip
    r = tl.program_id(0) * RB + tl.arange(0, RB)
    rl = tl.minimum(r, E - 1)  # rows past E load row E - 1 (unstored)
    kk = tl.arange(0, BK)
    for t in tl.static_range(T):
        acc = tl.zeros([RB, BK], tl.float32)
        for k0 in tl.range(0, D, BK):
            g = tl.load(g_ptr + rl[:, None] * D + k0 + kk[None, :]).to(tl.float32)
            acc += g * tl.load(x_ptr + t * D + k0 + kk).to(tl.float32)[None, :]
        logit = tl.sum(acc, 1).to(XDT).to(tl.float32)  # as the router's output, in x's dtype
        tl.store(logit_ptr + t * E + r, logit, mask=r < E)
    tl.debug_barrier()  # every thread's logits are stored before the release below
    if tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        for t in tl.static_range(T):
            _route_row(logit_ptr, w_ptr, ids_ptr, t, E, K, KP, EP, RENORM, DT, PACKED)
        tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")  # ready for the next call


_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def route_rows(logits: torch.Tensor, k: int, renorm: bool, dtype: torch.dtype,
               packed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Router logits [T, E] (E <= MAX_EXPERTS) -> (weights [T, k] in dtype, ids [T, k] int64):
    softmax in fp32, top-k, renormalised if asked, then cast. `packed`: _route_row's other
    top-k (the same choice; benchmarks/bench_gpu_router.py times both)."""
    T, E = logits.shape
    w = torch.empty(T, k, dtype=dtype, device=logits.device)
    ids = torch.empty(T, k, dtype=torch.int64, device=logits.device)
    _route_kernel[(T,)](logits.contiguous(), w, ids, E, K=k, KP=triton.next_power_of_2(k),
                        EP=triton.next_power_of_2(E), RENORM=renorm, DT=_TL[dtype],
                        PACKED=packed, num_warps=1)  # fmt: skip
    return w, ids


# One router row a program on one warp (E programs; the last one's top-k has no cross-warp
# reductions): 4.87 / 5.09 us a call against 6.27 / 6.75 for 2 rows on 4 warps at 128 / 256
# experts x 2048 (bench_gpu_router.py, H200, 68b1659; the fastest of 1, 2, 4 rows x 1, 2, 4
# warps).
ROUTER_ROWS = 1  # router rows per program of route_decode
ROUTER_WARPS = 1  # warps per program of route_decode (bench_gpu_router.py times 1, 2, 4)


def router_block(hidden: int) -> int:
    """route_decode's K step: the largest power of two <= 512 dividing D (0: D too odd)."""
    bk = min(512, hidden & -hidden)
    return bk if bk >= 16 else 0


def route_decode_impl(x: torch.Tensor, gate: torch.Tensor, k: int, renorm: bool,
                      dtype: torch.dtype, rows: int = ROUTER_ROWS, warps: int = ROUTER_WARPS,
                      packed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """x [T, D] (T <= 8) and the router weight gate [E, D] in x's dtype -> (weights [T, k] in
    dtype, ids [T, k] int64): the router's GEMM and route_rows' rule in one launch. rows, warps,
    packed: other tiles and top-k (bench_gpu_router.py; the same ids and weights)."""
    T, D = x.shape
    E = gate.shape[0]
    assert T <= 8 and gate.dtype == x.dtype and router_block(D), (T, D, gate.dtype, x.dtype)
    # fp32 logits [8, E] and the int32 counter of the last program
    logits, cnt = kept(("router", str(x.device), E), lambda: (
        torch.empty(8, E, device=x.device), torch.zeros(1, device=x.device, dtype=torch.int32)))  # fmt: skip
    w = torch.empty(T, k, dtype=dtype, device=x.device)
    ids = torch.empty(T, k, dtype=torch.int64, device=x.device)
    _router_kernel[(triton.cdiv(E, rows),)](
        x.contiguous(), gate.contiguous(), logits, cnt, w, ids, E, T=T, D=D, RB=rows,
        BK=router_block(D), K=k, KP=triton.next_power_of_2(k), EP=triton.next_power_of_2(E),
        RENORM=renorm, XDT=_TL[x.dtype], DT=_TL[dtype], PACKED=packed, num_warps=warps,
    )  # fmt: skip
    return w, ids


@torch.library.custom_op("moestream::route_decode", mutates_args=())
def route_decode_op(x: torch.Tensor, gate: torch.Tensor, k: int, renorm: bool,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`route_decode_impl` as one opaque op for torch.compile (its scratch and counter are its
    own, allocated at the first eager call)."""
    return route_decode_impl(x, gate, k, renorm, dtype)


@route_decode_op.register_fake
def _(x, gate, k, renorm, dtype):
    T = x.shape[0]
    return x.new_empty((T, k), dtype=dtype), x.new_empty((T, k), dtype=torch.int64)


def route_decode(x: torch.Tensor, gate: torch.Tensor, k: int, renorm: bool,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The custom op inside a compiled step, the plain function eagerly (as dense.gemv)."""
    fn = route_decode_op if torch.compiler.is_compiling() else route_decode_impl
    return fn(x, gate, k, renorm, dtype)
