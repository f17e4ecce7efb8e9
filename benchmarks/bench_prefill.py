"""Prefill on the CPU through the native kernels: one P-token prompt through a resident store,
timed whole and split into the expert layer ops, the dense projections and the rest (attention,
router, norms, Python), with the weight bytes each part reads and its rate.

Variants run interleaved in one process (medians of --repeats): `new` is the product path;
`old` is the path of before, selected here only (never a product flag): one native call per
expert (`_grouped` over `_ffn`, as without `_flat`) and the row kernels one token at a time (`_set_token_tile(1)`).

    python benchmarks/bench_prefill.py STORE [STORE ...] [--tokens 64] [--threads 2]
        [--repeats 5] [--variants new,old] [--out benchmarks/results/prefill.jsonl]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the CLI does

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_row, write_rows  # noqa: E402

from moestream.engine.kv_cache import KVCache  # noqa: E402
from moestream.experts.config import StreamConfig  # noqa: E402
from moestream.experts.streaming import StoreExperts  # noqa: E402
from moestream.kernels import dense, native  # noqa: E402
from moestream.runtime import open_model  # noqa: E402


class Timers:
    """Seconds spent inside wrapped callables, by name (not nested: the expert op excludes dense)."""

    def __init__(self):
        self.s: dict[str, float] = {}

    def wrap(self, name, fn):
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.s[name] = self.s.get(name, 0.0) + time.perf_counter() - t0

        return timed


@contextmanager
def variant(name: str, provider):
    """`old`: per-expert native calls and one-token row kernels; `new`: as shipped."""
    mod, flat = native.module(), provider._flat
    if name == "old":
        provider._flat = None  # _grouped then runs its per-expert path over the fixed slots
        mod._set_token_tile(1)
    try:
        yield
    finally:
        provider._flat = flat
        mod._set_token_tile(0)


def one_prefill(rt, ids: torch.Tensor, timers: Timers) -> float:
    cache = KVCache(rt.args, ids.numel() + 1, torch.float32)
    t0 = time.perf_counter()
    with torch.inference_mode():
        rt.model(ids, cache, 0, last_only=True)
    return time.perf_counter() - t0


def bytes_read(rt) -> dict:
    """Weight bytes a prefill reads: every expert record of every layer (64 tokens x top-8 of 128
    touch ~98% of them) and every dense QuantLinear once."""
    store = rt.provider.store
    experts = len(store.crc) * store.args.num_experts * store.layout.size
    dense_b = sum(
        sum(t.nbytes for t in m.qweight.sections().values())
        for m in rt.model.modules()
        if isinstance(m, dense.QuantLinear)
    )
    return {"experts": experts, "dense": dense_b}


def bench_store(path: str, args) -> list[dict]:
    cfg = StreamConfig(resident=True, kernel="native")
    rows = []
    with open_model(path, dtype="float32", experts=cfg, threads=args.threads) as rt:
        provider = rt.provider
        assert isinstance(provider, StoreExperts) and provider.native, "needs the native kernels"
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, rt.args.vocab_size, (args.tokens,), generator=g)
        timers = Timers()
        orig = {"experts": provider.experts, "linear": native.linear}
        provider.experts = timers.wrap("experts", provider.experts)
        native.linear = timers.wrap("dense", native.linear)
        try:
            one_prefill(rt, ids, timers)  # warm-up: caches, first calls
            per: dict[str, list] = {v: [] for v in args.variants}
            for _ in range(args.repeats):
                for v in args.variants:
                    timers.s = {}
                    with variant(v, provider):
                        total = one_prefill(rt, ids, timers)
                    per[v].append({"total": total, **timers.s})
        finally:
            provider.experts, native.linear = orig["experts"], orig["linear"]
        nbytes = bytes_read(rt)
        quant = provider.store.scheme.name
        for v, runs in per.items():
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            med["other"] = med["total"] - med["experts"] - med["dense"]
            res = {
                "prefill_tok_s": args.tokens / med["total"],
                "seconds": med,
                "expert_GBps": nbytes["experts"] / med["experts"] / 1e9,
                "dense_GBps": nbytes["dense"] / med["dense"] / 1e9,
                "bytes": nbytes,
                "runs_total_s": [r["total"] for r in runs],
            }
            conf = {"store": path, "quant": quant, "variant": v, "tokens": args.tokens,
                    "threads": args.threads, "layers": rt.args.num_hidden_layers}  # fmt: skip
            rows.append(bench_row("prefill_cpu", conf, res))
            print(
                f"{quant:<5} {v:<4} {res['prefill_tok_s']:7.1f} tok/s  total {med['total']:.3f} s"
                f"  experts {med['experts']:.3f} s ({res['expert_GBps']:.1f} GB/s)"
                f"  dense {med['dense']:.3f} s ({res['dense_GBps']:.1f} GB/s)"
                f"  other {med['other']:.3f} s",
                flush=True,
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stores", nargs="+")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--variants", default="new,old")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.variants = args.variants.split(",")
    assert set(args.variants) <= {"new", "old"}, "variants: new, old"
    torch.set_num_threads(args.threads)
    rows = [r for s in args.stores for r in bench_store(s, args)]
    write_rows(args.out, rows)


if __name__ == "__main__":
    main()
