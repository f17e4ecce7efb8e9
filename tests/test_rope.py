"""RoPE variants against transformers' own frequency functions and end-to-end logits."""

from __future__ import annotations

import pytest
import torch
from tiny_models import perturbed_model, save

from moestream.engine.kv_cache import KVCache
from moestream.loader import load_model
from moestream.models import model_args_from_dict
from moestream.models.layers import rope_inv_freq

VARIANTS = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "yarn": {
        "rope_type": "yarn",
        "rope_theta": 1e6,
        "factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 5e5,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
}


@pytest.mark.parametrize("name", VARIANTS)
def test_inv_freq_matches_transformers(name):
    import transformers as T
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = T.Qwen3MoeConfig(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=16,
        max_position_embeddings=256,
        rope_parameters=dict(VARIANTS[name]),
    )
    ours = model_args_from_dict(cfg.to_dict())
    got, got_scale = rope_inv_freq(ours.rope, 16, 256)
    if name == "default":
        want = 1.0 / (1e4 ** (torch.arange(0, 16, 2).float() / 16))
        want_scale = 1.0
    else:
        want, want_scale = ROPE_INIT_FUNCTIONS[name](cfg, "cpu")
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)
    assert got_scale == pytest.approx(want_scale)


def test_legacy_rope_fields_parse_like_v5():
    legacy = {
        "model_type": "qwen3_moe",
        "vocab_size": 8,
        "hidden_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "rope_theta": 1e6,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    }
    v5 = dict(
        legacy,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1e6,
            "factor": 4.0,
            "original_max_position_embeddings": 32768,
        },
    )
    del v5["rope_scaling"], v5["rope_theta"]
    assert model_args_from_dict(legacy).rope == model_args_from_dict(v5).rope


@pytest.mark.parametrize("name", ["yarn", "linear", "llama3", "dynamic"])
def test_scaled_rope_logits_match(tmp_path, name):
    from transformers import AutoModelForCausalLM

    # dynamic: a context of 16 so the 24-token prompt exercises the frequency growth.
    over = {"rope_parameters": dict(VARIANTS[name])}
    if name == "dynamic":
        over["max_position_embeddings"] = 16
    folder = save(perturbed_model("qwen3_moe", **over), tmp_path / name, "fused")
    ref = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    ours = load_model(folder)
    ids = torch.arange(3, 27)
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
        got = ours.model(ids, KVCache(ours.args, 32, torch.float32), 0)
    assert (want - got).abs().max().item() < 1e-4
