"""Offline recall of a predictor over a trace: replay each sequence through `observe` exactly as
the engine would and score every prediction against the recorded routing."""

from __future__ import annotations

import numpy as np
import torch

from moestream.obs.trace import Trace
from moestream.predict.base import Predictor


def replay_recall(
    predictor: Predictor, trace: Trace, seqs: list[int] | None = None, decode_only: bool = True
) -> list[dict]:
    """Per MoE column: {"positions": scored tokens with a prediction, "correct": predicted experts
    that were routed, "routed": K x positions, "recall": correct / routed or None}. Only generated
    tokens are scored with decode_only (prompt tokens still feed the predictor)."""
    L, K = trace.n_layers, trace.top_k
    out = [{"positions": 0, "correct": 0, "routed": 0} for _ in range(L)]
    empty = torch.empty(0)
    for i in range(len(trace.sequences)) if seqs is None else seqs:
        s = trace.sequences[i]
        predictor.reset()
        pending: dict[tuple[int, int], tuple[int, ...]] = {}
        for pos in range(s["length"]):
            row = s["offset"] + pos
            scored = not decode_only or pos >= s["prompt_tokens"]
            for col in range(L):
                ids = [int(e) for e in trace.ids[row, col]]
                guess = pending.pop((col, pos), None)
                if scored and guess is not None:
                    o = out[col]
                    o["positions"] += 1
                    o["routed"] += K
                    o["correct"] += len(set(guess) & set(ids))
                x = (
                    empty
                    if trace.hidden is None
                    else torch.from_numpy(np.array(trace.hidden[row, col]))
                )
                for p in predictor.observe(col, pos, x.float(), ids):
                    pending[(p.layer, p.pos)] = p.experts
    for o in out:
        o["recall"] = o["correct"] / o["routed"] if o["routed"] else None
    return out


def overall(rows: list[dict]) -> float | None:
    routed = sum(r["routed"] for r in rows)
    return sum(r["correct"] for r in rows) / routed if routed else None


HIDDEN_PREDICTORS = ("stale-gate", "prerouter")  # predict from the router input, not from ids


def recall_table(model, trace: Trace, names: list[str], heads=None) -> dict[str, list[dict]]:
    """Per predictor, per MoE column recall over the trace's generated tokens."""
    from moestream.config import ConfigError
    from moestream.predict.pipeline import make_predictor

    need = [n for n in names if n in HIDDEN_PREDICTORS]
    if need and trace.hidden is None:
        raise ConfigError(
            f"--predictor {need[0]} reads the router inputs, which this trace lacks: record it "
            "with `moestream trace --hidden`"
        )
    with torch.no_grad():
        return {
            n: replay_recall(make_predictor(n, model, heads=heads, trace=trace), trace)
            for n in names
        }


def format_recall(table: dict[str, list[dict]]) -> str:
    names = list(table)
    L = len(next(iter(table.values())))
    lines = ["layer " + " ".join(f"{n:>11}" for n in names)]

    def cell(r):
        return f"{'-':>11}" if r is None else f"{100 * r:10.1f}%"

    for col in range(L):
        lines.append(f"{col:5d} " + " ".join(cell(table[n][col]["recall"]) for n in names))
    lines.append("  all " + " ".join(cell(overall(table[n])) for n in names))
    return "\n".join(lines)
