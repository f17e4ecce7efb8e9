"""Qwen3.5 / Qwen3.6 MoE (`qwen3_5_moe`, text-only `qwen3_5_moe_text`): hybrid layers of Gated
DeltaNet linear attention (`linear_attn`) and gated full attention (`self_attn`: q_proj also yields
a per-channel output gate, zero-centred per-head q/k norms, partial RoPE), every layer MoE with a
sigmoid-gated shared expert, routing always renormalised; RMSNorm computes x * (1 + w).

Text positions only: the multimodal RoPE (mrope) with equal temporal/height/width positions is the
plain RoPE. Multimodal checkpoints keep the language model under `model.language_model.`; the vision
tower and the multi-token-prediction head are not used.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moestream.config import ModelArgs, partial_rotary_factor
from moestream.models.base import MoeCausalLM
from moestream.models.config_rules import layer_mixers, routed_experts
from moestream.models.layers import SparseMoe, apply_rope, gqa_attention
from moestream.models.linear_attention import GatedDeltaNet

RENAMES = (("model.language_model.", "model."),)
IGNORED = (r"^model\.visual\.", r"^mtp\.")
ALIASES = ("qwen3_5_moe_text",)


def normalize_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Multimodal checkpoints nest the language model's fields under text_config; the top level
    keeps tie_word_embeddings (and sometimes eos_token_id)."""
    if cfg.get("model_type") != "qwen3_5_moe" or "text_config" not in cfg:
        return cfg  # the text-only config (qwen3_5_moe_text) is flat
    text = dict(cfg["text_config"])
    for key in ("eos_token_id", "bos_token_id", "torch_dtype", "dtype"):
        if key in cfg and key not in text:
            text[key] = cfg[key]
    if "tie_word_embeddings" in cfg:  # transformers ties by the top-level config
        text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    return text


def config_fields(cfg: dict[str, Any], path: str) -> dict[str, Any]:
    """Qwen3_5MoeTextConfig's defaults: routing always renormalised, a quarter of each head
    rotary, every full_attention_interval-th layer full attention, the rest Gated DeltaNet."""
    types = cfg.get("layer_types")
    if types is None:
        every = int(cfg.get("full_attention_interval", 4))
        types = [
            "full_attention" if (i + 1) % every == 0 else "linear_attention"
            for i in range(int(cfg["num_hidden_layers"]))
        ]
    known = {"full_attention": "attention", "linear_attention": "linear_attention"}
    return dict(
        routed_experts(cfg, path),
        norm_topk_prob=True,
        partial_rotary_factor=partial_rotary_factor(cfg, 0.25),
        layer_mixers=layer_mixers(types, known),
        linear_conv_kernel_dim=int(cfg.get("linear_conv_kernel_dim", 4)),
        linear_num_key_heads=int(cfg.get("linear_num_key_heads", 16)),
        linear_num_value_heads=int(cfg.get("linear_num_value_heads", 32)),
        linear_key_head_dim=int(cfg.get("linear_key_head_dim", 128)),
        linear_value_head_dim=int(cfg.get("linear_value_head_dim", 128)),
    )


class ZeroCenteredRMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * (1 + w), all in fp32, cast back at the end (weights start at 0)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GatedAttention(nn.Module):
    """GQA attention whose output is scaled by sigmoid(gate) before o_proj; q_proj emits, per head,
    hd query dims then hd gate dims."""

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        D, H, Hkv, hd = (
            args.hidden_size,
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
        )
        self.layer, self.H, self.Hkv, self.hd = layer, H, Hkv, hd
        bias = args.attention_bias
        self.q_proj = nn.Linear(D, 2 * H * hd, bias=bias)
        self.k_proj = nn.Linear(D, Hkv * hd, bias=bias)
        self.v_proj = nn.Linear(D, Hkv * hd, bias=bias)
        self.o_proj = nn.Linear(H * hd, D, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(hd, args.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(hd, args.rms_norm_eps)
        self.scaling = hd**-0.5

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache, start: int
    ) -> torch.Tensor:
        T, H, Hkv, hd = x.shape[0], self.H, self.Hkv, self.hd
        q, gate = self.q_proj(x).view(T, H, 2 * hd).chunk(2, dim=-1)  # [T, H, hd] each
        q = apply_rope(self.q_norm(q).transpose(0, 1), cos, sin)  # [H, T, hd]
        k = apply_rope(self.k_norm(self.k_proj(x).view(T, Hkv, hd)).transpose(0, 1), cos, sin)
        v = self.v_proj(x).view(T, Hkv, hd).transpose(0, 1)
        k, v = cache.update(self.layer, k, v, start)  # [Hkv, S, hd]
        out = gqa_attention(q, k, v, self.scaling, start, None)  # [T, H*hd]
        out = out * torch.sigmoid(gate.reshape(T, H * hd))
        return self.o_proj(out)


class HybridDecoderLayer(nn.Module):
    """norm -> (linear or full attention) -> residual -> norm -> MoE -> residual."""

    def __init__(self, args: ModelArgs, i: int):
        super().__init__()
        self.linear = args.layer_mixers[i] == "linear_attention"
        if self.linear:
            self.linear_attn = GatedDeltaNet(args, i)
        else:
            self.self_attn = GatedAttention(args, i)
        self.mlp = SparseMoe(args, i, weights_in_act_dtype=True, shared=True)
        self.input_layernorm = ZeroCenteredRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x, cos, sin, cache, start):
        mixer = self.linear_attn if self.linear else self.self_attn
        x = x + mixer(self.input_layernorm(x), cos, sin, cache, start)
        return x + self.mlp(self.post_attention_layernorm(x))


def build(args: ModelArgs) -> MoeCausalLM:
    return MoeCausalLM(args, None, None, make_layer=HybridDecoderLayer, norm=ZeroCenteredRMSNorm)
