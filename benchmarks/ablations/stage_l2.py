"""Ablation: a decode step's staged misses read with larger PCIe requests, off the product path.

The hypothesis. With admissions out of its way (GpuConfig.admit_pause) a 50% step is the resident
compute plus its staged bytes at the staging launch's own rate, 41-42 GB/s on the H200 against
the copy engine's 55 (docs/gpu.md, "Admissions that pause for the staging"). If the SMs' reads
of pinned memory reach the link as small requests, each paying a header, asking the L2 for
256-byte blocks might move more bytes a second. PTX's `ld` takes a prefetch-size qualifier
(`.L2::256B`, sm_75+) that Triton does not expose, so each 4-byte word is loaded here through
inline PTX with it (a warp's 32 words are one 128-byte line, so the loads stay coalesced).

`StageMissesL2` is `kernels/triton/copy.py`'s StageMisses (no prefetch sets, no pause counter)
with that load; its spec is the same `stage_misses_ref`. CUDA only (inline PTX): the
interpreter cannot run it. `benchmarks/bench_pcie.py --graph` times it against the product's
staging inside CUDA graphs (no host launch in the timed span).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moestream.kernels.triton.copy import BLOCK, STAGE_CHUNKS, SectionCopy

# hint -> (PTX, words a load): one word a lane, or four (a 16-byte load from the first of the
# four consecutive words one asm instance gets: Triton's blocked layout gives a lane runs of
# contiguous words; the bytes check of tests/test_triton_ablations.py holds it to that)
HINTS = {
    "256": ("ld.global.L2::256B.b32 $0, [$1];", 1),
    "nc256": ("ld.global.nc.L2::256B.b32 $0, [$1];", 1),
    "v4_256": ("ld.global.L2::256B.v4.b32 {$0, $1, $2, $3}, [$4];", 4),
}


@triton.jit
def _load_hinted(ptrs, ASM: tl.constexpr, PACK: tl.constexpr):
    if PACK == 1:
        return tl.inline_asm_elementwise(ASM, "=r,l", [ptrs], dtype=tl.int32, is_pure=False,
                                         pack=1)  # fmt: skip
    return tl.inline_asm_elementwise(ASM, "=r,=r,=r,=r,l,l,l,l", [ptrs], dtype=tl.int32,
                                     is_pure=False, pack=4)  # fmt: skip


@triton.jit
def _copy_one_hinted(src, dst, r, s, c, n, WORDS: tl.constexpr, BLOCK: tl.constexpr,
                     ASM: tl.constexpr, PACK: tl.constexpr):  # fmt: skip
    src += r * WORDS
    dst += s * WORDS
    for w in range(c * BLOCK, WORDS, n * BLOCK):
        off = w + tl.arange(0, BLOCK)
        m = off < WORDS
        # masked lanes read words 0..: whole 16-byte groups (WORDS is a multiple of 4)
        v = _load_hinted(src + tl.where(m, off, off % 4), ASM, PACK)
        tl.store(dst + off, v, mask=m)


@triton.jit
def _stage_l2_kernel(codes_ptr, slots_ptr, base, s0, d0, s1, d1, s2, d2, s3, d3,
                     W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr, W3: tl.constexpr,
                     BLOCK: tl.constexpr, ASM: tl.constexpr, PACK: tl.constexpr):  # fmt: skip
    """_stage_kernel's program (p, c) without prefetch sets: a miss's chunk c of every section
    into staging slot base + p, through hinted loads."""
    p = tl.program_id(0)
    c, n = tl.program_id(1), tl.num_programs(1)
    code = tl.load(codes_ptr + p).to(tl.int64)
    if c == 0:
        tl.store(slots_ptr + p, tl.where(code < 0, base + p, code))
    if code < 0:
        r = -1 - code
        s = base + p
        _copy_one_hinted(s0, d0, r, s, c, n, W0, BLOCK, ASM, PACK)
        if W1 > 0:
            _copy_one_hinted(s1, d1, r, s, c, n, W1, BLOCK, ASM, PACK)
        if W2 > 0:
            _copy_one_hinted(s2, d2, r, s, c, n, W2, BLOCK, ASM, PACK)
        if W3 > 0:
            _copy_one_hinted(s3, d3, r, s, c, n, W3, BLOCK, ASM, PACK)


class StageMissesL2(SectionCopy):
    """StageMisses' call (codes, slots, base) with `hint` "256" (`ld.global.L2::256B`), "nc256"
    (the read-only path, `ld.global.nc.L2::256B`) or "v4_256" (16-byte `ld.global.L2::256B.v4`)
    loads."""

    def __init__(self, srcs: list[torch.Tensor], dsts: list[torch.Tensor],
                 chunks: int = STAGE_CHUNKS, hint: str = "256"):  # fmt: skip
        super().__init__(srcs, dsts)
        assert hint in HINTS, f"hint: one of {', '.join(HINTS)}"
        words = max(a.shape[1] for a, _ in self.pairs)
        self.stage_chunks = max(1, min(chunks, triton.cdiv(words, BLOCK)))
        self.asm, self.pack = HINTS[hint]
        assert self.pack == 1 or all(a.shape[1] % 4 == 0 for a, _ in self.pairs), "v4: 16 B words"

    def __call__(self, codes: torch.Tensor, slots: torch.Tensor, base: int) -> None:
        assert codes.is_contiguous() and slots.is_contiguous() and codes.numel() == slots.numel()
        _stage_l2_kernel[(codes.numel(), self.stage_chunks)](
            codes,
            slots,
            base,
            *self.args,
            BLOCK=BLOCK,
            ASM=self.asm,
            PACK=self.pack,
            num_warps=4,
            **self.consts,
        )
