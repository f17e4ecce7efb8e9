"""Prefetch with routing prediction vs on-demand reads, on the reference model's MoE shape
(layers, experts, top-k) with Qwen3-30B-A3B expert shapes (D=2048, I=768, int4).

The big model's weights are random, so its routing and its predictions are replayed from the
reference model: the routing from a held-out trace recorded with hidden states, and every
predictor's predictions computed by running that predictor over the same trace (stale gate =
the reference model's next router on its hidden states, prerouter = its trained heads). Each
mode runs in its own subprocess after the store is evicted from the page cache (O_DIRECT reads).
Prints decode tok/s per budget (10/25/50% of expert bytes) and mode (and the cold prefill's
time: the store is evicted before every run), the ratio to on-demand, bytes read per token, the
disk GB/s achieved (all reads / decode time) against a raw O_DIRECT ceiling measured in the same
run, the time stalled on reads (in all, and per layer in brackets: layer 0 first), prefetch
precision and prediction recall; every mode runs under each eviction policy of --policies (LRFU,
the default, and LRU), and "x" is the ratio to on-demand with the first policy; with --repeats N
the modes run N times interleaved and medians are added. --edge0-heads adds the prerouter modes
with Edge0's timing beside the --ref heads' (next-state heads: EDGE0_MODES). Appends JSON lines
to --out.

    .venv/bin/python benchmarks/bench_predict.py --ref models/pystd-moe-29m \
        --trace .cache/predict/trace-valid --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_stream import evict, seq_read_ceiling  # noqa: E402
from common import bench_row, write_rows  # noqa: E402

MODES = [  # (name, predictor, routing)
    ("on-demand", "none", "exact"),
    ("on-demand serial", "none", "exact"),  # read, then compute: no overlap inside a layer
    ("temporal", "temporal", "exact"),
    ("stale-gate", "stale-gate", "exact"),
    ("prerouter", "prerouter", "exact"),
    ("oracle", "oracle", "exact"),
    ("predicted routing", "prerouter", "predicted"),
    ("resident", "none", "exact"),  # every expert in RAM, no IO: the ceiling of any schedule
]
# With --edge0-heads (heads trained without --next-state): the same modes with Edge0's timing
# (head N at token t names layer N+1 of t+1), and the --ref heads' sets issued at that point (a
# what-if, not causal for next-state heads: their timing's cost alone, at the same sets).
EDGE0_MODES = [
    ("prerouter edge0", "prerouter-edge0", "exact"),
    ("predicted routing edge0", "prerouter-edge0", "predicted"),
    ("predicted routing early", "prerouter-early", "predicted"),
]

CHILD = r"""
import os
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning OpenMP threads starve IO threads
import json, sys, time, numpy as np, torch
torch.set_num_threads(int(sys.argv[5]))
from moestream.engine.kv_cache import KVCache
from moestream.obs.trace import load_trace
from moestream.predict.base import Prediction, Predictor
from moestream.experts.predicting import attach
from moestream.store.io import IOConfig
from moestream.loader import load_model
from moestream.experts.base import stats_delta
from moestream.experts.config import StreamConfig
store, mode, trace_dir, preds_file = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4]
seq, warm, n = (int(a) for a in sys.argv[6:9])
t = load_trace(trace_dir)
s = t.sequences[seq]
io = IOConfig(mode="direct", threads=mode["io_threads"], split=mode["split"], verify=mode["verify"])
cfg = StreamConfig(
    memory_budget=None if mode["resident"] else mode["budget"],  # resident: no cache, no budget
    resident=mode["resident"],
    io=io,
    policy=mode["policy"],
    overlap=mode["overlap"],
)
loaded = load_model(store, cfg)
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
        rows = self.table.get(f"{pos},{col}", [])
        return [Prediction(l, p, tuple(e), tuple(sc)) for l, p, e, sc in rows]
p = inner = loaded.provider
by_layer = {}  # layer -> seconds blocked on reads during the timed tokens
def stalled():
    st = inner.stats()
    return st.get("io_seconds", 0.0) + st.get("prefetch_wait_seconds", 0.0)
def timed_experts(layer, x, ids, weights, _run=inner.experts):
    s0 = stalled()
    y = _run(layer, x, ids, weights)
    if timing:
        by_layer[layer] = by_layer.get(layer, 0.0) + stalled() - s0
    return y
