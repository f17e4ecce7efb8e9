"""Shared benchmark plumbing: the row schema (moestream/obs/rows.py, shared with `moestream
bench`), config overrides, CUDA-event timing and CUDA graphs of a benchmark's calls."""

from __future__ import annotations

import statistics
from dataclasses import replace

from moestream.obs.rows import RESERVED, SCHEMA, bench_row, hardware, source, write_rows

__all__ = ["RESERVED", "SCHEMA", "bench_row", "capture_graph", "cuda_median_seconds",
           "graph_replay_us", "hardware", "median_seconds", "override", "source",
           "write_rows"]  # fmt: skip


def tiles_of(quant: str) -> str:
    """The layout whose tiles a quant name takes: "q4_k+q6_k" (a K-quant layer whose w2 has its
    own K-quant) takes q4_k's."""
    return quant.split("+")[0]


def group_of(quant: str) -> int:
    """The group the decode kernels take: 32, or a K-quant's 256-input super-block."""
    from moestream.kernels.triton.layout import KQUANTS

    return 256 if tiles_of(quant) in KQUANTS else 32


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


def capture_graph(fn):
    """A CUDA graph of fn(): run once on a side stream first (Triton compiles, lazy buffers are
    made outside the capture), then captured. Not replayed."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def graph_replay_us(graph, replays: int, n_calls: int) -> float:
    """us per call of a graph of `n_calls` calls, over `replays` back-to-back replays (CUDA
    events around them all)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * n_calls)
