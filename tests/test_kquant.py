"""GGUF K-quant schemes (q4_k, q5_k, q6_k: llama.cpp's super-blocks of 256 kept byte for byte):
dequantization equals the gguf package's (llama.cpp's dequantize_row_q*_K port) bit for bit, the
torch kernels run them, and the shapes / sources they cannot hold are refused with the fix."""

from __future__ import annotations

import gguf
import pytest
import torch
from gguf_models import assert_records_are, kquant_blocks, write_gguf
from test_gguf import FP32_TOL, hf_logits, our_logits
from tiny_models import perturbed_model, save

from moestream.cli import main
from moestream.config import ConfigError
from moestream.convert.writer import convert, source_scheme
from moestream.experts.config import StreamConfig, min_budget
from moestream.kernels.cpu import qlinear_cpu
from moestream.kernels.dense import QuantWeight
from moestream.kernels.ref import dequantize, dequantize_rows, qlinear_ref
from moestream.loader import load_model
from moestream.quant import KQUANT_BYTES, RecordLayout, make_scheme, quantize, tensor_width
from moestream.store.format import INT4_VERSION, MIXED_VERSION, VERSION, Store

KINDS = tuple(KQUANT_BYTES)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", [0, 1])
def test_dequantize_is_the_gguf_packages(kind, seed):
    raw = kquant_blocks(kind, 7, 768, seed)
    want = gguf.quants.dequantize(raw.reshape(7, -1), gguf.GGMLQuantizationType[kind.upper()])
    sec = {"w.q": torch.from_numpy(raw)}
    got = dequantize(sec, "w", 256, torch.float32)
    assert torch.equal(got, torch.from_numpy(want))
    rows = torch.tensor([5, 0, 5])
    assert torch.equal(dequantize_rows(sec, "w", rows, 256, torch.float32), got[rows])
    assert tensor_width(make_scheme(kind), sec["w.q"]) == 768


@pytest.mark.parametrize("kind", KINDS)
def test_torch_kernels_are_the_dequantized_matmul(kind):
    sec = {"w.q": torch.from_numpy(kquant_blocks(kind, 5, 512))}
    x = torch.randn(3, 512)
    want = x @ dequantize(sec, "w", 256, torch.float32).T
    assert torch.equal(qlinear_ref(x, sec, "w", 256), want)
    assert torch.equal(qlinear_cpu(x, sec, "w", 256), want)


def test_kquant_rules_are_refused_with_the_fix():
    s = make_scheme("q6_k")
    assert s.group_size == 256  # the super-block, whatever the default --group-size
    with pytest.raises(ConfigError, match="super-blocks of 256; drop --group-size"):
        make_scheme("q4_k", 64)
    with pytest.raises(ConfigError, match="not a multiple of 256.*--quant int4"):
        RecordLayout.build(s, 256, 96)
    with pytest.raises(ConfigError, match="does not quantize into q4_k.*--quant int4"):
        quantize(make_scheme("q4_k"), torch.randn(4, 256))


def test_dense_rows_stack_as_stored():
    """The fused q/k/v projection stacks K-quant rows as they are (row-major blocks)."""
    s = make_scheme("q4_k")
    parts = [torch.from_numpy(kquant_blocks("q4_k", n, 256, n)) for n in (3, 5)]
    w = QuantWeight.cat([QuantWeight(s, (p.shape[0], 256), {"q": p}) for p in parts])
    want = torch.cat([dequantize({"w.q": p}, "w", 256, torch.float32) for p in parts])
    assert torch.equal(dequantize(w.sections(), "w", 256, torch.float32), want)


# ---- GGUF files with K-quant experts (written in-test: tests/gguf_models) ----------------------
WIDE = {"mlp_only_layers": [], "hidden_size": 256, "moe_intermediate_size": 256}  # K % 256 == 0
DENSE_K = {  # a Q4_K embedding, llama.cpp's Q6_K output layer, one Q5_K projection
    "model.embed_tokens.weight": "Q4_K",
    "lm_head.weight": "Q6_K",
    "model.layers.0.self_attn.q_proj.weight": "Q5_K",
}


