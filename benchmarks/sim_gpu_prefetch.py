"""What the GPU pool's stale-gate prefetch (`--predictor stale-gate`, docs/gpu.md) would move, from
a `--hidden` trace, without a GPU: the trace's decode steps replayed through the pool's slot table
(store/policy.py `SlotTable`, the engine's policy) at VRAM budgets, once as the staged pool
(K staging slots taken from the budget) and once with the prefetch (2K more). Per decode token:
misses (records staged on a layer's critical path), misses a prefetch had already copied, the
prefetch's copies (predicted experts absent from the pool: router l+1 on layer l's router input,
`block.route` of the traced model), admissions, and their MB. It counts records, not time: what
the link carries and which part of it sits between a router and its experts.

The replay admits a step's misses at once; the engine admits them a step later (its table reads
a step behind the GPU), so this is a slightly warmer pool than the engine's.

    moestream trace -m STORE --prompts P.jsonl -n 48 --ignore-eos --hidden -o TRACE
    python benchmarks/sim_gpu_prefetch.py -m STORE --trace TRACE --shares 0.5,0.25 --out rows.jsonl
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_row, write_rows  # noqa: E402


def predictions(model, trace) -> np.ndarray:
    """[N, L, K] ids layer l + 1's router names from layer l's router input (column 0: -1)."""
    N, L, K = trace.ids.shape
    out = np.full((N, L, K), -1, dtype=np.int64)
    hidden = torch.from_numpy(np.asarray(trace.hidden, dtype=np.float32))
    with torch.no_grad():
        for col in range(1, L):
            _, ids = model.moe_blocks[col].route(hidden[:, col - 1])
            out[:, col] = ids.numpy()
    return out


def replay(trace, pred: np.ndarray, n_slots: int, policy: str, prefetch: bool) -> dict:
    """Counts per decode token through a SlotTable of n_slots (prefill chunks as the engine's)."""
    from moestream.obs.simulate import accesses
    from moestream.store.policy import SlotTable, make_policy

    layers = trace.model.moe_layers
    col_of = {layer: c for c, layer in enumerate(layers)}
    pol = make_policy(policy, layers=layers)
    table = SlotTable(n_slots, pol, trace.top_k)
    decode_rows = iter(np.flatnonzero(~trace.is_prompt).tolist())
    row = None
    n = {"misses": 0, "covered": 0, "prefetch_copies": 0, "routed": 0}
    for layer, experts, decode in accesses(trace, pol.capacity(n_slots)):
        if not decode:
            table.access(layer, experts)
            continue
        col = col_of[layer]
        if col == 0:
            row = next(decode_rows)
        misses = {e for e in experts if (layer, e) not in table}
        if prefetch and col > 0:
            absent = {int(e) for e in pred[row, col] if (layer, int(e)) not in table}
            n["prefetch_copies"] += len(absent)
            n["covered"] += len(misses & absent)
        n["misses"] += len(misses)
        n["routed"] += len(experts)
        table.access(layer, experts)
    tokens = int((~trace.is_prompt).sum())
    return {k: v / tokens for k, v in n.items()} | {"decode_tokens": tokens}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True, help="the store the trace was recorded from")
    ap.add_argument("--trace", required=True, help="a trace folder recorded with --hidden")
    ap.add_argument("--shares", default="0.5,0.25", help="fractions of the experts in VRAM")
    ap.add_argument("--policy", default="lrfu")
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default=None)
    a = ap.parse_args(argv)
    from moestream.obs.trace import load_trace
    from moestream.runtime import open_model
    from moestream.store.format import Store

    trace = load_trace(a.trace)
    if trace.hidden is None:
        print(f"{a.trace} has no router inputs: record it with `moestream trace --hidden`",
              file=sys.stderr)  # fmt: skip
        return 2
    size = Store(a.model).slot_size
    with open_model(a.model) as rt:
        pred = predictions(rt.model, trace)
    N, L, K = trace.ids.shape
    total = L * trace.num_experts
    rows = []
    for share in (float(s) for s in a.shares.split(",")):
        for prefetch in (False, True):
            slots = int(share * total) - K - 2 * K * prefetch  # the staging (and prefetch) sets
            r = replay(trace, pred, slots, a.policy, prefetch)
            critical = (r["misses"] - r["covered"]) * size / 1e6
            moved = (r["misses"] - r["covered"] + r["prefetch_copies"] + r["misses"]) * size / 1e6
            row = {"share": share, "variant": "prefetch" if prefetch else "staged",
                   "table_slots": slots, **r, "hit_rate": 1 - r["misses"] / r["routed"],
                   "critical_mb_per_token": critical,
                   "prefetch_mb_per_token": r["prefetch_copies"] * size / 1e6,
                   "admit_mb_per_token": r["misses"] * size / 1e6,
                   "pcie_mb_per_token": moved}  # fmt: skip
            rows.append(row)
            print(f"share {share:.2f} {row['variant']:<8}: hits {row['hit_rate']:.3f}, misses "
                  f"{r['misses']:.1f}/token, {r['covered']:.1f} covered by a prefetch, "
                  f"{r['prefetch_copies']:.1f} prefetch copies; MB/token: critical path "
                  f"{critical:.1f}, prefetch {row['prefetch_mb_per_token']:.1f}, admissions "
                  f"{row['admit_mb_per_token']:.1f}, PCIe {moved:.1f}")  # fmt: skip
    config = {"model": a.model, "trace": a.trace, "policy": a.policy, "record_bytes": size,
              "layers": L, "experts": trace.num_experts, "top_k": K}  # fmt: skip
    write_rows(a.out, [bench_row("sim_gpu_prefetch", config, r, a.commit) for r in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
