"""The slot table's host time per decode token with reads in flight, as the GPU pool drives it
(`experts/gpu.py`: one `access` per MoE layer, the misses reserved until their admission lands
`--lag` steps later), with the policy dropping busy keys' heap entries (`watch_busy` / `released`)
and with holding disabled (the busy set as protection only: what the table did before). Uniform
random routing at Qwen3-30B-A3B's 128 experts x top-8, 16 layers; interleaved rounds, medians.
The two variants make the same choices (tests/test_store_policy.py); only the time differs.

    python benchmarks/bench_slot_table.py --slots 1016,504 --lags 1,2,4 --out rows.jsonl
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_row, write_rows  # noqa: E402

from moestream.store.policy import PolicyError, SlotTable, make_policy  # noqa: E402


def run(policy_name: str, hold: bool, slots: int, lag: int, layers: int, experts: int,
        topk: int, tokens: int) -> tuple[float, float]:  # fmt: skip
    """(ms of table work per token, hit rate) of one replay."""
    policy = make_policy(policy_name, layers=list(range(layers)))
    if not hold:
        policy.watch_busy = policy.released = lambda keys: None
    t = SlotTable(slots, policy, min_slots=topk)
    rng = random.Random(1)
    pending: list[list] = []
    seconds = 0.0
    for _ in range(tokens):
        if len(pending) >= lag:  # admissions land `lag` steps after they were issued
            t.release(pending.pop(0))
        admitted = []
        t0 = time.perf_counter()
        for layer in range(layers):
            try:
                step = t.access(layer, sorted(rng.sample(range(experts), topk)))
            except PolicyError:
                continue  # every victim busy: the pool reads these misses from the host
            keys = [(layer, e) for e, _ in step.misses]
            t.reserve(keys)
            admitted += keys
        seconds += time.perf_counter() - t0
        pending.append(admitted)
    return seconds / tokens * 1e3, t.hits / max(t.hits + t.misses, 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="lrfu", choices=["lrfu", "lfu"])
    ap.add_argument(
        "--slots", default="1016,504", help="table sizes (the H200 bench's 50%% / 25%%)"
    )
    ap.add_argument("--lags", default="1,2,4", help="steps an admission stays in flight")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default=None)
    a = ap.parse_args(argv)
    rows = []
    for slots in (int(v) for v in a.slots.split(",")):
        for lag in (int(v) for v in a.lags.split(",")):
            ms: dict[bool, list[float]] = {True: [], False: []}
            hit = 0.0
            for r in range(a.rounds):
                for hold in (True, False) if r % 2 == 0 else (False, True):
                    t, hit = run(a.policy, hold, slots, lag, a.layers, a.experts, a.topk, a.tokens)
                    ms[hold].append(t)
            on, off = statistics.median(ms[True]), statistics.median(ms[False])
            print(f"{a.policy} slots {slots:5d} lag {lag}: held {on:.3f} ms/token, not held "
                  f"{off:.3f} ({off / on:.2f}x), hit rate {hit:.2f}")  # fmt: skip
            for hold, t in ((True, on), (False, off)):
                rows.append({"policy": a.policy, "slots": slots, "lag": lag, "hold": hold,
                             "table_ms_per_token": t, "speedup_vs_not_held": off / t,
                             "hit_rate": hit})  # fmt: skip
    config = {k: getattr(a, k) for k in ("layers", "experts", "topk", "tokens", "rounds")}
    write_rows(a.out, [bench_row("slot_table", config, r, a.commit) for r in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
