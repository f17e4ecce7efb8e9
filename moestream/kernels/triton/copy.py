"""Copy expert records by row on the device: rows of a pinned host mirror (read through unified
addressing, so no staging buffer or per-record memcpy call) into VRAM pool slots, one launch per
section. The GPU provider admits experts into its pool with it, on its copy stream."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # int32 words per step of a program
CHUNKS = 32  # programs per record (enough loads in flight to keep PCIe busy)


@triton.jit
def _copy_rows_kernel(src_ptr, dst_ptr, rows_ptr, slots_ptr, WORDS: tl.constexpr,
                      BLOCK: tl.constexpr):  # fmt: skip
    """Program (i, c): words c*BLOCK, c*BLOCK + n*BLOCK, ... of record rows[i] -> slot slots[i]."""
    src = src_ptr + tl.load(rows_ptr + tl.program_id(0)).to(tl.int64) * WORDS
    dst = dst_ptr + tl.load(slots_ptr + tl.program_id(0)).to(tl.int64) * WORDS
    for c in range(tl.program_id(1) * BLOCK, WORDS, tl.num_programs(1) * BLOCK):
        off = c + tl.arange(0, BLOCK)
        m = off < WORDS
        tl.store(dst + off, tl.load(src + off, mask=m), mask=m)


def _words(t: torch.Tensor) -> torch.Tensor:
    """[n, ...] contiguous -> [n, words] int32 (a view)."""
    flat = t.view(t.shape[0], -1).view(torch.uint8)
    assert flat.shape[1] % 4 == 0, "record sections are whole int32 words"
    return flat.view(torch.int32)


def copy_rows(src: torch.Tensor, dst: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor):
    """dst[slots[i]] = src[rows[i]] for every i (rows, slots: int64 on dst's device; src may be
    pinned host memory). Runs on the current stream, syncs nothing."""
    assert src.shape[1:] == dst.shape[1:] and src.dtype == dst.dtype
    assert rows.is_contiguous() and slots.is_contiguous() and rows.numel() == slots.numel()
    a, b = _words(src), _words(dst)
    n, words = rows.numel(), a.shape[1]
    if n:
        chunks = max(1, min(CHUNKS, triton.cdiv(words, BLOCK)))
        _copy_rows_kernel[(n, chunks)](a, b, rows, slots, WORDS=words, BLOCK=BLOCK, num_warps=4)
