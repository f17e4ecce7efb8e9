"""Random Qwen3-MoE checkpoints of any size, written layer by layer (for benchmarks and memory
tests that need realistic expert shapes without downloading a model). Not a trained model: the
router is random, so routing is spread over the experts (a pessimistic cache workload)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def qwen3_moe_config(
    hidden: int, inter: int, experts: int, top_k: int, layers: int, vocab: int = 1024
) -> dict:
    heads = max(hidden // 128, 2)
    return {
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(heads // 8, 1),
        "head_dim": 128 if hidden >= 256 else hidden // heads,
        "intermediate_size": 4 * hidden,
        "moe_intermediate_size": inter,
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def _layer_tensors(cfg: dict, i: int, g: torch.Generator, dtype) -> dict[str, torch.Tensor]:
    D, H, KV, hd = (
        cfg["hidden_size"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["head_dim"],
    )
    E, I = cfg["num_experts"], cfg["moe_intermediate_size"]

    def rnd(*shape, fan_in):
        return (torch.randn(*shape, generator=g) / fan_in**0.5).to(dtype)

    p = f"model.layers.{i}."
    return {
        p + "self_attn.q_proj.weight": rnd(H * hd, D, fan_in=D),
        p + "self_attn.k_proj.weight": rnd(KV * hd, D, fan_in=D),
        p + "self_attn.v_proj.weight": rnd(KV * hd, D, fan_in=D),
        p + "self_attn.o_proj.weight": rnd(D, H * hd, fan_in=H * hd),
        p + "self_attn.q_norm.weight": torch.ones(hd, dtype=dtype),
        p + "self_attn.k_norm.weight": torch.ones(hd, dtype=dtype),
        p + "input_layernorm.weight": torch.ones(D, dtype=dtype),
        p + "post_attention_layernorm.weight": torch.ones(D, dtype=dtype),
        p + "mlp.gate.weight": rnd(E, D, fan_in=D / 9),  # sharpened router: fewer near-ties
        p + "mlp.experts.gate_up_proj": rnd(E, 2 * I, D, fan_in=D),
        p + "mlp.experts.down_proj": rnd(E, D, I, fan_in=I),
    }


def write_random_qwen3_moe(folder: str | Path, cfg: dict, seed: int = 0, dtype=torch.bfloat16):
    """One safetensors shard per layer (fused experts), plus index, config and a byte tokenizer."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    V, D = cfg["vocab_size"], cfg["hidden_size"]
    weight_map = {}
    head = {
        "model.embed_tokens.weight": torch.randn(V, D, generator=g).to(dtype),
        "model.norm.weight": torch.ones(D, dtype=dtype),
        "lm_head.weight": (torch.randn(V, D, generator=g) / D**0.5).to(dtype),
    }
    # One layer in memory at a time.
    parts = [lambda: head] + [
        (lambda i=i: _layer_tensors(cfg, i, g, dtype)) for i in range(cfg["num_hidden_layers"])
    ]
    for n, make in enumerate(parts):
        tensors = make()
        name = f"model-{n:05d}.safetensors"
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        del tensors
    total = sum((folder / f).stat().st_size for f in set(weight_map.values()))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}  # transformers needs both
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "config.json").write_text(json.dumps(cfg))
    _write_byte_tokenizer(folder, V)
    return folder


def _write_byte_tokenizer(folder: Path, vocab: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab_map = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab_map, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": None}))
