"""Triton kernels for routed experts on CUDA: read only the routed experts' bytes.

- `layout.py`: `StackedExperts` (a layer's expert sections stacked on the device, store layout)
  and its pure-torch reference (`moe_stacked_ref`, built on kernels/ref.py).
- `decode.py`: 1-8 tokens, two launches per layer: gate/up per (pair, row block, D split) writing
  h = silu(g) * u, then down (PDL-launched) per row block over all slots (bf16/int8) or per
  (pair, row block) with a deterministic last-program combine (int4); GEMV on CUDA cores.
- `prefill.py`: tokens grouped by expert on the device, tl.dot per block of BLOCK_M rows.
`moe_experts` picks the path; shapes the kernels do not take fall back to the reference.
`layout.py` imports without triton; the kernels need it (the `gpu` extra, never the CPU install).
"""

from __future__ import annotations

import torch

from moestream.kernels.triton.layout import StackedExperts, moe_stacked_ref

DECODE_MAX_TOKENS = 8  # above this, grouping tokens by expert reads each expert once


def unsupported(experts: StackedExperts, tokens: int) -> str | None:
    """Why the Triton path cannot take this layer at this token count (None when it can)."""
    from moestream.kernels.triton import decode, prefill

    s = experts.scheme
    if tokens <= DECODE_MAX_TOKENS:
        cfg = decode.fit_config(
            s.name, experts.hidden, experts.inter, s.group_size, decode.DEFAULT_CONFIGS[s.name]
        )
        return None if cfg else f"no decode tile fits D={experts.hidden}, I={experts.inter}"
    return prefill.check_shapes(
        s.name, experts.hidden, experts.inter, s.group_size, prefill.PrefillConfig()
    )


def moe_experts(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: StackedExperts
) -> torch.Tensor:
    """x [T, D], ids [T, K], weights [T, K] -> [T, D]: the routed experts' weighted sum."""
    from moestream.kernels.triton import decode, prefill

    if unsupported(experts, x.shape[0]):
        return moe_stacked_ref(x, ids, weights, experts)
    if x.shape[0] <= DECODE_MAX_TOKENS:
        return decode.moe_decode(x, ids, weights, experts)
    return prefill.moe_prefill(x, ids, weights, experts)


__all__ = ["StackedExperts", "moe_experts", "moe_stacked_ref", "unsupported"]
