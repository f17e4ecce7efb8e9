"""LFM2 MoE (`lfm2_moe`, LiquidAI LFM2-8B-A1B / LFM2.5): short-convolution layers (`conv`: gated
depthwise causal conv, its last K-1 inputs kept as decode state) and GQA attention layers with
per-head q/k RMSNorm; the first `num_dense_layers` feed-forwards are dense, the rest route with
sigmoid scores, a learned `expert_bias` added for the top-k choice only, renormalised weights and
a routed scaling factor; the final norm is called `embedding_norm`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moestream.config import ConfigError, ModelArgs
from moestream.models.base import MoeCausalLM
from moestream.models.config_rules import first_dense_layers, layer_mixers, routed_experts
from moestream.models.layers import MLP, Attention, RMSNorm, SparseMoe
from moestream.models.linear_attention import causal_conv, recurrent_state

RENAMES = (
    (".self_attn.q_layernorm.", ".self_attn.q_norm."),
    (".self_attn.k_layernorm.", ".self_attn.k_norm."),
    (".self_attn.out_proj.", ".self_attn.o_proj."),
    (".feed_forward.w1.", ".feed_forward.gate_proj."),
    (".feed_forward.w3.", ".feed_forward.up_proj."),
    (".feed_forward.w2.", ".feed_forward.down_proj."),
    ("model.embedding_norm.", "model.norm."),
)


def normalize_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """LFM2's own spellings and defaults (Lfm2MoeConfig): norm_eps, tie_embedding, theta 1e6,
    renormalised top-k."""
    out = dict(cfg)
    out["rms_norm_eps"] = cfg.get("norm_eps", 1e-5)
    out["tie_word_embeddings"] = cfg.get("tie_embedding", cfg.get("tie_word_embeddings", True))
    out.setdefault("norm_topk_prob", True)
    if "rope_theta" not in cfg and "rope_theta" not in (cfg.get("rope_parameters") or {}):
        out["rope_theta"] = 1000000.0
    return out


def config_fields(cfg: dict[str, Any], path: str) -> dict[str, Any]:
    """Which layers are short convolutions (layer_types, or older configs' full_attn_idxs); the
    first num_dense_layers feed-forwards are dense."""
    n_layers = int(cfg["num_hidden_layers"])
    experts = routed_experts(cfg, path)
    types = cfg.get("layer_types")
    if types is None:
        if "full_attn_idxs" not in cfg:
            raise ConfigError("config.json: lfm2_moe needs layer_types (or full_attn_idxs)")
        full = set(cfg["full_attn_idxs"])
        types = ["full_attention" if i in full else "conv" for i in range(n_layers)]
    n_dense = int(cfg.get("num_dense_layers", 2))
    return dict(
        experts,
        moe_layers=first_dense_layers(n_layers, n_dense, experts["num_experts"]),
        layer_mixers=layer_mixers(types, {"full_attention": "attention", "conv": "conv"}),
        conv_kernel=int(cfg.get("conv_L_cache", 3)),
        conv_bias=bool(cfg.get("conv_bias", False)),
        selection_bias=bool(cfg.get("use_expert_bias", True)),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
    )


class ShortConv(nn.Module):
    """in_proj -> (B, C, x) -> C * conv(B * x) -> out_proj; conv state [D, K-1] in the cache."""

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        D, K, bias = args.hidden_size, args.conv_kernel, args.conv_bias
        self.layer = layer
        self.conv = nn.Conv1d(D, D, K, groups=D, bias=bias, padding=K - 1)
        self.in_proj = nn.Linear(D, 3 * D, bias=bias)
        self.out_proj = nn.Linear(D, D, bias=bias)

    def forward(self, x: torch.Tensor, cos, sin, cache, start: int) -> torch.Tensor:
        D, K = self.conv.weight.shape[0], self.conv.weight.shape[-1]
        st = recurrent_state(cache, self.layer, start, lambda: {"conv": x.new_zeros(D, K - 1)})
        b, c, h = self.in_proj(x).T.chunk(3, dim=0)  # [D, T] each
        y, st["conv"] = causal_conv(
            b * h, st["conv"], self.conv.weight[:, 0], self.conv.bias, False
        )
        return self.out_proj((c * y).T)


class Lfm2Moe(SparseMoe):
    """`feed_forward`: sigmoid router (`gate`) whose choice adds `expert_bias` (kept in fp32, as
    transformers' buffer); weights are the unbiased scores, renormalised (+1e-6), then scaled."""

    keep_fp32_params = ("expert_bias",)
    scores_are_probs = False

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__(args, layer, weights_in_act_dtype=True)
        self.scale = args.routed_scaling_factor
        self.expert_bias = (
            nn.Parameter(torch.zeros(args.num_experts), requires_grad=False)
            if args.selection_bias
            else None
        )

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(x).sigmoid()  # [T, E] in the activation dtype, as transformers

    def select(self, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.expert_bias is None:
            top, ids = torch.topk(s, self.k, dim=-1)
            return ids, top
        ids = torch.topk(s + self.expert_bias, self.k, dim=-1)[1]
        return ids, s.gather(1, ids)

    def weigh(self, picked: torch.Tensor) -> torch.Tensor:
        if self.renorm:
            picked = picked / (picked.sum(dim=-1, keepdim=True) + 1e-6)
        return picked * self.scale


class Lfm2DecoderLayer(nn.Module):
    """operator_norm -> (conv or self_attn) -> residual -> ffn_norm -> feed_forward -> residual."""

    def __init__(self, args: ModelArgs, i: int):
        super().__init__()
        self.is_conv = args.layer_mixers[i] == "conv"
        if self.is_conv:
            self.conv = ShortConv(args, i)
        else:
            self.self_attn = Attention(args, i, qkv_bias=False, o_bias=False, qk_norm="head")
        self.feed_forward = (
            Lfm2Moe(args, i)
            if args.moe_layers[i]
            else MLP(args.hidden_size, args.intermediate_size)
        )
        self.operator_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.ffn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    @property
    def mlp(self) -> nn.Module:  # what MoeCausalLM.moe_blocks looks for
        return self.feed_forward

    def forward(self, x, cos, sin, cache, start):
        mixer = self.conv if self.is_conv else self.self_attn
        x = x + mixer(self.operator_norm(x), cos, sin, cache, start)
        return x + self.feed_forward(self.ffn_norm(x))


def build(args: ModelArgs) -> MoeCausalLM:
    return MoeCausalLM(args, None, None, make_layer=Lfm2DecoderLayer)
