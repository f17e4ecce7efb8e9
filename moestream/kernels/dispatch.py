"""Pick the quantized-linear kernel: CPU kernels by default, the reference when asked (tests)."""

from __future__ import annotations

from moestream.kernels.cpu import qlinear_cpu
from moestream.kernels.ref import qlinear_ref

KERNELS = {"cpu": qlinear_cpu, "ref": qlinear_ref}


def qlinear(kind: str = "cpu"):
    if kind not in KERNELS:
        raise ValueError(f"unknown kernel {kind!r}; use {', '.join(KERNELS)}")
    return KERNELS[kind]
