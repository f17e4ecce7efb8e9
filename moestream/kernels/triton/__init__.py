"""Triton kernels for routed experts on CUDA: read only the routed experts' bytes.

- `layout.py`: `StackedExperts` (a layer's expert sections stacked on the device, store layout)
  and its pure-torch reference (`moe_stacked_ref`, built on kernels/ref.py).
- `decode.py`: 1-8 tokens, two launches per layer: gate/up per (pair, row block, D split)
  writing h = silu(g) * u, then down (PDL-launched) per (pair, row block), a token's rows added
  in slot order by the last program; GEMV on CUDA cores (bf16, int8) or tensor cores (`mma`,
  int4). Variants measured slower (one persistent launch per layer, ...) are benchmark code:
  benchmarks/ablations/triton_decode.py.
- `prefill.py`: tokens grouped by expert on the device, tl.dot per block of BLOCK_M rows.
- `grouped.py`: a prompt on int4 rows, q4_0 or q4_1 (bf16, sm_90): the routed experts dequantized to bf16, then
  torch's grouped GEMM (CUTLASS); the default for prompts (`prefill="grouped"`), 1.07-1.86x
  faster per layer than prefill.py at 16-2048 tokens on the H200.
`moe_experts` picks the path (`prompt_path`); shapes the kernels do not take fall back to the
reference.
`moe_pairs` + `combine_pairs` split a call into per-pair rows and their slot-order sum, with the
bits of `moe_experts` (the GPU provider's chunked prefill when the pool cannot hold all experts).
`layout.py` imports without triton; the kernels need it (the `gpu` extra, never the CPU install).
"""

from __future__ import annotations

import torch

from moestream.config import ConfigError
from moestream.kernels.triton.layout import KQUANTS, ROW_QUANTS, StackedExperts, moe_stacked_ref

DECODE_MAX_TOKENS = 8  # above this, grouping tokens by expert reads each expert once
# the expert schemes the GPU kernels read (q4_0 / q4_1 / q4_k / q5_k / q6_k: GGUF's blocks as
# stored; q5_0, q8_0: CPU only)
SCHEMES = ("bf16", "int8", "int4", "q4_0", "q4_1", *KQUANTS)
PREFILL = ("grouped", "triton")  # GpuConfig.prefill: a prompt's kernels, grouped.py / prefill.py
_KEPT: dict = {}


def kept(key: tuple, make):
    """Device buffers made once per key by `make()` and kept for the process: a captured CUDA
    graph holds their addresses (the eager call that makes them comes before any capture), and
    the counters among them are zero between calls (the program that used one resets it)."""
    if key not in _KEPT:
        _KEPT[key] = make()
    return _KEPT[key]


def unsupported(experts: StackedExperts, tokens: int) -> str | None:
    """Why the Triton path cannot take this layer at this token count (None when it can)."""
    from moestream.kernels.triton import decode, prefill, tuned

    s, D, I, q = experts.scheme, experts.hidden, experts.inter, experts.kernel_quant
    device = tuned.device_name(next(iter(experts.sections.values())).device)
    if tokens <= DECODE_MAX_TOKENS:
        cfg = decode.default_config(q, D, I, s.group_size, device, decode.own_down(experts))
        return None if cfg else f"no decode tile fits D={D}, I={I}"
    if q in KQUANTS:  # a prompt dequantizes its routed experts: the float kernels' shapes
        q = "bf16"
    cfg = prefill.default_config(q, D, I, device, tokens)
    return prefill.check_shapes(q, D, I, s.group_size, cfg)


SCRATCH_MARGIN = 256 << 20  # free VRAM kept beside the scratch (the prompt's activations)


def scratch_bytes(experts: int, hidden: int, inter: int) -> int:
    """The bf16 scratch of a layer's routed experts at most (w13 and w2 of `experts` experts)."""
    return experts * 3 * hidden * inter * 2


def arch_unsupported(capability: tuple[int, int]) -> str | None:
    """Why a CUDA device of this capability cannot run torch._grouped_mm's kernels (None: it can)."""
    if capability < (9, 0):
        return f"torch._grouped_mm's CUTLASS kernels need sm_90+ (this GPU: sm_{capability[0]}{capability[1]})"
    return None


