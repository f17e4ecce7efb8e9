"""Where a GPU decode step's time goes: wall time per token against the GPU kernels' time, the
kernel count per token, and the kernels that take it (torch.profiler, CUPTI), with CUDA graphs
and eager, every expert in VRAM.

A synthetic checkpoint with Qwen3-30B-A3B's shapes (hidden 2048, 32/4 heads x 128, 128 experts x
768, top-8, vocab 151936) and `--layers` layers is written on the spot and converted per quant.
Rows (`--out`): per (quant, variant) ms/token wall, GPU kernel us/token, kernels/token, the top
kernels (name, calls/token, us/token) and the dense / expert / lm-head shares by kernel name.

    PYTHONPATH=. python benchmarks/profile_gpu_decode.py --layers 4 --quants int4 --out rows.jsonl
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_gpu_graph import synthetic  # noqa: E402
from common import bench_row, write_rows  # noqa: E402

from moestream.config import SamplingConfig  # noqa: E402
from moestream.convert.writer import convert  # noqa: E402
from moestream.experts.config import GpuConfig  # noqa: E402
from moestream.quant import make_scheme  # noqa: E402
from moestream.runtime import open_model  # noqa: E402


def kernel_table(prof, tokens: int) -> tuple[float, int, list[dict]]:
    """(GPU kernel us per token, kernels per token, per-kernel rows sorted by time)."""
    by = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            row = by[ev.name]
            row[0] += 1
            row[1] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time
    rows = [{"kernel": n[:90], "calls_per_token": c / tokens, "us_per_token": t / tokens}
            for n, (c, t) in by.items()]  # fmt: skip
    rows.sort(key=lambda r: -r["us_per_token"])
    total = sum(r["us_per_token"] for r in rows)
    count = sum(r["calls_per_token"] for r in rows)
    return total, count, rows


def profile_one(store: Path, variant: str, a) -> dict:
    from torch.profiler import ProfilerActivity, profile

    base, _, sync = variant.partition("-")
    graph = base != "eager"
    experts = GpuConfig(resident=True, cuda_graph=graph, compile_step=base == "compiled")
    with open_model(store, dtype="bfloat16", experts=experts) as rt:
        if sync:  # the ablation: each step issued after the host read the one before
            rt.provider.decodes_ahead = lambda: False
        ids = rt.encode_prompt(a.prompt)
        cfg = SamplingConfig(max_new_tokens=a.tokens, ignore_eos=True)
        rt.generator.generate(ids, cfg)  # warm: compile, capture
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        res = rt.generator.generate(ids, cfg)
        wall = time.perf_counter() - t0
        s = res.stats()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            rt.generator.generate(ids, cfg)
            torch.cuda.synchronize()
    n = a.tokens  # one prefill + n-1 decode steps; the prefill is a small share at n=64
    us, count, rows = kernel_table(prof, n)
    return {
        "variant": variant,
        "decode_tok_s": s["decode_tok_s"],
        "ms_per_token": 1e3 / s["decode_tok_s"],
        "wall_s": wall,
        "gpu_kernel_us_per_token": us,
        "kernels_per_token": count,
        "gpu_busy_fraction": us / 1e3 / (1e3 / s["decode_tok_s"]),
        "host_ms_per_token": s.get("host_ms_per_token"),
        "top_kernels": rows[: a.top],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--quants", default="int4")
    ap.add_argument("-p", "--prompt", default="def fibonacci(n):")
    ap.add_argument("-n", "--tokens", type=int, default=64)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument(
        "--variants",
        default="graph,compiled",
        help="graph (captured eager ops), compiled (torch.compile'd, captured), eager; a -sync "
        "suffix issues each greedy step only after the host read the one before (the ablation "
        "of the step fed back on the device)",
    )
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default=None)
    a = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="moestream-prof-"))
    hf = synthetic(tmp, a.layers)
    rows = []
    for q in a.quants.split(","):
        store = convert(hf, tmp / q, make_scheme(q), False)
        for v in a.variants.split(","):
            r = {"quant": q, "layers": a.layers, **profile_one(store, v, a)}
            rows.append(r)
            print(
                f"{q} {r['variant']}: {r['decode_tok_s']:.1f} tok/s, {r['ms_per_token']:.3f} "
                f"ms/token, GPU kernels {r['gpu_kernel_us_per_token']:.0f} us/token "
                f"({r['kernels_per_token']:.0f} kernels), busy {r['gpu_busy_fraction']:.2f}, "
                f"host {r['host_ms_per_token'] or 0:.3f} ms/token"
            )
            for k in r["top_kernels"]:
                print(f"   {k['us_per_token']:8.1f} us {k['calls_per_token']:6.1f}x  {k['kernel']}")
    if a.out:
        config = {"layers": a.layers, "tokens": a.tokens, "prompt": a.prompt}
        write_rows(a.out, [bench_row("profile_gpu_decode", config, r, a.commit) for r in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
