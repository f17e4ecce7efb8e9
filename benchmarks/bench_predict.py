"""Prefetch with routing prediction vs on-demand reads, on the reference model's MoE shape
(layers, experts, top-k) with Qwen3-30B-A3B expert shapes (D=2048, I=768, int4).

The big model's weights are random, so its routing and its predictions are replayed from the
reference model: the routing from a held-out trace recorded with hidden states, and every
predictor's predictions computed by running that predictor over the same trace (stale gate =
the reference model's next router on its hidden states, prerouter = its trained heads). Each
mode runs in its own subprocess after the store is evicted from the page cache (O_DIRECT reads).
Prints decode tok/s per budget (10/25/50% of expert bytes) and mode, the ratio to on-demand,
read GB/s against a raw O_DIRECT ceiling measured in the same run, prefetch precision and
prediction recall; appends JSON lines to benchmarks/results/predict.jsonl.

    .venv/bin/python benchmarks/bench_predict.py --ref models/pystd-moe-29m \
        --trace .cache/predict/trace-valid
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_stream import evict, seq_read_ceiling  # noqa: E402
from common import write_jsonl  # noqa: E402

MODES = [  # (name, predictor, routing)
    ("on-demand", "none", "exact"),
    ("temporal", "temporal", "exact"),
    ("stale-gate", "stale-gate", "exact"),
    ("prerouter", "prerouter", "exact"),
    ("oracle", "oracle", "exact"),
    ("predicted routing", "prerouter", "predicted"),
]

CHILD = r"""
import os
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning OpenMP threads starve IO threads
import json, sys, time, numpy as np, torch
torch.set_num_threads(int(sys.argv[5]))
from moestream.engine.kv_cache import KVCache
from moestream.obs.trace import load_trace
from moestream.predict.base import Prediction, Predictor
from moestream.predict.pipeline import attach
from moestream.store.io import IOConfig
from moestream.store.load import load_store
from moestream.store.stream import StreamConfig, stats_delta
store, mode, trace_dir, preds_file = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4]
seq, warm, n = (int(a) for a in sys.argv[6:9])
t = load_trace(trace_dir)
s = t.sequences[seq]
cfg = StreamConfig(memory_budget=mode["budget"], io=IOConfig(mode="direct", threads=4))
loaded = load_store(store, cfg)
model = loaded.model
cursor = [0]
def make_route(col):
    def route(x):  # the reference model's routing for the rows this forward runs
        r = slice(cursor[0], cursor[0] + x.shape[0])
        ids = torch.from_numpy(np.asarray(t.ids[r, col], dtype=np.int64))
        return torch.from_numpy(np.asarray(t.weights[r, col])), ids
    return route
for col, b in enumerate(model.moe_blocks):
    b.route = make_route(col)
class Replay(Predictor):
    name = "replay"
    def __init__(self, table):
        self.table = table
    def observe(self, col, pos, x, ids):
        return [Prediction(l, p, tuple(e)) for l, p, e in self.table.get(f"{pos},{col}", [])]
if mode["predictor"] != "none":
    table = json.load(open(preds_file))
    attach(model, Replay(table), mode["routing"]).reset()
p = model.moe_blocks[0].provider
V = loaded.args.vocab_size
tokens = [int(v) % V for v in t.tokens[s["offset"] : s["offset"] + s["length"]]]
P = s["prompt_tokens"]
assert P + warm + n <= len(tokens), "the trace sequence is too short for --warmup + --tokens"
cache = KVCache(loaded.args, P + warm + n, torch.float32)
with torch.no_grad():
    cursor[0] = s["offset"]
    model(torch.tensor(tokens[:P]), cache, 0, last_only=True)
    for pos in range(P, P + warm + n):
        if pos == P + warm:
            before, t0 = p.stats(), time.perf_counter()
        cursor[0] = s["offset"] + pos
        model(torch.tensor([tokens[pos]]), cache, pos, last_only=True)
    dt = time.perf_counter() - t0
