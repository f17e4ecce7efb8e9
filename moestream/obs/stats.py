"""Routing statistics of a trace: distinct experts per layer (seed 000's table), hottest experts,
temporal reuse, coverage, routing entropy and cross-layer co-occurrence.

All functions take a `Trace` (see trace.py) and return plain Python numbers and lists, so the CLI
can print them or dump them as JSON. "Selections" are (position, layer, slot) entries: a layer
makes K selections per position.
"""

from __future__ import annotations

import numpy as np

from moestream.obs.trace import Trace

COVERAGE_LEVELS = (0.5, 0.8, 0.95)


def expert_counts(t: Trace, rows: np.ndarray | slice = slice(None)) -> np.ndarray:
    """[L, E] int64: how often each expert of each MoE layer was selected over `rows`."""
    ids = np.asarray(t.ids[rows], dtype=np.int64)  # [N, L, K]
    L, E = t.n_layers, t.num_experts
    flat = ids.transpose(1, 0, 2).reshape(L, -1) + np.arange(L)[:, None] * E  # [L, N*K]
    return np.bincount(flat.ravel(), minlength=L * E).reshape(L, E)


def unique_per_layer(t: Trace, rows: np.ndarray | slice = slice(None)) -> list[int]:
    return (expert_counts(t, rows) > 0).sum(axis=1).tolist()


def hottest(t: Trace, n: int = 5) -> list[dict]:
    """Per layer: the n most selected experts and the share of the layer's selections they take."""
    counts = expert_counts(t)
    out = []
    for c in counts:
        order = np.argsort(-c, kind="stable")[:n]
        total = c.sum()
        out.append(
            {
                "experts": order.tolist(),
                "counts": c[order].tolist(),
                "share": float(c[order].sum() / total) if total else 0.0,
            }
        )
    return out


