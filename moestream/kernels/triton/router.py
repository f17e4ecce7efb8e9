"""Top-k of a few router rows in one Triton launch (`topk_rows`): torch.topk on CUDA takes two
kernels (a radix select and a bitonic sort, ~9 us per MoE layer on the H200 at 128 experts, more
than the layer's attention GEMMs); here one program per row takes the maximum k times.
`route_rows` does the whole softmax top-k rule after the router's GEMM in that one launch: the
fp32 softmax, the top-k, the renormalisation and the cast to the combine dtype (three more
kernels in a captured step). Its reference is `SparseMoe.route` (models/layers.py).

Order: descending score; equal scores in ascending expert id (torch.topk leaves ties unspecified;
softmax probabilities of a trained router are practically never equal). Reference: torch.topk.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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
def _route_kernel(x_ptr, w_ptr, ids_ptr, E, K: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr,
                  RENORM: tl.constexpr, DT: tl.constexpr):  # fmt: skip
    t = tl.program_id(0)
    j = tl.arange(0, EP)
    x = tl.load(x_ptr + t * E + j, mask=j < E, other=float("-inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, 0))
    p = tl.where(j < E, e / tl.sum(e, 0), float("-inf"))  # softmax in fp32, as the torch rule
    r = tl.arange(0, KP)
    picked = tl.zeros([KP], dtype=tl.float32)
    for i in tl.static_range(K):
        m = tl.max(p, 0)
        first = tl.min(tl.where(p == m, j, EP), 0)
        picked = tl.where(r == i, m, picked)
        tl.store(ids_ptr + t * K + i, first.to(tl.int64))
        p = tl.where(j == first, float("-inf"), p)
    if RENORM:
        picked = picked / tl.sum(picked, 0)
    tl.store(w_ptr + t * K + r, picked.to(DT), mask=r < K)


_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def route_rows(logits: torch.Tensor, k: int, renorm: bool,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Router logits [T, E] (E <= MAX_EXPERTS) -> (weights [T, k] in dtype, ids [T, k] int64):
    softmax in fp32, top-k, renormalised if asked, then cast."""
    T, E = logits.shape
    w = torch.empty(T, k, dtype=dtype, device=logits.device)
    ids = torch.empty(T, k, dtype=torch.int64, device=logits.device)
    _route_kernel[(T,)](logits.contiguous(), w, ids, E, K=k, KP=triton.next_power_of_2(k),
                        EP=triton.next_power_of_2(E), RENORM=renorm, DT=_TL[dtype])  # fmt: skip
    return w, ids
