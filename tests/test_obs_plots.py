"""Trace plots: every PNG is written, has a sensible size, and a missing matplotlib is a clear error."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from moestream.cli import main as cli_main
from moestream.config import ConfigError
from moestream.obs import plots
from moestream.obs.trace import Trace


def make_trace():
    rng = np.random.default_rng(0)
    ids = np.stack([rng.permutation(16)[:4] for _ in range(40 * 3)]).reshape(40, 3, 4)
    return Trace.from_ids(ids, num_experts=16, prompt_tokens=[10, 5], lengths=[25, 15])


def test_plot_trace_writes_four_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    paths = plots.plot_trace(make_trace(), tmp_path, layer=2, sequence=1)
    assert [p.name for p in paths] == ["heatmap.png", "reuse.png", "coverage.png", "raster.png"]
    for p in paths:
        h, w = imread(p).shape[:2]
        assert 300 < h < 2000 and 500 < w < 2500, (p.name, h, w)
    with pytest.raises(ConfigError, match="not a MoE layer"):
        plots.plot_trace(make_trace(), tmp_path, layer=7)


def test_missing_matplotlib_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ConfigError, match=r"pip install 'moestream\[plot\]'"):
        plots.heatmap(make_trace(), tmp_path / "x.png")


def test_plot_cli(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from moestream.obs.trace import TraceModel, TraceWriter

    t = make_trace()
    w = TraceWriter(
        tmp_path / "tr", TraceModel("hand-made", 16, 4, [0, 1, 2], 8, 3, 0, "float32"), False
    )
    w.append_step(t.ids[:25], t.weights[:25], None)
    w.end_sequence(list(range(25)), prompt_tokens=10)
    w.close()
    assert cli_main(["plot", str(tmp_path / "tr"), "-o", str(tmp_path / "png")]) == 0
    assert sorted(p.name for p in (tmp_path / "png").iterdir()) == [
        "coverage.png",
        "heatmap.png",
        "raster.png",
        "reuse.png",
    ]
