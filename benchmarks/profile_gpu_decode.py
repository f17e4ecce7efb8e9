"""Where a GPU decode step's time goes: wall time per token against the GPU kernels' time, the
kernel count per token, and the kernels that take it (torch.profiler, CUPTI), with CUDA graphs
and eager, every expert in VRAM.

A synthetic checkpoint with Qwen3-30B-A3B's shapes (hidden 2048, 32/4 heads x 128, 128 experts x
768, top-8, vocab 151936) and `--layers` layers is written on the spot and converted per quant.
Rows (`--out`): per (quant, variant) ms/token wall, GPU kernel us/token, kernels/token, the top
kernels (name, calls/token, us/token) and the dense / expert / lm-head shares by kernel name.
`--store` profiles an existing store instead (e.g. gpu_peers.sh's), `--share S` a VRAM slot
pool of S of the expert bytes with device-side misses (then also the provider's counters per
token: host reads, admissions, bytes over PCIe, bookkeeping), and `--prefill 64,512` adds rows
for prompts of that many random ids (one prefill each, every expert resident or the same pool).

    PYTHONPATH=. python benchmarks/profile_gpu_decode.py --layers 4 --quants int4 --out rows.jsonl
    PYTHONPATH=. python benchmarks/profile_gpu_decode.py --store S --share 0.5 \
        --variants graph,graph-sync --prefill 64,512
    PYTHONPATH=. python benchmarks/profile_gpu_decode.py --store S --share 0.5 \
        --variants graph,graph+pause --timeline OUT   # each stream's busy time, the gaps
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

from moestream.config import Budget, SamplingConfig  # noqa: E402
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


# a variant's +suffixes: the pool's options (GpuConfig fields), as bench_peers' -pause / -hitsfirst
# (the field, its value; the pause is on by default wherever misses stage: +nopause turns it off)
POOL_OPTIONS = {"pause": ("admit_pause", True), "nopause": ("admit_pause", False),
                "hitsfirst": ("hits_first", True), "split": ("split_staging", True)}  # fmt: skip


def experts_config(base: str, share: float, opts: tuple[str, ...] = ()) -> GpuConfig:
    graph, compiled = base != "eager", base == "compiled"
    if share >= 1:  # main() refused pool options here
        return GpuConfig(resident=True, cuda_graph=graph, compile_step=compiled)
    return GpuConfig(gpu_budget=Budget(fraction=share), pinned_mirror=True, cuda_graph=graph,
                     compile_step=compiled, **dict(POOL_OPTIONS[o] for o in opts))  # fmt: skip


def timeline(prof, tokens: int, path: Path | None) -> dict:
    """The profiled run's GPU kernels by stream (from the Chrome trace): per token each stream's
    busy time and the time any stream is busy, so the idle gaps of a streamed step show; with
    `path`, the kernels (name, stream, start, duration in us) are also written there (gzip JSON)."""
    import gzip
    import json

    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text()).get("traceEvents", [])
    ks = sorted((float(e["ts"]), float(e["dur"]), str(e.get("args", {}).get("stream", e.get("tid"))),
                 e["name"][:60]) for e in events if e.get("cat") == "kernel" and "dur" in e)  # fmt: skip
    if not ks:
        return {}
    streams: dict[str, float] = defaultdict(float)
    for _, dur, st, _ in ks:
        streams[st] += dur
    union, end = 0.0, -1.0
    for ts, dur, _, _ in ks:  # the union of busy intervals over every stream
        if ts + dur > end:
            union += ts + dur - max(ts, end)
            end = ts + dur
    span = ks[-1][0] + ks[-1][1] - ks[0][0]
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(path, "wt") as f:
            json.dump([[round(ts, 2), round(dur, 2), st, name] for ts, dur, st, name in ks], f)
    return {
        "span_us_per_token": span / tokens,
        "any_busy_us_per_token": union / tokens,
        "stream_busy_us_per_token": {s: v / tokens for s, v in sorted(streams.items())},
    }


def pool_counters(before: dict, after: dict, steps: int) -> dict:
    """A streamed pool's decode counters per step (device misses)."""
    d = {k: (after[k] - before.get(k, 0)) / steps for k in
         ("host_reads", "host_read_bytes", "admit_bytes", "bookkeeping_seconds",
          "decode_table_seconds") if k in after}  # fmt: skip
    if "admit_bytes" in d:
        d["pcie_bytes_per_token"] = d["admit_bytes"] + d["host_read_bytes"]
        d["bookkeeping_ms_per_token"] = d.pop("bookkeeping_seconds") * 1e3
        d["table_ms_per_token"] = d.pop("decode_table_seconds") * 1e3
    return d


