"""The fused one-token decode ops (kernels/native.py: rmsnorm, attend, route) against their
reference, the model's own torch code (models/layers.py), and the model run with them on.

Tolerances: the ops compute the same math in fp32 with their own (fixed) summation order, so they
differ from torch's kernels by rounding only: <= 1e-5 relative to the output's max for a norm and
an attention step, router weights within 1e-6 and the same expert ids; a whole decode over a tiny
store stays within 1e-4 of the torch code's logits. The ISA variants (scalar, AVX2) and thread
counts give the same bits.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moestream.config import ModelArgs
from moestream.engine.kv_cache import KVCache
from moestream.kernels import native
from moestream.models.layers import Attention, Rope, SparseMoe

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernels did not build here")
ISAS = ["scalar"] + (["avx2"] if native.available() and native.best_isa() == "avx2" else [])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture
def calls(monkeypatch):
    """Counts the fused ops' calls (so a test sees the fused path really ran)."""
    n = dict.fromkeys(("rmsnorm", "attend", "route"), 0)
    for name in n:
        real = getattr(native, name)

        def spy(*a, _real=real, _name=name, **kw):
            n[_name] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(native, name, spy)
    return n


def args(**over) -> ModelArgs:
    import transformers as T

    from moestream.models import model_args_from_dict

    base = dict(vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=8,
                num_key_value_heads=2, head_dim=32, moe_intermediate_size=32, num_experts=16,
                num_experts_per_tok=4, max_position_embeddings=256)  # fmt: skip
    cfg = T.Qwen3MoeConfig(**{**base, **over})
    return model_args_from_dict(cfg.to_dict())


@pytest.mark.parametrize("D", [64, 2048, 37])
def test_rmsnorm_matches_torch_and_isas_agree(D):
    g = torch.Generator().manual_seed(D)
    x, w = torch.randn(3, D, generator=g) * 3, torch.randn(D, generator=g)
    outs = [native.rmsnorm(x, w, 1e-6, isa) for isa in ISAS]
    assert rel(outs[0], F.rms_norm(x, (D,), w, 1e-6)) <= 1e-5
    assert all(torch.equal(o, outs[0]) for o in outs)


def _attention(a: ModelArgs, qk_norm, seed: int) -> Attention:
    torch.manual_seed(seed)
    m = Attention(a, 0, qkv_bias=False, o_bias=False, qk_norm=qk_norm)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * (0.2 if p.dim() > 1 else 1.0) + (p.dim() == 1))
    return m


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("qk_norm", [None, "head"])
def test_attend_matches_the_torch_attention(qk_norm, window, calls):
    """Twelve decode steps after a 4-token prompt, fused vs the torch path on twin caches: every
    output and every cache entry within rounding (a sliding window masks older keys)."""
    a = args()
    m = _attention(a, qk_norm, seed=1)
    m.window = window  # the layer's sliding window (ModelArgs.sliding_windows sets it)
    caches = _twin_decode(m, a, seed=2)[0]
    assert calls["attend"] == 12  # every fused step took the op
    for t0, t1 in ((caches[0].k[0], caches[1].k[0]), (caches[0].v[0], caches[1].v[0])):
        assert rel(t1[:, :16], t0[:, :16]) <= 1e-5


def _twin_decode(m, a: ModelArgs, seed: int):
    """A 4-token prompt, then twelve decode steps of attention module m, torch code vs fused op on
    twin caches, each step's outputs within 1e-5 -> (the caches, the last step's (x, cos, sin),
    its fused output)."""
    rope = Rope(a.rope, a.rotary_dim, a.max_position_embeddings)
    caches = [KVCache(a, 32, torch.float32) for _ in range(2)]
    g = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        prompt = torch.randn(4, a.hidden_size, generator=g)
        cos, sin = rope(0, 4, torch.float32)
        for c in caches:
            m(prompt, cos, sin, c, 0)
        for pos in range(4, 16):
            x = torch.randn(1, a.hidden_size, generator=g)
            cos, sin = rope(pos, pos + 1, torch.float32)
            outs = []
            for fused, c in zip((False, True), caches):
                m.fused_decode = fused
                outs.append(m(x, cos, sin, c, pos))
            assert rel(outs[1], outs[0]) <= 1e-5, pos
    return caches, (x, cos, sin), outs[1]