@pytest.fixture(scope="module")
def kq(tmp_path_factory):
    """GGUF type -> (HF folder, GGUF with every expert tensor of that type and DENSE_K, values
    stored, its store, convert's stderr), built once."""
    root = tmp_path_factory.mktemp("gguf-kq")
    hf = save(perturbed_model("qwen3_moe", seed=2, **WIDE), root / "hf", "per_expert")
    cache = {}

    def get(kind: str, capsys):
        if kind not in cache:
            path = root / f"{kind}.gguf"
            types = {layer: (kind,) * 3 for layer in range(3)}
            stored = write_gguf(hf, path, types, dense_types=DENSE_K)
            capsys.readouterr()
            store = convert(path, root / f"{kind}-store", source_scheme(path, None), False)
            cache[kind] = (hf, path, stored, store, capsys.readouterr().err)
        return cache[kind]

    return get


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
def test_kquant_gguf_is_kept_exactly(kq, kind, tmp_path, capsys):
    """K-quant experts and dense weights go into their schemes byte for byte: every record and
    dense section dequantizes to the GGUF's values, the logits are transformers' on those values
    (kernel ref), and convert says so."""
    hf, _, stored, store, err = kq(kind, capsys)
    s, scheme = Store(store), kind.lower()
    assert s.scheme == make_scheme(scheme) and s.manifest["version"] == VERSION
    assert f"9 {kind} expert tensor(s): kept exactly as {scheme} (same values)" in err
    assert "1 Q6_K dense tensor(s): kept exactly as q6_k (same values)" in err
    assert_records_are(s, stored)
    for name, t in DENSE_K.items():
        assert s.dense_scheme(name) == make_scheme(t.lower())
        sec = {f"w.{k}": v for k, v in s.dense_sections(name).items()}
        assert torch.equal(dequantize(sec, "w", 256, torch.float32), stored[name])
    want = hf_logits(hf, stored, tmp_path)
    assert (want - our_logits(store)).abs().max().item() < FP32_TOL


def gpu_reads_the_blocks(store, monkeypatch, triton: bool = True, tile=None) -> None:
    """The GPU provider (device "cpu": its spec, and the Triton kernels on the interpreter with
    one small decode tile, `tile` where given) reads a K-quant store's records as stored: a prompt's logits (the
    routed experts dequantized, then the grouped GEMMs) and one token a call (the decode
    kernels' super-block steps) are the CPU spec's; streamed through a small pool, the resident
    bits."""
    from test_gguf import gpu_gives_the_spec, stepwise_logits

    from moestream.experts.config import GpuConfig

    if triton and tile is None:  # (the interpreter's time: one small decode tile)
        from moestream.kernels.triton.decode import DecodeConfig

        tile = DecodeConfig(bn=64, bk=256, bn_d=64, bk_d=256)
    gpu_gives_the_spec(store, monkeypatch, 1, triton, tile)  # (CI time: one decode step)
    # streamed through a pool of 2K slots (the host path's misses): the resident bits (the
    # Triton kernels' device-side misses: test_kquant_store_streams_on_cuda, and ~60 s on the
    # interpreter, run by hand)
    s = Store(store)
    small = GpuConfig(gpu_budget=2 * s.args.num_experts_per_tok * s.slot_size, kernel="ref",
                      device="cpu")  # fmt: skip
    resident = GpuConfig(resident=True, kernel="ref", device="cpu")
    assert torch.equal(our_logits(store, small), our_logits(store, resident))
    assert torch.equal(stepwise_logits(store, small, 2), stepwise_logits(store, resident, 2))


def test_kquant_store_streams_the_resident_tokens_and_the_gpu_reads_it(kq, capsys, monkeypatch):
    """On the native K-quant kernels, greedy decoding streamed at the minimum budget gives the
    resident tokens (and the prompt's logits their bits); the GPU provider reads the blocks as
    stored (gpu_reads_the_blocks)."""
    store = kq("Q4_K", capsys)[3]
    loaded = load_model(store, StreamConfig(resident=True))
    assert loaded.provider.native  # the layer op, not the torch fallback
    loaded.provider.close()
    want = our_logits(store, StreamConfig(resident=True))
    budget = min_budget(Store(store))
    assert torch.equal(want, our_logits(store, StreamConfig(memory_budget=budget)))
    args = ["generate", "-m", str(store), "-p", "def fib", "-n", "8", "--ignore-eos"]
    assert main([*args, "--resident"]) == 0
    resident = capsys.readouterr().out
    assert main([*args, "--memory-budget", str(budget)]) == 0
    assert capsys.readouterr().out == resident
    # (CI time: the Triton kernels on the q4_k + q6_k store of the one-layout test below)
    gpu_reads_the_blocks(store, monkeypatch, triton=False)


