"""Per-sequence decode state: a preallocated KV cache for attention layers, [Hkv, max_len, hd] per
layer (MLA: [H, max_len, qk_nope+qk_rope] keys and [H, max_len, v_head_dim] values), no
reallocation; and a state slot per recurrent layer (linear attention: conv + recurrent state)."""

from __future__ import annotations

import torch

from moestream.config import ModelArgs


class KVCache:
    def __init__(self, args: ModelArgs, max_len: int, dtype: torch.dtype, device="cpu"):
        heads, k_dim, v_dim = args.kv_cache_dims  # MLA: K and V widths differ
        attn = args.attention_layers
        self.k = [
            torch.empty((heads, max_len, k_dim), dtype=dtype, device=device) if a else None
            for a in attn
        ]
        self.v = [
            torch.empty((heads, max_len, v_dim), dtype=dtype, device=device) if a else None
            for a in attn
        ]
        # Recurrent layers keep fixed-size tensors here, named and shaped by the layer itself;
        # it resets them when a sequence starts at position 0.
        self.state: list[dict[str, torch.Tensor]] = [{} for _ in attn]
        self.max_len = max_len

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int):
        """Write k/v [Hkv, T, hd] at positions start.. and return the filled prefix [Hkv, start+T, hd]."""
        end = start + k.shape[1]
        if end > self.max_len:
            raise ValueError(f"KV cache full: {end} positions > capacity {self.max_len}")
        kc, vc = self.k[layer], self.v[layer]
        kc.narrow(1, start, end - start).copy_(k)  # narrow: one view op (decode counts ops)
        vc.narrow(1, start, end - start).copy_(v)
        return kc.narrow(1, 0, end), vc.narrow(1, 0, end)
