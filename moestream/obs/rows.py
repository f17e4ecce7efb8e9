"""One benchmark row schema, for `moestream bench` and every script in benchmarks/ (which
import it through benchmarks/common.py).

A row (`bench_row`) is one JSON line:
  schema    SCHEMA (2; rows without the field are the older layout: "commit" string, flat config)
  bench     the measurement's name
  time      local time the row was made
  source    {"commit": short hash, "dirty": tracked files modified}: the code that ran (a
            `--commit` given for a copy without .git is taken as is, dirty then unknown: null)
  hardware  CPU model and SIMD flags, cores, RAM, torch/python (and triton) versions, GPU if any
  config    what was asked to be measured (shapes, model, quant, threads, flags)
then the measurement's own fields: the variant a row measured (mode, policy, ...) and its results.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

SCHEMA = 2
RESERVED = ("schema", "bench", "time", "source", "hardware", "config")
# the CPU flags that decide which kernels are fast (x86 and Arm names)
SIMD_PREFIXES = ("avx", "amx", "fma", "f16c", "sse4", "ssse3", "bmi2", "asimd", "sve", "neon")


def _git(*args: str) -> str:
    cwd = Path(__file__).parent
    return subprocess.run(["git", *args], capture_output=True, text=True, cwd=cwd,
                          check=True).stdout.strip()  # fmt: skip


@functools.cache
def _checkout() -> dict:
    try:
        dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
        return {"commit": _git("rev-parse", "--short", "HEAD"), "dirty": dirty}
    except (OSError, subprocess.CalledProcessError):
        return {"commit": "unknown", "dirty": None}


def source(commit: str | None = None) -> dict:
    """The code that ran: this checkout's commit and dirty flag, or `commit` as given."""
    return {"commit": commit, "dirty": None} if commit else dict(_checkout())


def _cpuinfo() -> tuple[str, list[str]]:
    """(CPU model, SIMD flags) from /proc/cpuinfo (platform's names elsewhere)."""
    model, flags = None, None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = (part.strip() for part in line.partition(":"))
            if key == "model name" and model is None:
                model = value
            elif key in ("flags", "Features") and flags is None:
                flags = sorted(f for f in value.split() if f.startswith(SIMD_PREFIXES))
    except OSError:
        pass
    return model or platform.processor() or platform.machine(), flags or []


def _ram_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@functools.cache
def _machine() -> dict:
    model, flags = _cpuinfo()
    hw = {
        "cpu": model,
        "cpu_flags": flags,
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "ram_bytes": _ram_bytes(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        hw.update(gpu=torch.cuda.get_device_name(0), gpu_count=torch.cuda.device_count(),
                  cuda=torch.version.cuda)  # fmt: skip
    return hw


def hardware() -> dict:
    """The machine (cached) plus what a script may change: torch threads, triton if imported."""
    hw = {**_machine(), "torch_threads": torch.get_num_threads()}
    if "triton" in sys.modules:
        hw["triton"] = sys.modules["triton"].__version__
    return hw


def bench_row(bench: str, config: dict, results: dict, commit: str | None = None) -> dict:
    """One row of the schema above; `results` may not reuse its top-level keys."""
    clash = [k for k in RESERVED if k in results]
    assert not clash, f"results reuse the row's keys {clash}"
    return {
        "schema": SCHEMA,
        "bench": bench,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "source": source(commit),
        "hardware": hardware(),
        "config": config,
        **results,
    }


def write_rows(path: str | Path | None, rows: list[dict]) -> None:
    """Append rows made by bench_row as JSON lines (the folder is created). No path: nothing is
    written (results land only where --out asks, never in tracked files by default)."""
    assert all(r.get("schema") == SCHEMA for r in rows), "rows must come from bench_row"
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