def prompt_kernels(asked: str, quant: str, capability: tuple[int, int] | None, free: int | None,
                   scratch: int) -> tuple[str, str | None]:  # fmt: skip
    """A provider's prompt kernels at start-up: ("grouped" or "triton", why not grouped when it
    was asked for and cannot run). quant: the pool's kernel layout (StackedExperts.kernel_quant);
    capability None: not CUDA (the interpreter's tests); free: VRAM free for the scratch (None:
    not measured)."""
    if quant in KQUANTS and free is not None and free < scratch + SCRATCH_MARGIN:
        # (either family dequantizes a K-quant prompt's routed experts first)
        raise ConfigError(
            f"a prompt on {quant} experts dequantizes a layer's routed experts into a bf16 "
            f"scratch ({scratch / 2**30:.2f} GiB), which does not fit the free VRAM "
            f"({free / 2**30:.2f} GiB): lower --gpu-budget (or set one: every expert resident "
            "leaves less room)"
        )
    if asked == "triton":
        return "triton", None
    if quant not in (*ROW_QUANTS, *KQUANTS):
        return "triton", ("the grouped GEMMs read int4 experts in groups of a multiple of 32, or "
                          "q4_0 / q4_1 / K-quant ones")  # fmt: skip
    if capability is not None and arch_unsupported(capability):
        return "triton", arch_unsupported(capability)
    if free is not None and free < scratch + SCRATCH_MARGIN:
        return "triton", (
            f"their bf16 scratch ({scratch / 2**30:.2f} GiB) does not fit the free VRAM "
            f"({free / 2**30:.2f} GiB): lower --gpu-budget to use them"
        )
    return "grouped", None


def prompt_path(experts: StackedExperts, x: torch.Tensor, tokens: int, prefill: str) -> bool:
    """The one rule for the grouped-GEMM prompt path: asked for (GpuConfig.prefill), a prompt
    (more than DECODE_MAX_TOKENS tokens in the whole call) and a layer it takes."""
    if tokens <= DECODE_MAX_TOKENS:  # decode (an eager step calls this per layer): nothing more
        return False
    if prefill not in PREFILL:
        raise ValueError(f"unknown prefill kernels {prefill!r}; use {', '.join(PREFILL)}")
    from moestream.kernels.triton import grouped

    return prefill == "grouped" and grouped.unsupported(experts, x) is None


def moe_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    experts: StackedExperts,
    expert_ids: torch.Tensor | None = None,
    prefill: str = "grouped",
) -> torch.Tensor:
    """x [T, D], ids [T, K], weights [T, K] -> [T, D]: the routed experts' weighted sum.
    `expert_ids`: see `moe_stacked_ref` (only the reference fallback's summation order needs them;
    the kernels add a token's experts in slot order). `prefill`: a prompt's kernels ("grouped":
    grouped.py where it applies, else "triton": prefill.py)."""
    from moestream.kernels.triton import decode, grouped
    from moestream.kernels.triton import prefill as tiles

    if prompt_path(experts, x, x.shape[0], prefill):
        return grouped.moe_grouped(x, ids, weights, experts)
    if unsupported(experts, x.shape[0]):
        return moe_stacked_ref(x, ids, weights, experts, expert_ids)
    if x.shape[0] <= DECODE_MAX_TOKENS:
        return decode.moe_decode(x, ids, weights, experts)
    if experts.kernel_quant in KQUANTS:  # the routed experts dequantized, the float kernels
        ex, gids = grouped.dequantized(experts, ids, x.dtype)
        return tiles.moe_prefill(x, gids, weights, ex)
    return tiles.moe_prefill(x, ids, weights, experts)


def moe_pairs(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
              experts: StackedExperts, tokens: int, prefill: str = "grouped") -> torch.Tensor:  # fmt: skip
    """Pair rows [T * K, D] fp32 (weight times expert output) as `moe_experts` computes them for a
    call of `tokens` tokens: the kernel is chosen by `tokens`, not by this call's size, so a
    chunk of a call's pairs gets the same rows. A workspace view: copy it before the next call."""
    from moestream.kernels.triton import decode, grouped
    from moestream.kernels.triton import prefill as tiles

    if prompt_path(experts, x, tokens, prefill):
        return grouped.moe_grouped(x, ids, weights, experts, combine=False)
    why = unsupported(experts, tokens)
    if why:
        raise NotImplementedError(f"pair rows need the Triton kernels: {why}")
    if tokens <= DECODE_MAX_TOKENS:
        return decode.moe_decode(x, ids, weights, experts, combine=False)
    if experts.kernel_quant in KQUANTS:  # (as moe_experts: a pair row's bits are its expert's)
        ex, gids = grouped.dequantized(experts, ids, x.dtype)
        return tiles.moe_prefill(x, gids, weights, ex, combine=False, tokens=tokens)
    return tiles.moe_prefill(x, ids, weights, experts, combine=False, tokens=tokens)


def combine_pairs(y: torch.Tensor, topk: int, dtype: torch.dtype) -> torch.Tensor:
    """Pair rows [T * topk, D] -> [T, D] in dtype, added in slot order (the kernels' combine)."""
    from moestream.kernels.triton import decode

    return decode.combine_pairs(y, topk, dtype)


__all__ = [
    "PREFILL", "StackedExperts", "combine_pairs", "moe_experts", "moe_pairs", "moe_stacked_ref",
    "arch_unsupported", "prompt_kernels", "prompt_path", "scratch_bytes", "unsupported",
]  # fmt: skip