def _overlap(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a, b [N, K] id sets per row -> [N] size of each row's intersection."""
    return (a[:, :, None] == b[:, None, :]).any(axis=2).sum(axis=1)


def _pairs(t: Trace, generated_only: bool) -> tuple[np.ndarray, np.ndarray]:
    """Row indices (prev, cur) of consecutive positions inside one sequence."""
    prev, cur = [], []
    for s in t.sequences:
        first = s["offset"] + (s["prompt_tokens"] if generated_only else 1)
        first = max(first, s["offset"] + 1)
        r = np.arange(first, s["offset"] + s["length"])
        prev.append(r - 1)
        cur.append(r)
    if not prev:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(prev), np.concatenate(cur)


def temporal_reuse(t: Trace, generated_only: bool = False) -> list[float | None]:
    """Per layer: the mean fraction of token t's experts that were also routed at t-1 (same
    sequence). With generated_only, only pairs whose token t is a generated position."""
    prev, cur = _pairs(t, generated_only)
    if len(cur) == 0:
        return [None] * t.n_layers
    ids = np.asarray(t.ids, dtype=np.int64)
    return [
        float(_overlap(ids[cur, col], ids[prev, col]).mean() / t.top_k) for col in range(t.n_layers)
    ]


def coverage(t: Trace, levels=COVERAGE_LEVELS) -> dict[str, list[int]]:
    """Per layer: the fewest experts whose selections add up to each level (e.g. 50%) of the
    layer's selections."""
    counts = expert_counts(t)
    out = {}
    for q in levels:
        need = []
        for c in counts:
            cum = np.cumsum(np.sort(c)[::-1])
            need.append(int(np.searchsorted(cum, q * cum[-1] - 1e-9) + 1) if cum[-1] else 0)
        out[f"{round(q * 100)}%"] = need
    return out


def coverage_curves(t: Trace) -> np.ndarray:
    """[L, E]: share of a layer's selections covered by its n most used experts (n = 1..E)."""
    counts = np.sort(expert_counts(t), axis=1)[:, ::-1].astype(np.float64)
    total = counts.sum(axis=1, keepdims=True)
    return np.cumsum(counts, axis=1) / np.where(total == 0, 1, total)


def entropy_bits(t: Trace) -> list[float]:
    """Per layer: entropy (bits) of the expert selection frequencies; log2(E) = uniform use."""
    out = []
    for c in expert_counts(t):
        p = c[c > 0] / c.sum() if c.sum() else np.zeros(0)
        out.append(float(-(p * np.log2(p)).sum()) + 0.0)
    return out


def cooccurrence(t: Trace, col_a: int, col_b: int) -> np.ndarray:
    """[E, E]: C[i, j] = positions that selected expert i at MoE column col_a and j at col_b."""
    E = t.num_experts
    a = np.asarray(t.ids[:, col_a], dtype=np.int64)  # [N, K]
    b = np.asarray(t.ids[:, col_b], dtype=np.int64)
    pairs = (a[:, :, None] * E + b[:, None, :]).ravel()
    return np.bincount(pairs, minlength=E * E).reshape(E, E)


def cross_layer(t: Trace) -> list[dict]:
    """For each pair of consecutive MoE layers (l, l+1) at the same position:
    same_id: fraction of layer l+1's experts with the same id as one of layer l's (ids are not
    aligned across layers, so this is near K/E);
    cooc_top_k: fraction of layer l+1's experts among the K scoring highest by co-occurrence with
    layer l's experts, counts taken from this same trace (in-sample: an upper bound for a
    predictor from ids alone)."""
    ids = np.asarray(t.ids, dtype=np.int64)
    K = t.top_k
    out = []
    for col in range(t.n_layers - 1):
        a, b = ids[:, col], ids[:, col + 1]
        C = cooccurrence(t, col, col + 1)
        scores = C[a].sum(axis=1)  # [N, E]: votes of layer l's experts for each next expert
        pred = np.argsort(-scores, axis=1, kind="stable")[:, :K]
        out.append(
            {
                "layers": [t.model.moe_layers[col], t.model.moe_layers[col + 1]],
                "same_id": float(_overlap(b, a).mean() / K) if len(a) else 0.0,
                "cooc_top_k": float(_overlap(b, pred).mean() / K) if len(a) else 0.0,
            }
        )
    return out


def summarize(t: Trace, top_n: int = 5) -> dict:
    """Everything `moestream stats` prints, as JSON-ready values."""
    uniq = unique_per_layer(t)
    per_seq = [unique_per_layer(t, sl) for sl in t.sequence_slices()]
    prompt = t.is_prompt
    return {
        "model_type": t.model.model_type,
        "num_experts": t.num_experts,
        "top_k": t.top_k,
        "moe_layers": list(t.model.moe_layers),
        "positions": t.n_positions,
        "prompt_positions": int(prompt.sum()),
        "generated_positions": int((~prompt).sum()),
        "sequences": len(t.sequences),
        "unique_experts_per_layer": uniq,
        "unique_experts_mean": float(np.mean(uniq)) if uniq else 0.0,
        "unique_experts_per_sequence": per_seq,
        "unique_experts_mean_per_sequence": [float(np.mean(u)) for u in per_seq],
        "hottest": hottest(t, top_n),
        "temporal_reuse_per_layer": temporal_reuse(t),
        "temporal_reuse_generated_per_layer": temporal_reuse(t, generated_only=True),
        "random_reuse": t.top_k / t.num_experts,
        "coverage": coverage(t),
        "entropy_bits_per_layer": entropy_bits(t),
        "max_entropy_bits": float(np.log2(t.num_experts)),
        "cross_layer": cross_layer(t),
    }


def _mean(xs) -> float:
    xs = [x for x in xs if x is not None]
    return float(np.mean(xs)) if xs else float("nan")


def format_table(s: dict) -> str:
    """The human-readable report of `summarize`'s dict: one row per MoE layer plus a summary."""
    E, K = s["num_experts"], s["top_k"]
    lines = [
        f"{s['model_type']}: {E} experts, top-{K}, {len(s['moe_layers'])} MoE layers; "
        f"{s['positions']} positions ({s['prompt_positions']} prompt, "
        f"{s['generated_positions']} generated) in {s['sequences']} sequence(s)",
        "",
        f"{'layer':>5} {'unique':>6} {'top5 share':>10} {'reuse':>6} {'reuse gen':>9} "
        f"{'cov50':>5} {'cov80':>5} {'cov95':>5} {'entropy':>7}  hottest",
    ]
    cov = s["coverage"]
    for i, layer in enumerate(s["moe_layers"]):
        h = s["hottest"][i]
        ru, rg = s["temporal_reuse_per_layer"][i], s["temporal_reuse_generated_per_layer"][i]
        lines.append(
            f"{layer:>5} {s['unique_experts_per_layer'][i]:>6} {h['share']:>10.3f} "
            f"{_fmt(ru):>6} {_fmt(rg):>9} {cov['50%'][i]:>5} {cov['80%'][i]:>5} "
            f"{cov['95%'][i]:>5} {s['entropy_bits_per_layer'][i]:>7.2f}  "
            + ",".join(map(str, h["experts"]))
        )
    lines += [
        "",
        f"unique experts per layer: mean {s['unique_experts_mean']:.1f} of {E} "
        f"({s['unique_experts_mean'] / E:.0%})",
    ]
    for i, m in enumerate(s["unique_experts_mean_per_sequence"]):
        lines.append(f"  sequence {i}: mean {m:.1f} of {E}")
    lines += [
        f"temporal reuse: mean {_mean(s['temporal_reuse_per_layer']):.3f} "
        f"(generated {_mean(s['temporal_reuse_generated_per_layer']):.3f}; random {s['random_reuse']:.3f})",
        f"entropy: mean {_mean(s['entropy_bits_per_layer']):.2f} bits (uniform {s['max_entropy_bits']:.2f})",
    ]
    if s["cross_layer"]:
        lines.append(
            f"cross-layer (l -> l+1): same id {_mean(c['same_id'] for c in s['cross_layer']):.3f}, "
            f"co-occurrence top-{K} (in-sample) {_mean(c['cooc_top_k'] for c in s['cross_layer']):.3f}"
        )
    return "\n".join(lines)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"
