"""Mixtral (`mixtral`): plain GQA attention (optional sliding window), every layer MoE, top-k
weights always renormalised and kept in fp32 when combined (as transformers does)."""

from typing import Any

from moestream.config import ModelArgs
from moestream.models.base import MoeCausalLM
from moestream.models.layers import Attention, SparseMoe


def config_fields(cfg: dict[str, Any], path: str) -> dict[str, Any]:
    """MixtralConfig's defaults (Mixtral-8x7B); the window, when set, applies to every layer."""
    return dict(
        num_experts=int(cfg.get("num_local_experts", 8)),
        moe_intermediate_size=int(cfg.get("intermediate_size", 14336)),
        norm_topk_prob=True,
        sliding_windows=(cfg.get("sliding_window"),) * int(cfg["num_hidden_layers"]),
    )


def make_attention(args: ModelArgs, i: int) -> Attention:
    return Attention(args, i, qkv_bias=False, o_bias=False)


def make_mlp(args: ModelArgs, i: int):
    return SparseMoe(args, i, weights_in_act_dtype=False)


def build(args: ModelArgs) -> MoeCausalLM:
    return MoeCausalLM(args, make_attention, make_mlp)


# Original Mixtral checkpoints name the MoE block `block_sparse_moe`.
RENAMES = ((".block_sparse_moe.", ".mlp."),)
