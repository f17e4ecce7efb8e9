"""PNG plots of a trace (and of simulator results). matplotlib is an optional extra, imported only
when a plot is drawn: `pip install 'moestream[plot]'`."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from moestream.config import ConfigError
from moestream.obs import stats
from moestream.obs.trace import Trace


def _plt():
    try:
        import matplotlib
    except ImportError as e:
        raise ConfigError(
            f"plots need matplotlib ({e}); install it with: pip install 'moestream[plot]'"
        ) from e
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    fig.clf()
    return path


def _title(t: Trace) -> str:
    m = t.model
    return f"{m.model_type}: {m.num_experts} experts, top-{m.top_k}, {t.n_positions} positions"


def heatmap(t: Trace, path: Path) -> Path:
    """Layer x expert: each expert's share of its layer's selections."""
    plt = _plt()
    counts = stats.expert_counts(t).astype(np.float64)
    share = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
    L, E = share.shape
    fig, ax = plt.subplots(figsize=(min(4 + E / 12, 16), min(2 + L / 5, 10)))
    im = ax.imshow(share, aspect="auto", interpolation="nearest", cmap="magma")
    ax.set_xlabel("expert id")
    ax.set_ylabel("MoE layer")
    ax.set_yticks(range(L), [str(x) for x in t.model.moe_layers])
    if L > 24:
        ax.yaxis.set_major_locator(plt.MaxNLocator(12, integer=True))
    ax.set_title(f"expert selection share per layer (uniform = {1 / E:.3f})\n{_title(t)}")
    fig.colorbar(im, ax=ax, label="share of the layer's selections")
    return _save(fig, path)


def reuse(t: Trace, path: Path) -> Path:
    """Per layer: fraction of token t's experts also routed at t-1."""
    plt = _plt()
    layers = t.model.moe_layers
    x = np.arange(len(layers))
    fig, ax = plt.subplots(figsize=(max(6, len(layers) * 0.25 + 2), 4))
    for off, (vals, label) in zip(
        (-0.2, 0.2),
        (
            (stats.temporal_reuse(t), "all positions"),
            (stats.temporal_reuse(t, generated_only=True), "generated only"),
        ),
    ):
        v = [np.nan if y is None else y for y in vals]
        ax.bar(x + off, v, width=0.4, label=label)
    ax.axhline(t.top_k / t.num_experts, color="k", ls="--", lw=1, label="random (K/E)")
    ax.set_xticks(x, [str(v) for v in layers])
    if len(layers) > 24:
        ax.xaxis.set_major_locator(plt.MaxNLocator(16, integer=True))
    ax.set_ylim(0, 1)
    ax.set_xlabel("MoE layer")
    ax.set_ylabel("reuse from t-1")
    ax.set_title(f"temporal reuse of routed experts\n{_title(t)}")
    ax.legend(loc="lower right")
    return _save(fig, path)


def coverage(t: Trace, path: Path) -> Path:
    """Per layer: share of selections covered by the n most used experts."""
    plt = _plt()
    curves = stats.coverage_curves(t)  # [L, E]
    L, E = curves.shape
    n = np.arange(1, E + 1)
    fig, ax = plt.subplots(figsize=(7, 5))
    cmap = plt.get_cmap("viridis")
    for i, c in enumerate(curves):
        ax.plot(n, c, color=cmap(i / max(L - 1, 1)), lw=1.2)
    ax.plot(n, n / E, color="k", ls=":", lw=1, label="uniform use")
    for q in stats.COVERAGE_LEVELS:
        ax.axhline(q, color="grey", ls="--", lw=0.8)
        ax.text(E, q, f" {q:.0%}", va="center", fontsize=8)
    sm = plt.cm.ScalarMappable(
        cmap=cmap, norm=plt.Normalize(t.model.moe_layers[0], t.model.moe_layers[-1])
    )
    fig.colorbar(sm, ax=ax, label="MoE layer")
    ax.set_xlim(1, E)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("experts, most used first")
    ax.set_ylabel("share of selections covered")
    ax.set_title(f"coverage curves\n{_title(t)}")
    ax.legend(loc="lower right")
    return _save(fig, path)


