"""One decode token's attention (moestream/kernels/triton/attention.py) at long contexts, on a GPU:
the one-launch kernel (a program per query head, walking the positions serially) against the
split over the positions (heads x chunks programs, three launches) at each `--chunks` size and at
the kernel's own rule (`split_rule`: attention.split_chunk), side by side in one run.

Qwen3-30B-A3B's attention (32 query heads, 4 KV heads, head dim 128, q/k head norm, bf16). Per
context length: a captured CUDA graph of one call per cache copy (enough copies that a cycle reads
more than `MIN_CYCLE_BYTES`, past the L2), each copy a static cache of the engine's bucket for that
length (engine/graph.py: powers of two from 256) with the position as a device tensor, as in a
captured decode step; the variants' graphs replayed alternately, `--reps` rounds, medians.
Reported: us per call, the KV bytes the call must read (2 x KV heads x context x head dim x 2),
GB/s and the fraction of the HBM read ceiling measured in the same run, and each split's max
difference from the one-launch output (both round the probabilities as the torch code does; only
fp32 sums run in another order).

    python benchmarks/bench_gpu_attention.py --contexts 256 1024 8192 --chunks 64 256 --out rows.jsonl
    python benchmarks/bench_gpu_attention.py --dry-run   # CPU: interpreter, tiny heads
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

MIN_CYCLE_BYTES = 512 << 20  # per graph cycle of cache copies: well past the H200's 60 MB L2
QWEN3 = dict(heads=32, kv_heads=4, head_dim=128)
DRY = dict(heads=4, kv_heads=2, head_dim=32)


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--contexts", nargs="+", type=int, default=[128, 256, 512, 1024, 2048, 4096, 8192]
    )
    ap.add_argument(
        "--chunks",
        nargs="+",
        type=int,
        default=None,
        help="positions per program of the split (default 64 128 256; dry run 64)",
    )
    ap.add_argument("--reps", type=int, default=5, help="alternating rounds of graph replays")
    ap.add_argument("--replays", type=int, default=10, help="graph replays per round")
    ap.add_argument("--out", default=None, help="append JSON rows here")
    ap.add_argument("--commit", default=None, help="source commit when the tree has no .git")
    ap.add_argument("--dry-run", action="store_true", help="CPU, interpreter, tiny heads")
    a = ap.parse_args(argv)
    if any(c < 2 for c in a.contexts):
        ap.error("--contexts: lengths of at least 2 positions")
    if a.chunks is not None and any(c < 1 for c in a.chunks):
        ap.error("--chunks: at least 1 position per program")
    return a


def inputs(shape: dict, context: int, cap: int, copies: int, device: str, dtype):
    """`copies` (qkv, qk_w, cos, sin, kc, vc) of a decode token at position context - 1 over a
    cache bucket of `cap` positions holding context - 1 earlier ones, and the position as a
    device tensor."""
    import torch

    H, Hkv, hd = shape["heads"], shape["kv_heads"], shape["head_dim"]
    g = torch.Generator(device=device).manual_seed(context)
    out = []
    for _ in range(copies):
        qkv = torch.randn(1, (H + 2 * Hkv) * hd, device=device, generator=g).to(dtype)
        qk_w = (1 + 0.1 * torch.randn(H + Hkv, hd, device=device, generator=g)).to(dtype)
        ang = torch.rand(1, hd, device=device, generator=g) * 6.28
        kc, vc = (torch.randn(Hkv, cap, hd, device=device, generator=g).to(dtype) for _ in "kv")
        out.append((qkv, qk_w, ang.cos().to(dtype), ang.sin().to(dtype), kc, vc))
    return out, torch.tensor([context - 1], device=device)


def measure(shape: dict, context: int, a, device: str, ceiling: float | None) -> list[dict]:
    """Rows of one context: the one-launch kernel and the split at each chunk size, timed
    alternately."""
    import torch

    from moestream.engine.graph import bucket
    from moestream.kernels.triton import attention

    cuda = device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    H, Hkv, hd = shape["heads"], shape["kv_heads"], shape["head_dim"]
    cap = bucket(context, 1 << 30)  # the engine's capacity bucket for this length
    row_bytes = 2 * Hkv * hd * dtype.itemsize  # one position's k and v
    kv_bytes = context * row_bytes
    copies = max(1, -(-MIN_CYCLE_BYTES // (cap * row_bytes))) if cuda else 1
    sets, pos_t = inputs(shape, context, cap, copies, device, dtype)
    # (name, chunk) -> (SPLIT_CAP, CHUNK, MAX_CHUNKS): the one launch never splits; "split" takes
    # a fixed chunk; "split_rule" the kernel's own (attention.split_chunk)
    rule = (cap, attention.CHUNK, attention.MAX_CHUNKS)
    variants = {("one_launch", None): (1 << 62, attention.CHUNK, attention.MAX_CHUNKS)}
    variants |= {("split", c): (cap, c, 1 << 62) for c in a.chunks}
    variants[("split_rule", attention.split_chunk(cap))] = rule
    outs, graphs = {}, {}
    for (name, chunk), knobs in variants.items():

        def calls(knobs=knobs):  # the path is chosen per call (captured once on CUDA)
            saved = attention.SPLIT_CAP, attention.CHUNK, attention.MAX_CHUNKS
            attention.SPLIT_CAP, attention.CHUNK, attention.MAX_CHUNKS = knobs
            try:
                return [attention.attend_impl(qkv, w, c, s, kc, vc, pos_t, 0, 1e-6, hd**-0.5, 0,
                                              H, Hkv) for qkv, w, c, s, kc, vc in sets]  # fmt: skip
            finally:
                attention.SPLIT_CAP, attention.CHUNK, attention.MAX_CHUNKS = saved

        outs[name, chunk] = calls()[0].float()
        if cuda:
            from common import capture_graph

            graphs[name, chunk] = capture_graph(calls)
            graphs[name, chunk].replay()
        else:
            graphs[name, chunk] = calls
    times = {n: [] for n in variants}
    for rep in range(a.reps):
        for key in variants if rep % 2 == 0 else list(variants)[::-1]:
            times[key].append(replay_us(graphs[key], a.replays, len(sets), cuda))
    base = outs["one_launch", None]
    rows = []
    for name, chunk in variants:
        us = statistics.median(times[name, chunk])
        diff = ((outs[name, chunk] - base).abs().max() / base.abs().max()).item()
        gbps = kv_bytes / (us * 1e-6) / 1e9
        rows.append({"context": context, "bucket": cap, "variant": name, "us": us,
                     "us_all": times[name, chunk], "kv_bytes": kv_bytes, "gbps": gbps,
                     "hbm_read_gbps": ceiling,
                     "of_ceiling": None if ceiling is None else gbps / ceiling,
                     "chunk": chunk, "chunks": -(-cap // chunk) if chunk else 1,
                     "calls_in_graph": len(sets), "dtype": str(dtype).removeprefix("torch."),
                     "max_rel_diff_vs_one_launch": diff})  # fmt: skip
    return rows


def replay_us(graph, replays: int, n_calls: int, cuda: bool) -> float:
    """us per call of `replays` replays (CUDA events); on the CPU one eager round by the clock."""
    import time

    if cuda:
        from common import graph_replay_us

        return graph_replay_us(graph, replays, n_calls)
    t0 = time.perf_counter()
    graph()
    return (time.perf_counter() - t0) / n_calls * 1e6


def main(argv=None) -> int:
    a = parse(argv)
    if a.dry_run:  # before triton is imported: it reads the variable when kernels are decorated
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from common import bench_row, write_rows

    device = "cpu" if a.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("bench_gpu_attention.py: no CUDA device; --dry-run checks it on the CPU",
              file=sys.stderr)  # fmt: skip
        return 2
    shape = DRY if a.dry_run else QWEN3
    ceiling = None
    if not a.dry_run:
        from bench_peers import dram_gbps

        ceiling = dram_gbps(1, device="cuda")
    else:  # tiny chunks, so a short context is split into several
        from moestream.kernels.triton import attention

        attention.BLOCK_S = 16
    if a.chunks is None:
        a.chunks = [64] if a.dry_run else [64, 128, 256]
    rows = []
    for context in a.contexts:
        for r in measure(shape, context, a, device, ceiling):
            rows.append(r)
            name = r["variant"] + (f" {r['chunk']}" if r["chunk"] else "")
            print(f"context {context:>6} {name:>10}: {r['us']:8.2f} us, "
                  f"{r['gbps']:7.1f} GB/s of KV, diff {r['max_rel_diff_vs_one_launch']:.1e}")  # fmt: skip
        if device == "cuda":
            torch.cuda.empty_cache()
    config = {
        **shape,
        "dry_run": a.dry_run,
        "reps": a.reps,
        "replays": a.replays,
        "chunks": a.chunks,
    }
    write_rows(a.out, [bench_row("gpu_attention", config, r, a.commit) for r in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
