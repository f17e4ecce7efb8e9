"""Qwen3-MoE (`qwen3_moe`): per-head q/k RMSNorm, softmax top-k router with optional renorm,
no shared expert; layers listed in `mlp_only_layers` (or off `decoder_sparse_step`) are dense."""

from typing import Any

from moestream.config import ModelArgs
from moestream.models.base import MoeCausalLM
from moestream.models.config_rules import qwen_moe_fields
from moestream.models.layers import MLP, Attention, SparseMoe


def config_fields(cfg: dict[str, Any], path: str) -> dict[str, Any]:
    return qwen_moe_fields(cfg, path)


def make_attention(args: ModelArgs, i: int) -> Attention:
    return Attention(
        args, i, qkv_bias=args.attention_bias, o_bias=args.attention_bias, qk_norm="head"
    )


def make_mlp(args: ModelArgs, i: int):
    if args.moe_layers[i]:
        return SparseMoe(args, i, weights_in_act_dtype=True)
    return MLP(args.hidden_size, args.intermediate_size)


def build(args: ModelArgs) -> MoeCausalLM:
    return MoeCausalLM(args, make_attention, make_mlp)