def test_attend_variants_and_threads_agree_bit_for_bit():
    a = args()
    m = _attention(a, "head", seed=3)
    hd, H, Hkv = a.head_dim, a.num_attention_heads, a.num_key_value_heads
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(1, (H + 2 * Hkv) * hd, generator=g)
    cos, sin = Rope(a.rope, a.rotary_dim, 256)(200, 201, torch.float32)
    base = torch.randn(Hkv, 256, hd, generator=g)
    outs, threads = [], torch.get_num_threads()
    try:
        for isa in ISAS:
            for t in (1, 2):
                torch.set_num_threads(t)
                kc, vc = base.clone(), base.flip(1).clone()
                out = native.attend(qkv, m._qk_norm_weight(), 1e-6, cos[0], sin[0], kc, vc, 200,
                                    hd**-0.5, None, H, Hkv, isa)  # fmt: skip
                outs.append((out, kc, vc))
    finally:
        torch.set_num_threads(threads)
    for o in outs[1:]:
        assert all(torch.equal(x, y) for x, y in zip(o, outs[0]))


def _gpt_oss_args(**over) -> ModelArgs:
    import transformers as T

    from moestream.models import model_args_from_dict

    base = dict(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=2, head_dim=32, intermediate_size=32, num_local_experts=16,
                num_experts_per_tok=4, max_position_embeddings=256, sliding_window=5)  # fmt: skip
    return model_args_from_dict(T.GptOssConfig(**{**base, **over}).to_dict())


@pytest.mark.parametrize("window", [None, 5])
def test_sink_attend_matches_the_torch_attention(window, calls):
    """gpt-oss's SinkAttention (q/k/v biases, a sink logit per head in the softmax): twelve decode
    steps fused vs its torch code on twin caches, within rounding; the sinks count (large ones
    take most of the weight)."""
    from moestream.models.gpt_oss import SinkAttention

    a = _gpt_oss_args()
    torch.manual_seed(6)
    m = SinkAttention(a, 0)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * (0.2 if p.dim() > 1 else 1.0))
        m.sinks.copy_(torch.linspace(-4.0, 6.0, a.num_attention_heads))
    m.window = window
    caches, (x, cos, sin), out = _twin_decode(m, a, seed=7)
    assert calls["attend"] == 12
    with torch.inference_mode():
        m.sinks.zero_()
        m.fused_decode = True
        assert rel(m(x, cos, sin, caches[1], 15), out) > 0.01  # without them: another output


@pytest.mark.parametrize("E,k", [(16, 4), (32, 4), (128, 2)])
def test_gpt_oss_route_matches_topk_then_softmax(E, k):
    """GptOssMoe's rule (the biased logits' top-k, softmax over those k) through native.route: the
    same ids and weights within 1e-6 on every ISA; the bias counts."""
    from moestream.models.gpt_oss import GptOssMoe

    a = _gpt_oss_args(num_local_experts=E, num_experts_per_tok=k)
    moe = GptOssMoe(a, 0)
    g = torch.Generator().manual_seed(E + k)
    with torch.no_grad():
        moe.gate.weight.copy_(torch.randn(E, a.hidden_size, generator=g))
        moe.gate.bias.copy_(torch.randn(E, generator=g) * 4)
    x = torch.randn(1, a.hidden_size, generator=g)
    with torch.inference_mode():
        want_w, want_ids = moe.route(x)
        moe.fused_decode = True
        assert moe._route_fusable(x)
        got = [native.route(x, moe.gate.weight, k, False, isa, moe.gate.bias, True) for isa in ISAS]
        assert moe.route(x)[1].equal(got[0][1])  # the module takes the fused op
        bare = native.route(x, moe.gate.weight, k, False, None, None, True)
    assert torch.equal(got[0][1], want_ids)
    assert (got[0][0] - want_w).abs().max() <= 1e-6
    assert all(torch.equal(w, got[0][0]) and torch.equal(i, got[0][1]) for w, i in got)
    assert not (torch.equal(bare[1], want_ids) and torch.equal(bare[0], got[0][0]))