# Q4_K_M as llama-quantize picks it: Q4_K gate/up, down Q6_K on some layers and Q4_K on others;
# and a Q8_0 layer beside them.
MIXED = {0: ("Q4_K", "Q4_K", "Q6_K"), 1: ("Q4_K", "Q4_K", "Q4_K"), 2: ("Q8_0", "Q8_0", "Q8_0")}
MIXED_SCHEMES = {0: ("q4_k", "q6_k"), 1: ("q4_k", "q4_k"), 2: ("int8", "int8")}


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """(HF folder, the MIXED GGUF, values stored, its default store, convert's stderr)."""
    import contextlib
    import io

    root = tmp_path_factory.mktemp("gguf-mixed")
    hf = save(perturbed_model("qwen3_moe", seed=2, **WIDE), root / "hf", "per_expert")
    path = root / "m.gguf"
    stored = write_gguf(hf, path, MIXED, dense_type="Q8_0")  # kept int8: native q/k/v and o
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        store = convert(path, root / "store", source_scheme(path, None), False)
    return hf, path, stored, store, err.getvalue()


def test_mixed_kquant_gguf_is_kept_exactly(mixed, tmp_path):
    """Each projection keeps its own type byte for byte (per-layer record layouts, manifest
    version 5), convert says so per type, and the logits are transformers' on the file's values."""
    hf, _, stored, store, err = mixed
    s = Store(store)
    assert s.manifest["version"] == MIXED_VERSION and "record" not in s.manifest
    assert s.mixed and s.quant_name == "q4_k+q6_k+int8"
    assert_records_are(s, stored, MIXED_SCHEMES)
    assert "5 Q4_K expert tensor(s): kept exactly as q4_k (same values)" in err
    assert "1 Q6_K expert tensor(s): kept exactly as q6_k (same values)" in err
    assert "3 Q8_0 expert tensor(s): kept exactly as int8 (same values)" in err
    assert "requantized" not in err
    # Records differ in size (Q6_K down > Q4_K down; Q8_0 the largest): slots hold the largest.
    sizes = {layer: lay.size for layer, lay in s.layouts.items()}
    assert s.slot_size == sizes[2] == max(sizes.values()) and sizes[0] > sizes[1]
    assert s.expert_bytes == s.args.num_experts * sum(sizes.values())
    want = hf_logits(hf, stored, tmp_path)
    assert (want - our_logits(store)).abs().max().item() < FP32_TOL


def test_mixed_record_native_kernel_is_the_spec(mixed):
    """A record of q4_k w13 and q6_k w2: each projection is the spec's bits, the layer op within
    the spec's rounding, the same on every ISA."""
    from moestream.kernels import native
    from moestream.kernels.ref import moe_q8_ref, qlinear_q8

    if not native.available():
        pytest.skip("native kernels did not build here")
    s = Store(mixed[3])
    lay = s.layouts[0]
    secs = [lay.views(torch.frombuffer(bytearray(s.read_record(0, e)), dtype=torch.uint8))
            for e in (1, 4)]  # fmt: skip
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(2, 256, generator=g), torch.rand(2, 2, generator=g)
    isas = native.isas()
    for isa in isas:
        for name in ("w13", "w2"):
            assert torch.equal(native.linear(x, secs[0], name, isa), qlinear_q8(x, secs[0], name))
    got = [native.moe(x, secs, w, isa) for isa in isas]
    assert all(torch.equal(y, got[0]) for y in got)
    want = moe_q8_ref(x, secs, w)
    assert ((got[0] - want).abs().max() / want.abs().max()).item() <= 1e-3