def raster(t: Trace, path: Path, col: int | None = None, sequence: int = 0) -> Path:
    """Token x expert raster of one MoE layer (default: the middle one) for one sequence; the
    shade is the gate weight, the dashed line separates prompt and generated positions."""
    plt = _plt()
    col = t.n_layers // 2 if col is None else col
    s = t.sequences[sequence]
    sl = slice(s["offset"], s["offset"] + s["length"])
    ids = np.asarray(t.ids[sl, col], dtype=np.int64)  # [T, K]
    w = np.asarray(t.weights[sl, col], dtype=np.float32)
    T = ids.shape[0]
    img = np.full((t.num_experts, T), np.nan)
    img[ids, np.arange(T)[:, None]] = w
    fig, ax = plt.subplots(figsize=(min(4 + T / 15, 18), min(2 + t.num_experts / 12, 10)))
    im = ax.imshow(img, aspect="auto", interpolation="nearest", cmap="viridis", origin="lower")
    ax.axvline(s["prompt_tokens"] - 0.5, color="r", ls="--", lw=1.2)
    ax.text(s["prompt_tokens"], t.num_experts - 1, " generated →", color="r", va="top", fontsize=9)
    ax.set_facecolor("white")
    ax.set_xlabel("position (prompt | generated)")
    ax.set_ylabel("expert id")
    ax.set_title(
        f"routing of MoE layer {t.model.moe_layers[col]}, sequence {sequence}\n{_title(t)}"
    )
    fig.colorbar(im, ax=ax, label="gate weight")
    return _save(fig, path)


def plot_trace(
    t: Trace, out: str | Path, layer: int | None = None, sequence: int = 0
) -> list[Path]:
    """All trace plots into folder `out`; `layer` is a model layer index for the raster."""
    folder = Path(out)
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"{folder} is a file; plot -o names a folder for the PNGs")
    folder.mkdir(parents=True, exist_ok=True)
    col = None
    if layer is not None:
        if layer not in t.model.moe_layers:
            raise ConfigError(f"layer {layer} is not a MoE layer; MoE layers: {t.model.moe_layers}")
        col = t.model.moe_layers.index(layer)
    if not 0 <= sequence < len(t.sequences):
        raise ConfigError(f"sequence {sequence} does not exist; the trace has {len(t.sequences)}")
    return [
        heatmap(t, folder / "heatmap.png"),
        reuse(t, folder / "reuse.png"),
        coverage(t, folder / "coverage.png"),
        raster(t, folder / "raster.png", col, sequence),
    ]


def plot_simulation(results, total_experts: int, path: str | Path) -> Path:
    """Hit rate vs budget (as a fraction of all experts) for every simulated policy."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 5))
    for name in dict.fromkeys(r.label for r in results):
        rs = sorted((r for r in results if r.label == name), key=lambda r: r.n_slots)
        style = dict(color="k", ls="--") if name == "belady" else {}
        ax.plot(
            [r.n_slots / total_experts for r in rs],
            [r.decode_hit_rate for r in rs],
            marker="o",
            label=f"{name} (optimum)" if name == "belady" else name,
            **style,
        )
    ax.set_xlabel("cache budget (fraction of all experts)")
    ax.set_ylabel("decode hit rate")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.set_title("expert cache hit rate vs budget")
    ax.legend()
    return _save(fig, Path(path))


def plot_loss(history: list[dict], path: str | Path, title: str) -> Path:
    """Training loss per step (rows {stage, step, loss}), one line per stage, with a moving
    average over 10 steps."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    x0 = 0
    for stage in sorted({h["stage"] for h in history}):
        ys = np.array([h["loss"] for h in history if h["stage"] == stage])
        xs = x0 + np.arange(len(ys))
        ax.plot(xs, ys, alpha=0.3, label=f"stage {stage}")
        if len(ys) >= 10:
            ax.plot(
                xs[9:],
                np.convolve(ys, np.ones(10) / 10, "valid"),
                label=f"stage {stage}, mean of 10",
            )
        x0 += len(ys)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats)")
    ax.set_title(title)
    ax.legend()
    return _save(fig, Path(path))
