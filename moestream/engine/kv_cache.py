"""Per-sequence decode state: a preallocated KV cache for attention layers, [Hkv, max_len, hd] per
layer (MLA: [H, max_len, qk_nope+qk_rope] keys and [H, max_len, v_head_dim] values), no
reallocation; and a state slot per recurrent layer (linear attention: conv + recurrent state).

`StaticKVCache` is the same cache for a captured decode step (engine/graph.py): the position is a
device tensor and the torch attention reads the whole buffer, later positions masked (the Triton
attention reads the position on the device), so every step has the same shapes and nothing is
decided on the host."""

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

    def buffers(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s whole k/v buffers, once positions up to `end` are known to fit (the
        fused decode op, kernels/native.py: attend, writes and reads them itself)."""
        if end > self.max_len:
            raise ValueError(f"KV cache full: {end} positions > capacity {self.max_len}")
        return self.k[layer], self.v[layer]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int):
        """Write k/v [Hkv, T, hd] at positions start.. and return the filled prefix [Hkv, start+T, hd]."""
        end = start + k.shape[1]
        kc, vc = self.buffers(layer, end)
        kc.narrow(1, start, end - start).copy_(k)  # narrow: one view op (decode counts ops)
        vc.narrow(1, start, end - start).copy_(v)
        return kc.narrow(1, 0, end), vc.narrow(1, 0, end)


class StaticKVCache(KVCache):
    """A KVCache whose decode steps take the position as a device tensor `pos` [1] (int64).
    An int start (the prompt) writes as KVCache does. Buffers start zeroed: masked positions
    meet a zero probability, and 0 * garbage could be NaN."""

    def __init__(self, args: ModelArgs, max_len: int, dtype: torch.dtype, device="cpu"):
        super().__init__(args, max_len, dtype, device)
        for t in self.k + self.v:
            if t is not None:
                t.zero_()
        self.pos = torch.zeros(1, dtype=torch.int64, device=device)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, start):
        """start: an int (prompt) or a device tensor [1] (one decode token): then k/v [Hkv, 1, hd]
        go to that position and the whole buffers [Hkv, max_len, hd] come back."""
        if not isinstance(start, torch.Tensor):
            return super().update(layer, k, v, start)
        kc, vc = self.k[layer], self.v[layer]
        kc.index_copy_(1, start, k)
        vc.index_copy_(1, start, v)
        return kc, vc
