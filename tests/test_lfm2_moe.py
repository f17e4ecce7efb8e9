"""lfm2_moe beyond the shared runner: the hub's defaults (tied embeddings, no conv bias), routing
without the expert bias, cached continuation against transformers' own cache, the fp32 expert
bias under bf16, and a hub config."""

from __future__ import annotations

import pytest
import torch
from test_parity import _fp32_and_greedy_match, hf_load
from tiny_models import VOCAB, perturbed_model, save

from moestream.engine.kv_cache import KVCache
from moestream.loader import load_model


@pytest.mark.parametrize(
    "over",
    [
        dict(tie_word_embeddings=True, conv_bias=False),  # as LFM2-8B-A1B
        dict(use_expert_bias=False, norm_topk_prob=False, num_dense_layers=0),
    ],
    ids=["hub_defaults", "no_expert_bias"],
)
def test_variants_match_transformers(tmp_path, over):
    model = perturbed_model("lfm2_moe", seed=6, **over)
    _fp32_and_greedy_match(save(model, tmp_path / "lfm", "fused"))


def test_cached_continuation_matches_transformers(tiny_dir):
    """Prompt, a second prefill on top of the conv state, then decode steps: logits within 1e-4 of
    transformers fed the same pieces with its own cache."""
    from transformers import DynamicCache

    folder = tiny_dir("lfm2_moe", "fused")
    ref, ours = hf_load(folder), load_model(folder)
    ids = torch.randint(0, VOCAB, (80,), generator=torch.Generator().manual_seed(9))
    hf_cache, cache = DynamicCache(config=ref.config), KVCache(ours.args, 80, torch.float32)
    assert [k is not None for k in cache.k] == [False, True, False]
    with torch.no_grad():
        for a, b in [(0, 30), (30, 50), *((p, p + 1) for p in range(50, 54))]:
            want = ref(ids[None, a:b], cache=hf_cache, use_cache=True).logits[0]
            got = ours.model(ids[a:b], cache, a)
            assert (want - got).abs().max().item() < 1e-4, (a, b)


def test_expert_bias_stays_fp32_in_bf16(tiny_dir):
    ours = load_model(tiny_dir("lfm2_moe", "fused"), dtype="bfloat16")
    block = ours.model.moe_blocks[0]
    assert block.gate.weight.dtype == torch.bfloat16
    assert block.expert_bias.dtype == torch.float32 and block.expert_bias.abs().sum() > 0


# config.json of LiquidAI/LFM2-8B-A1B (the fields that matter here).
HUB_CONFIG = {
    "model_type": "lfm2_moe",
    "vocab_size": 65536,
    "hidden_size": 2048,
    "intermediate_size": 7168,
    "moe_intermediate_size": 1792,
    "num_hidden_layers": 24,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 128000,
    "norm_eps": 1e-05,
    "conv_bias": False,
    "conv_L_cache": 3,
    "rope_theta": 1000000.0,
    "num_dense_layers": 2,
    "num_experts": 32,
    "num_experts_per_tok": 4,
    "norm_topk_prob": True,
    "use_expert_bias": True,
    "routed_scaling_factor": 1.0,
    "eos_token_id": 7,
    "layer_types": ["conv", "conv", "full_attention", "conv", "conv", "conv"] * 2
    + ["full_attention", "conv", "conv", "conv", "full_attention", "conv"]
    + ["conv", "conv", "full_attention", "conv", "conv", "conv"],
}


def test_hub_config_reads_like_transformers():
    import transformers as T

    from moestream.models import model_args_from_dict
    from moestream.models.layers import rope_inv_freq

    a = model_args_from_dict(HUB_CONFIG)
    cfg = T.AutoConfig.for_model(**HUB_CONFIG)
    assert a.layer_mixers == tuple("conv" if t == "conv" else "attention" for t in cfg.layer_types)
    assert a.moe_layers == tuple(i >= cfg.num_dense_layers for i in range(24))
    assert a.rms_norm_eps == cfg.norm_eps and a.tie_word_embeddings == cfg.tie_word_embeddings
    assert a.tie_word_embeddings and a.selection_bias and a.norm_topk_prob
    assert (a.conv_kernel, a.conv_bias, a.head_dim) == (3, False, 64)
    assert a.eos_token_ids == (7,)
    rotary = T.models.lfm2_moe.modeling_lfm2_moe.Lfm2MoeRotaryEmbedding
    want, _ = rotary.compute_default_rope_parameters(cfg)
    got, _ = rope_inv_freq(a.rope, a.rotary_dim, a.max_position_embeddings)
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)
