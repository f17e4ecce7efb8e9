"""Tiny random Hugging Face checkpoints of every supported architecture, for the shared test runner.

Every parameter is perturbed (norms and biases start as constants in transformers), routers are
sharpened so top-k choices are not near ties, and checkpoints are saved per-expert, fused
(`save_original_format=False`) or sharded; `layouts(arch)` lists the ones an architecture has.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from moestream.models import supported_model_types

# Every supported model type: a new one cannot land without a tiny config here.
ARCHS = supported_model_types()
LAYOUTS = ("per_expert", "fused", "sharded")
VOCAB = 320
# gpt_oss has no per-expert layout: save_pretrained writes the fused tensors either way.
NO_PER_EXPERT = ("gpt_oss",)


def layouts(arch: str) -> tuple[str, ...]:
    return tuple(lay for lay in LAYOUTS if lay != "per_expert" or arch not in NO_PER_EXPERT)


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def hf_config(arch: str, **over):
    import transformers as T

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    if arch == "qwen3_moe":
        cfg = T.Qwen3MoeConfig(
            **common,
            head_dim=16,
            intermediate_size=48,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        )
    elif arch == "qwen2_moe":
        cfg = T.Qwen2MoeConfig(
            **common,
            intermediate_size=48,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=40,
            num_experts=8,
            num_experts_per_tok=3,
            norm_topk_prob=False,
            qkv_bias=True,
        )
    elif arch == "mixtral":
        cfg = T.MixtralConfig(
            **common,
            intermediate_size=32,
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=16,
        )
    elif arch == "olmoe":
        cfg = T.OlmoeConfig(
            **common,
            intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            attention_bias=True,
            clip_qkv=4.0,
        )
    elif arch == "glm4_moe":
        # Half-rotary heads, q/k norm, q/k/v bias; 4 groups of 2 experts, 2 groups kept.
        cfg = T.Glm4MoeConfig(
            **common,
            head_dim=16,
            intermediate_size=48,
            moe_intermediate_size=32,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=3,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            norm_topk_prob=False,
            routed_scaling_factor=1.5,
            use_qk_norm=True,
            attention_bias=True,
        )
    elif arch == "deepseek_v3":
        # MLA with a q LoRA, interleaved yarn RoPE (mscale in the softmax scale); 4 groups of 4.
        cfg = T.DeepseekV3Config(
            **{**common, "num_key_value_heads": 4},
            intermediate_size=48,
            moe_intermediate_size=32,  # a multiple of the store's quantization group (32)
            n_routed_experts=16,
            n_shared_experts=2,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            q_lora_rank=24,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=12,
            rope_interleave=True,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                original_max_position_embeddings=64,
                mscale=1.0,
                mscale_all_dim=0.8,
            ),
        )
    elif arch == "lfm2_moe":
        # Short-conv / attention layers (conv and projection biases on), one dense layer, then
        # sigmoid routing with a selection-only expert bias and a routed scaling factor.
        cfg = T.Lfm2MoeConfig(
            **common,
            intermediate_size=48,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=3,
            num_dense_layers=1,
            layer_types=["conv", "full_attention", "conv"],
            conv_L_cache=3,
            conv_bias=True,
            routed_scaling_factor=1.5,
        )
    elif arch in ("qwen3_5_moe", "qwen3_5_moe_text"):
        # Hybrid: Gated DeltaNet layers (2 key heads serving 4 value heads) around a gated
        # full-attention layer with the default quarter-rotary heads; every layer MoE + shared expert.
        text = dict(
            **common,
            head_dim=16,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            linear_conv_kernel_dim=4,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=8,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=40,
            num_experts=8,
            num_experts_per_tok=3,
        )
        text.update(over)
        if arch == "qwen3_5_moe_text":
            return T.Qwen3_5MoeTextConfig(**text)
        # The hub layout: a multimodal checkpoint with a (tiny) vision tower we must ignore.
        vision = dict(
            depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=64
        )
        return T.Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
    elif arch == "gpt_oss":
        # Sliding (window 8 < the 24-token prompt) / full / sliding layers, attention sinks, yarn
        # RoPE past its original context, and a low swiglu_limit so the clamp binds.
        cfg = T.GptOssConfig(
            **common,
            head_dim=16,
            intermediate_size=32,
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            swiglu_limit=1.5,
            attention_bias=True,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=150000.0,
                factor=4.0,
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=False,
                original_max_position_embeddings=64,
            ),
        )
    else:
        raise ValueError(arch)
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg


def perturbed_model(arch: str, seed: int = 0, **over):
    import transformers as T

    torch.manual_seed(seed)
    cfg = hf_config(arch, **over)
    cls = {
        "qwen3_moe": T.Qwen3MoeForCausalLM,
        "qwen2_moe": T.Qwen2MoeForCausalLM,
        "mixtral": T.MixtralForCausalLM,
        "olmoe": T.OlmoeForCausalLM,
        "glm4_moe": T.Glm4MoeForCausalLM,
        "deepseek_v3": T.DeepseekV3ForCausalLM,
        "gpt_oss": T.GptOssForCausalLM,
        "lfm2_moe": T.Lfm2MoeForCausalLM,
        "qwen3_5_moe": T.Qwen3_5MoeForConditionalGeneration,
        "qwen3_5_moe_text": T.Qwen3_5MoeForCausalLM,
    }[arch]
    model = cls(cfg).float().eval()
    with torch.no_grad():
        for name, b in model.named_buffers():
            # Buffers, but learned state (DeepSeek/GLM correction bias, LFM2 expert bias).
            if name.endswith(("e_score_correction_bias", "expert_bias")):
                b.copy_(0.1 * torch.randn_like(b))
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                # Around the init constant: 1, or 0 for norms computing x * (1 + w) (qwen3_5_moe).
                p.copy_(p + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif name.endswith("self_attn.sinks"):
                p.copy_(torch.randn_like(p))
            elif name.endswith(
                ("mlp.gate.weight", "mlp.router.weight", "feed_forward.gate.weight")
            ):
                p.copy_(torch.randn_like(p) * 3.0 / p.shape[1] ** 0.5)  # sharpened router
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    return model


def save(model, folder: Path, layout: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    if layout == "per_expert":
        model.save_pretrained(folder)
    elif layout == "fused":
        model.save_pretrained(folder, save_original_format=False)
    elif layout == "sharded":
        model.save_pretrained(folder, max_shard_size="40KB")
    else:
        raise ValueError(layout)
    write_tokenizer(folder)
    return folder


def write_tokenizer(folder: Path) -> None:
    """A small byte-level BPE so CLI paths (encode, chat template, streaming text) can be tested."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = [
        "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"
    ] * 20
    tok.train_from_iterator(text, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "eos_token": "<|end|>",
                "chat_template": CHAT_TEMPLATE,
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )
