"""Tuned tile settings of the Triton kernels as data: configs/tiles.json (package data), keyed by
device name (torch.cuda.get_device_name), kernel ("decode", "prefill"), quant and shape.

Lookup for (device, kernel, quant, D, I): the device's row for the shape "D=<D>,I=<I>", else its
"any" row; a device (or quant) without rows takes the file's `fallback_device` (the NVIDIA H200,
the only GPU tuned so far), and so does the interpreter (device None). Rows hold the config's
fields plus a "note" on where they come from. benchmarks/tune_gpu_decode.py --write adds rows
through `with_row` and `dumps`, so the file keeps one layout. Imports without triton.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

CONFIG_FILE = Path(__file__).parent / "configs" / "tiles.json"
ANY_SHAPE = "any"
INFO_KEYS = ("note",)  # row fields that are not config fields


_NAMES: dict = {}


def device_name(device: torch.device | None) -> str | None:
    """The name rows are keyed by: torch.cuda.get_device_name for a CUDA device (cached: it is
    asked on every layer call), None otherwise (the interpreter)."""
    if device is None or device.type != "cuda":
        return None
    key = str(device)
    if key not in _NAMES:
        _NAMES[key] = torch.cuda.get_device_name(device)
    return _NAMES[key]


def shape_key(hidden: int, inter: int) -> str:
    return f"D={hidden},I={inter}"


@functools.cache
def load(path: Path = CONFIG_FILE) -> dict:
    """The parsed file (read once per path)."""
    data = json.loads(Path(path).read_text())
    assert data["fallback_device"] in data["devices"], "fallback_device has no rows"
    return data


def settings(kernel: str, quant: str, hidden: int, inter: int, device: str | None,
             path: Path = CONFIG_FILE) -> dict:  # fmt: skip
    """Config fields for this device, kernel, quant and shape (see the module docstring)."""
    data = load(path)
    devices = data["devices"]
    for name in (device, data["fallback_device"]):
        rows = devices.get(name, {}).get(kernel, {}).get(quant, {})
        row = rows.get(shape_key(hidden, inter), rows.get(ANY_SHAPE))
        if row is not None:
            return {k: v for k, v in row.items() if k not in INFO_KEYS}
    raise KeyError(f"no {kernel} tiles for {quant} in {path}")


def with_row(data: dict, device: str, kernel: str, quant: str, shape: str, row: dict) -> dict:
    """A copy of the parsed file with one row set (the tuner's winner)."""
    data = json.loads(json.dumps(data))
    dev = data["devices"].setdefault(device, {})
    dev.setdefault(kernel, {}).setdefault(quant, {})[shape] = row
    return data


def dumps(data: dict) -> str:
    """The file's text: rows one level per key, two-space indents."""
    return json.dumps(data, indent=2) + "\n"
