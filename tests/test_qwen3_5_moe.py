"""qwen3_5_moe beyond the shared runner: Gated DeltaNet kernels against transformers' torch
fallbacks, multi-chunk prompts and cached continuation, the text-only variant, the multimodal
checkpoint's ignored tensors, a hub config, and the per-layer recurrent state in KVCache."""

from __future__ import annotations

import pytest
import torch
from test_parity import PROMPT, _fp32_and_greedy_match, hf_load
from tiny_models import VOCAB, perturbed_model, save

from moestream.engine.kv_cache import KVCache
from moestream.loader import load_model
from moestream.models import linear_attention as la


def _hf_fns():
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m

    return m


@pytest.mark.parametrize("T", [1, 5, 64, 150])
def test_gated_delta_rule_matches_transformers(T):
    """Chunked (prompt) and recurrent (decode) rules against transformers' torch fallbacks,
    from a non-zero state, with 2 key heads serving 4 value heads."""
    m = _hf_fns()
    g = torch.Generator().manual_seed(T)
    Hk, Hv, dk, dv = 2, 4, 16, 8
    q, k = (torch.randn(1, T, Hk, dk, generator=g) for _ in range(2))
    v = torch.randn(1, T, Hv, dv, generator=g)
    beta = torch.rand(1, T, Hv, generator=g)
    decay = -torch.rand(1, T, Hv, generator=g)
    state = torch.randn(1, Hv, dk, dv, generator=g)
    kwargs = dict(initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    ours_args = (
        *(la.l2norm(t[0].repeat_interleave(2, dim=1)).transpose(0, 1) for t in (q, k)),
        v[0].transpose(0, 1),
        decay[0].T,
        beta[0].T,
        state[0],
    )
    for theirs, ours in (
        (m.torch_chunk_gated_delta_rule, la.chunk_gated_delta_rule),
        (m.torch_recurrent_gated_delta_rule, la.recurrent_gated_delta_rule),
    ):
        want, want_state = theirs(q, k, v, g=decay, beta=beta, **kwargs)
        got, got_state = ours(*ours_args)
        torch.testing.assert_close(got.transpose(0, 1), want[0], rtol=0, atol=2e-5)
        torch.testing.assert_close(got_state, want_state[0], rtol=0, atol=2e-5)
    # The two forms are the same function.
    a, sa = la.chunk_gated_delta_rule(*ours_args)
    b, sb = la.recurrent_gated_delta_rule(*ours_args)
    torch.testing.assert_close(a, b, rtol=0, atol=5e-5)
    torch.testing.assert_close(sa, sb, rtol=0, atol=5e-5)


def test_causal_conv_with_state_matches_transformers():
    """Prompt (zero left context) then token-by-token decode equals transformers' conv1d_fn over
    the whole sequence, and the decode step equals its causal_conv1d_update."""
    m = _hf_fns()
    g = torch.Generator().manual_seed(0)
    C, K, T = 12, 4, 9
    w, x = torch.randn(C, K, generator=g), torch.randn(C, T, generator=g)
    want = m.causal_conv1d_fn(x[None], w, None, activation="silu")[0]
    out, state = la.causal_conv(x[:, :6], torch.zeros(C, K - 1), w)
    outs = [out]
    for t in range(6, T):
        hf_state = torch.cat((torch.zeros(1, C, 1), state[None]), dim=-1)  # HF keeps K inputs
        step_want = m.causal_conv1d_update(x[None, :, t : t + 1], hf_state, w, None, "silu")[0]
        out, state = la.causal_conv(x[:, t : t + 1], state, w)
        torch.testing.assert_close(out, step_want, rtol=0, atol=1e-6)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, dim=-1), want, rtol=0, atol=1e-6)
    torch.testing.assert_close(state, x[:, -(K - 1) :])


def test_long_prompt_and_cached_continuation_match_transformers(tiny_dir):
    """A 150-token prompt (three 64-token chunks) then a 40-token continuation prefilled on top of
    the state, then decode steps: logits within 1e-4 of transformers fed the same pieces with its
    own cache (same chunked/recurrent paths)."""
    folder = tiny_dir("qwen3_5_moe", "fused")
    ref, ours = hf_load(folder), load_model(folder)
    ids = torch.randint(0, VOCAB, (200,), generator=torch.Generator().manual_seed(9))
    pieces = [(0, 150), (150, 190), *((p, p + 1) for p in range(190, 194))]
    from transformers import DynamicCache

    hf_cache, cache = DynamicCache(config=ref.config), KVCache(ours.args, 200, torch.float32)
    with torch.no_grad():
        for a, b in pieces:
            want = ref(ids[None, a:b], cache=hf_cache, use_cache=True).logits[0]
            got = ours.model(ids[a:b], cache, a)
            assert (want - got).abs().max().item() < 1e-4, (a, b)


def test_cache_restarts_at_position_zero(tiny_dir):
    """A new sequence at start 0 resets the recurrent state: reusing a cache gives the same logits;
    attention-free layers hold no K/V."""
    ours = load_model(tiny_dir("qwen3_5_moe", "fused"))
    cache = KVCache(ours.args, 64, torch.float32)
    assert [k is not None for k in cache.k] == [False, True, False]
    with torch.no_grad():
        first = ours.model(PROMPT, cache, 0)
        ours.model(PROMPT[:3], cache, len(PROMPT))
        again = ours.model(PROMPT, cache, 0)
    assert torch.equal(first, again)


