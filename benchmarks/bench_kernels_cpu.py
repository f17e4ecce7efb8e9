"""Per-expert CPU kernel cost at Qwen3-30B-A3B expert shapes (D=2048, I=768), one decode token.

For each scheme: time of one expert (gate+up, SiLU*up, down) through the dispatcher the engine
uses, the record bytes it reads, and the implied GB/s against the DRAM ceiling (~26 GB/s with 2
threads, ~13 with 1 on the dev box). int8 has no torch kernel with per-block scales, so it
dequantizes to fp32 and calls F.linear on every use: this measures what that costs.

    python benchmarks/bench_kernels_cpu.py [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_row, write_rows  # noqa: E402

from moestream.kernels.dispatch import qlinear  # noqa: E402
from moestream.kernels.ref import expert_ffn_q  # noqa: E402
from moestream.quant import RecordLayout, make_scheme, quantize_expert  # noqa: E402


def time_expert(scheme: str, D: int, I: int, n_experts: int, reps: int) -> dict:
    layout = RecordLayout.build(make_scheme(scheme), D, I)
    g = torch.Generator().manual_seed(0)
    # Several distinct experts so the weights come from DRAM, not cache.
    secs = [
        quantize_expert(
            layout,
            torch.randn(2 * I, D, generator=g) / D**0.5,
            torch.randn(D, I, generator=g) / I**0.5,
        )
        for _ in range(n_experts)
    ]
    x = torch.randn(1, D, generator=g)
    lin = qlinear("cpu")
    with torch.inference_mode():
        for s in secs:
            expert_ffn_q(x, s, 32, lin)
        t0 = time.perf_counter()
        for _ in range(reps):
            for s in secs:
                expert_ffn_q(x, s, 32, lin)
        dt = (time.perf_counter() - t0) / (reps * n_experts)
    return {
        "scheme": scheme,
        "record_bytes": layout.size,
        "us_per_expert": round(dt * 1e6, 1),
        "record_gbps": round(layout.size / dt / 1e9, 2),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results/kernels_cpu.jsonl")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    rows = []
    for scheme in ("bf16", "int8", "int4"):
        config = {"D": 2048, "I": 768, "threads": a.threads, "experts": 16, "reps": 5}
        row = bench_row("cpu_expert_kernel", config, time_expert(scheme, 2048, 768, 16, 5))
        print(row)
        rows.append(row)
    write_rows(a.out, rows)


if __name__ == "__main__":
    main()
