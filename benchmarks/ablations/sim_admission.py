"""Scored admission against admitting every miss, replayed on the CPU through the engine's slot
table (docs/gpu.md, "Scored admission"): the GPU pool's device-side misses, where every decode
miss crosses the link for its step and an admitted one crosses it again into its slot, so the
link carries misses + admissions. Synthetic routing, since the benchmark checkpoints' routers are
random: per layer fixed logits x `skew` plus Gumbel noise, plus `corr` on the experts the layer
chose at the previous token (temporal locality); top-K of that. Admissions stay busy `lag` steps
(the pool admits behind the issued steps); with `--landed` a key is a hit only once its
admission landed (how the GPU pool counts: until its copy lands it is read from the mirror), so
a longer lag (admissions that pause for the staging land later) costs hits. Rows: hit rate,
admissions and records moved per token.

`--cpu` replays the CPU slot cache instead (not built; the question is whether to build it):
there every miss is read from the store once, admitted or not, so records moved = misses; a
declined miss would be read into scratch slots taken from the budget (2 x top-k: a step queued
ahead must not overwrite the one computing), so the scored table is 2 x top-k slots smaller;
reads land within their step (no lag).

    python benchmarks/ablations/sim_admission.py --slots 504,1016 --corr 0,1.5,3 --out rows.jsonl
    python benchmarks/ablations/sim_admission.py --landed --lag 8 --skew 1.0 --corr 1.5
    python benchmarks/ablations/sim_admission.py --cpu --layers 48 --slots 1536,3072   # Qwen3-30B
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import bench_row, write_rows  # noqa: E402

from moestream.store.policy import PolicyError, SlotTable, make_policy  # noqa: E402


def replay(slots: int, scored: bool, skew: float, corr: float, lag: int = 2, tokens: int = 600,
           warm: int = 200, layers: int = 16, experts: int = 128, topk: int = 8,
           seed: int = 1, policy: str = "lrfu", cpu: bool = False,
           landed: bool = False) -> dict:  # fmt: skip
    """One replay: after `warm` tokens, the hit rate and per token admissions / records moved
    (`cpu`: the CPU slot cache's rules, see the module's docstring). `landed`: a key whose
    admission is still in flight is a miss (the GPU pool reads it from the mirror until its copy
    lands and the slot is published); otherwise the table's own count (a hit once admitted)."""
    if cpu:
        slots -= 2 * topk if scored else 0  # the scratch sets come out of the budget
        lag = 0
    rng = np.random.default_rng(seed)
    table = SlotTable(slots, make_policy(policy, layers=list(range(layers))), min_slots=topk)
    logits = rng.normal(size=(layers, experts)) * skew
    prev = np.zeros((layers, experts))
    pending: list[list] = []
    inflight: set = set()  # keys of the pending admissions
    hits = misses = admitted = 0
    for tok in range(tokens):
        while pending and len(pending) >= lag:  # admissions land `lag` steps after issue
            done = pending.pop(0)
            table.release(done)
            inflight.difference_update(done)
        now: list = []
        for layer in range(layers):
            g = logits[layer] + rng.gumbel(size=experts) + corr * prev[layer]
            chosen = sorted(np.argsort(-g)[:topk].tolist())
            prev[layer] = 0.0
            prev[layer, chosen] = 1.0
            h0, m0 = table.hits, table.misses
            # routed keys the table holds whose copy has not landed: read from the mirror
            late = sum((layer, e) in inflight for e in chosen) if landed else 0
            try:
                step = table.access(layer, chosen, scored=scored)
            except PolicyError:  # every victim busy: these misses stay host reads
                if tok >= warm:
                    held = sum((layer, e) in table for e in chosen) - late
                    misses += topk - held
                    hits += held
                continue
            keys = [(layer, e) for e, _ in step.misses]
            if lag:
                table.reserve(keys)
                now += keys
            if tok >= warm:
                hits += table.hits - h0 - late
                misses += table.misses - m0 + late
                admitted += len(keys)
        pending.append(now)
        inflight.update(now)
    n = tokens - warm
    moved = misses if cpu else misses + admitted
    return {"hit_rate": hits / max(hits + misses, 1), "admissions_per_token": admitted / n,
            "records_moved_per_token": moved / n, "table_slots": slots}  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--slots", default="504,1016", help="table sizes (the H200 bench's 25%% / 50%%)"
    )
    ap.add_argument("--skew", default="0.5,1.0", help="routing skew: the fixed logits' scale")
    ap.add_argument("--corr", default="0,1.5,3", help="temporal locality: bonus of last choice")
    ap.add_argument("--lag", type=int, default=2, help="steps an admission stays in flight")
    ap.add_argument("--tokens", type=int, default=600)
    ap.add_argument("--policy", default="lrfu", choices=["lrfu", "lfu"])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument(
        "--cpu",
        action="store_true",
        help="the CPU slot cache: misses read once, scored's scratch from the budget",
    )
    ap.add_argument(
        "--landed",
        action="store_true",
        help="a key is a hit only once its admission landed (the GPU pool reads it from the "
        "mirror until then); default: once admitted, as the table counts",
    )
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default=None)
    a = ap.parse_args(argv)
    if a.tokens < 2:
        ap.error("--tokens must be at least 2 (a third of them warm the table)")
    if a.topk > a.experts:
        ap.error(f"--topk {a.topk} is more than --experts {a.experts}")
    rows = []
    for slots in (int(x) for x in a.slots.split(",")):
        for skew in (float(x) for x in a.skew.split(",")):
            for corr in (float(x) for x in a.corr.split(",")):
                r = {}
                for admit in ("all", "scored"):
                    r[admit] = replay(slots, admit == "scored", skew, corr, a.lag, a.tokens,
                                      a.tokens // 3, a.layers, a.experts, a.topk,
                                      policy=a.policy, cpu=a.cpu, landed=a.landed)  # fmt: skip
                    cfg = {"slots": slots, "skew": skew, "corr": corr, "lag": a.lag,
                           "tokens": a.tokens, "policy": a.policy, "admit": admit,
                           "layers": a.layers, "experts": a.experts, "topk": a.topk,
                           "target": "cpu" if a.cpu else "gpu", "landed": a.landed}  # fmt: skip
                    rows.append(bench_row("sim_admission", cfg, r[admit], a.commit))
                al, sc = r["all"], r["scored"]
                print(f"slots {slots:>5} skew {skew:.1f} corr {corr:.1f}: records moved/token "
                      f"{al['records_moved_per_token']:6.1f} -> {sc['records_moved_per_token']:6.1f}"
                      f", hit {al['hit_rate']:.3f} -> {sc['hit_rate']:.3f}, admissions "
                      f"{al['admissions_per_token']:.1f} -> {sc['admissions_per_token']:.1f}")  # fmt: skip
    write_rows(a.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
