"""The shared runner: every architecture x every expert layout against transformers' eager path."""

from __future__ import annotations

import pytest
import torch
from tiny_models import ARCHS, VOCAB, layouts

from moestream.engine.kv_cache import KVCache
from moestream.loader import load_model

PROMPT = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(1234))
N_NEW = 32


def hf_load(folder, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype, attn_implementation="eager", experts_implementation="eager"
    ).eval()


def hf_greedy_with_routes(model, prompt: torch.Tensor, n: int):
    """Greedy tokens from transformers plus, per step, each router module's top-k set (last position)."""
    routes: list[dict[int, frozenset]] = []
    current: dict[int, frozenset] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        block = layer.mlp if hasattr(layer, "mlp") else layer.feed_forward  # lfm2_moe
        gate = getattr(block, "gate", None) or getattr(block, "router", None)
        if gate is None or not hasattr(gate, "top_k"):
            continue

        def hook(_m, _inp, out, i=i):
            current[i] = frozenset(out[2][-1].tolist())  # (logits, scores, indices)

        hooks.append(gate.register_forward_hook(hook))
    ids = prompt[None]
    out = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(ids).logits[0, -1]
            routes.append(dict(current))
            tok = int(logits.argmax())
            out.append(tok)
            ids = torch.cat([ids, torch.tensor([[tok]])], dim=1)
    for h in hooks:
        h.remove()
    return out, routes


def our_greedy_with_routes(loaded, prompt: torch.Tensor, n: int, dtype=torch.float32):
    current: dict[int, frozenset] = {}
    loaded.model.set_observer(
        lambda layer, ids, w, x: current.__setitem__(layer, frozenset(ids[-1].tolist()))
    )
    cache = KVCache(loaded.args, len(prompt) + n, dtype)
    out, routes = [], []
    with torch.no_grad():
        logits = loaded.model(prompt, cache, 0, last_only=True)[-1]
        pos = len(prompt)
        for _ in range(n):
            routes.append(dict(current))
            tok = int(logits.argmax())
            out.append(tok)
            logits = loaded.model(torch.tensor([tok]), cache, pos, last_only=True)[-1]
            pos += 1
    loaded.model.set_observer(None)
    return out, routes


@pytest.mark.parametrize("arch,layout", [(a, lay) for a in ARCHS for lay in layouts(a)])
def test_fp32_matches_transformers(tiny_dir, arch, layout):
    ours, routes = _fp32_and_greedy_match(tiny_dir(arch, layout), N_NEW)
    assert len(routes[0]) == len(ours.args.moe_layer_ids)  # every MoE layer was compared


# bf16: we cast at the same points as transformers' eager path, and observe bit-identical logits
# with torch 2.13. Documented tolerance: max-abs logit error <= 0.03 (about one bf16 ulp at the
# logits' magnitude ~4; bf16 itself is ~0.1-0.7 away from fp32 on these models), and identical
# greedy tokens.
BF16_TOL = 0.03


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_within_documented_tolerance(tiny_dir, arch):
    folder = tiny_dir(arch, "fused")
    ref = hf_load(folder, torch.bfloat16)
    ours = load_model(folder, dtype="bfloat16")
    with torch.no_grad():
        hf = ref(PROMPT[None], use_cache=True)
        want = hf.logits[0].float()
        cache = KVCache(ours.args, 64, torch.bfloat16)
        got = ours.model(PROMPT, cache, 0).float()
        # One decode step too: the one-token path (attention over the cache, the K-expert loop)
        # is not the prefill path.
        nxt = want[-1].argmax().view(1)
        want_step = ref(nxt[None], past_key_values=hf.past_key_values).logits[0].float()
        got_step = ours.model(nxt, cache, PROMPT.shape[0]).float()
    assert (want - got).abs().max().item() <= BF16_TOL
    assert (want_step - got_step).abs().max().item() <= BF16_TOL
    want_ids, _ = hf_greedy_with_routes(ref, PROMPT, 16)
    got_ids, _ = our_greedy_with_routes(ours, PROMPT, 16, torch.bfloat16)
    assert got_ids == want_ids


def _fp32_and_greedy_match(folder, n_new: int = 16):
    """fp32 logits within 1e-4 of transformers, then n_new greedy tokens and every step's top-k
    sets identical. Returns our loaded model and transformers' routes."""
    ref = hf_load(folder)
    ours = load_model(folder)
    with torch.no_grad():
        want = ref(PROMPT[None]).logits[0]
        got = ours.model(PROMPT, KVCache(ours.args, 64, torch.float32), 0)
    assert (want - got).abs().max().item() < 1e-4
    want_ids, want_routes = hf_greedy_with_routes(ref, PROMPT, n_new)
    got_ids, got_routes = our_greedy_with_routes(ours, PROMPT, n_new)
    assert got_ids == want_ids
    for step, (w, g) in enumerate(zip(want_routes, got_routes, strict=True)):
        assert w == g, f"top-k sets differ at decode step {step}"
    return ours, want_routes


def test_deepseek_v3_without_q_lora_plain_rope(tmp_path):
    """The other MLA variant: q_proj instead of q_a/q_b, non-interleaved default RoPE (no mscale)."""
    from tiny_models import perturbed_model, save

    model = perturbed_model(
        "deepseek_v3",
        seed=3,
        q_lora_rank=None,
        rope_interleave=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    assert model.model.layers[0].self_attn.q_proj is not None
    _fp32_and_greedy_match(save(model, tmp_path / "ds", "per_expert"))


def test_glm4_moe_full_rotary_no_qk_norm(tmp_path):
    from tiny_models import perturbed_model, save

    model = perturbed_model(
        "glm4_moe",
        seed=4,
        use_qk_norm=False,
        attention_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 1.0},
    )
    _fp32_and_greedy_match(save(model, tmp_path / "glm", "per_expert"))


