"""A random gpt-oss checkpoint with gpt-oss-20b's real per-layer shapes, as the hub stores it:
experts in MXFP4 (`*_blocks` uint8 [E, out, in/32, 16] + `*_scales` e8m0 [E, out, in/32],
`quantization_config` mxfp4), attention with q/k/v/o biases and sinks, a router with a bias,
sliding / full layers alternating, yarn RoPE; dense tensors bf16. Both converters read it
(moestream `convert`, llama.cpp `convert_hf_to_gguf.py`, which repacks the MXFP4 blocks).

Not a trained model: codes are uniform random bytes and the scales sit where gpt-oss's do (block
maxima ~2^-3 .. 2^-1, weights ~0.05 rms), the router is random (routing spread evenly). The
vocabulary is a byte-level BPE trained to `--vocab` tokens on this Python's stdlib sources (not
gpt-oss's 201,088 o200k tokens: its lm_head alone would be ~0.6 GB a token at Q8_0, the same on
both engines).

    python benchmarks/gen_gpt_oss.py OUT_DIR [--layers 24] [--vocab 32000] [--seed 0]
"""

from __future__ import annotations

import argparse
import glob
import json
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

# openai/gpt-oss-20b's config.json as on the hub (tests/test_mxfp4.py reads it too)
HUB_CONFIG = {
    "model_type": "gpt_oss",
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "eos_token_id": 200002,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "output_router_logits": False,
    "pad_token_id": 199999,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 201088,
    "quantization_config": {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    },
}
# e8m0 exponents of the blocks: 2^(e - 127) times e2m1 values up to 6
SCALES = (120, 124)


def mxfp4(g: torch.Generator, E: int, n_out: int, n_in: int) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = torch.randint(0, 256, (E, n_out, n_in // 32, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(*SCALES, (E, n_out, n_in // 32), dtype=torch.uint8, generator=g)
    return blocks, scales


def layer(cfg: dict, i: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    D, H, KV, hd = (cfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                     "head_dim"))  # fmt: skip
    E, I = cfg["num_local_experts"], cfg["intermediate_size"]
    bf = torch.bfloat16

    def rnd(*shape, fan_in):
        return (torch.randn(*shape, generator=g) / fan_in**0.5).to(bf)

    p = f"model.layers.{i}."
    gu, gu_s = mxfp4(g, E, 2 * I, D)
    dn, dn_s = mxfp4(g, E, D, I)
    out = {
        p + "input_layernorm.weight": torch.ones(D, dtype=bf),
        p + "post_attention_layernorm.weight": torch.ones(D, dtype=bf),
        p + "self_attn.sinks": rnd(H, fan_in=1),
        p + "mlp.router.weight": rnd(E, D, fan_in=D / 9),  # sharpened, as synthetic.py's
        p + "mlp.router.bias": rnd(E, fan_in=1),
        p + "mlp.experts.gate_up_proj_blocks": gu,
        p + "mlp.experts.gate_up_proj_scales": gu_s,
        p + "mlp.experts.gate_up_proj_bias": rnd(E, 2 * I, fan_in=16),
        p + "mlp.experts.down_proj_blocks": dn,
        p + "mlp.experts.down_proj_scales": dn_s,
        p + "mlp.experts.down_proj_bias": rnd(E, D, fan_in=16),
    }
    for name, n_out, n_in in (("q", H * hd, D), ("k", KV * hd, D), ("v", KV * hd, D),
                              ("o", D, H * hd)):  # fmt: skip
        out[p + f"self_attn.{name}_proj.weight"] = rnd(n_out, n_in, fan_in=n_in)
        out[p + f"self_attn.{name}_proj.bias"] = rnd(n_out, fan_in=64)
    return out


def tokenizer(folder: Path, vocab: int) -> None:
    """Byte-level BPE (GPT-2's regex) trained to `vocab` tokens on this Python's stdlib sources."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = Path(json.__file__).parent.parent
    files = (
        sorted(glob.glob(str(root / "*.py"))) + sorted(glob.glob(str(root / "*" / "*.py")))[:400]
    )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(files, trainer)
    if tok.get_vocab_size() != vocab:
        raise SystemExit(f"the tokenizer reached {tok.get_vocab_size()} tokens, not {vocab}")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
        "bos_token": None, "add_bos_token": False}))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    folder = Path(a.out)
    folder.mkdir(parents=True, exist_ok=True)
    # this vocabulary's own end-of-text token (id 0) and no padding token
    cfg = dict(HUB_CONFIG, num_hidden_layers=a.layers, vocab_size=a.vocab, eos_token_id=0)
    del cfg["pad_token_id"]
    cfg["layer_types"] = ["sliding_attention", "full_attention"] * (a.layers // 2)
    cfg["layer_types"] += ["sliding_attention"] * (a.layers % 2)
    tokenizer(folder, a.vocab)
    g = torch.Generator().manual_seed(a.seed)
    V, D = a.vocab, cfg["hidden_size"]
    head = {
        "model.embed_tokens.weight": torch.randn(V, D, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.ones(D, dtype=torch.bfloat16),
        "lm_head.weight": (torch.randn(V, D, generator=g) / D**0.5).to(torch.bfloat16),
    }
    weight_map, t0 = {}, time.time()
    for n in range(a.layers + 1):
        tensors = head if n == 0 else layer(cfg, n - 1, g)
        name = f"model-{n:05d}-of-{a.layers + 1:05d}.safetensors"
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        print(f"wrote {name} ({time.time() - t0:.0f}s)", flush=True)
    total = sum((folder / f).stat().st_size for f in set(weight_map.values()))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    print(f"done: {total / 1e9:.2f} GB in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