def test_mixed_store_streams_the_resident_bits_and_refuses_the_gpu(mixed, capsys):
    """Streamed at the minimum budget (slots of the largest record) a mixed store gives the
    resident greedy tokens and prompt logits bit for bit on the native kernels; the decode step
    of one native call takes it, each layer's down input in its weights' width (layer 2's int8
    down projection takes int16 activations, the others int8), with the per-module path's logits
    and caches bit for bit; the GPU provider refuses its per-layer record layouts with the fix."""
    from test_native_step import assert_step_gives_the_per_module_bits

    from moestream.experts.config import GpuConfig

    store = mixed[3]
    loaded = load_model(store, StreamConfig(resident=True))
    assert loaded.provider.native  # the layer op, not the torch fallback
    assert_step_gives_the_per_module_bits(loaded)
    loaded.provider.close()
    want = our_logits(store, StreamConfig(resident=True))
    s = Store(store)
    budget, k = min_budget(s), s.args.num_experts_per_tok
    assert budget == k * s.slot_size  # k slots of the largest record
    streamed = load_model(store, StreamConfig(memory_budget=budget))
    assert streamed.provider.n_slots == k
    streamed.provider.close()
    assert torch.equal(want, our_logits(store, StreamConfig(memory_budget=budget)))
    args = ["generate", "-m", str(store), "-p", "def fib", "-n", "8", "--ignore-eos"]
    assert main([*args, "--resident"]) == 0
    resident = capsys.readouterr().out
    assert main([*args, "--memory-budget", str(budget)]) == 0
    assert capsys.readouterr().out == resident and resident.strip()
    with pytest.raises(ConfigError, match="record layout differs across layers.*--quant int4"):
        load_model(store, GpuConfig(resident=True, kernel="ref", device="cpu"))


def test_q4_k_m_like_store_decodes_in_one_native_step_with_the_streamed_bits(tmp_path, capsys,
                                                                            monkeypatch):  # fmt: skip
    """A Q4_K_M file's layout: Q4_K gate/up with Q6_K or Q4_K down per layer, attention in Q4_K
    with v in Q6_K on some layers (q/k/v then run as three projections), output Q6_K: the layers'
    schemes differ but their activation widths agree, so the whole-step DecodeStep takes the
    resident store, and its greedy tokens are the per-module path's (streamed at the minimum
    budget) bit for bit. The GPU provider reads it as stored: its slots hold the q6_k-down
    records, a q4_k-down layer reads its records packed at each slot's start
    (gpu_reads_the_blocks)."""
    from moestream.models import native_step

    wide = {**WIDE, "head_dim": 64}  # o_proj reads 4 x 64: Q4_K holds it
    hf = save(perturbed_model("qwen3_moe", seed=3, **wide), tmp_path / "hf", "per_expert")
    kinds = {0: ("Q4_K", "Q4_K", "Q6_K"), 1: ("Q4_K", "Q4_K", "Q4_K"), 2: ("Q4_K", "Q4_K", "Q6_K")}
    v6 = {f"model.layers.{i}.self_attn.v_proj.weight": "Q6_K" for i in (0, 2)}
    path = tmp_path / "m.gguf"
    write_gguf(hf, path, kinds, dense_type="Q4_K", dense_types={"lm_head.weight": "Q6_K", **v6})
    store = convert(path, tmp_path / "store", source_scheme(path, None), False)
    loaded = load_model(store, StreamConfig(resident=True))
    attn = [layer.self_attn for layer in loaded.model.model.layers]
    assert attn[0]._three and attn[1]._qfused is not None  # v in Q6_K: three projections
    assert native_step.why_not(loaded.model, loaded.provider) is None
    loaded.provider.close()
    args = ["generate", "-m", str(store), "-p", "def fib", "-n", "8", "--ignore-eos"]
    assert main([*args, "--resident"]) == 0
    resident = capsys.readouterr().out
    assert main([*args, "--memory-budget", str(min_budget(Store(store)))]) == 0
    assert capsys.readouterr().out == resident and resident.strip()
    gpu_reads_the_blocks(store, monkeypatch)


