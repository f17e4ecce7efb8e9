"""OLMoE (`olmoe`): RMSNorm over the whole q and k projections (not per head), optional qkv
clipping, attention bias on q/k/v/o, every layer MoE with an optionally renormalised top-k."""

from typing import Any

from moestream.config import ModelArgs
from moestream.models.base import MoeCausalLM
from moestream.models.config_rules import routed_experts
from moestream.models.layers import Attention, SparseMoe


def config_fields(cfg: dict[str, Any], path: str) -> dict[str, Any]:
    # OLMoE has no sliding window, whatever use_sliding_window says.
    return dict(routed_experts(cfg, path), sliding_windows=(None,) * int(cfg["num_hidden_layers"]))


def make_attention(args: ModelArgs, i: int) -> Attention:
    return Attention(
        args,
        i,
        qkv_bias=args.attention_bias,
        o_bias=args.attention_bias,
        qk_norm="full",
        clip_qkv=args.clip_qkv,
    )


def make_mlp(args: ModelArgs, i: int):
    return SparseMoe(args, i, weights_in_act_dtype=True)


def build(args: ModelArgs) -> MoeCausalLM:
    return MoeCausalLM(args, make_attention, make_mlp)
