"""RMSNorm of a few rows in one Triton launch (`rms_norm_rows`; `add_rms_norm_rows` with the
residual add before it), for a captured decode step that is not compiled: the torch code
(`models/layers.RMSNorm` in bf16/fp16: a cast to fp32, the norm, a cast back, the weight) is
four kernels there (inductor fuses them under --compile).
Same roundings: the norm in fp32, rounded to the activation dtype, times the weight, rounded.
The sum of squares runs in another order than torch's, so a row can differ in the last bit.
Reference: RMSNorm.forward with gpu_decode off.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _norm_row(x_ptr, w_ptr, out_ptr, t, x, d, m, D, eps, DT: tl.constexpr):
    """Row t's norm from its fp32 values x [BD] (zero past D), stored at out_ptr: both kernels
    take this code, so a row gets the same bits from either."""
    h = (x * tl.rsqrt(tl.sum(x * x, 0) / D + eps)).to(DT).to(tl.float32)
    y = tl.load(w_ptr + d, mask=m, other=0.0).to(tl.float32) * h
    tl.store(out_ptr + t * D + d, y.to(DT), mask=m)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, D, eps, BD: tl.constexpr, DT: tl.constexpr):
    t = tl.program_id(0)
    d = tl.arange(0, BD)
    m = d < D
    x = tl.load(x_ptr + t * D + d, mask=m, other=0.0).to(tl.float32)
    _norm_row(x_ptr, w_ptr, out_ptr, t, x, d, m, D, eps, DT)


@triton.jit
def _add_rms_norm_kernel(x_ptr, y_ptr, w_ptr, sum_ptr, out_ptr, D, eps, BD: tl.constexpr,
                         DT: tl.constexpr):  # fmt: skip
    """s = x + y rounded to DT (torch's add: fp32, one rounding) stored, then s's norm."""
    t = tl.program_id(0)
    d = tl.arange(0, BD)
    m = d < D
    x = tl.load(x_ptr + t * D + d, mask=m, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + t * D + d, mask=m, other=0.0).to(tl.float32)
    s = (x + y).to(DT)
    tl.store(sum_ptr + t * D + d, s, mask=m)
    _norm_row(sum_ptr, w_ptr, out_ptr, t, s.to(tl.float32), d, m, D, eps, DT)


def _tiles(x: torch.Tensor, weight: torch.Tensor) -> dict:
    """Both kernels' block and warps (the same for a row: the same reduction, the same bits)."""
    assert x.dtype in _TL and weight.dtype == x.dtype, (x.dtype, weight.dtype)
    BD = triton.next_power_of_2(x.shape[1])
    return dict(BD=BD, DT=_TL[x.dtype], num_warps=4 if BD <= 4096 else 8)


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, D] in bf16 / fp16, weight [D] in x's dtype -> weight * rms_norm(x) [T, D]."""
    T, D = x.shape
    out = torch.empty_like(x)
    _rms_norm_kernel[(T,)](x.contiguous(), weight, out, D, eps, **_tiles(x, weight))
    return out


def add_rms_norm_rows(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(s, rms_norm_rows(s)) for s = x + y [T, D] (a residual add and the norm after it) in one
    launch: s has torch's bits for x + y, the norm rms_norm_rows' bits for s."""
    T, D = x.shape
    assert y.shape == x.shape and y.dtype == x.dtype, (y.shape, y.dtype)
    s, out = torch.empty_like(x), torch.empty_like(x)
    _add_rms_norm_kernel[(T,)](x.contiguous(), y.contiguous(), weight, s, out, D, eps,
                               **_tiles(x, weight))  # fmt: skip
    return s, out
