"""Pure-torch reference math for routed experts: the specification other kernels are tested against.

One expert e: y = down_e(silu(gate_e(x)) * up_e(x)). gate and up share the token's input; down
takes each slot's own activation (mixing these up silently corrupts output, see seed 001).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def expert_ffn(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """x [T, D], w13 [2I, D] (gate rows then up rows), w2 [D, I] -> [T, D]."""
    gate, up = F.linear(x, w13).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2)


def moe_ref(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, get_expert) -> torch.Tensor:
    """Routed MoE: x [T, D], ids/weights [T, K]; get_expert(e) -> (w13, w2). Experts in ascending
    id order, each token's contribution scaled by its gate weight and summed (as transformers)."""
    out = torch.zeros_like(x)
    ids_list = ids.tolist()
    by_expert: dict[int, list[tuple[int, int]]] = {}
    for t, row in enumerate(ids_list):
        for k, e in enumerate(row):
            by_expert.setdefault(e, []).append((t, k))
    for e in sorted(by_expert):
        rows = by_expert[e]
        tok = torch.tensor([t for t, _ in rows])
        slot = torch.tensor([k for _, k in rows])
        w13, w2 = get_expert(e)
        y = expert_ffn(x[tok], w13, w2) * weights[tok, slot, None]
        out.index_add_(0, tok, y.to(out.dtype))
    return out
