"""Shared benchmark plumbing: hardware/commit description and JSON-lines output."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import torch


def hardware() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    hw = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        hw["gpu"] = torch.cuda.get_device_name(0)
    return hw


def commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            check=True,
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
        ).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_jsonl(path: str | Path, rows: list[dict]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    with open(path, "a") as f:
        for row in rows:
            f.write(
                json.dumps({"time": stamp, "commit": commit(), "hardware": hardware(), **row})
                + "\n"
            )


def override(cfg, spec: str):
    """A frozen config with fields replaced from 'bn=8,mma=1' (whole numbers; 0/1 for flags)."""
    kw = {k: int(v) for k, v in (kv.split("=") for kv in spec.split(","))}
    return replace(cfg, **{k: bool(v) if isinstance(getattr(cfg, k), bool) else v
                           for k, v in kw.items()})  # fmt: skip
