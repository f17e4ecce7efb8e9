"""scripts/replay_issue18.py, which replays every input of issue 18: a representative subset runs
here (a conflict, a damaged store, a pipe closed early, not a model, a habit; the whole replay
takes minutes); its output holds no stack trace and its summary counts every case as expected."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "replay_issue18.py"
SUBSET = ["mmap-budget", "truncated-dense", "head-pipe", "not-a-model", "version"]


def load():
    spec = importlib.util.spec_from_file_location("replay_issue18", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_cases_are_named_once_and_their_fixtures_exist():
    mod = load()
    names = [c.name for c in mod.CASES]
    assert len(names) == len(set(names)) and set(SUBSET) <= set(names)
    assert all(set(c.needs) <= set(mod.FIXTURES) for c in mod.CASES)


def test_a_subset_replays_as_expected(tmp_path):
    cmd = [sys.executable, str(SCRIPT), "--cases", ",".join(SUBSET), "--keep", str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "Traceback" not in out and f"summary: {len(SUBSET)}/{len(SUBSET)} cases" in out
    assert out.count("-> exit ") == len(SUBSET) and "FAIL" not in out


def test_an_unexpected_exit_fails_the_replay(tmp_path):
    mod = load()
    case = mod.Case("x", "x", ["true"], rc=2, expect=("missing text",))
    problems = mod.check(case, 0, "Trace" + "back (most recent call last)", "", mod.Env(tmp_path))
    assert problems == ["exit 0, expected 2", "missing 'missing text'", "a Python stack trace"]
