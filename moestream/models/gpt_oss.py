"""gpt-oss (`gpt_oss`): GQA attention with q/k/v/o bias and a learned per-head sink logit in the
softmax, sliding-window and full layers alternating (`layer_types`), yarn RoPE; every layer is MoE
with a biased router (top-k on the logits, softmax over the k) and experts with biases and the
clamped SwiGLU (`kernels/ref.py: ExpertActivation`), computed by the provider. RMSNorm multiplies
its weight in fp32, before the cast back."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moestream.config import ModelArgs
from moestream.models.base import MoeCausalLM
from moestream.models.config_rules import layer_windows, routed_experts
from moestream.models.layers import Attention, RMSNorm, SparseMoe

# Checkpoint name -> ours: the router is `mlp.router` in gpt_oss, `mlp.gate` in SparseMoe.
RENAMES = ((".mlp.router.", ".mlp.gate."),)

# transformers' RoPE when config.json names none (GptOssConfig.__post_init__).
DEFAULT_ROPE = dict(
    rope_type="yarn",
    factor=32.0,
    beta_fast=32.0,
    beta_slow=1.0,
    truncate=False,
    original_max_position_embeddings=4096,
)
DEFAULT_ROPE_THETA = 150000.0


def normalize_config(cfg: dict[str, Any]) -> dict[str, Any]:
    out = dict(cfg)
    if not (cfg.get("rope_parameters") or cfg.get("rope_scaling")):
        out["rope_scaling"] = dict(DEFAULT_ROPE)
    out.setdefault("rope_theta", DEFAULT_ROPE_THETA)
    return out


def config_fields(cfg: dict[str, Any], path: str) -> dict[str, Any]:
    # No use_sliding_window flag: layer_types, by default sliding on even layers.
    n_layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)
    ]
    return dict(
        routed_experts(cfg, path),
        attention_bias=bool(cfg.get("attention_bias", True)),
        sliding_windows=layer_windows(types, cfg.get("sliding_window")),
        expert_bias=True,
        swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
    )


class GptOssRMSNorm(RMSNorm):
    """The weight multiplies the fp32 normalised input before the cast back (Llama's RMSNorm
    casts first)."""

    fp32_rows_are_rmsnorm = True  # its fp32 rows are RMSNorm's (the one-call step computes them)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return super().forward(x)
        return (self.weight * F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)).to(x.dtype)


class SinkAttention(Attention):
    """Attention whose softmax also spans one learned logit per head (`sinks`), dropped after."""

    def __init__(self, args: ModelArgs, layer: int):
        bias = args.attention_bias
        super().__init__(args, layer, qkv_bias=bias, o_bias=bias)
        self.sinks = nn.Parameter(torch.empty(args.num_attention_heads))

    def softmax(self, scores: torch.Tensor) -> torch.Tensor:
        Hkv, GT, S = scores.shape  # query head h = kv * G + g, as the sinks are ordered
        G = self.H // self.Hkv
        sinks = self.sinks.to(scores.dtype).view(Hkv, G, 1, 1).expand(Hkv, G, GT // G, 1)
        logits = torch.cat([scores.view(Hkv, G, GT // G, S), sinks], dim=-1)  # [Hkv, G, T, S+1]
        # transformers subtracts the max itself and runs the softmax in the activation dtype.
        logits = logits - logits.amax(dim=-1, keepdim=True)
        return torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1].reshape(Hkv, GT, S)

    native_softmax = softmax  # native.attend computes it with attend_sinks()

    def attend_sinks(self) -> torch.Tensor:
        return self.sinks if self.sinks.dtype == torch.float32 else self.sinks.float()


class GptOssMoe(SparseMoe):
    """Router with bias: top-k on the raw logits, then softmax over those k (activation dtype)."""

    scores_are_probs = False
    topk_first = True  # native.route's form of this rule

    @functools.cached_property
    def _route_rule(self) -> bool:
        """native.route computes this block's rule: this class's scores and weigh over the base
        top-k, an nn.Linear router (its bias added before the top-k)."""
        cls = type(self)
        return (cls.scores, cls.select, cls.weigh) == (
            GptOssMoe.scores,
            SparseMoe.select,
            GptOssMoe.weigh,
        ) and type(self.gate) is nn.Linear

    def __init__(self, args: ModelArgs, layer: int):
        gate = nn.Linear(args.hidden_size, args.num_experts, bias=True)
        super().__init__(args, layer, weights_in_act_dtype=True, gate=gate)

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(x)  # [T, E] logits

    def weigh(self, picked: torch.Tensor) -> torch.Tensor:
        return torch.softmax(picked, dim=-1, dtype=picked.dtype)


def make_attention(args: ModelArgs, i: int) -> SinkAttention:
    return SinkAttention(args, i)


def make_mlp(args: ModelArgs, i: int) -> GptOssMoe:
    return GptOssMoe(args, i)


def build(args: ModelArgs) -> MoeCausalLM:
    model = MoeCausalLM(args, make_attention, make_mlp)
    D, eps = args.hidden_size, args.rms_norm_eps
    for layer in model.model.layers:
        layer.input_layernorm = GptOssRMSNorm(D, eps)
        layer.post_attention_layernorm = GptOssRMSNorm(D, eps)
    model.model.norm = GptOssRMSNorm(D, eps)
    return model