def test_attend_refuses_a_full_cache_with_the_cache_error():
    a = args()
    m = _attention(a, "head", seed=5)
    m.fused_decode = True
    cache = KVCache(a, 4, torch.float32)
    cos, sin = Rope(a.rope, a.rotary_dim, 256)(4, 5, torch.float32)
    with torch.inference_mode(), pytest.raises(ValueError, match="KV cache full"):
        m(torch.randn(1, a.hidden_size), cos, sin, cache, 4)


@pytest.mark.parametrize("renorm", [True, False])
@pytest.mark.parametrize("E,k", [(16, 4), (128, 8), (60, 1)])
def test_route_matches_softmax_topk(E, k, renorm):
    a = args(num_experts=E, num_experts_per_tok=k, norm_topk_prob=renorm)
    moe = SparseMoe(a, 0, weights_in_act_dtype=True)
    g = torch.Generator().manual_seed(E + k)
    with torch.no_grad():
        moe.gate.weight.copy_(torch.randn(E, a.hidden_size, generator=g))
    x = torch.randn(1, a.hidden_size, generator=g)
    with torch.inference_mode():
        want_w, want_ids = moe.route(x)
        moe.fused_decode = True
        got = [native.route(x, moe.gate.weight, k, renorm, isa) for isa in ISAS]
        assert moe.route(x)[1].equal(got[0][1])  # the module takes the fused op
    assert torch.equal(got[0][1], want_ids)
    assert (got[0][0] - want_w).abs().max() <= 1e-6
    assert all(torch.equal(w, got[0][0]) and torch.equal(i, got[0][1]) for w, i in got)


def test_route_ties_take_the_lower_expert_id():
    gate = torch.zeros(8, 16)
    gate[[6, 2, 5], 0] = 1.0  # three equal logits
    w, ids = native.route(torch.ones(1, 16), gate, 2, False)
    assert ids.tolist() == [[2, 5]]


def test_route_keeps_the_torch_rule_where_a_block_has_its_own():
    """A block overriding the routing rule (sigmoid routers) never takes the op."""
    import dataclasses

    from moestream.models.layers import SigmoidMoe

    a = dataclasses.replace(args(), n_group=1, topk_group=1, routed_scaling_factor=1.0)
    moe = SigmoidMoe(a, 0)
    moe.fused_decode = True
    assert not moe._route_fusable(torch.randn(1, a.hidden_size))


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "olmoe", "gpt_oss"])
def test_decode_with_fused_ops_matches_the_torch_code(tmp_path, arch, calls):
    """Tiny int8 stores (q/k head norm, none, whole-vector norm, gpt-oss's sinks and biased
    top-k-then-softmax router) decoded with the native kernels,
    fused ops on vs off, the same tokens fed: every step's logits within 1e-4 of the max (the
    expert kernels are the same in both)."""
    from tiny_models import perturbed_model, save

    from moestream.convert.writer import convert
    from moestream.experts.config import StreamConfig
    from moestream.loader import load_model
    from moestream.quant import make_scheme

    src = save(perturbed_model(arch), tmp_path / "hf", "fused")
    convert(src, tmp_path / "store", make_scheme("int8"), False)
    loaded = load_model(tmp_path / "store", StreamConfig(resident=True, kernel="native"))
    model, a = loaded.model, loaded.args
    assert all(m.fused_decode for m in model.modules() if isinstance(m, Attention))
    toks, runs, seen = [1, 5, 9], [], {}
    for on in (False, True):
        model.set_fused_decode(on)
        seen[on] = dict(calls)
        cache = KVCache(a, 16, torch.float32)
        with torch.inference_mode():
            out = [model(torch.tensor(toks[:3]), cache, 0, last_only=True)]
            for pos in range(3, 10):
                if not on:
                    toks.append(int(out[-1].argmax()))
                out.append(model(torch.tensor([toks[pos]]), cache, pos, last_only=True))
        runs.append(torch.cat(out))
    assert seen[True] == seen[False]  # the torch code's run took no fused op
    fused = {k: calls[k] - seen[True][k] for k in calls}
    L, moe = a.num_hidden_layers, len(a.moe_layer_ids)
    assert fused["route"] == 7 * moe and fused["rmsnorm"] >= 7 * (2 * L + 1)
    assert fused["attend"] == (0 if arch == "olmoe" else 7 * L)  # olmoe: whole-vector q/k norm
    assert rel(runs[1], runs[0]) <= 1e-4
