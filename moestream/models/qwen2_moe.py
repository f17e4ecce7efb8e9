"""Qwen2-MoE (`qwen2_moe`): q/k/v bias, no q/k norm, routed experts plus a shared expert whose
output is scaled by sigmoid(shared_expert_gate(x)); optional per-layer sliding windows."""

from typing import Any

from moestream.config import ModelArgs
from moestream.models.base import MoeCausalLM
from moestream.models.config_rules import layer_windows, qwen_moe_fields
from moestream.models.layers import MLP, Attention, SparseMoe


def config_fields(cfg: dict[str, Any], path: str) -> dict[str, Any]:
    return dict(
        qwen_moe_fields(cfg, path),
        qkv_bias=bool(cfg.get("qkv_bias", True)),
        sliding_windows=sliding_windows(cfg, int(cfg["num_hidden_layers"])),
    )


def sliding_windows(cfg: dict[str, Any], n_layers: int) -> tuple[int | None, ...]:
    """With use_sliding_window: layer_types, or the layers from max_window_layers on slide."""
    window = cfg.get("sliding_window")
    if not cfg.get("use_sliding_window", False) or window is None:
        return (None,) * n_layers
    types = cfg.get("layer_types")
    if types is None:
        first = int(cfg.get("max_window_layers", n_layers))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
    return layer_windows(types, window)


def make_attention(args: ModelArgs, i: int) -> Attention:
    return Attention(args, i, qkv_bias=args.qkv_bias, o_bias=False)


def make_mlp(args: ModelArgs, i: int):
    if args.moe_layers[i]:
        return SparseMoe(args, i, weights_in_act_dtype=True, shared=True)
    return MLP(args.hidden_size, args.intermediate_size)


def build(args: ModelArgs) -> MoeCausalLM:
    return MoeCausalLM(args, make_attention, make_mlp)
