"""Qwen2-MoE (`qwen2_moe`): q/k/v bias, no q/k norm, routed experts plus a shared expert whose
output is scaled by sigmoid(shared_expert_gate(x)); optional per-layer sliding windows."""

from moestream.config import ModelArgs
from moestream.models.base import MoeCausalLM
from moestream.models.layers import MLP, Attention, SparseMoe


def make_attention(args: ModelArgs, i: int) -> Attention:
    return Attention(args, i, qkv_bias=args.qkv_bias, o_bias=False)


def make_mlp(args: ModelArgs, i: int):
    if args.moe_layers[i]:
        return SparseMoe(args, i, weights_in_act_dtype=True, shared=True)
    return MLP(args.hidden_size, args.intermediate_size)


def build(args: ModelArgs) -> MoeCausalLM:
    return MoeCausalLM(args, make_attention, make_mlp)
