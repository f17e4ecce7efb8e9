"""Seed 000's warm-up experiment: plain generation vs pre-warming the top-N hottest experts per
layer (from a router trace) vs N random experts, with the store's expert files in the OS page cache
and evicted from it; TTFT and decode tok/s over several repetitions in alternating order.

    python benchmarks/bench_warmup.py -m MODEL --trace TRACE [--reps 5] [--top-n 20] [--io mmap]
        [--out benchmarks/results/warmup.jsonl]

Same as `moestream bench warmup ...` (this script forwards its arguments); the code lives in
moestream/obs/warmup.py. Record a trace of the same model first with `moestream trace`.
"""

from __future__ import annotations

import sys

from moestream.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "warmup", *sys.argv[1:]]))
