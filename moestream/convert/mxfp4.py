"""MXFP4 expert weights (gpt-oss hub checkpoints): `X_blocks` uint8 [..., N, K/32, 16] holds two
FP4 (E2M1) codes per byte, low nibble first, and `X_scales` uint8 [..., N, K/32] one shared
power-of-two exponent per block of 32 (E8M0, bias 127). Dequantized once, at load/convert time,
to fp32, which holds every value exactly; the engine never computes in FP4.

Same math as transformers' `integrations/mxfp4.py: _convert_moe_packed_tensors` (its pure-torch
path: lut[low], lut[high] interleaved, then ldexp by scale - 127), except that this returns the
stored [N, K] orientation; transformers transposes the last two dims for its x @ W experts.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

# E2M1 code -> value (sign bit 3, exponent bits 2..1, mantissa bit 0).
_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_VALUES = _MAGNITUDES + tuple(-v for v in _MAGNITUDES)
BLOCK = 32  # values per shared scale


def is_mxfp4_checkpoint(folder: str | Path) -> bool:
    """A Hugging Face folder whose config.json says its experts are MXFP4 (gpt-oss on the hub:
    quantization_config.quant_method "mxfp4")."""
    try:
        cfg = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return False  # (the loader names a missing or broken config.json)
    q = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    return isinstance(q, dict) and q.get("quant_method") == "mxfp4"


class Mxfp4Error(ValueError):
    """Blocks and scales whose shapes or dtypes do not describe one MXFP4 tensor."""


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks uint8 [..., N, G, 16], scales uint8 [..., N, G] -> fp32 [..., N, G * 32]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise Mxfp4Error(
            f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}"
        )
    if blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise Mxfp4Error(
            f"blocks {list(blocks.shape)} and scales {list(scales.shape)} do not match "
            f"(expected blocks [..., N, G, {BLOCK // 2}] with scales [..., N, G])"
        )
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()  # [..., G, 16, 2]
    values = lut[codes].flatten(-3)  # [..., N, G * 32], low nibble first
    exps = (scales.to(torch.int32) - 127).repeat_interleave(BLOCK, dim=-1)
    return torch.ldexp(values, exps)
