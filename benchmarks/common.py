"""Shared benchmark plumbing: the row schema (moestream/obs/rows.py, shared with `moestream
bench`) and config overrides."""

from __future__ import annotations

from dataclasses import replace

from moestream.obs.rows import RESERVED, SCHEMA, bench_row, hardware, source, write_rows

__all__ = ["RESERVED", "SCHEMA", "bench_row", "hardware", "override", "source", "write_rows"]


def override(cfg, spec: str):
    """A frozen config with fields replaced from 'bn=8,mma=1' (whole numbers; 0/1 for flags)."""
    kw = {k: int(v) for k, v in (kv.split("=") for kv in spec.split(","))}
    return replace(cfg, **{k: bool(v) if isinstance(getattr(cfg, k), bool) else v
                           for k, v in kw.items()})  # fmt: skip
