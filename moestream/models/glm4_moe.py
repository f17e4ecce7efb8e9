"""GLM-4.5 / GLM-4.6 MoE (`glm4_moe`): GQA attention with q/k/v bias (o_proj without), optional
per-head q/k RMSNorm and partial rotary (half of each head by default); the first
`first_k_dense_replace` layers are dense, the rest route with sigmoid scores, a selection-only
correction bias and group-limited top-k, plus ungated shared experts."""

from typing import Any

from moestream.config import ModelArgs, partial_rotary_factor
from moestream.models.base import MoeCausalLM
from moestream.models.config_rules import deepseek_style_fields
from moestream.models.layers import MLP, Attention, SigmoidMoe


def config_fields(cfg: dict[str, Any], path: str) -> dict[str, Any]:
    # Glm4MoeConfig's defaults; half of each head rotates when the config does not say.
    return dict(
        deepseek_style_fields(
            cfg, path, first_dense=1, routed_scaling=1.0, n_group=1, topk_group=1
        ),
        partial_rotary_factor=partial_rotary_factor(cfg, 0.5),
    )


def make_attention(args: ModelArgs, i: int) -> Attention:
    return Attention(
        args,
        i,
        qkv_bias=args.attention_bias,
        o_bias=False,
        qk_norm="head" if args.use_qk_norm else None,
    )


def make_mlp(args: ModelArgs, i: int):
    if args.moe_layers[i]:
        return SigmoidMoe(args, i)
    return MLP(args.hidden_size, args.intermediate_size)


def build(args: ModelArgs) -> MoeCausalLM:
    return MoeCausalLM(args, make_attention, make_mlp)
