"""Pick the quantized-linear kernel (CPU kernels by default, the reference when asked), the
whole-MoE kernel (reference or Triton on CUDA), the router's top-k and the one-token attention
core on CUDA."""

from __future__ import annotations

import torch
import torch.nn.functional as F

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


TOPK_TRITON_MAX_TOKENS = 8  # decode rows; a prompt's many rows go to torch.topk


def topk(s: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Router top-k: (values [T, k], ids [T, k]) in descending order, as torch.topk. A few fp32
    rows on CUDA take one Triton launch (kernels/triton/router.py) instead of torch's two."""
    if (
        s.is_cuda
        and s.dtype == torch.float32
        and s.shape[0] <= TOPK_TRITON_MAX_TOKENS
        and s.shape[-1] <= 1024
    ):
        try:
            from moestream.kernels.triton.router import topk_rows
        except ImportError:  # no triton: torch's kernels below
            pass
        else:
            return topk_rows(s, k)
    return torch.topk(s, k, dim=-1)


def attend_unsupported(
    heads: int, kv_heads: int, head_dim: int, rotary_dim: int, dtype
) -> str | None:
    """Why the one-token Triton attention cannot take these shapes (or triton is missing)."""
    try:
        from moestream.kernels.triton.attention import unsupported
    except ImportError:
        return "triton is not installed"
    return unsupported(heads, kv_heads, head_dim, rotary_dim, dtype)


def decode_attend(*args) -> torch.Tensor:
    """One token's q/k head norm, RoPE, cache write and attention on CUDA
    (kernels/triton/attention.py; its reference is the model's torch code)."""
    from moestream.kernels.triton.attention import decode_attend as attend

    return attend(*args)


def route_decode(x: torch.Tensor, gate: torch.Tensor, k: int, renorm: bool, dtype: torch.dtype):
    """The router's GEMM and softmax top-k rule of a few decode rows on CUDA in one launch
    (kernels/triton/router.py; its reference is SparseMoe.route) -> (weights in dtype, ids).
    A hidden size the kernel's K step does not divide takes the GEMM, then route_rows."""
    from moestream.kernels.triton import router

    if router.router_block(x.shape[-1]):
        return router.route_decode(x, gate, k, renorm, dtype)
    return router.route_rows(F.linear(x, gate), k, renorm, dtype)


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """A few bf16/fp16 rows' RMSNorm on CUDA in one launch (kernels/triton/norm.py; its
    reference is RMSNorm.forward)."""
    from moestream.kernels.triton.norm import rms_norm_rows as norm

    return norm(x, weight, eps)


def add_rms_norm_rows(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(x + y, its RMSNorm) for a few bf16/fp16 rows on CUDA in one launch (kernels/triton/norm.py;
    reference: the add, then RMSNorm.forward)."""
    from moestream.kernels.triton.norm import add_rms_norm_rows as add_norm

    return add_norm(x, y, weight, eps)
