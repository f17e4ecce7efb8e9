"""Greedy choice on the GPU in one pass over the logits: the first maximum and its log-probability.

`greedy_pick(logits)` replaces argmax + an fp32 log-softmax over the vocabulary (a cast, a
softmax and a reduction: ~45 us per token at vocab 151936 on the H200, 6% of a 4-layer step) by two
small launches: per block of BLOCK logits (max, first index of the max, sum of exp(x - max)),
then one program merges the blocks in order. The token equals `torch.argmax` (the first maximum);
the log-probability is -log(sum exp(x - max)), as log_softmax computes it, with the sum taken in
another order (fp32, last bits). Reference: `greedy_pick_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _blocks(x_ptr, m_ptr, i_ptr, s_ptr, V, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    m = tl.max(x, 0)
    first = tl.min(tl.where(x == m, offs, V), 0)
    s = tl.sum(tl.exp(x - m), 0)
    tl.store(m_ptr + b, m)
    tl.store(i_ptr + b, first)
    tl.store(s_ptr + b, s)


@triton.jit
def _merge(m_ptr, i_ptr, s_ptr, out_ptr, NB, NBP: tl.constexpr):
    j = tl.arange(0, NBP)
    ok = j < NB
    m = tl.load(m_ptr + j, mask=ok, other=float("-inf"))
    idx = tl.load(i_ptr + j, mask=ok, other=0)
    s = tl.load(s_ptr + j, mask=ok, other=0.0)
    top = tl.max(m, 0)
    first = tl.min(tl.where(m == top, j, NBP), 0)  # the first block holding the maximum
    tok = tl.sum(tl.where(j == first, idx, 0), 0)
    total = tl.sum(tl.where(ok, s * tl.exp(m - top), 0.0), 0)
    tl.store(out_ptr, tok.to(tl.float64))
    tl.store(out_ptr + 1, (-tl.log(total)).to(tl.float64))


def greedy_pick(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """logits [V] on a CUDA device -> float64 [2]: (token id, its log-probability)."""
    V = logits.shape[-1]
    nb = triton.cdiv(V, BLOCK)
    dev = logits.device
    m = torch.empty(nb, dtype=torch.float32, device=dev)
    i = torch.empty(nb, dtype=torch.int32, device=dev)
    s = torch.empty(nb, dtype=torch.float32, device=dev)
    out = torch.empty(2, dtype=torch.float64, device=dev) if out is None else out
    _blocks[(nb,)](logits.contiguous(), m, i, s, V, BLOCK=BLOCK, num_warps=8)
    _merge[(1,)](m, i, s, out, nb, NBP=triton.next_power_of_2(nb))
    return out


def greedy_pick_ref(logits: torch.Tensor) -> torch.Tensor:
    """The spec: torch.argmax (the first maximum) and log_softmax in fp32 at that token."""
    tok = torch.argmax(logits)
    lp = torch.log_softmax(logits.float(), -1)[tok]
    return torch.stack((tok.double(), lp.double()))
