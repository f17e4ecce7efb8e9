"""A decode step's Triton kernels chained by programmatic dependent launch (PDL, sm_90+).

A captured step is ~9 Triton launches a layer (norms, the dense GEMVs, attention, the router, the
MoE pair), most of them a few microseconds of latency-bound work: each launch's program dispatch
and first round trip to memory sat after the previous kernel's end. Chained, a kernel is launched
with `launch_pdl` while the one before still runs; it first asks L2 for its constant weights
(`prefetch_rows`: the GEMVs' and the router's own rows), then `enter` waits until the previous
grid has completed and its writes are visible (`griddepcontrol.wait`) before it reads or writes
anything else. So every kernel of the chain sees what a plain launch would: the same bits; only
the weights' trip from HBM overlaps the kernel before. A kernel waits before its first write too,
so it never overwrites what the kernel before still reads (a captured step reuses buffers).
Waiting is transitive (a grid completes after its own wait), and a kernel launched normally (a
torch op, the staging copy) waits for everything before it as usual. The MoE's down kernel reads
its pairs' ids before its wait (the PDL of decode.py), so gate/up, chained after the router, lets
it launch only after gate/up's own wait, in every mode.

Modes (`GpuConfig.pdl`, set for the process by the loader; a captured graph keeps the mode it was
captured with):
  off    every kernel is launched normally.
  next   a kernel lets the next one launch once its own wait returned: the prefetch overlaps one
         kernel.
  early  a kernel lets the next one launch as soon as it starts: a launch can run several
         kernels ahead of the computing one (its programs only wait while they hold no data).
A prefetch is only a hint to L2 (the point of coherence), so it can never return stale data.
The interpreter and GPUs before sm_90 run every kernel with mode off.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from moestream.kernels.triton import PDL_MODES

MODES = dict(zip(PDL_MODES, range(3)))  # the kernels' constexpr PDL code
LINE = 128  # bytes of an L2 line: one prefetch each
_mode = "off"


def set_mode(mode: str) -> None:
    """The mode of every chained launch from now on (loader: GpuConfig.pdl)."""
    global _mode
    assert mode in MODES, mode  # GpuConfig validates user input
    _mode = mode


def mode() -> str:
    return _mode


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9  # griddepcontrol is sm_90+


def flags(t: torch.Tensor) -> dict:
    """A chained kernel's launch arguments on t's device: the constexpr PDL code and, when on,
    the launch option."""
    code = MODES[_mode] if t.is_cuda and _capable(t.device.index or 0) else 0
    return {"PDL": code, "launch_pdl": True} if code else {"PDL": 0}


@triton.jit
def enter(PDL: tl.constexpr):
    """Before a kernel's first access to anything another kernel writes: wait for the grid before
    (and let the next launch, early or after the wait by mode)."""
    if PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    elif PDL == 1:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def lines(seg: int) -> int:
    """`prefetch_rows`' NL for segments of `seg` bytes: L2 lines, rounded up to a power of two."""
    return triton.next_power_of_2(triton.cdiv(seg, LINE))


@triton.jit
def prefetch_rows(ptr, rows, row_bytes, start, seg, NL: tl.constexpr, PDL: tl.constexpr):
    """Ask L2 for bytes [start, start + seg) of each of `rows` (row_bytes apart) from ptr, one
    prefetch a line (NL = lines(seg)): a chained kernel's constant weights, before `enter`.
    Nothing without PDL (a prefetch right before the loads gains nothing)."""
    if PDL != 0:
        line = tl.arange(0, NL)[None, :] * 128
        off = rows.to(tl.int64)[:, None] * row_bytes + start + line
        want = ((line < seg) & (off >= 0)).to(tl.int32)  # [rows, NL]: the lines past seg skipped
        tl.inline_asm_elementwise(
            """{
            .reg .pred p;
            setp.ne.s32 p, $2, 0;
            @p prefetch.global.L2 [$1];
            mov.u32 $0, 0;
            }""",
            "=r,l,r",
            [ptr.to(tl.pointer_type(tl.int8), bitcast=True) + off, want],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
