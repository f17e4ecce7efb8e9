"""Routing statistics on hand-made traces whose answers are computed by hand."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from moestream.cli import main as cli_main
from moestream.obs import stats
from moestream.obs.trace import Trace, TraceModel, TraceWriter, load_trace

# E=4, K=2, 2 MoE layers, one sequence of 4 positions whose first 2 are the prompt.
IDS = np.array(
    [
        [[0, 1], [2, 3]],
        [[1, 2], [2, 3]],
        [[0, 1], [3, 2]],
        [[3, 0], [2, 3]],
    ]
)


@pytest.fixture
def t():
    return Trace.from_ids(IDS, num_experts=4, prompt_tokens=[2])


def test_counts_unique_and_hottest(t):
    np.testing.assert_array_equal(stats.expert_counts(t), [[3, 3, 1, 1], [0, 0, 4, 4]])
    assert stats.unique_per_layer(t) == [4, 2]
    h = stats.hottest(t, n=2)
    assert h[0] == {"experts": [0, 1], "counts": [3, 3], "share": 0.75}
    assert h[1] == {"experts": [2, 3], "counts": [4, 4], "share": 1.0}


def test_temporal_reuse(t):
    # layer 0: {0,1}->{1,2}->{0,1}->{3,0} shares one of two experts at every step.
    assert stats.temporal_reuse(t) == [0.5, 1.0]
    assert stats.temporal_reuse(t, generated_only=True) == [0.5, 1.0]


def test_reuse_does_not_cross_sequences():
    ids = np.array([[[0, 1]], [[0, 1]], [[2, 3]], [[2, 3]]])
    t = Trace.from_ids(ids, num_experts=4, lengths=[2, 2], prompt_tokens=[1, 1])
    assert stats.temporal_reuse(t) == [1.0]
    assert stats.unique_per_layer(t) == [4]
    s = stats.summarize(t)
    assert s["unique_experts_per_sequence"] == [[2], [2]]
    assert s["unique_experts_mean_per_sequence"] == [2.0, 2.0]


def test_coverage_and_curves(t):
    # layer 0 sorted counts 3,3,1,1 of 8: 50% needs 2, 80% (6.4) needs 3, 95% (7.6) needs 4.
    assert stats.coverage(t) == {"50%": [2, 1], "80%": [3, 2], "95%": [4, 2]}
    np.testing.assert_allclose(
        stats.coverage_curves(t), [[3 / 8, 6 / 8, 7 / 8, 1.0], [0.5, 1.0, 1.0, 1.0]]
    )


def test_entropy(t):
    h0, h1 = stats.entropy_bits(t)
    assert h0 == pytest.approx(3 - 0.75 * math.log2(3), abs=1e-12)
    assert h1 == pytest.approx(1.0, abs=1e-12)


def test_cross_layer(t):
    C = stats.cooccurrence(t, 0, 1)
    assert C[0, 2] == 3 and C[1, 3] == 3 and C[2, 2] == 1 and C[3, 3] == 1 and C[0, 0] == 0
    assert C.sum() == 4 * 2 * 2
    (pair,) = stats.cross_layer(t)
    assert pair["layers"] == [0, 1]
    assert pair["same_id"] == 0.25  # rows 1 and 3 share one id out of two
    assert pair["cooc_top_k"] == 1.0  # layer 1 always picks {2, 3}


def test_round_trip_and_cli_json(tmp_path, capsys):
    model = TraceModel("hand-made", 4, 2, [0, 1], 8, 2, 0, "float32")
    w = TraceWriter(tmp_path / "tr", model, hidden=False)
    w.append_step(IDS[:2], np.full((2, 2, 2), 0.5, np.float32), None)  # prefill of 2
    w.append_step(IDS[2:3], np.full((1, 2, 2), 0.5, np.float32), None)
    w.append_step(IDS[3:], np.full((1, 2, 2), 0.5, np.float32), None)
    w.end_sequence([5, 6, 7, 8], prompt_tokens=2, prompt="p", generated_ids=[7, 8, 9])
    w.append_step(IDS[:1], np.full((1, 2, 2), 0.5, np.float32), None)  # an unfinished sequence
    w.close()
    t = load_trace(tmp_path / "tr")
    assert t.n_positions == 4  # the unfinished sequence's row is dropped
    np.testing.assert_array_equal(t.ids, IDS)
    assert t.tokens.tolist() == [5, 6, 7, 8]
    assert t.is_prompt.tolist() == [True, True, False, False]
    assert cli_main(["stats", str(tmp_path / "tr"), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["unique_experts_per_layer"] == [4, 2]
    assert s["unique_experts_mean"] == 3.0
    assert s["temporal_reuse_per_layer"] == [0.5, 1.0]
    assert s["coverage"]["80%"] == [3, 2]
    assert cli_main(["stats", str(tmp_path / "tr")]) == 0
    text = capsys.readouterr().out
    assert "mean 3.0 of 4" in text
