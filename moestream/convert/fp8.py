"""Block-scaled FP8 weights (DeepSeek-V3 style): `W.weight` in float8_e4m3fn plus
`W.weight_scale_inv` with one fp32 multiplier per 128x128 block. Dequantized once, at load/convert
time; the engine never computes in FP8."""

from __future__ import annotations

import math
from typing import Any

import torch


class Fp8Error(ValueError):
    """An FP8 tensor, scale or quantization_config that cannot be dequantized as stored."""


def fp8_block_size(config: dict[str, Any]) -> tuple[int, int] | None:
    """(rows, cols) of one scale block from config.json's quantization_config; None = one scale
    per tensor. Raises when the checkpoint is quantized some other way."""
    q = config.get("quantization_config")
    if not q:
        raise Fp8Error("config.json has no quantization_config, yet tensors carry *_scale_inv")
    if q.get("quant_method") != "fp8":
        raise Fp8Error(
            f"quantization_config.quant_method {q.get('quant_method')!r} is not supported "
            "(only fp8 with weight_scale_inv block scales)"
        )
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise Fp8Error("FP8 with static activation scales is not supported (dynamic only)")
    block = q.get("weight_block_size")
    if block is None:
        return None
    if len(block) != 2 or min(block) <= 0:
        raise Fp8Error(f"quantization_config.weight_block_size must be [rows, cols], got {block}")
    return int(block[0]), int(block[1])


def _scales_fp32(scale_inv: torch.Tensor) -> torch.Tensor:
    if scale_inv.dtype == torch.uint8:  # raw E8M0 exponents: 2^(byte - 127)
        return (scale_inv.float() - 127.0).exp2()
    return scale_inv.float()  # fp32 (DeepSeek-V3), bf16 or float8_e8m0fnu


def dequantize_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] | None
) -> torch.Tensor:
    """weight [..., N, K] (fp8) and scale_inv [..., ceil(N/bn), ceil(K/bk)] -> fp32 [..., N, K],
    each element times the scale of its block; edge blocks may be partial."""
    w = weight.float()
    s = _scales_fp32(scale_inv)
    if block is None:
        if s.numel() != 1:
            raise Fp8Error(f"per-tensor FP8 scale must have one element, got shape {list(s.shape)}")
        return w * s.reshape(())
    N, K = w.shape[-2:]
    bn, bk = block
    want = [*w.shape[:-2], math.ceil(N / bn), math.ceil(K / bk)]
    if list(s.shape) != want:
        raise Fp8Error(
            f"scale_inv shape {list(s.shape)} does not match weight {list(w.shape)} in "
            f"{bn}x{bk} blocks (expected {want})"
        )
    s = s.repeat_interleave(bn, dim=-2)[..., :N, :]  # rows expanded: [..., N, ceil(K/bk)]
    s = s.repeat_interleave(bk, dim=-1)[..., :K]
    return w.mul_(s)
