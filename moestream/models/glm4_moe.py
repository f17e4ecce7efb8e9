"""GLM-4.5 / GLM-4.6 MoE (`glm4_moe`): GQA attention with q/k/v bias (o_proj without), optional
per-head q/k RMSNorm and partial rotary (half of each head by default); the first
`first_k_dense_replace` layers are dense, the rest route with sigmoid scores, a selection-only
correction bias and group-limited top-k, plus ungated shared experts."""

from moestream.config import ModelArgs
from moestream.models.base import MoeCausalLM
from moestream.models.layers import MLP, Attention, SigmoidMoe


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