@pytest.mark.parametrize("arch", ["glm4_moe", "deepseek_v3"])
def test_mtp_layers_are_ignored(tiny_dir, tmp_path, arch):
    """GLM-4.5 / DeepSeek-V3 store their multi-token-prediction layer as layer N: classified as
    ignored (not unknown); a layer past N + num_mtp_layers is still an error."""
    import shutil

    from safetensors.torch import save_file

    from moestream.convert.hf import CheckpointError, HFCheckpoint

    src = tiny_dir(arch, "per_expert")
    folder = tmp_path / arch
    shutil.copytree(src, folder)
    ours = load_model(src)
    n, D = ours.args.num_hidden_layers, ours.args.hidden_size
    mtp = {
        f"model.layers.{n}.eh_proj.weight": torch.randn(D, 2 * D),
        f"model.layers.{n}.enorm.weight": torch.ones(D),
        f"model.layers.{n}.shared_head.head.weight": torch.randn(VOCAB, D),
        f"model.layers.{n}.mlp.experts.0.gate_proj.weight": torch.randn(4, D),
        f"model.layers.{n}.mlp.gate.e_score_correction_bias": torch.zeros(8),
    }
    save_file(mtp, str(folder / "mtp.safetensors"))
    ckpt = HFCheckpoint(folder)
    assert sorted(ckpt.ignored) == sorted(mtp)
    with_mtp = load_model(folder)
    with torch.no_grad():
        want = ours.model(PROMPT, KVCache(ours.args, 64, torch.float32), 0)
        got = with_mtp.model(PROMPT, KVCache(with_mtp.args, 64, torch.float32), 0)
    assert torch.equal(want, got)

    save_file(
        {f"model.layers.{n + 1}.eh_proj.weight": torch.randn(D, 2 * D)},
        str(folder / "x.safetensors"),
    )
    with pytest.raises(CheckpointError, match=f"model.layers.{n + 1}.eh_proj"):
        load_model(folder)


HUB_CONFIGS = {
    # config.json of zai-org/GLM-4.5-Air and deepseek-ai/DeepSeek-V3 (fields that matter here).
    "glm4_moe": {
        "model_type": "glm4_moe",
        "attention_bias": True,
        "head_dim": 128,
        "hidden_size": 4096,
        "partial_rotary_factor": 0.5,
        "intermediate_size": 10944,
        "max_position_embeddings": 131072,
        "moe_intermediate_size": 1408,
        "norm_topk_prob": True,
        "num_attention_heads": 96,
        "n_group": 1,
        "topk_group": 1,
        "n_routed_experts": 128,
        "n_shared_experts": 1,
        "routed_scaling_factor": 1.0,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 1,
        "num_hidden_layers": 46,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "num_nextn_predict_layers": 1,
        "use_qk_norm": False,
        "vocab_size": 151552,
        "eos_token_id": [151329, 151336, 151338],
    },
    "deepseek_v3": {
        "model_type": "deepseek_v3",
        "attention_bias": False,
        "first_k_dense_replace": 3,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "kv_lora_rank": 512,
        "max_position_embeddings": 163840,
        "moe_intermediate_size": 2048,
        "moe_layer_freq": 1,
        "n_group": 8,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 61,
        "num_key_value_heads": 128,
        "num_nextn_predict_layers": 1,
        "q_lora_rank": 1536,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 40,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
        "rope_theta": 10000,
        "routed_scaling_factor": 2.5,
        "topk_group": 4,
        "v_head_dim": 128,
        "vocab_size": 129280,
    },
}


@pytest.mark.parametrize("arch", HUB_CONFIGS)
def test_hub_config_reads_like_transformers(arch):
    """Real hub config.json files (legacy rope_scaling, no head_dim for DeepSeek) give the same
    dims, routing fields, RoPE frequencies and softmax scale as transformers derives."""
    import transformers as T
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from moestream.models import model_args_from_dict
    from moestream.models.layers import rope_inv_freq

    raw = HUB_CONFIGS[arch]
    a = model_args_from_dict(raw)
    cfg = T.AutoConfig.for_model(**raw)
    assert a.num_experts == cfg.n_routed_experts and a.n_group == cfg.n_group
    assert a.topk_group == cfg.topk_group and a.routed_scaling_factor == cfg.routed_scaling_factor
    assert a.moe_layers == tuple(i >= cfg.first_k_dense_replace for i in range(a.num_hidden_layers))
    assert a.num_mtp_layers == 1 and a.n_shared_experts == cfg.n_shared_experts
    assert a.rotary_dim == int(cfg.head_dim * cfg.rope_parameters.get("partial_rotary_factor", 1.0))
    rope_type = cfg.rope_parameters["rope_type"]
    if rope_type == "default":
        attn_cls = T.models.glm4_moe.modeling_glm4_moe.Glm4MoeRotaryEmbedding
        want, want_scale = attn_cls.compute_default_rope_parameters(cfg)
    else:
        want, want_scale = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu")
    got, got_scale = rope_inv_freq(a.rope, a.rotary_dim, a.max_position_embeddings)
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)
    assert got_scale == pytest.approx(want_scale)
    if arch == "deepseek_v3":
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

        from moestream.models.deepseek_v3 import softmax_scale

        with torch.device("meta"):
            attn = DeepseekV3Attention(cfg, 0)
        assert softmax_scale(a) == pytest.approx(attn.scaling, rel=1e-12)
        assert a.kv_cache_dims == (128, 192, 128) and a.q_lora_rank == 1536 and a.rope_interleave
