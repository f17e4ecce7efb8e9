"""Pick the quantized-linear kernel (CPU kernels by default, the reference when asked) and the
whole-MoE kernel (reference or Triton on CUDA)."""

from __future__ import annotations

from moestream.kernels.cpu import qlinear_cpu
from moestream.kernels.ref import qlinear_ref

KERNELS = {"cpu": qlinear_cpu, "ref": qlinear_ref}


def qlinear(kind: str = "cpu"):
    if kind not in KERNELS:
        raise ValueError(f"unknown kernel {kind!r}; use {', '.join(KERNELS)}")
    return KERNELS[kind]


def moe_kernel(kind: str = "ref"):
    """Whole routed-MoE kernel over a layer's `StackedExperts` (device tensors): 'ref' is the
    pure-torch spec, 'triton' the CUDA kernels (imported only when asked: triton is optional).
    Both are called (x, ids, weights, experts, expert_ids=None): ids index `experts`."""
    if kind == "ref":
        from moestream.kernels.triton.layout import moe_stacked_ref

        return moe_stacked_ref
    if kind == "triton":
        from moestream.kernels.triton import moe_experts

        return moe_experts
    raise ValueError(f"unknown MoE kernel {kind!r}; use ref or triton")
