"""CPU kernels for quantized expert records, reading the record's sections in place.

- int4: `torch.ops.aten._weight_int4pack_mm_for_cpu` on the packed nibbles as stored (the store
  uses the kernel's own AVX-512 layout, so there is no repack on the hot path); scale/zero are
  stored bf16 and cast to the activation dtype per call (~1/4 of the packed bytes).
- int8: torch 2.13's `_weight_int8pack_mm` only takes one scale per output row, and sym8 has one
  per K-block of 32, so int8 dequantizes (one fused multiply) and calls F.linear; this is the
  reference math, so it is exact.
- bf16: cast to the activation dtype and F.linear, as the reference.
- q4_0 / q4_1: dequantize (reference math) and F.linear; their fast path is the native kernel.

`int4_kernel_ok()` checks once that this machine's torch packs int4 the way the store does
(other vector widths pack differently); when it does not, dispatch falls back to the reference.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from moestream.kernels.ref import dequantize
from moestream.quant import INT4_BLOCK_N, int4_sz_kn, pack_int4


@functools.cache
def int4_kernel_ok() -> bool:
    """True when torch's CPU int4 packing equals moestream's stored layout on this machine."""
    try:
        q = torch.randint(0, 16, (2 * INT4_BLOCK_N, 64), generator=torch.Generator().manual_seed(0))
        theirs = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    except (RuntimeError, AttributeError):
        return False
    return theirs.shape == (2 * INT4_BLOCK_N, 32) and torch.equal(theirs, pack_int4(q))


def qlinear_cpu(x: torch.Tensor, sec: dict, name: str, group_size: int) -> torch.Tensor:
    """x [T, K] -> [T, N] with the weight `name` of a record, no dequantized copy for int4."""
    q = sec[f"{name}.q"]
    int4 = f"{name}.sz" in sec  # q4_0's uint8 nibbles are another layout: the reference
    if int4 and q.shape[0] % INT4_BLOCK_N == 0 and int4_kernel_ok():
        # bf16 activations: with fp32 ones torch 2.13 takes a slow path (0.21 vs 11.2 GB/s of
        # packed weights measured at D=2048, 2 threads; benchmarks/bench_kernels_cpu.py).
        sz = int4_sz_kn(sec[f"{name}.sz"], q.shape[0])  # [K/g, N, 2], torch's order: a copy
        xb = x.to(torch.bfloat16).contiguous()
        return torch.ops.aten._weight_int4pack_mm_for_cpu(xb, q, group_size, sz).to(x.dtype)
    return F.linear(x, dequantize(sec, name, group_size, x.dtype))
