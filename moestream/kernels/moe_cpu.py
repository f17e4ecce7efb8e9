"""Whole routed-MoE math on the CPU for experts held as dense tensors (the resident provider):
one-token decode in few torch calls, prefill grouped by expert. Same summation order as
`kernels/ref.py` (ascending expert id), so the bits equal transformers' eager path."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moestream.kernels.ref import ExpertActivation, expert_ffn, group_by_expert


class DecodeBuffers:
    """Scratch for one decode step's K experts, kept between steps with its per-slot views: at
    one token every torch call is dispatch overhead (~1-3 us here), so the views are made once.
    Not shared between threads (the engine runs one forward pass at a time)."""

    def __init__(self):
        self._by_key: dict = {}

    def get(self, K: int, D: int, I: int, dtype: torch.dtype, device: torch.device):
        key = (K, D, I, dtype, device)
        b = self._by_key.get(key)
        if b is None:
            h = torch.empty(K, 1, 2 * I, dtype=dtype, device=device)  # gate | up per slot
            a = torch.empty(K, 1, I, dtype=dtype, device=device)  # silu(gate) * up
            y = torch.empty(K, 1, D, dtype=dtype, device=device)  # down per slot
            b = self._by_key[key] = (
                h.unbind(0),
                h[..., :I],
                h[..., I:],
                a,
                a.unbind(0),
                y,
                y.unbind(0),
                y.view(K, D),
            )
        return b


def moe_decode_plain(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13t,
    w2t,
    bufs: DecodeBuffers,
) -> torch.Tensor:
    """One token, plain SwiGLU experts in few torch calls: per expert one GEMM for gate|up and
    one for down written into fixed per-slot rows, one SiLU*up over all K slots, then the
    weighted sum. fp32 sums with one [1, K] @ [K, D] GEMM; lower precision keeps transformers'
    rounding steps (weight product in the weights' dtype, cast, then adds in ascending expert
    order), so bf16 stays bit-identical to its eager path. w13t[e] [D, 2I], w2t[e] [I, D]."""
    K = ids.shape[1]
    I = w2t[0].shape[0]
    h, gate, up, a, a_rows, y, y_rows, y2d = bufs.get(K, x.shape[1], I, x.dtype, x.device)
    experts = ids.tolist()[0]
    for k, e in enumerate(experts):
        torch.mm(x, w13t[e], out=h[k])
    torch.mul(F.silu(gate), up, out=a)
    for k, e in enumerate(experts):
        torch.mm(a_rows[k], w2t[e], out=y_rows[k])
    if x.dtype == torch.float32:
        return torch.mm(weights, y2d)
    scaled = (y * weights.view(K, 1, 1)).to(x.dtype).unbind(0)
    order = sorted(range(K), key=experts.__getitem__)
    out = scaled[order[0]]
    for k in order[1:]:
        out = out + scaled[k]
    return out


def moe_decode(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    get_expert,
    act: ExpertActivation | None = None,
) -> torch.Tensor:
    """One token through experts with biases or a clamped activation (gpt_oss; plain SwiGLU
    experts take moe_decode_plain): the reference expert_ffn per expert, in ascending id order
    (the summation order of transformers). get_expert(e) -> (w13, w2, b13, b2) or (w13, w2)."""
    out = torch.zeros_like(x)
    for e, w in sorted(zip(ids[0].tolist(), weights[0].tolist())):
        out += expert_ffn(x, *get_expert(e), act=act) * w
    return out


def moe_grouped(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    get_expert,
    act: ExpertActivation | None = None,
) -> torch.Tensor:
    """Prefill: x [T, D], ids/weights [T, K]; each routed expert once over its tokens."""
    out = torch.zeros_like(x)
    for e, t, s in group_by_expert(ids):
        w13, w2, *bias = get_expert(e)
        y = expert_ffn(x[t], w13, w2, *bias, act=act) * weights[t, s, None]
        out.index_add_(0, t, y.to(out.dtype))
    return out
