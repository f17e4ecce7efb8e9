"""The native decode step (models/native_step.py: every decoder layer of a one-token CPU step in
one DecodeStep call) against its reference, the per-module fused path (the same C++ functions
called layer by layer from Python): the same logits and KV caches bit for bit, on every scheme,
ISA variant and thread count; the provider's counters as the per-module path keeps them; and the
cases that do not qualify say why and run the layers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moestream.engine.kv_cache import KVCache
from moestream.kernels import native
from moestream.models import native_step

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernels did not build here")
ISAS = native.isas() or ["scalar"]


def _store(tmp_path, arch: str, scheme: str, dense: str = "all", **over):
    from tiny_models import perturbed_model, save

    from moestream.convert.writer import convert
    from moestream.quant import make_dense, make_scheme

    s = make_scheme(scheme)
    # "all": the experts' format (mxfp4's auto keeps the dense weights float: int8 for it)
    d = make_dense(dense if dense != "all" else "int8" if scheme == "mxfp4" else "auto", s)
    if dense == "all":  # tiny attention is under the size floor: quantize it anyway
        d = dataclasses.replace(d, min_params=0)
    src = save(perturbed_model(arch, **over), tmp_path / "hf", "fused")
    return convert(src, tmp_path / f"store-{scheme}", s, False, d)


def _load(store, **cfg):
    from moestream.experts.config import StreamConfig
    from moestream.loader import load_model

    return load_model(store, StreamConfig(**({"resident": True} | cfg)))


@pytest.fixture
def runs(monkeypatch):
    """Counts DecodeStep.run calls (so a test sees the step really ran)."""
    n = {"run": 0}
    real = native.decode_step

    class Counted:
        def __init__(self):
            self._s = real()

        def run(self, *a):
            n["run"] += 1
            return self._s.run(*a)

        def __getattr__(self, name):
            return getattr(self._s, name)

    monkeypatch.setattr(native, "decode_step", Counted)
    return n


def _decode(model, args, use_step: bool, steps: int = 14):
    """A 3-token prompt then `steps` one-token steps (positions past the sliding window of the
    tiny Mixtral): the logits of every step and the caches' filled rows."""
    model.modules_changed()
    if not use_step:
        model._decode_step = False  # the per-module fused path
    cache = KVCache(args, 32, torch.float32)
    with torch.inference_mode():
        out = [model(torch.tensor([1, 5, 9]), cache, 0, last_only=True)]
        for pos in range(3, 3 + steps):
            out.append(model(torch.tensor([pos * 7 % 300]), cache, pos, last_only=True))
    n = 3 + steps
    return torch.cat(out), [t[:, :n].clone() for t in (*cache.k, *cache.v) if t is not None]


def assert_step_gives_the_per_module_bits(loaded, steps: int = 4) -> None:
    """A resident store's model: the one-call step qualifies, is built, and gives the per-module
    path's logits and caches bit for bit."""
    assert native_step.why_not(loaded.model, loaded.provider) is None
    want = _decode(loaded.model, loaded.args, use_step=False, steps=steps)
    got = _decode(loaded.model, loaded.args, use_step=True, steps=steps)
    assert loaded.model._decode_step  # built, not declined
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))


# qwen3_moe: q/k head norm; mixtral: no q/k norm, a sliding window of 16 (the decode passes it).
@pytest.mark.parametrize("scheme", ["int8", "int4", "q4_0", "q4_1", "q5_0", "q8_0", "mxfp4"])
@pytest.mark.parametrize("arch,over", [("qwen3_moe", {"mlp_only_layers": []}), ("mixtral", {})])
def test_step_gives_the_per_module_bits(tmp_path, arch, over, scheme, runs):
    assert_step_bits_at_1_and_2_threads(_load(_store(tmp_path, arch, scheme, **over)), runs)


def assert_step_bits_at_1_and_2_threads(loaded, runs) -> None:
    """The step qualifies and, at 1 and 2 threads, takes every one-token step with the per-module
    fused path's logits and caches bit for bit."""
    model, args = loaded.model, loaded.args
    assert native_step.why_not(model, loaded.provider) is None
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            want_logits, want_cache = _decode(model, args, use_step=False)
            before = runs["run"]
            got_logits, got_cache = _decode(model, args, use_step=True)
            assert runs["run"] - before == 14  # every one-token step took the native step
            assert torch.equal(got_logits, want_logits)
            assert all(torch.equal(a, b) for a, b in zip(got_cache, want_cache))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("scheme", ["mxfp4", "int8"])