def test_mixed_gguf_requantizes_what_it_must_and_refuses_kquant(tmp_path, capsys):
    """gate and up of different types cannot share the w13 section: that layer's w13 alone is
    requantized (said), its down and the other layers kept; `--quant int4` puts every expert in
    int4 (a version-6 store, the GPU's fix); `--quant q4_k` on it, or on a Hugging Face folder,
    is refused (exit 2, one line with the fix) before anything is written."""
    hf = save(perturbed_model("qwen3_moe", seed=2, **WIDE), tmp_path / "hf", "per_expert")
    path = tmp_path / "m.gguf"
    types = {0: ("Q4_K", "Q5_K", "Q6_K"), 1: ("Q4_K", "Q4_K", "Q6_K"), 2: ("Q4_K",) * 3}
    stored = write_gguf(hf, path, types)
    capsys.readouterr()
    assert main(["convert", str(path), str(tmp_path / "s")]) == 0
    err = capsys.readouterr().err
    s = Store(tmp_path / "s")
    assert s.scheme.name == "int4"  # what requantized projections go into
    assert [tuple(x.name for x in s.layouts[i].schemes) for i in range(3)] == [
        ("int4", "q6_k"), ("q4_k", "q6_k"), ("q4_k", "q4_k")]  # fmt: skip
    assert "layer 0: gate Q4_K and up Q5_K differ" in err and "requantized to int4" in err
    assert "1 Q4_K expert tensor(s): dequantized and requantized to int4" in err
    assert "5 Q4_K expert tensor(s): kept exactly as q4_k" in err
    assert "2 Q6_K expert tensor(s): kept exactly as q6_k" in err
    assert "1 Q5_K expert tensor(s): dequantized and requantized to int4" in err
    assert_records_are(s, stored, layers=[1, 2])
    sec = s.layouts[0].views(torch.frombuffer(bytearray(s.read_record(0, 3)), dtype=torch.uint8))
    name = "model.layers.0.mlp.experts.3.{}_proj.weight".format
    assert torch.equal(dequantize(sec, "w2", 256, torch.float32), stored[name("down")])
    w13 = torch.cat([stored[name("gate")], stored[name("up")]])  # int4 of the file's values
    assert all(torch.equal(sec[f"w13.{k}"], v) for k, v in quantize(s.scheme, w13).items())
    assert main(["convert", str(path), str(tmp_path / "i4"), "--quant", "int4"]) == 0
    s4 = Store(tmp_path / "i4")
    assert not s4.mixed and s4.manifest["version"] == INT4_VERSION and "records" not in s4.manifest
    assert "6 Q4_K expert tensor(s): dequantized and requantized to int4" in capsys.readouterr().err
    for src in (path, hf):
        assert main(["convert", str(src), str(tmp_path / "k"), "--quant", "q4_k"]) == 2
        err = capsys.readouterr().err
        assert "does not quantize into q4_k" in err and "--quant int4" in err
        assert "Traceback" not in err and not (tmp_path / "k").exists()
    assert main(["convert", str(hf), str(tmp_path / "k6"), "--quant", "q6_k"]) == 2
    err = capsys.readouterr().err  # experts: q6_k only as kept from a GGUF
    assert "q6_k only for the output layer" in err and "--quant int4" in err
    assert "Traceback" not in err and not (tmp_path / "k6").exists()


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda m: m["records"]["0"]["schemes"][1].update(name="q4_k"), "layer 0's record layout"),
        (lambda m: m["records"]["1"]["schemes"][0].update(name="q9_k"), "schemes this moestream"),
        (lambda m: m["records"].pop("2"), r"record layouts for layers \[0, 1\]"),
        (lambda m: m.pop("records"), "'record' is missing"),
        (lambda m: m.update(version=7), "version 7"),
        (lambda m: m.update(version=4), "in a version 4 manifest"),
    ],
)
def test_damaged_record_layouts_are_refused(mixed, tmp_path, edit, match):
    """A version-5 manifest whose per-layer layouts were edited: one line naming it, ending in
    'convert again' (a relabelled scheme would misread every record of the layer)."""
    import json
    import shutil

    from moestream.store.format import StoreError

    store = shutil.copytree(mixed[3], tmp_path / "s")
    m = json.loads((store / "manifest.json").read_text())
    edit(m)
    (store / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(StoreError, match=f"{match}.*convert"):
        Store(store)


# A Q4_K_M file whose experts' width 256 does not divide (DeepSeek-V2-Lite's and Qwen1.5-MoE's
# 1408): llama-quantize writes their down projections in its fallbacks below Q4_K gate/up, Q5_0
# for Q4_K and Q8_0 for Q6_K (its use_more_bits layers).
FALLBACK = {0: ("Q4_K", "Q4_K", "Q8_0"), 1: ("Q4_K", "Q4_K", "Q5_0"), 2: ("Q4_K", "Q4_K", "Q5_0")}
NARROW = {**WIDE, "moe_intermediate_size": 96}  # 3 x 32: no K-quant down fits


def fallback_store(root):
    hf = save(perturbed_model("qwen3_moe", seed=4, **NARROW), root / "hf", "per_expert")
    path = root / "m.gguf"
    stored = write_gguf(hf, path, FALLBACK, dense_type="Q8_0")
    return convert(path, root / "s", source_scheme(path, None), False), stored


def test_fallback_down_store_is_kept_and_the_gpu_reads_it(tmp_path, monkeypatch):
    """Q4_K gate/up over Q8_0 or Q5_0 down (a Q4_K_M file 256 does not divide): kept exactly
    (q4_k, int8, q5_0 records per layer), and the GPU provider reads it as stored: its slots hold
    the int8-down records, a q5_0-down layer reads its uint8 blocks packed at each slot's start,
    the decode kernels' q5_0 and int8 steps in the down launch (a tile that fits I = 96), a
    prompt's routed downs dequantized by dequant_blocks32 (gpu_reads_the_blocks)."""
    from moestream.kernels.triton.decode import DecodeConfig

    store, stored = fallback_store(tmp_path)
    s = Store(store)
    assert s.quant_name == "q4_k+int8+q5_0"
    assert_records_are(s, stored, {0: ("q4_k", "int8"), 1: ("q4_k", "q5_0"), 2: ("q4_k", "q5_0")})
    assert s.slot_size == s.layouts[0].size > s.layouts[1].size  # int8 down: the largest
    gpu_reads_the_blocks(store, monkeypatch, tile=DecodeConfig(bn=32, bk=256, bn_d=64, bk_d=32))


@pytest.mark.cuda
def test_fallback_down_store_streams_on_cuda(tmp_path):
    """The fallback-down store streamed through 3 slots with device-side misses (staged from the
    pinned mirror inside a captured step): the resident run's greedy tokens and log-probs."""
    from test_gpu_provider import device_miss_runs

    store, _ = fallback_store(tmp_path)
    (_, want), (rt, got) = device_miss_runs(store, "cuda", "bfloat16", 16, 3)
    assert rt.provider.device_misses and rt.provider.staged
    for a, b in zip(want, got):
        assert a.ids == b.ids and a.logprobs == b.logprobs


@pytest.mark.cuda
def test_kquant_store_streams_on_cuda(tmp_path):
    """A Q4_K_M-like store (q6_k down on layers 0 and 2, q4_k on layer 1: per-layer layouts in
    slots of the largest record) streamed through 3 slots with device-side misses (staged from
    the pinned mirror inside a captured step) gives the resident run's greedy tokens and
    log-probs exactly."""
    from test_gpu_provider import device_miss_runs

    hf = save(perturbed_model("qwen3_moe", seed=2, **WIDE), tmp_path / "hf", "per_expert")
    path = tmp_path / "m.gguf"
    kinds = {0: ("Q4_K", "Q4_K", "Q6_K"), 1: ("Q4_K",) * 3, 2: ("Q4_K", "Q4_K", "Q6_K")}
    write_gguf(hf, path, kinds, dense_type="Q8_0")
    store = convert(path, tmp_path / "s", source_scheme(path, None), False)
    (_, want), (rt, got) = device_miss_runs(store, "cuda", "bfloat16", 16, 3)
    assert rt.provider.device_misses and rt.provider.staged
    for a, b in zip(want, got):
        assert a.ids == b.ids and a.logprobs == b.logprobs


def test_one_mixed_layout_in_every_layer_takes_the_decode_step(tmp_path, monkeypatch):
    """Q4_K gate/up and Q6_K down in every layer (one layout, two schemes per record): the one-call
    decode step qualifies and gives the per-module path's logits and caches bit for bit; the GPU
    provider reads the records as stored, w2 in its own step (gpu_reads_the_blocks)."""
    from test_native_step import assert_step_gives_the_per_module_bits

    from moestream.kernels import native

    if not native.available():
        pytest.skip("native kernels did not build here")
    hf = save(perturbed_model("qwen3_moe", seed=2, **WIDE), tmp_path / "hf", "per_expert")
    path = tmp_path / "m.gguf"
    write_gguf(hf, path, dict.fromkeys(range(3), ("Q4_K", "Q4_K", "Q6_K")), dense_type="Q8_0")
    store = convert(path, tmp_path / "s", source_scheme(path, None), False)
    s = Store(store)
    assert s.mixed and s.manifest["version"] == MIXED_VERSION and s.layout.mixed
    loaded = load_model(store, StreamConfig(resident=True))
    assert_step_gives_the_per_module_bits(loaded)
    loaded.provider.close()
    # (CI time: the Triton kernels on the Q4_K_M-like store of the test above)
    gpu_reads_the_blocks(store, monkeypatch, triton=False)


def test_mixed_store_bytes_are_each_records_own(mixed, tmp_path):
    """Streaming a mixed store: the bytes read are each record's own size (not the slot's), and a
    router trace's replay (slots of the largest record, per-layer record sizes) gives the
    engine's hits, misses and bytes."""
    from moestream.config import SamplingConfig
    from moestream.obs.simulate import simulate
    from moestream.obs.trace import load_trace, record_trace
    from moestream.runtime import open_model
    from moestream.store.io import IOConfig

    s = Store(mixed[3])
    io = IOConfig(mode="pagecache", threads=1)
    cfg = StreamConfig(memory_budget=3 * s.slot_size, io=io, policy="lru")
    with open_model(mixed[3], experts=cfg) as rt:
        sampling = SamplingConfig(max_new_tokens=6, ignore_eos=True)
        t = load_trace(record_trace(rt, ["def fib(n):", "return n"], sampling, tmp_path / "tr"))
        engine = rt.generator.provider.stats()
    sizes = {layer: lay.size for layer, lay in s.layouts.items()}
    assert t.model.expert_bytes == s.slot_size and t.model.layer_bytes() == sizes
    sim = simulate(t, "lru", 3, t.model.expert_bytes, record_bytes=t.model.layer_bytes())
    assert (sim.hits, sim.misses, sim.bytes_read) == (
        engine["hits"], engine["misses"], engine["bytes_read"])  # fmt: skip
    assert engine["bytes_read"] < engine["misses"] * s.slot_size  # smaller records read less


def test_q6_k_quantizer_writes_ggufs_blocks():
    """quant.quantize_q6_k: bytes the gguf package reads as the values our dequantization gives;
    every unclamped value the nearest level of its sub-block's stored step d * sc; an all-zero
    super-block all zero bytes; a Gaussian weight within Q6_K's error (~0.018 relative RMS,
    between int8's and int4's)."""
    from gguf import GGMLQuantizationType, quants

    from moestream.quant import quantize_q6_k, unpack_kquant

    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 1024, generator=g) * 0.05
    w[5, 256:512] = 0
    w[7, :16] *= 40  # one sub-block far larger than its neighbours: their sc round coarsely
    q = quantize_q6_k(w, rows_per_chunk=20)  # chunks: 20, 20, 8 rows
    assert q.shape == (48, 4, 210) and q.dtype == torch.uint8
    assert torch.equal(q, quantize(make_scheme("q6_k"), w)["q"])
    ours = dequantize({"w.q": q}, "w", 256, torch.float32)
    theirs = quants.dequantize(q.numpy().reshape(48, -1), GGMLQuantizationType.Q6_K)
    assert torch.equal(ours, torch.from_numpy(theirs))
    assert not q[5, 1].any() and not ours[5, 256:512].any()
    f = unpack_kquant(q)
    step = (f["d"].repeat_interleave(16, 1) * f["sc"].float()).repeat_interleave(16, 1)
    free = (f["q"] > -32) & (f["q"] < 31) & (step != 0)
    err = (ours - w).abs()
    assert (err[free] <= step.abs()[free] * 0.5 * (1 + 1e-5)).all()
    rel = ((ours - w)[8:].pow(2).mean() / w[8:].pow(2).mean()).sqrt()
    assert 0.01 < rel < 0.025
    with pytest.raises(ConfigError, match="multiple of 256"):
        quantize_q6_k(torch.randn(2, 320))
