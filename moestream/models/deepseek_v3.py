"""DeepSeek-V3 / R1 (`deepseek_v3`): multi-head latent attention (queries optionally through a
low-rank q_a/q_b pair; keys/values from a shared latent plus one shared rotary key), RoPE on the
rope part only (interleaved pairs when `rope_interleave`), softmax scale with the yarn mscale; the
first `first_k_dense_replace` layers are dense, the rest use the sigmoid group-limited router with
ungated shared experts."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from moestream.config import ModelArgs
from moestream.models.base import MoeCausalLM
from moestream.models.config_rules import deepseek_style_fields
from moestream.models.layers import MLP, RMSNorm, SigmoidMoe, apply_rope, attention_mask

# transformers builds q_a_layernorm / kv_a_layernorm with RMSNorm's default eps, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def config_fields(cfg: dict[str, Any], path: str) -> dict[str, Any]:
    """DeepseekV3Config's defaults for the routing and the latent-attention dims."""
    rope_dim = int(cfg.get("qk_rope_head_dim", 64))
    q_lora = cfg.get("q_lora_rank", 1536)
    return dict(
        deepseek_style_fields(
            cfg, path, first_dense=3, routed_scaling=2.5, n_group=8, topk_group=4
        ),
        head_dim=rope_dim,  # RoPE and the config's head_dim cover the rope part
        q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=int(cfg.get("kv_lora_rank", 512)),
        qk_nope_head_dim=int(cfg.get("qk_nope_head_dim", 128)),
        qk_rope_head_dim=rope_dim,
        v_head_dim=int(cfg.get("v_head_dim", 128)),
        rope_interleave=bool(cfg.get("rope_interleave", True)),
    )


def softmax_scale(args: ModelArgs) -> float:
    """1/sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)^2 under yarn-style scaling."""
    scale = (args.qk_nope_head_dim + args.qk_rope_head_dim) ** -0.5
    r = args.rope
    if r.rope_type != "default" and r.mscale_all_dim and r.factor > 1:
        m = 0.1 * r.mscale_all_dim * math.log(r.factor) + 1.0
        scale = scale * m * m
    return scale


class MLAttention(nn.Module):
    """Multi-head latent attention; caches the expanded per-head K [H, S, nope+rope] and V."""

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        D, H = args.hidden_size, args.num_attention_heads
        self.layer, self.H = layer, H
        self.nope, self.rope, self.vd = (
            args.qk_nope_head_dim,
            args.qk_rope_head_dim,
            args.v_head_dim,
        )
        self.kv_lora = args.kv_lora_rank
        qk = self.nope + self.rope
        self.q_lora = args.q_lora_rank
        if self.q_lora is None:
            self.q_proj = nn.Linear(D, H * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(D, self.q_lora, bias=args.attention_bias)
            self.q_a_layernorm = RMSNorm(self.q_lora, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(self.q_lora, H * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, self.kv_lora + self.rope, bias=args.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.kv_lora, H * (self.nope + self.vd), bias=False)
        self.o_proj = nn.Linear(H * self.vd, D, bias=args.attention_bias)
        self.interleave = args.rope_interleave
        self.scaling = softmax_scale(args)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # Interleaved checkpoints pair dims (0,1), (2,3), ...: gather evens then odds and rotate
        # halves; bit-identical to transformers' apply_rotary_pos_emb_interleave (same layout out).
        if self.interleave:
            x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
        return apply_rope(x, cos, sin)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache, start: int
    ) -> torch.Tensor:
        T, H = x.shape[0], self.H
        if self.q_lora is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(T, H, self.nope + self.rope).transpose(0, 1)  # [H, T, nope+rope]
        q_pass, q_rot = torch.split(q, [self.nope, self.rope], dim=-1)
        kv_latent, k_rot = torch.split(
            self.kv_a_proj_with_mqa(x), [self.kv_lora, self.rope], dim=-1
        )  # [T, r], [T, rope]
        kv = self.kv_b_proj(self.kv_a_layernorm(kv_latent))  # [T, H*(nope+vd)]
        kv = kv.view(T, H, self.nope + self.vd).transpose(0, 1)
        k_nope, v = torch.split(kv, [self.nope, self.vd], dim=-1)  # [H, T, nope], [H, T, vd]
        q = torch.cat((q_pass, self._rope(q_rot, cos, sin)), dim=-1)
        k_rot = self._rope(k_rot.unsqueeze(0), cos, sin).expand(
            H, -1, -1
        )  # one key shared by heads
        k = torch.cat((k_nope, k_rot), dim=-1)  # [H, T, nope+rope]
        k, v = cache.update(self.layer, k, v, start)  # [H, S, nope+rope], [H, S, vd]
        S = k.shape[1]
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scaling  # [H, T, S]
        mask = attention_mask(T, S, start, None, x.device)
        if mask is not None:
            scores = scores.masked_fill(mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        if q.dtype != torch.float32:
            probs = probs.to(q.dtype)
        out = torch.matmul(probs, v)  # [H, T, vd]
        return self.o_proj(out.transpose(0, 1).reshape(T, H * self.vd))


def make_attention(args: ModelArgs, i: int) -> MLAttention:
    return MLAttention(args, i)


def make_mlp(args: ModelArgs, i: int):
    if args.moe_layers[i]:
        return SigmoidMoe(args, i)
    return MLP(args.hidden_size, args.intermediate_size)


def build(args: ModelArgs) -> MoeCausalLM:
    return MoeCausalLM(args, make_attention, make_mlp)
