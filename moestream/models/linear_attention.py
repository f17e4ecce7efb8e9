"""Gated DeltaNet linear attention (Qwen3.5 `linear_attn` layers): causal depthwise conv, the gated
delta rule (chunked over the prompt, recurrent in decode) and the gated RMSNorm on its output.

The math follows transformers' torch fallbacks (`causal_conv1d_*`, `torch_chunk_gated_delta_rule`,
`torch_recurrent_gated_delta_rule`) operation by operation, without the batch dimension.
Shapes: T tokens, Hk key heads, Hv value heads, dk / dv head dims, C = 2*Hk*dk + Hv*dv conv channels.
The decode state (conv: last K-1 inputs [C, K-1]; recurrent: [Hv, dk, dv] fp32) lives in
`cache.state[layer]`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from moestream.config import ModelArgs

CHUNK = 64  # transformers' chunk size: same blocks, same rounding


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def recurrent_state(cache, layer: int, start: int, init: Callable[[], dict]) -> dict:
    """The layer's slot in `cache.state`, filled by `init()` when a sequence starts at 0."""
    st = cache.state[layer]
    if start == 0:
        st.clear()
        st.update(init())
    elif not st:
        raise ValueError(f"layer {layer}: no recurrent state to continue from position {start}")
    return st


def causal_conv(
    x: torch.Tensor,
    state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    silu: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv (+ SiLU). x [C, T], state [C, K-1] (the inputs before x), weight
    [C, K] -> (out [C, T], new state [C, K-1])."""
    K, T = weight.shape[-1], x.shape[-1]
    xx = torch.cat((state, x), dim=-1)  # [C, K-1+T]
    out = F.conv1d(xx[None], weight[:, None, :], bias, groups=weight.shape[0])[0][:, -T:]
    return (F.silu(out) if silu else out), xx[:, xx.shape[-1] - (K - 1) :]


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q/k [H, T, dk], v [H, T, dv], g/beta [H, T] (fp32, l2-normed q/k), state [H, dk, dv]
    -> (out [H, T, dv], new state). Chunks of CHUNK tokens: a triangular solve inside each chunk
    (the UT transform), a sequential scan across chunks."""
    H, T, dk = k.shape
    q = q * dk**-0.5
    pad = (CHUNK - T % CHUNK) % CHUNK
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    n = (T + pad) // CHUNK
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, k_beta, v_beta = (x.reshape(H, n, CHUNK, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    cum = g.reshape(H, n, CHUNK).cumsum(dim=-1)  # log decay from the chunk start
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    pair = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pair  # [H, n, C, C], unit lower triangular
    intra = (q @ k.transpose(-1, -2)) * pair
    new_v = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(
        system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True
    )
    out = torch.zeros_like(new_v)
    q = q * cum.exp()[..., None]
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [H, n, 1, 1]
    for i in range(n):
        v_new = new_v[:, i] - k_cum[:, i] @ state
        out[:, i] = q[:, i] @ state + intra[:, i] @ v_new
        state = state * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    return out.reshape(H, -1, v.shape[-1])[:, :T], state


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token (decode); same arguments and results as chunk_gated_delta_rule."""
    q = q / q.shape[-1] ** 0.5
    out = torch.empty_like(v)
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[:, None, None]
        kv_mem = (state * k[:, t, :, None]).sum(dim=-2)  # [H, dv]
        delta = (v[:, t] - kv_mem) * beta[:, t, None]
        state = state + k[:, t, :, None] * delta[:, None, :]
        out[:, t] = (state * q[:, t, :, None]).sum(dim=-2)
    return out, state


class GatedRMSNorm(nn.Module):
    """RMSNorm over each value head, then times silu(z) in fp32 (transformers' RMSNormGated)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        h = self.weight * h.to(x.dtype)
        return (h * F.silu(z.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """`linear_attn`: in_proj_qkv -> causal conv -> gated delta rule -> gated norm -> out_proj."""

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        D = args.hidden_size
        self.layer = layer
        self.Hk, self.Hv = args.linear_num_key_heads, args.linear_num_value_heads
        self.dk, self.dv = args.linear_key_head_dim, args.linear_value_head_dim
        self.key_dim, self.value_dim = self.Hk * self.dk, self.Hv * self.dv
        C, K = 2 * self.key_dim + self.value_dim, args.linear_conv_kernel_dim
        self.conv1d = nn.Conv1d(C, C, K, groups=C, padding=K - 1, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.Hv))
        self.A_log = nn.Parameter(torch.zeros(self.Hv))
        self.norm = GatedRMSNorm(self.dv, args.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, D, bias=False)
        self.in_proj_qkv = nn.Linear(D, C, bias=False)
        self.in_proj_z = nn.Linear(D, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(D, self.Hv, bias=False)
        self.in_proj_a = nn.Linear(D, self.Hv, bias=False)

    def forward(self, x: torch.Tensor, cos, sin, cache, start: int) -> torch.Tensor:
        T = x.shape[0]
        C, K = self.conv1d.weight.shape[0], self.conv1d.weight.shape[-1]
        st = recurrent_state(
            cache,
            self.layer,
            start,
            lambda: {
                "conv": x.new_zeros(C, K - 1),
                "recurrent": torch.zeros(self.Hv, self.dk, self.dv, device=x.device),
            },
        )
        qkv, st["conv"] = causal_conv(self.in_proj_qkv(x).T, st["conv"], self.conv1d.weight[:, 0])
        q, k, v = torch.split(qkv.T, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        z = self.in_proj_z(x).reshape(T * self.Hv, self.dv)
        beta = self.in_proj_b(x).sigmoid()  # [T, Hv]
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        # Each key head serves Hv/Hk consecutive value heads; the rule runs in fp32 [H, T, d].
        rep = self.Hv // self.Hk
        q, k = (
            l2norm(t.reshape(T, self.Hk, self.dk).repeat_interleave(rep, dim=1).float())
            .transpose(0, 1)
            .contiguous()
            for t in (q, k)
        )
        v = v.reshape(T, self.Hv, self.dv).float().transpose(0, 1).contiguous()
        beta, g = beta.float().T.contiguous(), g.T.contiguous()
        rule = recurrent_gated_delta_rule if T == 1 else chunk_gated_delta_rule
        out, st["recurrent"] = rule(q, k, v, g, beta, st["recurrent"])
        out = out.transpose(0, 1).to(x.dtype).reshape(T * self.Hv, self.dv)
        return self.out_proj(self.norm(out, z).reshape(T, self.value_dim))