inner.experts = timed_experts
timing = False
if mode["predictor"] != "none":
    table = json.load(open(preds_file))
    p = attach(model, p, Replay(table), mode["routing"], mode["min_score"])
    p.reset()
V = loaded.args.vocab_size
tokens = [int(v) % V for v in t.tokens[s["offset"] : s["offset"] + s["length"]]]
P = s["prompt_tokens"]
assert P + warm + n <= len(tokens), "the trace sequence is too short for --warmup + --tokens"
cache = KVCache(loaded.args, P + warm + n, torch.float32)
with torch.no_grad():
    cursor[0] = s["offset"]
    t_pre = time.perf_counter()  # a cold prefill: the store was evicted before this process
    model(torch.tensor(tokens[:P]), cache, 0, last_only=True)
    prefill_s = time.perf_counter() - t_pre
    for pos in range(P, P + warm + n):
        if pos == P + warm:
            before, t0, timing = p.stats(), time.perf_counter(), True
        cursor[0] = s["offset"] + pos
        model(torch.tensor([tokens[pos]]), cache, pos, last_only=True)
    dt = time.perf_counter() - t0
d = stats_delta(before, p.stats())
p.close()
stall = [1e3 * by_layer.get(l, 0.0) / n for l in sorted(set(by_layer) | {0})]
print(json.dumps({"prefill_s": prefill_s, "prompt_tokens": P, "decode_s": dt, "tok_s": n / dt,
                  "stall_ms_by_layer": stall, **d}))
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


def prediction_tables(
    ref: Path, trace, seq: int, heads: Path | None, work: Path, ahead: int, edge0: Path | None
) -> dict:
    """predictor -> file of {"pos,col": [[layer, pos, experts], ...]} emitted along sequence seq,
    plus each predictor's recall over that sequence's generated tokens."""
    import numpy as np
    import torch

    from moestream.predict.pipeline import make_predictor
    from moestream.predict.prerouter import PrerouterHeads
    from moestream.predict.recall import overall, replay_recall
    from moestream.runtime import open_model

    model = open_model(ref).model
    h = PrerouterHeads.load(heads) if heads else None
    runs = [(n, n, h) for n in ("temporal", "stale-gate", "prerouter", "oracle")]
    if edge0 is not None:
        h0 = PrerouterHeads.load(edge0)
        if h0.next_state:
            raise SystemExit(f"--edge0-heads {edge0}: these are next-state heads (no Edge0 timing)")
        runs.append(("prerouter-edge0", "prerouter", h0))
    out = {}
    s = trace.sequences[seq]
    for label, name, h in runs:
        pred = make_predictor(name, model, heads=h, trace=trace, ahead=ahead)
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
                        table[f"{pos},{col}"] = [
                            [p.layer, p.pos, list(p.experts), list(p.scores)] for p in ps
                        ]
        path = work / f"preds-{label}-seq{seq}.json"
        path.write_text(json.dumps(table))
        fresh = make_predictor(name, model, heads=h, trace=trace)
        recall = overall(replay_recall(fresh, trace, [seq])) if name != "oracle" else 1.0
        out[label] = (path, recall)
        if label == "prerouter" and edge0 is not None and h is not None and h.next_state:
            path = work / f"preds-prerouter-early-seq{seq}.json"
            path.write_text(json.dumps(issued_early(table)))
            out["prerouter-early"] = (path, recall)
    return out


def issued_early(table: dict) -> dict:
    """The same predictions, each issued where Edge0 issues it: (layer L, token p) at token p-1's
    layer L-1 (next-state heads issue them all at token p's layer 0)."""
    early: dict[str, list] = {}
    for rows in table.values():
        for layer, pos, experts, scores in rows:
            if layer >= 1 and pos >= 1:
                early.setdefault(f"{pos - 1},{layer - 1}", []).append([layer, pos, experts, scores])
    return early


