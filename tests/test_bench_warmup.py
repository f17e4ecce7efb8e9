"""Warm-up experiment bookkeeping (benchmarks/bench_warmup.py): hot-expert choice from a trace, the
summary's medians/ratios."""

from __future__ import annotations

import numpy as np
import pytest
from bench_warmup import WarmupConfig, hot_experts, random_experts, summarize

from moestream.config import ConfigError
from moestream.obs.trace import Trace


def test_hot_experts_per_layer():
    ids = np.array([[[0, 1], [2, 3]], [[1, 2], [2, 0]], [[1, 3], [2, 3]]])
    t = Trace.from_ids(ids, num_experts=4)
    assert hot_experts(t, 2) == {0: [1, 0], 1: [2, 3]}
    r = random_experts([0, 1], 4, 3, seed=0)
    assert sorted(r) == [0, 1] and all(len(set(v)) == 3 and max(v) < 4 for v in r.values())


def test_summary_medians_and_ratios():
    rows = [
        {"page_cache": "warm", "arm": a, "ttft_s": tt, "decode_tok_s": v, "prewarm_s": 0.0}
        for a, tt, v in [
            ("none", 0.1, 10.0),
            ("none", 0.3, 30.0),
            ("none", 0.2, 20.0),
            ("hot", 0.1, 22.0),
            ("hot", 0.1, 22.0),
        ]
    ]
    none, hot = summarize(rows)
    assert (none["arm"], none["n"], none["decode_tok_s"], none["ttft_s"]) == ("none", 3, 20.0, 0.2)
    assert hot["tok_s_vs_none"] == pytest.approx(0.1)
    assert hot["ttft_vs_none"] == pytest.approx(-0.5)


def test_config_is_checked():
    with pytest.raises(ConfigError, match="unknown arm"):
        WarmupConfig(arms=("none", "cold"))
    with pytest.raises(ConfigError, match="page-cache"):
        WarmupConfig(page_cache=("hot",))
