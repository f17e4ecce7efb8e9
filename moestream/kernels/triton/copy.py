"""Copy expert records by row on the device: rows of a pinned host mirror (read through unified
addressing, so no staging buffer or per-record memcpy call) into VRAM pool slots, every section
of a record in one launch. The GPU provider admits experts into its pool with it, on its copy
stream (`SectionCopy`, spec `dst[slots[i]] = src[rows[i]]` per section: `copy_rows_ref`), and
stages a decode step's misses with it inside the captured step (`StageMisses`: a routed pair
whose code is negative gets its mirror row copied into the pool's staging slot of that pair,
unless a prefetch launch of an earlier layer copied it into its own slots already; spec
`stage_misses_ref`).

Both read the same link. With a shared `busy` counter (GpuConfig.admit_pause) the staging
programs that copy count themselves in it while they run, and the admission's programs wait
before each block while it is above zero: a step's misses, on its critical path, get the whole
link, and admissions move in the step's compute (docs/gpu.md, "Admissions that pause"). A
`hurry` word on the device, which the host sets (a 4-byte copy on a stream of its own) while
its admissions fall behind (the provider's rule), lets them through at once: read live, so it
frees launches already waiting. Both words the spin reads live in VRAM: with the hurry word in
pinned host memory (a read over PCIe each poll) the pause ran at 0.48x the default's decode on
the H200 (a1f37fe), its polls taking, we think, the link from the very staging they wait for."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # int32 words per step of a program: 16 KB of loads in flight per program
# Admissions: a fixed number of programs walk every (record, section, chunk) of a call, so the
# bytes in flight stay ADMIT_PROGRAMS x 16 KB however many records one call admits. Admissions
# share PCIe with the next step's staging, which is on that step's critical path; the link
# serves outstanding reads roughly in proportion, so a bounded admission leaves staging more of
# it (bench_pcie.py's contention rows); but a slower admission keeps its victims' slots busy
# and admits less. 32 was the best of 8 / 32 / 256 end to end on the H200 (docs/gpu.md).
ADMIT_PROGRAMS = 32
# A prompt's misses (the provider's host path): the compute waits for them and nothing else
# reads the link, so as many programs as the old per-record grid had at 16 records.
FILL_PROGRAMS = 256
CHUNKS = 4  # chunks per section of an admitted record (work items of the admission's programs)
MAX_SECTIONS = 4  # a record's sections (q and scales of w13 and w2)
# Programs per staged pair: each copies its share of every section; a layer's misses are on
# the step's critical path, with nothing else of the step to run beside them.
STAGE_CHUNKS = 32
# A pausing admission's sub-block while it waits on the staging: 4 KB a program (128 KB in
# flight over ADMIT_PROGRAMS), so a staging launch that starts while its loads are out waits
# for at most ~2.5 us of them. Hurried, it copies whole BLOCKs again: with 4 KB blocks even
# when hurried, at 25% of the experts in VRAM its records landed late with the hurry nearly
# always set (hits 0.44 against 0.555, H200 at fc14a4d); a quarter of the bytes in flight is,
# we think, a quarter of its share of a busy link (not measured yet with whole blocks).
PAUSE_BLOCK = 1024


@triton.jit
def _wait_idle(busy_ptr, hurry_ptr):
    """Spin while a staging launch's programs count themselves in busy and the host's hurry
    word is 0 (a throttle: bytes and bits never depend on it). Both are device words (L2
    reads); hurry is read only while busy: an idle staging costs a block one load."""
    n = tl.load(busy_ptr, volatile=True)
    while n > 0:
        hurry = tl.load(hurry_ptr, volatile=True)
        n = tl.where(hurry != 0, 0, tl.load(busy_ptr, volatile=True))


@triton.jit
def _copy_block(src, dst, w, WORDS: tl.constexpr, N: tl.constexpr):
    """Words w .. w + N (those below WORDS) of src -> dst."""
    off = w + tl.arange(0, N)
    m = off < WORDS
    tl.store(dst + off, tl.load(src + off, mask=m), mask=m)


@triton.jit
def _copy_one(src, dst, r, s, c, n, busy_ptr, hurry_ptr, WORDS: tl.constexpr,
              BLOCK: tl.constexpr, PAUSE: tl.constexpr, SUB: tl.constexpr):  # fmt: skip
    """Program chunk c of n: words c*BLOCK, (c + n)*BLOCK, ... of record r -> slot s. PAUSE:
    a block with the hurry word up goes whole; else by SUB words, each waiting for the staging
    to be idle (or for the hurry)."""
    src += r * WORDS
    dst += s * WORDS
    for w in range(c * BLOCK, WORDS, n * BLOCK):
        if PAUSE:
            if tl.load(hurry_ptr, volatile=True) != 0:
                _copy_block(src, dst, w, WORDS, BLOCK)
            else:
                for j in tl.static_range(BLOCK // SUB):
                    _wait_idle(busy_ptr, hurry_ptr)
                    _copy_block(src, dst, w + j * SUB, WORDS, SUB)
        else:
            _copy_block(src, dst, w, WORDS, BLOCK)


@triton.jit
def _copy_sections_kernel(rows_ptr, slots_ptr, items, busy_ptr, hurry_ptr, s0, d0, s1, d1, s2,
                          d2, s3, d3,
                          W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr,
                          W3: tl.constexpr, S: tl.constexpr, C: tl.constexpr,
                          BLOCK: tl.constexpr, PAUSE: tl.constexpr,
                          SUB: tl.constexpr):  # fmt: skip
    """Program p of P: work items p, p + P, ... of `items` = records x S sections x C chunks;
    item (i, sec, c) copies chunk c of that section of record rows[i] -> slot slots[i]. PAUSE:
    every SUB words wait while busy > 0 (a staging launch is copying) unless hurry != 0."""
    for item in range(tl.program_id(0), items, tl.num_programs(0)):
        i = item // (S * C)
        sec = (item // C) % S
        c = item % C
        r = tl.load(rows_ptr + i).to(tl.int64)
        s = tl.load(slots_ptr + i).to(tl.int64)
        if sec == 0:
            _copy_one(s0, d0, r, s, c, C, busy_ptr, hurry_ptr, W0, BLOCK, PAUSE, SUB)
        elif sec == 1:
            _copy_one(s1, d1, r, s, c, C, busy_ptr, hurry_ptr, W1, BLOCK, PAUSE, SUB)
        elif sec == 2:
            _copy_one(s2, d2, r, s, c, C, busy_ptr, hurry_ptr, W2, BLOCK, PAUSE, SUB)
        else:
            _copy_one(s3, d3, r, s, c, C, busy_ptr, hurry_ptr, W3, BLOCK, PAUSE, SUB)


@triton.jit
def _stage_kernel(codes_ptr, slots_ptr, base, acodes_ptr, abase, busy_ptr, s0, d0, s1, d1, s2, d2,
                  s3, d3, W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr,
                  W3: tl.constexpr, A: tl.constexpr, BLOCK: tl.constexpr,
                  MARK: tl.constexpr, SLOTS: tl.constexpr):  # fmt: skip
    """Program (p, c): pair p's code >= 0 is its slot; a code < 0 names mirror row -1 - code:
    if one of the A prefetched codes (acodes) is that code, its prefetch slot abase + j holds
    the row already; else chunk c of every section goes to staging slot base + p. slots[p]: the
    slot the decode kernels then read. MARK: a program that copies counts itself in busy while
    it does (pausing admissions wait for zero). SLOTS False: slots is not written (another
    launch for the same codes writes it; the sections here are the rest of each record)."""
    p = tl.program_id(0)
    c, n = tl.program_id(1), tl.num_programs(1)
    code = tl.load(codes_ptr + p).to(tl.int64)
    slot = tl.where(code < 0, base + p, code)
    found = code != code  # False
    for j in tl.static_range(A):
        match = (code < 0) & (tl.load(acodes_ptr + j).to(tl.int64) == code)
        found = found | match
        slot = tl.where(match, abase + j, slot)
    if SLOTS and c == 0:
        tl.store(slots_ptr + p, slot)
    if (code < 0) & (found == 0):
        if MARK:
            tl.atomic_add(busy_ptr, 1, sem="relaxed", scope="gpu")
        r = -1 - code
        s = base + p
        _copy_one(s0, d0, r, s, c, n, busy_ptr, busy_ptr, W0, BLOCK, False, BLOCK)
        if W1 > 0:
            _copy_one(s1, d1, r, s, c, n, busy_ptr, busy_ptr, W1, BLOCK, False, BLOCK)
        if W2 > 0:
            _copy_one(s2, d2, r, s, c, n, busy_ptr, busy_ptr, W2, BLOCK, False, BLOCK)
        if W3 > 0:
            _copy_one(s3, d3, r, s, c, n, busy_ptr, busy_ptr, W3, BLOCK, False, BLOCK)
        if MARK:
            tl.debug_barrier()  # every warp has its loads back (its stores issued)
            tl.atomic_add(busy_ptr, -1, sem="relaxed", scope="gpu")


@triton.jit
def _gather_codes_kernel(ids_ptr, table_ptr, codes_ptr, seen_ptr, P: tl.constexpr,
                         BP: tl.constexpr):  # fmt: skip
    """codes[p] = table[ids[p]], seen[p] = ids[p] (int64) for p < P, one program."""
    p = tl.arange(0, BP)
    m = p < P
    i = tl.load(ids_ptr + p, mask=m, other=0).to(tl.int64)
    tl.store(codes_ptr + p, tl.load(table_ptr + i, mask=m).to(tl.int64), mask=m)
    tl.store(seen_ptr + p, i, mask=m)


def gather_codes(ids: torch.Tensor, table: torch.Tensor, codes: torch.Tensor,
                 seen: torch.Tensor) -> None:  # fmt: skip
    """A one-token MoE layer's codes = table[ids] (its slot map at the routed experts) and a copy
    of the ids, both int64 [P] where the host reads them: one launch, where index_select and a
    copy took two (~5 us of a streamed step's critical path a layer on the H200). Spec:
    `codes.copy_(table[ids]); seen.copy_(ids)`. Syncs nothing: capturable."""
    P = ids.numel()
    assert codes.numel() == seen.numel() == P and table.dim() == 1
    assert ids.is_contiguous() and table.is_contiguous()
    assert codes.is_contiguous() and seen.is_contiguous()
    assert codes.dtype == seen.dtype == torch.int64
    _gather_codes_kernel[(1,)](ids, table, codes, seen, P=P, BP=triton.next_power_of_2(P),
                               num_warps=1)  # fmt: skip


def _words(t: torch.Tensor) -> torch.Tensor:
    """[n, ...] contiguous -> [n, words] int32 (a view)."""
    flat = t.view(t.shape[0], -1).view(torch.uint8)
    assert flat.shape[1] % 4 == 0, "record sections are whole int32 words"
    return flat.view(torch.int32)


class SectionCopy:
    """`dst[slots[i]] = src[rows[i]]` for every section pair (src may be pinned host memory,
    dst on the device; the same shapes and dtypes per pair), one launch of `programs` programs
    per call. The int32 views are made once: a call only launches. `busy` (int32 [1] on dst's
    device, shared with a StageMisses): every block waits while a staging launch copies, unless
    `hurry` (int32 [1] on dst's device, given with busy) is nonzero: written from another
    stream (the provider copies 4 bytes from pinned memory), waiting programs read it live."""

    def __init__(self, srcs: list[torch.Tensor], dsts: list[torch.Tensor],
                 programs: int = ADMIT_PROGRAMS, busy: torch.Tensor | None = None,
                 hurry: torch.Tensor | None = None):  # fmt: skip
        assert 0 < len(srcs) == len(dsts) <= MAX_SECTIONS, "1 to 4 section pairs"
        assert programs > 0
        for a, b in zip(srcs, dsts):
            assert a.shape[1:] == b.shape[1:] and a.dtype == b.dtype, "section shapes differ"
            assert a.is_contiguous() and b.is_contiguous(), "sections must be contiguous"
        self.pairs = [(_words(a), _words(b)) for a, b in zip(srcs, dsts)]
        words = [a.shape[1] for a, _ in self.pairs]
        assert (busy is None) == (hurry is None), "a pausing admission takes busy and hurry"
        self.busy, self.hurry = busy, hurry
        self.chunks = max(1, min(CHUNKS, triton.cdiv(max(words), BLOCK)))
        self.programs = programs
        pad = MAX_SECTIONS - len(self.pairs)
        ptrs = [t for pair in self.pairs for t in pair] + [self.pairs[0][0]] * (2 * pad)
        self.args = ptrs
        self.consts = {f"W{i}": w for i, w in enumerate(words + [0] * pad)}

    def __call__(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """rows, slots: int64 [n] contiguous on dst's device. Runs on the current stream, syncs
        nothing."""
        n = rows.numel()
        assert slots.numel() == n and rows.is_contiguous() and slots.is_contiguous()
        if n:
            items = n * len(self.pairs) * self.chunks
            _copy_sections_kernel[(min(self.programs, items),)](
                rows, slots, items, *([rows] * 2 if self.busy is None else [self.busy, self.hurry]),
                *self.args,
                S=len(self.pairs), C=self.chunks, BLOCK=BLOCK, PAUSE=self.busy is not None,
                SUB=PAUSE_BLOCK,
                num_warps=4, **self.consts)  # fmt: skip


class StageMisses(SectionCopy):
    """A one-token decode call's misses into VRAM before its kernels run: for codes [P] (a slot,
    or -1 - mirror row), mirror row -> staging slot `base + p` of pair p, every section, one
    launch of `chunks` programs a pair; `slots` [P] gets the slot each pair is read from. The
    decode kernels then read only VRAM: a miss crosses PCIe once, as whole rows, instead of as
    the decode kernels' small tiles (which read pinned memory at about half the link's rate).
    `ahead`: (codes [A], base) of an earlier call that copied its misses into slots base .. base
    + A - 1 (a prefetch: the same launch with other codes); a miss among them is read from there,
    not copied again (the same mirror row, so the same bytes). `busy`: the programs that copy
    count themselves in it while they run (a pausing SectionCopy's counter). `write_slots`
    False: a launch of some sections only, beside one that writes `slots` for the same codes
    (GpuConfig.split_staging: a record's down sections staged apart from its gate/up)."""

    def __init__(self, srcs: list[torch.Tensor], dsts: list[torch.Tensor],
                 chunks: int = STAGE_CHUNKS, busy: torch.Tensor | None = None,
                 write_slots: bool = True):  # fmt: skip
        super().__init__(srcs, dsts)
        self.busy = busy
        self.write_slots = write_slots
        assert chunks > 0
        # no more programs a pair than the largest section has blocks (small records: tests)
        words = max(a.shape[1] for a, _ in self.pairs)
        self.stage_chunks = max(1, min(chunks, triton.cdiv(words, BLOCK)))

    def __call__(self, codes: torch.Tensor, slots: torch.Tensor, base: int,
                 ahead: tuple[torch.Tensor, int] | None = None) -> None:  # fmt: skip
        """codes, slots: int64 [P] contiguous on dst's device (P pairs, the staging slots base
        .. base + P - 1). Runs on the current stream, syncs nothing: capturable."""
        assert codes.is_contiguous() and slots.is_contiguous() and codes.numel() == slots.numel()
        acodes, abase = ahead if ahead is not None else (codes, 0)
        assert acodes.is_contiguous()
        grid = (codes.numel(), self.stage_chunks)
        _stage_kernel[grid](codes, slots, base, acodes, abase,
                            codes if self.busy is None else self.busy, *self.args,
                            A=acodes.numel() if ahead is not None else 0, BLOCK=BLOCK,
                            MARK=self.busy is not None, SLOTS=self.write_slots, num_warps=4,
                            **self.consts)  # fmt: skip


def stage_misses_ref(src: list[torch.Tensor], dst: list[torch.Tensor], codes: torch.Tensor,
                     base: int, ahead: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:  # fmt: skip
    """The spec of StageMisses: plain indexing per section; returns the slots."""
    codes = codes.reshape(-1)
    miss = codes < 0
    slots = torch.where(miss, base + torch.arange(codes.numel(), device=codes.device), codes)
    if ahead is not None:  # misses a prefetch copied: read from its slot, nothing copied
        for j, a in enumerate(ahead[0].reshape(-1).tolist()):
            hit = miss & (codes == a)
            slots[hit] = ahead[1] + j
            miss = miss & ~hit
    for s, d in zip(src, dst):
        copy_rows_ref(s, d, (-1 - codes[miss]), slots[miss])
    return slots


def copy_rows_ref(src: torch.Tensor, dst: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor):
    """The spec: plain indexing."""
    dst[slots.to(dst.device)] = src[rows.to(src.device)].to(dst.device)
