"""One benchmark row schema (benchmarks/common.py): a row carries schema, bench, time, source
(commit + dirty flag), hardware and config beside the results, and every script in benchmarks/
writes its rows through `bench_row` and `write_rows`. No benchmark runs: their sources are read."""

from __future__ import annotations

import json
import re
from pathlib import Path

import common
import pytest

BENCH = Path(__file__).parents[1] / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if p.name != "common.py")
# scripts that write no rows, and why
NO_ROWS = {
    "ncu_decode.py": "runs one layer for Nsight Compute, which records the measurement",
    "gen_gpt_oss.py": "writes a benchmark checkpoint; it measures nothing",
}


def test_a_row_has_the_schema_fields():
    r = common.bench_row("x", {"D": 8}, {"ms": 1.5})
    assert list(r)[:6] == ["schema", "bench", "time", "source", "hardware", "config"]
    assert (r["schema"], r["bench"], r["config"], r["ms"]) == (common.SCHEMA, "x", {"D": 8}, 1.5)
    assert set(r["source"]) == {"commit", "dirty"} and r["source"]["dirty"] in (True, False, None)
    hw = r["hardware"]
    assert {"cpu", "cpu_flags", "cores", "ram_bytes", "torch", "python", "torch_threads"} <= set(hw)
    assert isinstance(hw["cpu_flags"], list) and hw["cores"] >= 1
    assert json.loads(json.dumps(r)) == r
    given = common.bench_row("x", {}, {}, commit="abc1234")["source"]
    assert given == {"commit": "abc1234", "dirty": None}  # a copy without .git: dirty unknown
    with pytest.raises(AssertionError, match="reuse"):
        common.bench_row("x", {}, {"config": 1})


def test_write_rows_appends_rows_of_the_schema(tmp_path):
    path = tmp_path / "sub" / "rows.jsonl"
    rows = [common.bench_row("x", {"i": i}, {"ms": i}) for i in range(2)]
    common.write_rows(path, rows[:1])
    common.write_rows(path, rows[1:])
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows
    with pytest.raises(AssertionError, match="bench_row"):
        common.write_rows(path, [{"ms": 1}])


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_writes_its_rows_through_the_helper(script):
    text = (BENCH / script).read_text()
    appends = re.search(r"open\([^)]*[\"']a[\"']", text)
    if script in NO_ROWS:
        assert "write_rows" not in text and not appends, NO_ROWS[script]
        return
    assert re.search(r"from common import [^\n]*\bbench_row\b", text), "imports bench_row"
    assert "bench_row(" in text and "write_rows(" in text
    assert not appends, "rows are appended by common.write_rows only"