d = stats_delta(before, p.stats())
p.close()
print(json.dumps({"decode_s": dt, "tok_s": n / dt, **d}))
"""


def build_store(work: Path, layers: int, experts: int, top_k: int) -> Path:
    from moestream.convert.synthetic import qwen3_moe_config, write_random_qwen3_moe
    from moestream.convert.writer import convert
    from moestream.quant import make_scheme

    store = work / f"store-L{layers}-E{experts}-K{top_k}-int4"
    if not (store / "manifest.json").is_file():
        cfg = qwen3_moe_config(hidden=2048, inter=768, experts=experts, top_k=top_k, layers=layers)
        hf = write_random_qwen3_moe(work / f"hf-L{layers}-E{experts}", cfg)
        convert(hf, store, make_scheme("int4"), progress=True)
    return store


def prediction_tables(ref: Path, trace, seq: int, heads: Path | None, work: Path) -> dict:
    """predictor -> file of {"pos,col": [[layer, pos, experts], ...]} emitted along sequence seq,
    plus each predictor's recall over that sequence's generated tokens."""
    import numpy as np
    import torch

    from moestream.predict.pipeline import make_predictor
    from moestream.predict.prerouter import PrerouterHeads
    from moestream.predict.recall import overall, replay_recall
    from moestream.runtime import open_model

    model = open_model(ref).generator.model
    h = PrerouterHeads.load(heads) if heads else None
    out = {}
    s = trace.sequences[seq]
    for name in ("temporal", "stale-gate", "prerouter", "oracle"):
        pred = make_predictor(name, model, heads=h, trace=trace)
        pred.reset()
        for _ in range(seq):
            pred.reset()  # the oracle replays sequence `seq`
        table = {}
        with torch.no_grad():
            for pos in range(s["length"]):
                row = s["offset"] + pos
                for col in range(trace.n_layers):
                    x = torch.from_numpy(np.array(trace.hidden[row, col], dtype=np.float32))
                    ps = pred.observe(col, pos, x, [int(e) for e in trace.ids[row, col]])
                    if ps:
                        table[f"{pos},{col}"] = [[p.layer, p.pos, list(p.experts)] for p in ps]
        path = work / f"preds-{name}-seq{seq}.json"
        path.write_text(json.dumps(table))
        fresh = make_predictor(name, model, heads=h, trace=trace)
        recall = overall(replay_recall(fresh, trace, [seq])) if name != "oracle" else 1.0
        out[name] = (path, recall)
    return out


def main() -> None:
    from moestream.obs.trace import load_trace
    from moestream.predict.prerouter import find_heads

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref", required=True, help="reference model folder (prerouter heads beside)")
    ap.add_argument("--trace", required=True, help="held-out trace of --ref with --hidden")
    ap.add_argument("--sequence", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=8, help="decode tokens before timing")
    ap.add_argument("--tokens", type=int, default=48, help="timed decode tokens")
    ap.add_argument("--budgets", default="10,25,50", help="percent of expert bytes")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", default=".cache/bench_predict")
    ap.add_argument("--out", default="benchmarks/results/predict.jsonl")
    a = ap.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    trace = load_trace(a.trace)
    L, E, K = trace.n_layers, trace.num_experts, trace.top_k
    store = build_store(work, L, E, K)
    tables = prediction_tables(Path(a.ref), trace, a.sequence, find_heads(a.ref), work)
    expert_bytes = sum(p.stat().st_size for p in store.glob("experts-*.bin"))
    evict(store)
    ceiling = seq_read_ceiling(next(store.glob("experts-*.bin")))
    record = expert_bytes // (L * E)
    meta = {
        "bench": "predict",
        "config": {"D": 2048, "I": 768, "E": E, "K": K, "layers": L, "quant": "int4"},
        "ref": str(a.ref),
        "trace": str(a.trace),
        "sequence": a.sequence,
        "tokens": a.tokens,
        "threads": a.threads,
        "expert_bytes": expert_bytes,
        "record_bytes": record,
        "seq_read_ceiling_gbps": ceiling,
    }
    print(
        f"{L} layers x {E} experts top-{K}, {record / 2**20:.2f} MiB/expert, store "
        f"{expert_bytes / 1e9:.2f} GB; O_DIRECT ceiling {ceiling:.2f} GB/s"
    )
    print(
        f"{'budget':>6} {'mode':18} {'tok/s':>7} {'x':>5} {'GB/tok':>7} {'read GB/s':>9} "
        f"{'hit %':>6} {'pf prec':>7} {'recall':>6}"
    )
    rows = []
    for pct in (int(b) for b in a.budgets.split(",")):
        base = None
        for name, predictor, routing in MODES:
            mode = {"budget": expert_bytes * pct // 100, "predictor": predictor, "routing": routing}
            table, recall = tables.get(predictor, (work / "none.json", None))
            evict(store)
            r = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    CHILD,
                    str(store),
                    json.dumps(mode),
                    a.trace,
                    str(table),
                    str(a.threads),
                    str(a.sequence),
                    str(a.warmup),
                    str(a.tokens),
                ],
                capture_output=True,
                text=True,
            )
            if r.returncode:
                print(r.stderr[-2000:], file=sys.stderr)
                r.check_returncode()
            s = json.loads(r.stdout.strip().splitlines()[-1])
            base = s["tok_s"] if base is None else base
            looks = s["hits"] + s["misses"]
            row = {
                **meta,
                "budget_pct": pct,
                "mode": name,
                "predictor": predictor,
                "routing": routing,
                **s,
                "speedup": s["tok_s"] / base,
                "gb_per_token": s["bytes_read"] / a.tokens / 1e9,
                "hit_rate": s["hits"] / looks if looks else 0.0,
                "recall": recall,
            }
            rows.append(row)
            print(
                f"{pct:5d}% {name:18} {s['tok_s']:7.2f} {row['speedup']:5.2f} "
                f"{row['gb_per_token']:7.3f} {s['read_gbps']:9.2f} {100 * row['hit_rate']:6.1f} "
                f"{s.get('prefetch_precision', 0.0):7.2f} "
                f"{'' if recall is None else f'{100 * recall:5.1f}%'}"
            )
    write_jsonl(a.out, rows)


if __name__ == "__main__":
    main()
