"""Cache simulator: LRU and Belady hit counts on hand-made sequences equal hand-computed values."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moestream.cli import main as cli_main
from moestream.config import ConfigError
from moestream.obs.simulate import accesses, budget_slots, run_grid, simulate
from moestream.obs.trace import Trace, TraceModel, TraceWriter

# The textbook reference string 1,2,3,4,1,2,5,1,2,3,4,5 (here 0-based) with 3 frames:
# LRU faults 10 times, Belady's MIN 7 times.
REF = [0, 1, 2, 3, 0, 1, 4, 0, 1, 2, 3, 4]


def single_expert_trace(seq):
    return Trace.from_ids(np.array(seq)[:, None, None], num_experts=5, prompt_tokens=[1])


def test_lru_and_belady_on_the_textbook_string():
    t = single_expert_trace(REF)
    lru = simulate(t, "lru", n_slots=3, expert_bytes=100)
    assert (lru.hits, lru.misses) == (2, 10)
    opt = simulate(t, "belady", n_slots=3, expert_bytes=100)
    assert (opt.hits, opt.misses) == (5, 7)
    assert opt.bytes_read == 700 and opt.bytes_per_token == pytest.approx(700 / 12)
    # row 0 is the prompt: the 11 decode accesses miss 9 (LRU) and 6 (MIN) times
    assert (lru.decode_hits, lru.decode_misses) == (2, 9)
    assert (opt.decode_hits, opt.decode_misses) == (5, 6)
    assert opt.decode_bytes_per_token == pytest.approx(600 / 11)


def test_everything_fits_only_cold_misses():
    t = single_expert_trace(REF)
    for name in ("lru", "lfu", "belady"):
        r = simulate(t, name, n_slots=5, expert_bytes=1)
        assert (r.hits, r.misses) == (7, 5), name


def test_two_layers_top2_with_in_step_protection():
    # rows (layer 0, layer 1): ({0,1},{0,1}), ({0,2},{0,1}), ({1,2},{2,3}) with 4 slots.
    # LRU by hand: row 0 misses 4; row 1: (0,2) misses, evicting (0,1); row 2: (0,1) misses
    # evicting (0,0), (1,2) and (1,3) miss evicting (1,0), (1,1). 8 misses, 4 hits.
    ids = np.array([[[0, 1], [1, 0]], [[2, 0], [0, 1]], [[1, 2], [3, 2]]])
    t = Trace.from_ids(ids, num_experts=4, prompt_tokens=[1])
    r = simulate(t, "lru", n_slots=4, expert_bytes=1)
    assert (r.hits, r.misses) == (4, 8)
    assert simulate(t, "belady", n_slots=4, expert_bytes=1).misses == 8


def test_accesses_follow_the_engine_order():
    # prompt of 2 positions (one prefill), then 1 decode position; 1 layer, top-2
    ids = np.array([[[3, 1]], [[0, 3]], [[2, 0]]])
    t = Trace.from_ids(ids, num_experts=4, prompt_tokens=[2])
    assert list(accesses(t, n_slots=2)) == [
        (0, [0, 1], False),  # prefill: distinct experts ascending, chunks of n_slots
        (0, [3], False),
        (0, [0, 2], True),  # decode: the token's experts ascending
    ]


def test_budget_slots():
    assert budget_slots("0.25", 64, 1000) == 16
    assert budget_slots("25%", 64, 1000) == 16
    assert budget_slots("1.0", 64, 1000) == 64
    assert budget_slots("10KiB", 64, 1000) == 10
    assert budget_slots("4000", 64, 1000) == 4  # a unitless integer is bytes
    assert budget_slots("1GiB", 64, 1000) == 64  # capped at every expert
    with pytest.raises(ConfigError, match="fraction"):
        budget_slots("1MiB", 64, 0)
    for bad, msg in [("2", "holds no expert"), ("1.5", "--budget 1.5"), ("0", "> 0")]:
        with pytest.raises(ConfigError, match=msg):
            budget_slots(bad, 64, 1000)


def test_grid_and_cli(tmp_path, capsys):
    t = single_expert_trace(REF)
    results, skipped = run_grid(t, ["lru"], ["0.6", "1.0"], expert_bytes=100)
    assert [(r.policy, r.n_slots, r.misses) for r in results] == [
        ("lru", 3, 10),
        ("belady", 3, 7),
        ("lru", 5, 5),
        ("belady", 5, 5),
    ]
    assert skipped == []

    model = TraceModel("hand-made", 5, 1, [0], 8, 1, 0, "float32", expert_bytes=100)
    w = TraceWriter(tmp_path / "tr", model, hidden=False)
    w.append_step(np.array(REF[:1])[:, None, None], np.ones((1, 1, 1), np.float32), None)
    for e in REF[1:]:
        w.append_step(np.array([[[e]]]), np.ones((1, 1, 1), np.float32), None)
    w.end_sequence(list(range(12)), prompt_tokens=1)
    w.close()
    argv = ["simulate", str(tmp_path / "tr"), "--policy", "lru", "--budget", "300", "--json"]
    assert cli_main(argv) == 0
    rows = json.loads(capsys.readouterr().out)["results"]
    assert [(r["policy"], r["n_slots"], r["misses"]) for r in rows] == [
        ("lru", 3, 10),
        ("belady", 3, 7),
    ]
    png = tmp_path / "sim.png"
    argv = ["simulate", str(tmp_path / "tr"), "--policy", "lru", "--budget", "0.6"]
    assert cli_main([*argv, "--budget", "1.0", "--plot", str(png)]) == 0
    assert "belady" in capsys.readouterr().out
    assert png.stat().st_size > 10_000


def test_gpu_admission_rules_by_hand():
    """The GPU pool's replay (admit): a decode miss crosses the link for its step and an admitted
    one again. LFU, 2 slots, prompt [0], then decode 1 0 2 0 2 1. Every miss admitted: 2 evicts 1
    (count 1), later 1 evicts 2: misses at 1, 2, 1 and 3 admissions. Scored: 2 (count 0, then 1)
    never beats 1 (count 1): declined twice, 1 stays and hits; misses at 1, 2, 2, 1 admission."""
    t = single_expert_trace([0, 1, 0, 2, 0, 2, 1])
    cpu = simulate(t, "lfu", n_slots=2, expert_bytes=10)
    every = simulate(t, "lfu", n_slots=2, expert_bytes=10, admit="all")
    scored = simulate(t, "lfu", n_slots=2, expert_bytes=10, admit="scored")
    assert (every.decode_hits, every.decode_misses, every.decode_admissions) == (3, 3, 3)
    assert (scored.decode_hits, scored.decode_misses, scored.decode_admissions) == (3, 3, 1)
    assert (cpu.decode_hits, cpu.decode_misses, cpu.admit) == (3, 3, None)
    # bytes: the prompt's miss once, then misses + admissions over the link
    assert every.bytes_read == 10 * (1 + 3 + 3) and scored.bytes_read == 10 * (1 + 3 + 1)
    assert cpu.bytes_read == 10 * (1 + 3)
    assert (every.label, scored.label, cpu.label) == ("lfu/all", "lfu/scored", "lfu")
    with pytest.raises(ConfigError, match="scored"):
        simulate(t, "lfu", n_slots=2, expert_bytes=10, admit="some")


def test_cli_replays_the_gpu_admission_rules(tmp_path, capsys):
    model = TraceModel("hand-made", 5, 1, [0], 8, 1, 0, "float32", expert_bytes=100)
    w = TraceWriter(tmp_path / "tr", model, hidden=False)
    seq = [0, 1, 0, 2, 0, 2, 1]
    for e in seq:
        w.append_step(np.array([[[e]]]), np.ones((1, 1, 1), np.float32), None)
    w.end_sequence(list(range(len(seq))), prompt_tokens=1)
    w.close()
    argv = ["simulate", str(tmp_path / "tr"), "--policy", "lfu", "--budget", "200"]
    assert cli_main([*argv, "--gpu-admit", "all,scored", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["results"]
    assert [(r["policy"], r["admit"], r["decode_admissions"]) for r in rows] == [
        ("lfu", "all", 3), ("lfu", "scored", 1), ("belady", None, 0)]  # fmt: skip
    assert cli_main([*argv, "--gpu-admit", "scored"]) == 0
    assert "lfu/scored" in capsys.readouterr().out
    assert cli_main([*argv, "--gpu-admit", "most"]) == 2
    assert "unknown admission rule 'most'" in capsys.readouterr().err