def profile_one(store: Path, variant: str, a) -> dict:
    from torch.profiler import ProfilerActivity, profile

    name, *opts = variant.split("+")
    base, _, sync = name.partition("-")
    experts = experts_config(base, a.share, tuple(opts))
    with open_model(store, dtype="bfloat16", experts=experts) as rt:
        if sync:  # the ablation: each step issued after the host read the one before
            rt.provider.decodes_ahead = lambda: False
        ids = rt.encode_prompt(a.prompt)
        cfg = SamplingConfig(max_new_tokens=a.tokens, ignore_eos=True)
        rt.generator.generate(ids, cfg)  # warm: compile, capture
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        before = rt.provider.stats()
        res = rt.generator.generate(ids, cfg)
        wall = time.perf_counter() - t0
        s = res.stats()
        # the counters take a step's routing once a later one runs: the last decode step's
        # never is, so n - 2 of the n - 1 steps are counted (test_gpu_provider asserts n - 2)
        pool = pool_counters(before, rt.provider.stats(), max(a.tokens - 2, 1))
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            rt.generator.generate(ids, cfg)
            torch.cuda.synchronize()
    n = a.tokens  # one prefill + n-1 decode steps; the prefill is a small share at n=64
    us, count, rows = kernel_table(prof, n)
    safe = f"{store.name}_{variant}".replace("+", "_")  # the device tool refuses odd names
    tl_path = Path(a.timeline) / f"timeline_{safe}.json.gz" if a.timeline else None
    lanes = timeline(prof, n, tl_path)
    stage = sum(r["us_per_token"] for r in rows if "_stage_kernel" in r["kernel"])
    if stage and pool.get("host_read_bytes"):  # the staged misses' rate inside the step
        pool["stage_gbps_in_step"] = pool["host_read_bytes"] / (stage * 1e3)
    return {
        "variant": variant,
        "decode_tok_s": s["decode_tok_s"],
        "ms_per_token": 1e3 / s["decode_tok_s"],
        "wall_s": wall,
        "gpu_kernel_us_per_token": us,
        "kernels_per_token": count,
        "gpu_busy_fraction": us / 1e3 / (1e3 / s["decode_tok_s"]),
        "host_ms_per_token": s.get("host_ms_per_token"),
        **pool,
        **lanes,
        "top_kernels": rows[: a.top],
    }


def profile_prefill(store: Path, tokens: int, a) -> dict:
    """One prompt of `tokens` random ids (after a warm-up prompt of the same length): wall time
    with a sync, the host's time until the forward returned (queueing the kernels; with a
    synchronising call inside, also waiting for them), and its kernels."""
    from torch.profiler import ProfilerActivity, profile

    from moestream.engine.kv_cache import KVCache

    with open_model(store, dtype="bfloat16", experts=experts_config("eager", a.share)) as rt:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, rt.args.vocab_size, (tokens,), generator=g).to(rt.generator.device)
        cache = KVCache(rt.args, tokens, rt.generator.dtype, rt.generator.device)
        model = rt.generator.model

        def once() -> float:
            """The forward's host time; returns after the GPU finished."""
            t0 = time.perf_counter()
            with torch.inference_mode():
                model(ids, cache, 0, last_only=True)
            host = time.perf_counter() - t0
            torch.cuda.synchronize()
            return host

        once()
        walls, hosts = [], []
        for _ in range(3):
            t0 = time.perf_counter()
            hosts.append(once())
            walls.append(time.perf_counter() - t0)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            once()
        syncs = host_syncs(once)
    wall = sorted(walls)[1]
    us, count, rows = kernel_table(prof, 1)
    return {"variant": f"prefill{tokens}", "prefill_tokens": tokens, "prefill_ms": wall * 1e3,
            "prefill_tok_s": tokens / wall, "host_ms": sorted(hosts)[1] * 1e3,
            "gpu_kernel_us": us, "kernels": count,
            "host_syncs": len(syncs), "host_sync_sites": syncs[:8],
            "top_kernels": rows[: a.top]}  # fmt: skip


