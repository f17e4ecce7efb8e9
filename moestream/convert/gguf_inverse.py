"""llama.cpp's converter rewrites of a tensor, undone: GGUF values -> the Hugging Face tensor.

deepseek2: `kv_b_proj` is written as two tensors for the absorbed MLA (`attn_k_b` [H, r, nope],
transposed per head, and `attn_v_b` [H, vd, r]); `kv_b` joins them back into [H * (nope + vd), r].
qwen35moe: zero-centred norms are written as 1 + w, `A_log` as A = -exp(A_log), and where a key
head serves several value heads the value heads are reordered from grouped by key head
[Hk, Hv/Hk, d] to tiled [Hv/Hk, Hk, d] (ggml broadcasts that way); `qwen35_values` undoes the
values, `qwen35_order` gives the index that restores Hugging Face's order of rows or columns.
"""

from __future__ import annotations

import torch

from moestream.config import ModelArgs

# qwen35moe norms the converter shifts by +1 (the linear-attention gated norm is not shifted)
_SHIFTED = ("input_layernorm.weight", "post_attention_layernorm.weight", "model.norm.weight",
            "q_norm.weight", "k_norm.weight")  # fmt: skip


def kv_b(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """attn_k_b [H, r, nope] and attn_v_b [H, vd, r] -> kv_b_proj [H * (nope + vd), r]."""
    kv = torch.cat((k_b.transpose(1, 2), v_b), dim=1)  # [H, nope + vd, r]
    return kv.reshape(-1, kv.shape[-1]).contiguous()


def qwen35_values(name: str, w: torch.Tensor) -> torch.Tensor:
    """Undo the converter's value rewrites: 1 + w norms, A = -exp(A_log)."""
    if name.endswith(_SHIFTED) and ".linear_attn." not in name:
        return w.float() - 1.0
    if name.endswith("linear_attn.A_log"):
        return torch.log(-w.double()).float()
    if name.endswith("linear_attn.conv1d.weight") and w.dim() == 2:
        return w.unsqueeze(1)  # squeezed depthwise conv [C, K] -> [C, 1, K]
    return w


def _tiled_to_grouped(n_k: int, per_k: int, d: int) -> torch.Tensor:
    """Index i of a grouped [Hk, per_k, d] vector -> its position in the tiled [per_k, Hk, d] one."""
    return torch.arange(per_k * n_k * d).reshape(per_k, n_k, d).transpose(0, 1).reshape(-1)


def qwen35_order(name: str, a: ModelArgs) -> tuple[int, torch.Tensor] | None:
    """(dim, index): the tensor's Hugging Face order is `w.index_select(dim, index)` of the GGUF
    one; None where the converter kept the order (one value head per key head, other tensors)."""
    n_k, n_v = a.linear_num_key_heads, a.linear_num_value_heads
    if ".linear_attn." not in name or n_k == n_v:
        return None
    per_k, dv = n_v // n_k, a.linear_value_head_dim
    v_heads = _tiled_to_grouped(n_k, per_k, dv)
    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):  # q, k channels as they are, then v
        qk = 2 * n_k * a.linear_key_head_dim
        return 0, torch.cat((torch.arange(qk), qk + v_heads))
    if name.endswith("in_proj_z.weight"):
        return 0, v_heads
    if name.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
        return 0, _tiled_to_grouped(n_k, per_k, 1)
    if name.endswith("out_proj.weight"):
        return 1, v_heads
    return None
