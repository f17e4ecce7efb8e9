"""Shared benchmark plumbing: the row schema (moestream/obs/rows.py, shared with `moestream
bench`), config overrides and CUDA-event timing."""

from __future__ import annotations

import statistics
from dataclasses import replace

from moestream.obs.rows import RESERVED, SCHEMA, bench_row, hardware, source, write_rows

__all__ = ["RESERVED", "SCHEMA", "bench_row", "cuda_median_seconds", "hardware",
           "median_seconds", "override", "source", "write_rows"]  # fmt: skip


def override(cfg, spec: str):
    """A frozen config with fields replaced from 'bn=8,mma=1' (whole numbers; 0/1 for flags)."""
    kw = {k: int(v) for k, v in (kv.split("=") for kv in spec.split(","))}
    return replace(cfg, **{k: bool(v) if isinstance(getattr(cfg, k), bool) else v
                           for k, v in kw.items()})  # fmt: skip


def cuda_median_seconds(fn, reps: int, flush_bytes: int = 0) -> float:
    """Median seconds of fn() by CUDA events, after one warm-up call; with `flush_bytes` a buffer
    that large is zeroed before each call (the L2 flushed)."""
    import torch

    flush = torch.empty(flush_bytes, dtype=torch.uint8, device="cuda") if flush_bytes else None
    fn()
    times = []
    for _ in range(reps):
        if flush is not None:
            flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def median_seconds(fn, reps: int, cuda: bool, flush_bytes: int = 0) -> float:
    """Median seconds of fn() after one warm-up call: CUDA events (cuda_median_seconds, the L2
    flushed with `flush_bytes`), or the wall clock for a CPU dry run."""
    if cuda:
        return cuda_median_seconds(fn, reps, flush_bytes)
    import time

    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)
