"""The package's shape as rules a test can hold: no import cycle between packages (lazy imports
included), and nobody reaches the expert provider through a model's blocks or probes it."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "moestream"


def code_map():
    spec = importlib.util.spec_from_file_location("code_map", ROOT / "scripts" / "code_map.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_no_package_import_cycles():
    cm = code_map()
    g = cm.graph(PKG)
    assert "store" in g and "experts" in g and g["experts"] >= {"store"}
    assert cm.cycles(g) == [], cm.cycles(g)
    assert "loader" not in g["store"] and "convert" not in g["store"]


def test_cycle_finder_finds_a_cycle():
    cm = code_map()
    assert cm.cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_provider_is_owned_not_fished_out_or_probed():
    bad = re.compile(r"moe_blocks\[0\]\.provider|hasattr\(.*provider|getattr\(.*provider")
    hits = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in PKG.rglob("*.py")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if bad.search(line)
    ]
    assert hits == []


def test_the_suite_uses_a_throwaway_conversion_cache():
    import os
    import tempfile

    from moestream.convert.cache import cache_root

    assert Path(tempfile.gettempdir()) in cache_root().parents
    assert cache_root() != Path.home() / ".cache" / "moestream"
    assert os.environ["MOESTREAM_CACHE"] == str(cache_root())
    from moestream.config import ext_cache_root

    assert Path.home() / ".cache" / "moestream" not in ext_cache_root().parents