def host_syncs(fn) -> list[str]:
    """The synchronising CUDA calls fn makes (torch's sync debug mode): the Python line of each."""
    import warnings

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return [f"{w.filename}:{w.lineno} {str(w.message)[:80]}" for w in got
            if "synchroniz" in str(w.message)]  # fmt: skip


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
        help="graph (captured eager ops), compiled (torch.compile'd, captured), eager; +pause / "
        "+nopause / +hitsfirst / +split: a pool's admit_pause on / off (on by default), hits_first, "
        "split_staging (--share < 1); a -sync "
        "suffix issues each greedy step only after the host read the one before (the ablation "
        "of the step fed back on the device)",
    )
    ap.add_argument("--store", default=None, help="profile this store (not a synthetic one)")
    ap.add_argument(
        "--share",
        type=float,
        default=1.0,
        help="fraction of expert bytes in a VRAM pool (device misses); 1 = resident",
    )
    ap.add_argument("--prefill", default="", help="prompt lengths to profile alone, e.g. 64,512")
    ap.add_argument(
        "--timeline",
        default=None,
        help="folder for each variant's GPU kernels by stream (timeline_<store>_<variant>.json.gz)",
    )
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default=None)
    a = ap.parse_args(argv)
    for v in a.variants.split(","):  # pool options: known ones, and only for a pool
        opts = v.split("+")[1:]
        bad = [o for o in opts if o not in POOL_OPTIONS]
        if bad:
            ap.error(f"unknown pool option {bad[0]!r} in {v!r}; use {', '.join(POOL_OPTIONS)}")
        if opts and a.share >= 1:
            ap.error(f"{v!r}: --share 1 (every expert resident) has no pool; drop the +options")
    if a.store:
        from moestream.store.format import Store

        st = Store(a.store)
        stores = {st.scheme.name: Path(a.store)}
        a.layers = st.args.num_hidden_layers
    else:
        tmp = Path(tempfile.mkdtemp(prefix="moestream-prof-"))
        hf = synthetic(tmp, a.layers)
        stores = {q: convert(hf, tmp / q, make_scheme(q), False) for q in a.quants.split(",")}
    config = {"layers": a.layers, "tokens": a.tokens, "prompt": a.prompt, "share": a.share,
              "store": a.store}  # fmt: skip
    for q, store in stores.items():
        for v in [v for v in a.variants.split(",") if v]:
            report(a, config, {"quant": q, "layers": a.layers, **profile_one(store, v, a)})
        for n in [int(x) for x in a.prefill.split(",") if x]:
            report(a, config, {"quant": q, "layers": a.layers, **profile_prefill(store, n, a)})
    return 0


def report(a, config: dict, r: dict) -> None:
    """Print one row and append it to --out at once (an interrupted run keeps what it did)."""
    if "prefill_ms" in r:
        print(f"{r['quant']} {r['variant']}: {r['prefill_ms']:.2f} ms = {r['prefill_tok_s']:.0f} "
              f"tok/s, host {r['host_ms']:.2f} ms, GPU kernels {r['gpu_kernel_us']:.0f} us "
              f"({r['kernels']:.0f} kernels), "
              f"{r['host_syncs']} host syncs")  # fmt: skip
        for site in r["host_sync_sites"]:
            print(f"   sync: {site}")
    else:
        print(
            f"{r['quant']} {r['variant']}: {r['decode_tok_s']:.1f} tok/s, {r['ms_per_token']:.3f} "
            f"ms/token, GPU kernels {r['gpu_kernel_us_per_token']:.0f} us/token "
            f"({r['kernels_per_token']:.0f} kernels), busy {r['gpu_busy_fraction']:.2f}, "
            f"host {r['host_ms_per_token'] or 0:.3f} ms/token"
        )
        if "pcie_bytes_per_token" in r:
            print(f"   PCIe {r['pcie_bytes_per_token'] / 1e6:.1f} MB/token (host reads "
                  f"{r['host_read_bytes'] / 1e6:.1f}, admitted {r['admit_bytes'] / 1e6:.1f}), "
                  f"bookkeeping {r['bookkeeping_ms_per_token']:.3f} ms/token (table "
                  f"{r['table_ms_per_token']:.3f})")  # fmt: skip
        if "stage_gbps_in_step" in r:
            print(f"   staged misses at {r['stage_gbps_in_step']:.1f} GB/s inside the step")
        if "span_us_per_token" in r:
            lanes = ", ".join(f"{s} {v:.0f}" for s, v in r["stream_busy_us_per_token"].items())
            print(f"   span {r['span_us_per_token']:.0f} us/token, some stream busy "
                  f"{r['any_busy_us_per_token']:.0f}; by stream: {lanes}")  # fmt: skip
    for k in r["top_kernels"]:
        per = k["us_per_token"]
        print(f"   {per:8.1f} us {k['calls_per_token']:6.1f}x  {k['kernel']}")
    if a.out:
        write_rows(a.out, [bench_row("profile_gpu_decode", config, r, a.commit)])


if __name__ == "__main__":
    sys.exit(main())