def test_gpt_oss_step_gives_the_per_module_bits(tmp_path, scheme, runs):
    """gpt-oss (q/k/v/o biases, attention sinks, sliding and full layers, the biased router's
    top-k then softmax, expert biases and the clamped SwiGLU) in one call: the per-module fused
    path's logits and caches bit for bit at 1 and 2 threads, positions past the window of 8."""
    assert_step_bits_at_1_and_2_threads(_load(_store(tmp_path, "gpt_oss", scheme)), runs)


@pytest.mark.parametrize("isa", ISAS)
def test_step_follows_the_isa_choice(tmp_path, isa, monkeypatch):
    """The step and the per-module path take the same variant (native._isa) and agree on it."""
    loaded = _load(_store(tmp_path, "qwen3_moe", "int4", mlp_only_layers=[]))
    monkeypatch.setattr(native, "_isa", lambda _: native.ISAS[isa])
    want = _decode(loaded.model, loaded.args, use_step=False)[0]
    got = _decode(loaded.model, loaded.args, use_step=True)[0]
    assert torch.equal(got, want)


def test_step_keeps_the_providers_counters(tmp_path):
    """Hits and expert seconds count as experts() counts them (the mode line and --json)."""
    loaded = _load(_store(tmp_path, "qwen3_moe", "int8", mlp_only_layers=[]))
    stats = []
    for use in (False, True):
        h0 = loaded.provider.stats()["hits"]
        s0 = loaded.provider.stats()["compute_seconds"]
        _decode(loaded.model, loaded.args, use_step=use)
        st = loaded.provider.stats()
        stats.append((st["hits"] - h0, st["compute_seconds"] - s0))
    assert stats[0][0] == stats[1][0] > 0
    assert stats[1][1] > 0


def test_what_does_not_qualify_says_why_and_runs_the_layers(tmp_path, runs):
    from moestream.runtime import open_model

    def why(store, **cfg) -> str | None:
        loaded = _load(store, **cfg)
        return native_step.why_not(loaded.model, loaded.provider)

    store = _store(tmp_path, "qwen3_moe", "int8")  # layer 1 is a dense MLP
    assert "not a plain MoE block" in why(store)
    with open_model(store) as rt:
        assert rt.mode["native_step"] is False  # the mode line says per layer, by omission
    flat = _store(tmp_path / "f", "qwen3_moe", "int8", dense="float", mlp_only_layers=[])
    assert "not quantized" in why(flat)
    olmoe = _store(tmp_path / "o", "olmoe", "int8")  # clip_qkv and whole-vector q/k norm
    assert "native.attend's rule" in why(olmoe)
    plain = _store(tmp_path / "p", "qwen3_moe", "int8", mlp_only_layers=[])
    assert "resident" in why(plain, resident=False, memory_budget=64 << 10)
    assert why(plain, kernel="cpu") is not None
    assert runs["run"] == 0


def test_an_observer_turns_the_step_off_until_removed(tmp_path, runs):
    loaded = _load(_store(tmp_path, "qwen3_moe", "int8", mlp_only_layers=[]))
    model, seen = loaded.model, []
    model.set_observer(lambda layer, ids, w, x: seen.append(layer))
    assert "router traces" in native_step.why_not(model, loaded.provider)
    _decode(model, loaded.args, use_step=True, steps=2)
    assert runs["run"] == 0 and len(seen) == 3 * loaded.args.num_hidden_layers
    model.set_observer(None)
    _decode(model, loaded.args, use_step=True, steps=2)
    assert runs["run"] == 2


def test_generation_runs_through_the_step(tmp_path, runs):
    """The runtime's greedy decode takes the step and gives the per-module path's tokens."""
    from moestream.cli import mode_line
    from moestream.config import SamplingConfig
    from moestream.runtime import open_model

    store = _store(tmp_path, "qwen3_moe", "int4", mlp_only_layers=[])
    toks = []
    for use in (True, False):
        with open_model(store) as rt:
            assert rt.mode["native_step"] and "native decode step" in mode_line(rt.mode)
            if not use:
                rt.model.set_fused_decode(True)
                rt.model._decode_step = False
            res = rt.generator.generate([1, 2, 3], SamplingConfig(max_new_tokens=8))
            toks.append(res.ids)
    assert runs["run"] >= 7
    assert toks[0] == toks[1]
