"""GGUF files of the tiny random checkpoints, written in-test with the `gguf` package the way
llama.cpp's convert_hf_to_gguf.py writes them (its tensor name map, experts stacked [E, ...], Q/K
rows permuted for the `llama` arch, the vocabulary as tokens + merges + token types), so CI
covers the GGUF reader without llama.cpp. `write_gguf` also returns the values it stored, as
Hugging Face tensors, so a test can run transformers on exactly the (dequantized) weights."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np
import torch

GGUF_ARCH = {
    "qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "olmoe": "olmoe", "mixtral": "llama",
    "glm4_moe": "glm4moe", "lfm2_moe": "lfm2moe", "deepseek_v3": "deepseek2",
    "qwen3_5_moe_text": "qwen35moe", "gpt_oss": "gpt-oss",
}  # fmt: skip
# qwen35moe norms llama.cpp's converter writes as 1 + w (zero-centred in Hugging Face's)
SHIFTED_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight", "model.norm.weight",
                 "q_norm.weight", "k_norm.weight")  # fmt: skip


def gguf_arch(name: str):
    """The gguf package's MODEL_ARCH of a general.architecture name (glm4moe is GLM4_MOE)."""
    import gguf

    return {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[name]


def gguf_key(hf: str) -> str:
    """The HF name as llama.cpp's tensor map knows it (it renames the router's selection bias and
    qwen35moe's dt_bias)."""
    hf = hf.replace("e_score_correction_bias", "e_score_correction.bias")
    hf = hf.replace("linear_attn.dt_bias", "linear_attn.dt_proj.bias")
    if hf.endswith(".self_attn.sinks"):  # gpt-oss: the converter names it sinks.weight
        hf += ".weight"
    return hf.replace(".expert_bias", ".expert_bias.bias")


_EXPERT_ROLES = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
_MIXTRAL_ROLES = {"w1": "gate", "w3": "up", "w2": "down"}
# K-quant blocks written for a weight of std s get d ~ N(0, s / this): about s once scaled by
# their typical |sc * (q - mid)| (centred blocks).
_KQUANT_SPREAD = {"Q4_K": 120.0, "Q5_K": 250.0, "Q6_K": 1000.0}


def expert_name(model_type: str, layer: int, e: int, role: str) -> str:
    """The per-expert Hugging Face name of one expert weight (role: gate, up, down)."""
    if model_type in ("mixtral", "lfm2_moe"):
        w = {"gate": "w1", "up": "w3", "down": "w2"}[role]
        block = "block_sparse_moe" if model_type == "mixtral" else "feed_forward"
        return f"model.layers.{layer}.{block}.experts.{e}.{w}.weight"
    return f"model.layers.{layer}.mlp.experts.{e}.{role}_proj.weight"


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute (HF rotate-half rows -> GGML's adjacent pairs)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _store(writer, name: str, w: np.ndarray, qtype) -> np.ndarray:
    """Add one tensor in qtype; returns the values a reader dequantizes back."""
    import gguf

    T = gguf.GGMLQuantizationType
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    # norms, biases and rows a block does not divide stay F32 (llama.cpp falls back to F16)
    if qtype == T.F32 or w.ndim == 1 or w.shape[-1] % block:
        writer.add_tensor(name, w.astype(np.float32))
        return w.astype(np.float32)
    if qtype.name in _KQUANT_SPREAD:  # no quantizer in the gguf package: random centred blocks
        n, k = int(np.prod(w.shape[:-1])), w.shape[-1]
        scale = float(w.std()) / _KQUANT_SPREAD[qtype.name]
        raw = kquant_blocks(qtype.name.lower(), n, k, zlib.crc32(name.encode()), scale, True)
        q = raw.reshape(*w.shape[:-1], -1)
    else:
        q = gguf.quants.quantize(w.astype(np.float32), qtype)
    writer.add_tensor(name, q, raw_dtype=qtype)
    return gguf.quants.dequantize(q, qtype)


def _vocab(writer, folder: Path, pre: str, vocab_size: int) -> None:
    import gguf

    tok = json.loads((folder / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    # Rows past the tokenizer are padded as llama.cpp's get_vocab_base does.
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [gguf.TokenType.UNUSED] * vocab_size
    for t, i in vocab.items():
        tokens[i], types[i] = t, gguf.TokenType.NORMAL
    for a in tok["added_tokens"]:
        types[a["id"]] = gguf.TokenType.CONTROL if a["special"] else gguf.TokenType.USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    writer.add_eos_token_id(vocab[cfg["eos_token"]])
    if "chat_template" in cfg:
        writer.add_chat_template(cfg["chat_template"])


def write_gguf(
    folder: Path,
    path: Path,
    expert_types=None,
    dense_type: str = "F32",
    pre: str = "gpt-2",
    skip_key: str | None = None,
    dense_types: dict[str, str] | None = None,
    spm=None,
) -> dict[str, torch.Tensor]:
    """A GGUF of the per-expert HF checkpoint in folder. expert_types: layer -> (gate, up, down)
    type names (default F32); dense_types: HF name -> type, over dense_type; spm: a SentencePiece
    vocabulary (tests/spm_models.SpmVocab) to write instead of the folder's byte-level one.
    Returns HF name -> the values stored (dequantized)."""
    import gguf
    from safetensors.numpy import load_file

    T = gguf.GGMLQuantizationType
    cfg = json.loads((folder / "config.json").read_text())
    mt, n = cfg["model_type"], cfg["num_hidden_layers"]
    arch = GGUF_ARCH[mt]
    state = load_file(str(folder / "model.safetensors"))
    writer = gguf.GGUFWriter(str(path), arch)
    _metadata(writer, cfg, skip_key)
    if spm is None:
        _vocab(writer, folder, pre, cfg["vocab_size"])
    else:
        from spm_models import write_spm_vocab

        write_spm_vocab(writer, spm)
    names = gguf.get_tensor_name_map(gguf_arch(arch), n)
    stored: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for hf, w in state.items():
        parts = hf.split(".")
        if mt == "gpt_oss" and ".experts." in hf:
            _gpt_oss_experts(writer, hf, w, experts, stored)
            continue
        if ".experts." in hf:
            layer, e, role = int(parts[2]), int(parts[5]), parts[6]
            role = (_MIXTRAL_ROLES if mt in ("mixtral", "lfm2_moe") else _EXPERT_ROLES)[role]
            experts.setdefault((layer, role), {})[e] = w
            continue
        name = names.get_name(gguf_key(hf), try_suffixes=(".weight", ".bias"))
        assert name is not None, hf
        out, heads = w, None
        if mt == "mixtral" and hf.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg["num_attention_heads" if "q_proj" in hf else "num_key_value_heads"]
            out = _permute(w, heads)
        if hf.endswith("shared_expert_gate.weight"):
            out = w.reshape(-1)  # [1, D] -> as llama.cpp stores small gates (F32, 1-D)
        if hf.endswith(("conv.conv.weight", "linear_attn.conv1d.weight")):
            out = w.squeeze(1)  # a depthwise conv [D, 1, L] -> [D, L], as llama.cpp
        kind = T[(dense_types or {}).get(hf, dense_type)]
        if hf.endswith("kv_b_proj.weight") and arch == "deepseek2":
            stored[hf] = _store_kv_b(writer, name, w, cfg, kind)
            continue
        if arch == "qwen35moe":
            stored[hf] = _store_qwen35(writer, name, hf, w, out, cfg, kind)
            continue
        vals = _store(writer, name, out, kind)
        if heads is not None:  # the values in HF's row order: the permutation undone
            vals = vals.reshape(heads, -1, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        stored[hf] = torch.from_numpy(np.ascontiguousarray(vals).reshape(w.shape))
    types = expert_types or {}
    for (layer, role), by_e in sorted(experts.items()):
        w = np.stack([by_e[e] for e in range(len(by_e))])  # [E, N, K]
        kind = dict(zip(("gate", "up", "down"), types.get(layer, ("F32",) * 3)))[role]
        vals = _store(writer, f"blk.{layer}.ffn_{role}_exps.weight", w, T[kind])
        if mt == "gpt_oss":
            stored[f"{layer}.{role}"] = torch.from_numpy(np.ascontiguousarray(vals))
            continue
        for e in range(len(by_e)):
            stored[expert_name(mt, layer, e, role)] = torch.from_numpy(
                np.ascontiguousarray(vals[e])
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if mt == "gpt_oss":
        _gpt_oss_fused(stored, n)
    return stored


def _gpt_oss_experts(writer, hf: str, w: np.ndarray, experts: dict, stored: dict) -> None:
    """gpt_oss's fused experts as llama.cpp's GptOssModel writes a float checkpoint: gate_up_proj
    [E, D, 2I] (x @ W, gate and up interleaved along 2I) -> gate / up [E, I, D], down_proj
    [E, I, D] -> [E, D, I]; the biases split alike, written F32 as `ffn_*_exps.bias`."""
    layer, key = int(hf.split(".")[2]), hf.split(".")[-1]
    if key.endswith("_bias"):
        parts = {"gate": w[:, ::2], "up": w[:, 1::2]} if "gate_up" in key else {"down": w}
        for role, b in parts.items():
            writer.add_tensor(f"blk.{layer}.ffn_{role}_exps.bias", np.ascontiguousarray(b))
        stored[hf] = torch.from_numpy(w.copy())
        return
    t = w.transpose(0, 2, 1)  # [E, out, in]
    parts = {"gate": t[:, ::2], "up": t[:, 1::2]} if "gate_up" in key else {"down": t}
    for role, m in parts.items():
        experts[(layer, role)] = dict(enumerate(np.ascontiguousarray(m)))


def _gpt_oss_fused(stored: dict, n_layers: int) -> None:
    """The stored gate / up / down values [E, out, in] back into gpt_oss's fused HF tensors."""
    for layer in range(n_layers):
        stored.update(gpt_oss_fused(layer, *(stored.pop(f"{layer}.{r}") for r in _ROLES)))


_ROLES = ("gate", "up", "down")


def gpt_oss_fused(layer: int, gate, up, down, b_gate=None, b_up=None, b_down=None) -> dict:
    """gpt_oss's fused HF expert tensors of one layer from GGUF-ordered values: gate / up [E, I,
    D], down [E, D, I] (biases [E, I], [E, D]) -> gate_up_proj [E, D, 2I], gate and up
    interleaved, down_proj [E, I, D] (gate_up_proj_bias [E, 2I], down_proj_bias [E, D])."""

    def interleave(a, b):
        return torch.stack([a, b], dim=2).flatten(1, 2)

    pre = f"model.layers.{layer}.mlp.experts"
    out = {
        f"{pre}.gate_up_proj": interleave(gate, up).transpose(1, 2).contiguous(),
        f"{pre}.down_proj": down.transpose(1, 2).contiguous(),
    }
    if b_gate is not None:
        out[f"{pre}.gate_up_proj_bias"] = interleave(b_gate, b_up).contiguous()
        out[f"{pre}.down_proj_bias"] = b_down
    return out


def _store_kv_b(writer, name: str, w: np.ndarray, cfg: dict, kind) -> torch.Tensor:
    """DeepSeek's kv_b_proj [H * (nope + vd), r] as llama.cpp writes it for the absorbed MLA:
    attn_k_b [H, r, nope] (each head's key rows transposed) and attn_v_b [H, vd, r]. Returns the
    values stored, rejoined in Hugging Face's layout."""
    H, nope = cfg["num_attention_heads"], cfg["qk_nope_head_dim"]
    per_head = w.reshape(H, -1, w.shape[-1])  # [H, nope + vd, r]
    k_b = np.ascontiguousarray(per_head[:, :nope].transpose(0, 2, 1))
    k_vals = _store(writer, name.replace("attn_kv_b", "attn_k_b"), k_b, kind)
    v_vals = _store(writer, name.replace("attn_kv_b", "attn_v_b"), per_head[:, nope:], kind)
    joined = np.concatenate([k_vals.reshape(k_b.shape).transpose(0, 2, 1),
                             v_vals.reshape(per_head[:, nope:].shape)], axis=1)  # fmt: skip
    return torch.from_numpy(np.ascontiguousarray(joined).reshape(w.shape))


def v_heads_tiled(cfg: dict, hf: str) -> tuple[int, np.ndarray] | None:
    """(axis, index) of llama.cpp's qwen35moe value-head reorder: GGUF = HF.take(index, axis),
    value heads grouped by key head [Hk, Hv/Hk, d] written tiled [Hv/Hk, Hk, d]; None where the
    converter keeps the order."""
    n_k, n_v = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    if ".linear_attn." not in hf or n_k == n_v:
        return None
    dv, qk = cfg["linear_value_head_dim"], 2 * n_k * cfg["linear_key_head_dim"]

    def tiled(d: int) -> np.ndarray:
        return np.arange(n_v * d).reshape(n_k, n_v // n_k, d).swapaxes(0, 1).reshape(-1)

    if hf.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        return 0, np.concatenate([np.arange(qk), qk + tiled(dv)])
    if hf.endswith("in_proj_z.weight"):
        return 0, tiled(dv)
    if hf.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
        return 0, tiled(1)
    if hf.endswith("out_proj.weight"):
        return 1, tiled(dv)
    return None


def _store_qwen35(writer, name, hf, w, out, cfg, kind) -> torch.Tensor:
    """A qwen35moe dense tensor as llama.cpp's converter writes it: norms as 1 + w, A_log as
    -exp(A_log), value heads tiled; returns the values in Hugging Face's form (the original
    where only the value changed, in F32: what transformers computes from it is the same)."""
    order = v_heads_tiled(cfg, hf)
    if order is not None:
        out = np.ascontiguousarray(np.take(out, order[1], axis=order[0]))
    if hf.endswith(SHIFTED_NORMS) and ".linear_attn." not in hf:
        _store(writer, name, out + 1.0, kind)
        return torch.from_numpy(w.copy())
    if hf.endswith("A_log"):
        _store(writer, name, -np.exp(out), kind)
        return torch.from_numpy(w.copy())
    vals = _store(writer, name, out, kind).reshape(out.shape)
    if order is not None:  # back to Hugging Face's order: the inverse permutation
        vals = np.take(vals, np.argsort(order[1]), axis=order[0])
    return torch.from_numpy(np.ascontiguousarray(vals).reshape(w.shape))


def _metadata(writer, cfg: dict, skip_key: str | None) -> None:
    import gguf

    heads = cfg["num_attention_heads"]
    n_exp = cfg.get("num_experts", cfg.get("num_local_experts"))
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    adds = {
        "block_count": cfg["num_hidden_layers"],
        "context_length": cfg["max_position_embeddings"],
        "embedding_length": cfg["hidden_size"],
        "feed_forward_length": cfg.get("intermediate_size"),  # (qwen35moe has none)
        "head_count": heads,
        "head_count_kv": cfg["num_key_value_heads"],
        "key_length": head_dim,
        "rope_freq_base": cfg.get("rope_parameters", {}).get("rope_theta", 10000.0),
        "layer_norm_rms_eps": cfg["rms_norm_eps"],
        "expert_count": n_exp,
        "expert_used_count": cfg["num_experts_per_tok"],
    }
    if "moe_intermediate_size" in cfg:
        adds["expert_feed_forward_length"] = cfg["moe_intermediate_size"]
    if cfg["model_type"] == "gpt_oss":  # as llama.cpp's GptOssModel (+ TextModel's yarn keys)
        rp = cfg["rope_parameters"]
        adds.update(
            expert_feed_forward_length=cfg["intermediate_size"],
            sliding_window=cfg["sliding_window"],
            rope_scaling_type=gguf.RopeScalingType.YARN,
            rope_scaling_factor=rp["factor"],
            rope_scaling_orig_ctx_len=rp["original_max_position_embeddings"],
            rope_scaling_yarn_beta_fast=rp["beta_fast"],
            rope_scaling_yarn_beta_slow=rp["beta_slow"],
        )
    if cfg.get("shared_expert_intermediate_size"):
        adds["expert_shared_feed_forward_length"] = cfg["shared_expert_intermediate_size"]
    if cfg["model_type"] == "olmoe" and cfg.get("clip_qkv"):
        adds["clamp_kqv"] = cfg["clip_qkv"]
    if cfg["model_type"] == "lfm2_moe":  # as llama.cpp's LFM2MoeModel.set_gguf_parameters
        kv = cfg["num_key_value_heads"]
        adds.update(
            head_count_kv=[kv if t == "full_attention" else 0 for t in cfg["layer_types"]],
            leading_dense_block_count=cfg["num_dense_layers"],
            expert_gating_func=gguf.ExpertGatingFuncType.SIGMOID,
            shortconv_l_cache=cfg["conv_L_cache"],
        )
    if cfg["model_type"] == "glm4_moe":  # as llama.cpp's Glm4MoeModel.set_gguf_parameters
        adds.update(
            expert_count=cfg["n_routed_experts"],
            expert_shared_count=cfg["n_shared_experts"],
            leading_dense_block_count=cfg["first_k_dense_replace"],
            expert_gating_func=gguf.ExpertGatingFuncType.SIGMOID,
            expert_weights_scale=cfg["routed_scaling_factor"],
            expert_weights_norm=cfg["norm_topk_prob"],
            expert_group_count=cfg["n_group"],
            expert_group_used_count=cfg["topk_group"],
            rope_dimension_count=int(head_dim * cfg.get("partial_rotary_factor", 0.5)),
        )
    if cfg["model_type"] == "deepseek_v3":  # as llama.cpp's DeepseekV2Model
        adds.update(_deepseek2_metadata(cfg))
    if cfg["model_type"] == "qwen3_5_moe_text":  # as llama.cpp's Qwen3_5MoeTextModel
        types = cfg["layer_types"]
        adds.update(
            ssm_conv_kernel=cfg["linear_conv_kernel_dim"],
            ssm_state_size=cfg["linear_key_head_dim"],
            ssm_group_count=cfg["linear_num_key_heads"],
            ssm_time_step_rank=cfg["linear_num_value_heads"],
            ssm_inner_size=cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"],
            # (this gguf package has no recurrent_layers key: the interval gives the same types)
            full_attention_interval=types.index("full_attention") + 1,
            rope_dimension_count=int(head_dim * cfg["rope_parameters"]["partial_rotary_factor"]),
            # the config's (padded, as the converter does), else the hub files'
            rope_dimension_sections=[*cfg["rope_parameters"].get("mrope_section", [11, 11, 10]), 0],
        )
    for key, value in adds.items():
        if key != skip_key and value is not None:
            getattr(writer, f"add_{key}")(value)


def _deepseek2_metadata(cfg: dict) -> dict:
    import gguf

    r, rope = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    rp = cfg["rope_parameters"]
    out = dict(
        head_count_kv=1,  # MLA written as MQA over the latent
        key_length=r + rope,
        value_length=r,
        key_length_mla=cfg["qk_nope_head_dim"] + rope,
        value_length_mla=cfg["v_head_dim"],
        kv_lora_rank=r,
        q_lora_rank=cfg["q_lora_rank"],
        expert_count=cfg["n_routed_experts"],
        expert_shared_count=cfg["n_shared_experts"],
        leading_dense_block_count=cfg["first_k_dense_replace"],
        expert_gating_func=gguf.ExpertGatingFuncType.SIGMOID,
        expert_weights_scale=cfg["routed_scaling_factor"],
        expert_group_count=cfg["n_group"],
        expert_group_used_count=cfg["topk_group"],
        rope_dimension_count=rope,
    )
    if cfg["norm_topk_prob"]:
        out["expert_weights_norm"] = True
    if rp.get("rope_type") == "yarn":
        out.update(
            rope_scaling_type=gguf.RopeScalingType.YARN,
            rope_scaling_factor=rp["factor"],
            rope_scaling_orig_ctx_len=rp["original_max_position_embeddings"],
            rope_scaling_yarn_log_mul=0.1 * rp["mscale_all_dim"],
        )
    return out


def rewrite_gguf(src: Path, dst: Path, arch: str, fields: dict | None = None, **writer_kw) -> None:
    """src's metadata and tensors written again to dst by the gguf package (`writer_kw`: e.g.
    split_max_tensors); `fields` replaces a key's value, None drops it."""
    import gguf

    fields = fields or {}
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), arch, **writer_kw)
    for k, f in r.fields.items():
        if k.startswith(("GGUF.", "general.architecture")) or (k in fields and fields[k] is None):
            continue
        contents = fields[k] if k in fields else f.contents()
        w.add_key_value(k, contents, f.types[0], f.types[-1] if len(f.types) > 1 else None)
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def kquant_blocks(
    kind: str, n: int, k: int, seed: int = 0, scale: float = 0.01, centred: bool = False
) -> np.ndarray:
    """Random GGUF K-quant rows uint8 [n, k/256, block bytes] (kind: q4_k, q5_k, q6_k): every
    quant, scale and min byte uniform, the fp16 d (and dmin) ~ N(0, scale): any valid block, as
    the gguf package cannot quantize into K-quants. `centred` (q4_k / q5_k): weights like a real
    model's, around 0: each sub-block's min equal to its scale and dmin = d * (mid quant)."""
    from moestream.quant import KQUANT_BYTES

    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // 256, KQUANT_BYTES[kind]), dtype=np.uint8)
    d = (rng.standard_normal((n, k // 256, 1)) * scale).astype(np.float16)
    if kind == "q6_k":
        raw[..., 208:210] = d.view(np.uint8)
        return raw
    dmin = rng.standard_normal((n, k // 256, 1)).astype(np.float16)
    if centred:  # m = sc: bytes 4-7 as 0-3, 8-11 one nibble twice; w = d * sc * (q - mid)
        raw[..., 4:8] = raw[..., 0:4]
        raw[..., 8:12] = (raw[..., 8:12] & 15) * 17
        dmin = (d.astype(np.float32) * (7.5 if kind == "q4_k" else 15.5)).astype(np.float16)
    else:
        dmin = (dmin * scale).astype(np.float16)
    raw[..., 0:2], raw[..., 2:4] = d.view(np.uint8), dmin.view(np.uint8)
    return raw


def assert_records_are(s, stored: dict, schemes: dict | None = None, layers=None) -> None:
    """Every expert record of store `s` dequantizes (float32) to exactly `stored`'s gate, up and
    down tensors (HF names, as `expert_name` gives them): nothing was rounded a second time.
    `schemes`: layer -> (w13's, w2's) scheme names the store must hold them in; `layers`: only
    those MoE layers (default all)."""
    from moestream.kernels.ref import dequantize

    I, mt = s.args.moe_intermediate_size, s.args.model_type
    for layer in s.args.moe_layer_ids if layers is None else layers:
        layout = s.layouts[layer]
        if schemes is not None:
            assert tuple(x.name for x in layout.schemes) == schemes[layer], layer
        g13, g2 = layout.groups
        for e in range(s.args.num_experts):
            buf = torch.frombuffer(bytearray(s.read_record(layer, e)), dtype=torch.uint8)
            sec = layout.views(buf)
            w13 = dequantize(sec, "w13", g13, torch.float32)
            assert torch.equal(w13[:I], stored[expert_name(mt, layer, e, "gate")])
            assert torch.equal(w13[I:], stored[expert_name(mt, layer, e, "up")])
            w2 = dequantize(sec, "w2", g2, torch.float32)
            assert torch.equal(w2, stored[expert_name(mt, layer, e, "down")])


def fuse_gguf(src: Path, dst: Path, arch: str, qkv: bool = True, gate_up: bool = True) -> None:
    """src's GGUF with tensors fused as llama.cpp's converter fuses them (`--fuse-qkv`: each
    layer's attn_q / attn_k / attn_v weights (and biases) as one attn_qkv, rows q, k, v;
    `--fuse-gate-up-exps`: ffn_gate_exps and ffn_up_exps as ffn_gate_up_exps, each expert's
    gate rows then up rows), the stored blocks as they are."""
    import gguf

    r = gguf.GGUFReader(str(src))
    tensors = {t.name: t for t in r.tensors}
    w = gguf.GGUFWriter(str(dst), arch)
    for k, f in r.fields.items():
        if not k.startswith(("GGUF.", "general.architecture")):
            w.add_key_value(k, f.contents(), f.types[0], f.types[-1] if len(f.types) > 1 else None)
    groups = []  # (fused name, its parts): rows concatenated
    for t in r.tensors:
        blk, _, rest = t.name.rpartition(".attn_q.")
        if qkv and blk and f"{blk}.attn_k.{rest}" in tensors:
            parts = [f"{blk}.attn_{p}.{rest}" for p in "qkv"]
            groups.append((f"{blk}.attn_qkv.{rest}", parts))
        if gate_up and t.name.endswith(".ffn_gate_exps.weight"):
            blk = t.name.rsplit(".", 2)[0]
            groups.append((f"{blk}.ffn_gate_up_exps.weight", [t.name, f"{blk}.ffn_up_exps.weight"]))
    fused = {p for _, parts in groups for p in parts}
    for t in r.tensors:
        if t.name not in fused:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    for name, parts in groups:
        data = np.concatenate([np.array(tensors[p].data) for p in parts], axis=-2 if
                              tensors[parts[0]].data.ndim > 1 else 0)  # fmt: skip
        w.add_tensor(name, data, raw_dtype=tensors[parts[0]].tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
