"""The store fault matrix: every kind of tests/fault_kinds.py (each file of a store damaged) in
every IO mode ends in the resident bits or a one-line error naming the file (exit 2); never exit 0
with other tokens, never a traceback. In-process (~0.1 s a case); a few cases through the real
CLI for the exit code. `scripts/fault_matrix.py` prints the same matrix as a table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fault_kinds import KINDS, MODES, generate, run_case

from moestream.convert.writer import convert
from moestream.quant import make_scheme

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def store(tiny_dir, tmp_path_factory):
    dst = tmp_path_factory.mktemp("matrix") / "store"
    return convert(tiny_dir("qwen3_moe"), dst, make_scheme("int8"), False)


@pytest.fixture(scope="module")
def want(store):
    rc, out, err = generate(store, "resident")
    assert rc == 0, err
    return json.loads(out)["ids"]


@pytest.mark.parametrize("mode", list(MODES))
def test_undamaged_store_gives_the_resident_ids_in_every_mode(store, want, mode):
    rc, out, err = generate(store, mode)
    assert rc == 0 and json.loads(out)["ids"] == want, err


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", list(KINDS))
def test_fault_ends_in_the_resident_bits_or_a_named_error(store, want, tmp_path, kind, mode):
    outcome, detail = run_case(store, tmp_path, kind, mode, want)
    assert outcome in ("clean error", "unchanged"), f"{outcome}: {detail}"


@pytest.mark.parametrize(
    "kind", ["dense: header json damaged", "manifest: no manifest", "experts: dangling symlink"]
)
def test_cli_exit_code_is_2_with_one_line(store, tmp_path, kind):
    import shutil

    file, fault = KINDS[kind]
    folder = shutil.copytree(store, tmp_path / "s")
    fault(folder)
    r = subprocess.run(
        [sys.executable, "-m", "moestream", "generate", "-m", str(folder), "-p", "x", "-n", "2"],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("moestream: error: ") and file in lines[0]