def main() -> None:
    from moestream.obs.trace import load_trace
    from moestream.predict.prerouter import find_heads
    from moestream.store.io import CRC_IMPL

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref", required=True, help="reference model folder (prerouter heads beside)")
    ap.add_argument("--trace", required=True, help="held-out trace of --ref with --hidden")
    ap.add_argument("--sequence", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=8, help="decode tokens before timing")
    ap.add_argument("--tokens", type=int, default=48, help="timed decode tokens")
    ap.add_argument("--budgets", default="10,25,50", help="percent of expert bytes")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--split", type=int, default=4, help="parallel part reads per record")
    ap.add_argument("--io-threads", type=int, default=4, help="IO pool threads")
    ap.add_argument(
        "--min-score",
        type=float,
        default=0.04,
        help="prefetch only experts the predictor scores at least this (router probability)",
    )
    ap.add_argument("--ahead", type=int, default=1, help="layers ahead the stale gate names")
    ap.add_argument(
        "--edge0-heads",
        default=None,
        help="heads trained without --next-state: adds the prerouter modes with Edge0's timing",
    )
    ap.add_argument("--no-verify", action="store_true", help="skip the crc32 of each record read")
    ap.add_argument(
        "--policies",
        default="lrfu,lru",
        help="eviction policies, comma list; every mode runs with each (ratios are to on-demand "
        "with the first policy, and to on-demand with the same policy)",
    )
    ap.add_argument("--repeats", type=int, default=1, help="runs per mode; medians reported")
    ap.add_argument("--modes", default=None, help="comma list of mode names (default: all)")
    ap.add_argument("--work", default=".cache/bench_predict")
    ap.add_argument("--out", default=None, help="append JSON rows here")
    a = ap.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    trace = load_trace(a.trace)
    L, E, K = trace.n_layers, trace.num_experts, trace.top_k
    store = build_store(work, L, E, K)
    edge0 = Path(a.edge0_heads) if a.edge0_heads else None
    tables = prediction_tables(
        Path(a.ref), trace, a.sequence, find_heads(a.ref), work, a.ahead, edge0
    )
    expert_bytes = sum(p.stat().st_size for p in store.glob("experts-*.bin"))
    evict(store)
    ceiling = seq_read_ceiling(next(store.glob("experts-*.bin")))
    record = expert_bytes // (L * E)
    config = {
        "D": 2048,
        "I": 768,
        "E": E,
        "K": K,
        "layers": L,
        "quant": "int4",
        "ref": str(a.ref),
        "trace": str(a.trace),
        "sequence": a.sequence,
        "tokens": a.tokens,
        "threads": a.threads,
        "io_split": a.split,
        "io_threads": a.io_threads,
        "min_score": a.min_score,
        "stale_gate_ahead": a.ahead,
        "heads": str(find_heads(a.ref)),
        "edge0_heads": a.edge0_heads,
        "verify_crc": not a.no_verify,
        "crc_impl": CRC_IMPL,
    }
    meta = {"expert_bytes": expert_bytes, "record_bytes": record, "seq_read_ceiling_gbps": ceiling}
    print(
        f"{L} layers x {E} experts top-{K}, {record / 2**20:.2f} MiB/expert, store "
        f"{expert_bytes / 1e9:.2f} GB; O_DIRECT ceiling {ceiling:.2f} GB/s"
    )
    print(
        f"{'budget':>6} {'mode/policy':26} {'tok/s':>7} {'x':>5} {'GB/tok':>7} {'disk GB/s':>9} "
        f"{'stall ms':>8} {'hit %':>6} {'pf prec':>7} {'prefill s':>9} {'recall':>6}"
    )
    rows = []
    policies = a.policies.split(",")
    for pct in (int(b) for b in a.budgets.split(",")):
        samples: dict[str, list[dict]] = {}
        for rep in range(a.repeats):  # modes interleaved, so slow spells of the box hit all
            base: dict[str, float] = {}  # policy -> on-demand tok/s in this repeat
            for policy in policies:
                for name, predictor, routing in MODES + (EDGE0_MODES if edge0 else []):
                    if a.modes and name not in a.modes.split(","):
                        continue
                    if name == "resident" and policy != policies[0]:
                        continue  # no cache, no policy: once per repeat
                    mode = {
                        "budget": expert_bytes * pct // 100,
                        "predictor": predictor,
                        "routing": routing,
                        "policy": policy,
                        "overlap": name != "on-demand serial",
                        "resident": name == "resident",
                        "split": a.split,
                        "io_threads": a.io_threads,
                        "min_score": a.min_score,
                        "verify": not a.no_verify,
                    }
                    table, recall = tables.get(predictor, (work / "none.json", None))
                    s = run_mode(store, mode, table, a)
                    base.setdefault(policy, s["tok_s"])
                    results = {
                        **meta,
                        "budget_pct": pct,
                        "mode": name,
                        "predictor": predictor,
                        "routing": routing,
                        "policy": policy,
                        "repeat": rep,
                        **s,
                        **derived(s, a.tokens),
                        "speedup": s["tok_s"] / base[policies[0]],
                        "speedup_same_policy": s["tok_s"] / base[policy],
                        "recall": recall,
                    }
                    row = bench_row("predict", config, results)
                    rows.append(row)
                    samples.setdefault(f"{name}/{policy}", []).append(row)
                    print(line(pct, f"{name}/{policy}", row, recall))
        if a.repeats > 1:
            print(f"median of {a.repeats} runs ({pct}%):")
            ref = statistics.median(r["tok_s"] for r in next(iter(samples.values())))
            same = {  # policy -> median on-demand tok/s
                rs[0]["policy"]: statistics.median(r["tok_s"] for r in rs)
                for rs in samples.values()
                if rs[0]["mode"] == "on-demand"
            }
            for name, rs in samples.items():
                keys = [k for k in MEDIAN_KEYS if all(k in r for r in rs)]
                med = {k: statistics.median(r[k] for r in rs) for k in keys}
                summary = {**rs[0], **med, "repeat": "median", "speedup": med["tok_s"] / ref}
                if rs[0]["policy"] in same:
                    summary["speedup_same_policy"] = med["tok_s"] / same[rs[0]["policy"]]
                summary["tok_s_samples"] = [r["tok_s"] for r in rs]
                if all("stall_ms_by_layer" in r for r in rs):  # elementwise medians
                    per = zip(*(r["stall_ms_by_layer"] for r in rs))
                    summary["stall_ms_by_layer"] = [statistics.median(v) for v in per]
                rows.append(summary)
                print(line(pct, name, summary, summary["recall"]))
    write_rows(a.out, rows)