def test_text_only_variant(tmp_path):
    """`qwen3_5_moe_text` checkpoints (Qwen3_5MoeForCausalLM: `model.layers.` names, no vision)."""
    folder = save(perturbed_model("qwen3_5_moe_text", seed=5), tmp_path / "text", "per_expert")
    assert load_model(folder).args.model_type == "qwen3_5_moe"
    _fp32_and_greedy_match(folder)


def test_vision_and_mtp_tensors_are_ignored_explicitly(tiny_dir, tmp_path):
    import shutil

    from safetensors.torch import save_file

    from moestream.convert.hf import CheckpointError, HFCheckpoint

    folder = tmp_path / "mm"
    shutil.copytree(tiny_dir("qwen3_5_moe", "per_expert"), folder)
    save_file({"mtp.fc.weight": torch.zeros(4, 4)}, str(folder / "mtp.safetensors"))
    ckpt = HFCheckpoint(folder)
    assert "mtp.fc.weight" in ckpt.ignored
    assert any(n.startswith("model.visual.") for n in ckpt.ignored)
    assert not any("visual" in n or n.startswith("mtp.") for n in ckpt.dense_names)
    assert all(n.startswith(("model.language_model.", "lm_head.")) for n in ckpt.dense_names)
    save_file({"model.audio.x.weight": torch.zeros(2)}, str(folder / "x.safetensors"))
    with pytest.raises(CheckpointError, match="model.audio.x.weight"):
        load_model(folder)


# config.json of Qwen/Qwen3.5-35B-A3B (the fields that matter here).
HUB_CONFIG = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "model_type": "qwen3_5_moe",
    "tie_word_embeddings": False,
    "text_config": {
        "attention_bias": False,
        "attn_output_gate": True,
        "eos_token_id": 248044,
        "full_attention_interval": 4,
        "head_dim": 256,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 10,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_value_head_dim": 128,
        "max_position_embeddings": 262144,
        "model_type": "qwen3_5_moe_text",
        "moe_intermediate_size": 512,
        "num_attention_heads": 16,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 40,
        "num_key_value_heads": 2,
        "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": [11, 11, 10],
            "partial_rotary_factor": 0.25,
            "rope_theta": 10000000,
            "rope_type": "default",
        },
        "shared_expert_intermediate_size": 512,
        "vocab_size": 248320,
    },
    "vision_config": {"depth": 27, "hidden_size": 1152, "out_hidden_size": 2048},
}


def test_hub_config_reads_like_transformers():
    import transformers as T

    from moestream.models import model_args_from_dict
    from moestream.models.layers import rope_inv_freq

    a = model_args_from_dict(HUB_CONFIG)
    cfg = T.AutoConfig.for_model(**HUB_CONFIG).text_config
    assert a.model_type == "qwen3_5_moe" and a.norm_topk_prob and not a.tie_word_embeddings
    assert a.layer_mixers == tuple(
        "attention" if t == "full_attention" else t for t in cfg.layer_types
    )
    assert sum(a.attention_layers) == 10 and all(a.moe_layers)
    assert (a.num_experts, a.num_experts_per_tok, a.shared_expert_intermediate_size) == (
        256,
        8,
        512,
    )
    assert a.eos_token_ids == (248044,) and a.rotary_dim == 64
    assert (a.linear_num_key_heads, a.linear_num_value_heads) == (16, 32)
    rotary = T.models.qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeTextRotaryEmbedding
    want, _ = rotary.compute_default_rope_parameters(cfg)
    got, _ = rope_inv_freq(a.rope, a.rotary_dim, a.max_position_embeddings)
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)
    text_only = model_args_from_dict(HUB_CONFIG["text_config"])
    assert text_only == a


@pytest.mark.parametrize("sections", [[2, 0, 0], [1, 1, 0], [0, 1, 0], [11, 11, 10]])
def test_text_positions_rotate_every_pair_whatever_the_mrope_sections(sections):
    """transformers expands text positions to three equal rows (t, h, w), so its interleaved
    mrope is the plain RoPE on every rotary pair, whatever the sections: moestream's Rope table.
    (llama.cpp differs where sections leave a pair on its 4th position: test_gguf.)"""
    import transformers as T

    from moestream.models import model_args_from_dict
    from moestream.models.layers import Rope

    rope = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                mrope_section=sections)  # fmt: skip
    cfg = T.Qwen3_5MoeTextConfig(head_dim=16, rope_parameters=rope)
    rotary = T.models.qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeTextRotaryEmbedding(cfg)
    x = torch.zeros(1, 40, 16)
    cos, sin = rotary(x, torch.arange(40)[None])  # [1, T, rd]
    a = model_args_from_dict(cfg.to_dict())
    our_cos, our_sin = Rope(a.rope, a.rotary_dim, 64)(0, 40, torch.float32)
    rd = a.rotary_dim
    assert rd == 4 and cos.shape[-1] == rd
    torch.testing.assert_close(our_cos, cos[0], rtol=0, atol=0)
    torch.testing.assert_close(our_sin[:, rd // 2 :], sin[0][:, rd // 2 :], rtol=0, atol=0)
    torch.testing.assert_close(-our_sin[:, : rd // 2], sin[0][:, : rd // 2], rtol=0, atol=0)
