"""RMSNorm of a few rows in one Triton launch (`rms_norm_rows`), for a captured decode step that
is not compiled: the torch code (`models/layers.RMSNorm` in bf16/fp16: a cast to fp32, the
norm, a cast back, the weight) is four kernels there (inductor fuses them under --compile).
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
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, D, eps, BD: tl.constexpr, DT: tl.constexpr):
    t = tl.program_id(0)
    d = tl.arange(0, BD)
    m = d < D
    x = tl.load(x_ptr + t * D + d, mask=m, other=0.0).to(tl.float32)
    h = (x * tl.rsqrt(tl.sum(x * x, 0) / D + eps)).to(DT).to(tl.float32)
    y = tl.load(w_ptr + d, mask=m, other=0.0).to(tl.float32) * h
    tl.store(out_ptr + t * D + d, y.to(DT), mask=m)


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, D] in bf16 / fp16, weight [D] in x's dtype -> weight * rms_norm(x) [T, D]."""
    T, D = x.shape
    assert x.dtype in _TL and weight.dtype == x.dtype, (x.dtype, weight.dtype)
    out = torch.empty_like(x)
    BD = triton.next_power_of_2(D)
    _rms_norm_kernel[(T,)](x.contiguous(), weight, out, D, eps, BD=BD, DT=_TL[x.dtype],
                           num_warps=4 if BD <= 4096 else 8)  # fmt: skip
    return out
