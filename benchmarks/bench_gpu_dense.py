"""Quantized dense GEMV (moestream/kernels/triton/dense.py) vs bf16 F.linear at decode, on a GPU.

Shapes of Qwen3-30B-A3B's dense weights: q_proj 4096x2048, q/k/v fused 5120x2048, o_proj
2048x4096, the output layer 151936x2048 and a 32000-token one. Per shape and token count: bf16
F.linear on the weight (what the GPU ran before: a dequantized copy) and the GEMV on its int8 /
int4 (/ q4_0) sections. Each variant is timed as a CUDA graph of `--calls` calls over enough
weight copies that every call reads from HBM (more than `MIN_CYCLE_BYTES` per cycle, past the
L2), replayed `--reps` times between CUDA events. Reported: us per call, bytes read (weight
sections + activations + output), GB/s, and the fraction of the HBM read ceiling measured in the
same run (bench_peers.dram_gbps: a 4 GiB fp32 sum), plus the GEMV's max error relative to the
reference (dequantize + F.linear in bf16) as a sanity check. JSON lines through common.bench_row.

    python benchmarks/bench_gpu_dense.py --out gpu_dense.jsonl [--tokens 1 8] [--quant int8 int4]
    python benchmarks/bench_gpu_dense.py --sweep --out gpu_dense.jsonl  # + every candidate config
    python benchmarks/bench_gpu_dense.py --dry-run   # CPU: one tiny shape through the interpreter

Tiles are gemv_config's untuned rule; --sweep also times dense.gemv_candidates per shape and token
count (rows' "tiles"; the rule's pick "rule": true, the fastest "best": true, BEST in the table). `--dry-run` checks the script end to end on the CPU (fp32
activations, the "bf16_linear" variant then runs in fp32: a row's config says its dtype), times
nothing that means anything, and writes rows only with --out.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

SHAPES = {
    "q_proj": (4096, 2048),
    "qkv_fused": (5120, 2048),
    "o_proj": (2048, 4096),
    "lm_head": (151936, 2048),
    "lm_head_32k": (32000, 2048),
}
DRY_SHAPES = {"tiny": (200, 256)}
MIN_CYCLE_BYTES = 512 << 20  # per graph cycle of weight copies: well past the H200's 60 MB L2


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="append JSON rows here")
    ap.add_argument(
        "--quant",
        nargs="+",
        default=["int8", "int4"],
        choices=["int8", "int4", "q4_0", "int4_rows"],
    )
    ap.add_argument("--tokens", nargs="+", type=int, default=[1])
    ap.add_argument("--calls", type=int, default=16, help="calls per captured graph (at least)")
    ap.add_argument("--reps", type=int, default=20, help="graph replays timed")
    ap.add_argument("--commit", default=None, help="source commit when the tree has no .git")
    ap.add_argument("--dry-run", action="store_true", help="CPU, interpreter, one tiny shape")
    ap.add_argument("--sweep", action="store_true",
                    help="time every dense.gemv_candidates config per shape, mark the fastest")  # fmt: skip
    ap.add_argument("--configs", default=None,
                    help="time the rule's tiles and these overrides of them per shape, e.g. "
                    "'bn=8,bk=1024;num_warps=2' (GemvConfig fields; 0/1 for flags; a split rule folds: "
                    "give split=1 with fold=0)")  # fmt: skip
    ap.add_argument("--shapes", nargs="+", default=None, choices=list(SHAPES),
                    help="only these shapes (default all)")  # fmt: skip
    a = ap.parse_args()
    if a.sweep and a.configs:
        ap.error("--sweep and --configs: pick one (both time several tiles per shape)")
    if any(not 1 <= t <= 8 for t in a.tokens):
        ap.error("--tokens: the GEMV is for decode, 1 to 8 tokens")
    return a


def weights(n: int, k: int, copies: int, quant: str | None, device: str) -> list:
    """`copies` random [n, k] weights: bf16 tensors (quant None) or section dicts (suffix ->
    tensor, quant.quantize)."""
    import torch

    from moestream.quant import make_scheme, quantize

    out = []
    for i in range(copies):
        g = torch.Generator(device=device).manual_seed(i)
        w = torch.randn(n, k, device=device, generator=g) / k**0.5
        out.append(w.to(torch.bfloat16) if quant is None else quantize(make_scheme(quant), w))
        del w
    return out


def time_us(calls: list, reps: int, cuda: bool) -> float:
    """us per call: a CUDA graph of the calls replayed `reps` times (CUDA events); on the CPU
    (dry run) one eager pass timed by the clock."""

    if not cuda:
        t0 = time.perf_counter()
        for c in calls:
            c()
        return (time.perf_counter() - t0) / len(calls) * 1e6
    from common import capture_graph, graph_replay_us

    g = capture_graph(lambda: [c() for c in calls])
    g.replay()
    return graph_replay_us(g, reps, len(calls))


def bench_shape(name: str, n: int, k: int, a, ceiling: float | None, device: str) -> list[dict]:
    """Rows of one shape: bf16 F.linear and the GEMV per quant, per token count."""
    import torch
    import torch.nn.functional as F

    cuda = device == "cuda"
    copies = max(1, -(-MIN_CYCLE_BYTES // (n * k * 2))) if cuda else 1  # bf16 bytes decide
    n_calls = max(a.calls, copies) if cuda else 1
    rows = []
    for T in a.tokens:
        x = torch.randn(T, k, device=device).to(torch.bfloat16 if cuda else torch.float32)
        act = T * (k + n) * x.element_size()  # x in, y out
        ws = [w.to(x.dtype) for w in weights(n, k, copies, None, device)]
        us = time_us(
            [lambda w=ws[i % copies]: F.linear(x, w) for i in range(n_calls)], a.reps, cuda
        )
        rows.append(
            _row(name, n, k, T, x.dtype, n_calls, "bf16_linear", us, n * k * 2 + act, ceiling)
        )
        del ws
        for quant in a.quant:
            rows += _gemv_rows(name, n, k, x, quant, copies, n_calls, a.reps, ceiling, a.sweep,
                               a.configs)  # fmt: skip
            if cuda:
                torch.cuda.empty_cache()
    return rows


def _gemv_rows(name, n, k, x, quant, copies, n_calls, reps, ceiling, sweep,
               spec=None) -> list[dict]:  # fmt: skip
    """The GEMV on `copies` quantized weights, with its error against dequantize + F.linear: with
    gemv_config's tiles, or (sweep) one row per gemv_candidates config, or (spec) the rule's and
    each override of them; the fastest marked best. A tile the shape or compiler refuses is
    reported and skipped."""
    import torch.nn.functional as F
    from common import override

    from moestream.kernels.ref import dequantize
    from moestream.kernels.triton.dense import gemv_candidates, gemv_impl
    from moestream.quant import int4_sz_kn, int4_to_rows

    stored = "int4" if quant == "int4_rows" else quant  # int4_rows: the GPU's repack of int4
    secs = [(sec["q"], next(v for s, v in sec.items() if s != "q"))
            for sec in weights(n, k, copies, stored, x.device.type)]  # fmt: skip
    suffix = {"int8": "s", "int4": "sz", "q4_0": "d"}[stored]
    ref = F.linear(x, dequantize({"w.q": secs[0][0], f"w.{suffix}": secs[0][1]}, "w", 32,
                                 x.dtype)).float()  # fmt: skip
    if quant == "int4_rows":
        secs = [int4_to_rows(q, sz, 32) for q, sz in secs]
    elif quant == "int4":  # the store-layout GEMV reads sz in [K/G, N, 2] order
        secs = [(q, int4_sz_kn(sz, n)) for q, sz in secs]
    q, scales = secs[0]
    nbytes = q.nbytes + scales.nbytes + x.shape[0] * (k + n) * x.element_size()  # + x in, y out
    configs = gemv_candidates(quant, n, k, 32, x.shape[0])  # the rule's tiles come first
    if spec:
        configs = [configs[0]] + [override(configs[0], i) for i in filter(None, spec.split(";"))]
    elif not sweep:
        configs = configs[:1]
    rows = []
    for i, cfg in enumerate(configs):
        if cfg.fma and k % (cfg.bk * cfg.split):
            print(f"{name} {quant} {cfg}: K={k} is not a multiple of bk * split", flush=True)
            continue
        calls = [lambda s=secs[j % copies]: gemv_impl(x, *s, None, quant, n, 32, cfg)
                 for j in range(n_calls)]  # fmt: skip
        try:
            us = time_us(calls, reps, x.is_cuda)
        except Exception as exc:  # a tile the shape or the compiler refuses: say so, go on
            print(f"{name} {quant} {cfg}: {type(exc).__name__}: {exc}", flush=True)
            continue
        err = (gemv_impl(x, q, scales, None, quant, n, 32, cfg).float() - ref).abs().max()
        extra = {
            "max_rel_err_vs_ref": (err / ref.abs().max()).item(),
            "tiles": asdict(cfg) | {"candidate": i, "rule": i == 0},
        }
        rows.append(_row(name, n, k, x.shape[0], x.dtype, n_calls, f"triton_{quant}", us, nbytes,
                         ceiling, extra))  # fmt: skip
    if (sweep or spec) and rows:
        min(rows, key=lambda r: r["us"])["best"] = True
    return rows


def _row(name, n, k, T, dtype, n_calls, variant, us, nbytes, ceiling, extra=None) -> dict:
    gbps = nbytes / (us * 1e-6) / 1e9
    return {
        "shape": name, "N": n, "K": k, "tokens": T, "calls_in_graph": n_calls, "variant": variant,
        "dtype": str(dtype).removeprefix("torch."), "us": us, "bytes": nbytes, "gbps": gbps,
        "hbm_read_gbps": ceiling, "of_ceiling": None if ceiling is None else gbps / ceiling,
        **(extra or {}),
    }  # fmt: skip


def main() -> None:
    a = parse()
    if a.dry_run:  # before triton is imported: it reads the variable when kernels are decorated
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from common import bench_row, write_rows

    device = "cpu" if a.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("bench_gpu_dense.py: no CUDA device; --dry-run checks it on the CPU", file=sys.stderr)
        sys.exit(2)
    if a.dry_run:
        ceiling = None  # the 4 GiB device sum is the ceiling; a dry run measures nothing
    else:
        from bench_peers import dram_gbps

        ceiling = dram_gbps(torch.get_num_threads(), device="cuda")
    results = []
    shapes = DRY_SHAPES if a.dry_run else {s: SHAPES[s] for s in a.shapes or SHAPES}
    for name, (n, k) in shapes.items():
        results += bench_shape(name, n, k, a, ceiling, device)
    keys = ("shape", "N", "K", "tokens", "dtype", "calls_in_graph")
    rows = [bench_row("gpu_dense", {"dry_run": a.dry_run} | {key: r.pop(key) for key in keys}, r,
                      a.commit) for r in results]  # fmt: skip
    write_rows(a.out, rows)
    print(
        "dry run: nothing measured" if ceiling is None else f"HBM read ceiling {ceiling:.0f} GB/s"
    )
    print(f"{'shape':12} {'T':>2} {'variant':13} {'us':>8} {'MB':>7} {'GB/s':>6} {'ceil':>5} "
          f"{'x bf16':>6} {'err':>8}  tiles")  # fmt: skip
    base = {}
    for r in rows:
        c = r["config"]
        key = (c["shape"], c["tokens"])
        base.setdefault(key, r["us"])  # the bf16 F.linear row comes first
        print(f"{c['shape']:12} {c['tokens']:>2} {r['variant']:13} {r['us']:8.1f} "
              f"{r['bytes'] / 1e6:7.1f} {r['gbps']:6.0f} {r['of_ceiling'] or 0:5.2f} "
              f"{base[key] / r['us']:6.2f} {r.get('max_rel_err_vs_ref', 0):8.1e}  "
              f"{_tiles(r)}")  # fmt: skip


def _tiles(r: dict) -> str:
    """A GEMV row's tiles for the table (rule: gemv_config's pick; best: the sweep's fastest)."""
    t = r.get("tiles")
    if t is None:
        return ""
    keys = ("bn", "bk", "split", "num_warps", "unroll") if t["fma"] else ("bn", "gps", "split")
    kind = (
        "fma "
        + "elem " * bool(t.get("elem"))
        + "fold " * bool(t.get("fold"))
        + "half " * bool(t.get("half"))
        if t["fma"]
        else "mma "
    )
    marks = (" rule" if t["rule"] else "") + (" BEST" if r.get("best") else "")
    return kind + ",".join(f"{key}={t[key]}" for key in keys) + marks


if __name__ == "__main__":
    main()
