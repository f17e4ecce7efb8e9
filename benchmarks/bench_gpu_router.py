"""A decode step's routing on a CUDA GPU (moestream/kernels/triton/router.py `route_decode`: the
router's GEMM and the softmax top-k in one launch) by its tiles, against torch's three steps.

At 16 layers the routing took 96 us of a 761 us token in the H200 profile (6 us a layer for a
512 KB GEMV and a top-k). The launch's last program routes: 8 rounds of a max and a min across
its warps (`packed`: one max of a 64-bit key, the probability's bits above the expert's reverse
id, the same choice). Variants: router rows a program (`rows`), warps a program (`warps`),
`packed`; and torch's F.linear + softmax + topk (what a step ran before the kernel). Each
variant is timed as a CUDA graph of `--calls` calls over enough router weights that each call
reads from HBM (past the L2), replayed `--reps` times. JSON rows (common.bench_row): us per call,
and each variant's experts and weights are checked against torch's rule before it is timed
(`default_bits`: whether it also gives the product tiles' ids and weights bit for bit).

    python benchmarks/bench_gpu_router.py --out gpu_router.jsonl
    python benchmarks/bench_gpu_router.py --dry-run   # CPU: a tiny shape through the interpreter
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

# (experts, hidden, top-k, renormalised)
SHAPES = {"Qwen3-30B-A3B": (128, 2048, 8, True), "Qwen3.5-35B-A3B": (256, 2048, 8, True)}
DRY_SHAPES = {"tiny": (16, 64, 2, True)}
MIN_CYCLE_BYTES = 256 << 20  # router weights per graph cycle: well past the H200's 60 MB L2


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="append JSON rows here")
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4], help="router rows a program")
    ap.add_argument("--warps", nargs="+", type=int, default=[1, 2, 4])
    ap.add_argument("--calls", type=int, default=64, help="calls per captured graph (at least)")
    ap.add_argument("--reps", type=int, default=20, help="graph replays timed")
    ap.add_argument("--commit", default=None, help="source commit when the tree has no .git")
    ap.add_argument("--dry-run", action="store_true", help="CPU, interpreter, one tiny shape")
    a = ap.parse_args()
    for name in ("rows", "warps"):
        bad = [v for v in getattr(a, name) if v < 1 or v & (v - 1)]
        if bad:
            ap.error(f"--{name} {bad}: powers of two (1, 2, 4, ...)")
    return a


def torch_route(x, gate, k, renorm):
    """SparseMoe.route's rule in torch (logits in x's dtype, fp32 softmax, top-k, renormalised)."""
    import torch
    import torch.nn.functional as F

    p = F.linear(x, gate).float().softmax(-1)
    w, ids = torch.topk(p, k, -1)
    if renorm:
        w = w / w.sum(-1, keepdim=True)
    return w.to(x.dtype), ids


def same_choice(label, w, ids, want_w, want_ids) -> None:
    """The variant picks torch's experts with torch's weights (rtol 2^-7). The order of two
    experts may differ: the kernel's GEMV sums in another order than cuBLAS, so a near tie of two
    logits can round either way (seen at 256 experts)."""
    import torch

    got, want = ids[0].sort(), want_ids[0].sort()
    assert torch.equal(got.values, want.values), (label, ids, want_ids)
    torch.testing.assert_close(w[0, got.indices].float(), want_w[0, want.indices].float(),
                               rtol=2**-7, atol=1e-6)  # fmt: skip


def main() -> None:
    a = parse()
    if a.dry_run:  # before triton is imported: it reads the variable when kernels are decorated
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from common import bench_row, capture_graph, graph_replay_us, write_rows

    from moestream.kernels.triton.router import route_decode_impl

    cuda = not a.dry_run
    if cuda and not torch.cuda.is_available():
        print(
            "bench_gpu_router.py: no CUDA device; --dry-run checks it on the CPU", file=sys.stderr
        )
        sys.exit(2)
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    rows = []
    for name, (E, D, k, renorm) in (SHAPES if cuda else DRY_SHAPES).items():
        copies = max(1, MIN_CYCLE_BYTES // (E * D * 2)) if cuda else 1
        n_calls = max(a.calls, copies) if cuda else 1
        gen = torch.Generator().manual_seed(0)
        gates = [
            (torch.randn(E, D, generator=gen) / D**0.5).to(device, dtype) for _ in range(copies)
        ]
        x = torch.randn(1, D, generator=gen).to(device, dtype)
        want_w, want_ids = torch_route(x, gates[0], k, renorm)
        bits = route_decode_impl(x, gates[0], k, renorm, dtype)  # the product's tiles
        variants = [("torch", None)] + [
            (f"rows={r},warps={w},packed={int(p)}", dict(rows=r, warps=w, packed=p))
            for r, w, p in itertools.product(a.rows, a.warps, (False, True))
        ]
        for label, kw in variants:
            if kw is None:
                fn = lambda g: torch_route(x, g, k, renorm)  # noqa: E731
            else:
                fn = lambda g, kw=kw: route_decode_impl(x, g, k, renorm, dtype, **kw)  # noqa: E731
                w, ids = fn(gates[0])
                same_choice(label, w, ids, want_w, want_ids)
                exact = torch.equal(ids, bits[1]) and torch.equal(w, bits[0])
            calls = [lambda g=gates[i % copies]: fn(g) for i in range(n_calls)]
            if cuda:
                g = capture_graph(lambda: [c() for c in calls])
                g.replay()
                us = graph_replay_us(g, a.reps, n_calls)
            else:
                calls[0]()
                us = None  # a dry run measures nothing
            row = {"shape": name, "experts": E, "hidden": D, "topk": k, "variant": label,
                   "us": us, "calls_in_graph": n_calls,
                   "default_bits": None if kw is None else exact}  # fmt: skip
            rows.append(row)
            same = "" if kw is None else ("  (the default's bits)" if exact else "  (other bits)")
            print(f"{name:16} {label:28} " + ("dry run" if us is None else f"{us:6.2f} us") + same,
                  flush=True)  # fmt: skip
    keys = ("shape", "experts", "hidden", "topk", "variant", "calls_in_graph")
    write_rows(a.out, [bench_row("gpu_router", {"dry_run": a.dry_run} | {k: r.pop(k) for k in keys},
                                 r, a.commit) for r in rows])  # fmt: skip


if __name__ == "__main__":
    main()