MEDIAN_KEYS = (
    "tok_s",
    "prefill_s",
    "gb_per_token",
    "disk_gbps",
    "stall_ms_per_token",
    "hit_rate",
    "prefetch_precision",
)


def run_mode(store: Path, mode: dict, table: Path, a) -> dict:
    """One mode in a fresh process, after evicting the store from the page cache."""
    evict(store)
    args = [str(store), json.dumps(mode), a.trace, str(table), str(a.threads)]
    args += [str(a.sequence), str(a.warmup), str(a.tokens)]
    r = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True)
    if r.returncode:
        print(r.stderr[-2000:], file=sys.stderr)
        r.check_returncode()
    return json.loads(r.stdout.strip().splitlines()[-1])


def derived(s: dict, tokens: int) -> dict:
    looks = s["hits"] + s["misses"]
    return {
        "gb_per_token": s["bytes_read"] / tokens / 1e9,
        "hit_rate": s["hits"] / looks if looks else 0.0,
        # all bytes read (demand + prefetch) per second of decode, against the ceiling
        "disk_gbps": s["bytes_read"] / s["decode_s"] / 1e9,
        # decode time spent blocked on reads (demand misses + prefetches not yet done)
        "stall_ms_per_token": 1e3 * (s["io_seconds"] + s["prefetch_wait_seconds"]) / tokens,
    }


def line(pct: int, name: str, row: dict, recall) -> str:
    return (
        f"{pct:5d}% {name:26} {row['tok_s']:7.2f} {row['speedup']:5.2f} "
        f"{row['gb_per_token']:7.3f} {row['disk_gbps']:9.2f} "
        f"{row['stall_ms_per_token']:8.1f} {100 * row['hit_rate']:6.1f} "
        f"{row.get('prefetch_precision', 0.0):7.2f} {row.get('prefill_s', 0.0):9.2f} "
        f"{'' if recall is None else f'{100 * recall:5.1f}%'}"
        f"  [{' '.join(f'{v:.1f}' for v in row.get('stall_ms_by_layer', []))}]"
    )


if __name__ == "__main__":
    main()
