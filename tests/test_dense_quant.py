"""Quantized dense weights (quant.DenseQuant, kernels/dense.py): which tensors convert quantizes,
the store's record of them, and exactness: a quantized-dense model equals a float model holding
the dequantized sections (ref kernel, bit for bit), the native kernel equals its spec, streaming
equals resident."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from tiny_models import ARCHS, perturbed_model, save

from moestream.convert.writer import convert
from moestream.engine.kv_cache import KVCache
from moestream.experts.config import StreamConfig, min_budget
from moestream.kernels import native
from moestream.kernels.dense import QuantEmbedding, QuantLinear, QuantWeight
from moestream.kernels.ref import dequantize, dequantize_rows, qlinear_q8
from moestream.loader import build_model, load_model
from moestream.models import checkpoint_renamer
from moestream.quant import DenseQuant, make_dense, make_scheme, quantize
from moestream.store.format import INT4_VERSION, MANIFEST, Store, StoreError
from moestream.store.io import IOConfig

PROMPT = torch.randint(0, 320, (10,), generator=torch.Generator().manual_seed(3))


def every_dense(quant: str) -> DenseQuant:
    """The --quant rule with no size floor: the tiny models' tensors are all small."""
    d = make_dense("auto", make_scheme(quant))
    return DenseQuant(d.weights, d.output, min_params=0)


@pytest.fixture(scope="module")
def dense_store(tiny_dir, tmp_path_factory):
    root, cache = tmp_path_factory.mktemp("dense"), {}

    def get(arch: str, quant: str = "int4", tied: bool = False):
        key = (arch, quant, tied)
        if key not in cache:
            src = tiny_dir(arch, "fused")
            if tied:
                model = perturbed_model(arch, tie_word_embeddings=True)
                src = save(model, root / f"hf-{arch}-tied", "fused")
            dst = root / f"{arch}-{quant}-{tied}"
            cache[key] = convert(src, dst, make_scheme(quant), False, every_dense(quant))
        return cache[key]

    return get


def logits(model, n: int = 4) -> torch.Tensor:
    """Prompt, then n greedy decode steps: every step's last-position logits [n + 1, V]."""
    cache = KVCache(model.args, len(PROMPT) + n, torch.float32)
    out = []
    with torch.no_grad():
        row = model(PROMPT, cache, 0, last_only=True)[-1]
        for pos in range(len(PROMPT), len(PROMPT) + n):
            out.append(row)
            row = model(torch.tensor([int(row.argmax())]), cache, pos, last_only=True)[-1]
    out.append(row)
    return torch.stack(out)


def dequantized_float_model(folder, provider):
    """The reference: a float model whose quantized weights are the store's sections dequantized
    (fp32), the float ones copied, on the same experts."""
    store = Store(folder)
    model = build_model(store.args, torch.float32)
    params = dict(model.named_parameters())
    ours = checkpoint_renamer(store.args.model_type)
    filled = set()
    with torch.no_grad():
        for name in store.dense_names:
            if ours(name) not in params:  # a tied lm_head
                continue
            scheme = store.dense_scheme(name)
            if scheme is None:
                t = store.tensor(name)
            else:
                sec = {f"w.{k}": v for k, v in store.dense_sections(name).items()}
                t = dequantize(sec, "w", scheme.group_size, torch.float32)
            params[ours(name)].copy_(t)
            filled.add(ours(name))
        assert filled == set(params) - {"lm_head.weight"} or filled == set(params)
        if store.args.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
    model.set_provider(provider)
    return model


def test_the_rule_quantizes_projections_embedding_and_output_not_routers(dense_store, tiny_dir):
    m = json.loads((dense_store("qwen3_moe") / MANIFEST).read_text())
    assert m["version"] == INT4_VERSION  # int4 sections: blocked (scale, zero) pairs
    formats = {n: f["scheme"]["name"] for n, f in m["dense_formats"].items()}
    assert formats["model.embed_tokens.weight"] == "int4"
    # q6_k output under int4, but the tiny model's K (64) is not whole super-blocks of 256: int8
    assert formats["lm_head.weight"] == "int8"
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert formats[f"model.layers.0.self_attn.{proj}.weight"] == "int4"
    assert not any(
        n.endswith(("mlp.gate.weight", "norm.weight")) for n in formats
    )  # routers, norms: float
    assert "model.layers.0.mlp.gate.weight" in m["dense"]  # stored as it was
    assert "model.layers.0.self_attn.q_proj.weight.sz" in m["dense"]  # sections, checksummed
    assert m["dense_quant"]["output"]["name"] == "q6_k"
    # The default floor keeps the tiny model's (small) tensors float; bf16 / --dense float: all.
    assert make_dense("auto", make_scheme("int4")).scheme_for("linear", (64, 64)) is None
    assert make_dense("float", make_scheme("int4")) == DenseQuant()
    assert make_dense("auto", make_scheme("bf16")) == DenseQuant()
    assert make_dense("int8", make_scheme("int4")).output.name == "int8"
    for quant in ("int4", "q4_0", "q4_1", "q5_0"):  # as llama.cpp's 4-bit files keep it
        d = make_dense("auto", make_scheme(quant))
        assert d.output.name == "q6_k" and d.scheme_for("output", (4096, 512)).name == "q6_k"
        assert d.scheme_for("output", (4096, 640)).name == "int8"  # 640: not whole super-blocks


@pytest.mark.parametrize("tied", [False, True])
def test_q6_k_output_layer_under_int4(tmp_path, tied):
    """Hidden 256: the int4 rule writes lm_head (and a tied embedding, one table) in q6_k; the ref
    kernel gives the float model's bits holding the dequantized table, the native kernel its
    Q8_0-activation spec, and the lookup only the rows asked for."""
    model = perturbed_model("qwen3_moe", hidden_size=256, tie_word_embeddings=tied)
    src = save(model, tmp_path / "hf", "fused")
    folder = convert(src, tmp_path / "store", make_scheme("int4"), False, every_dense("int4"))
    store = Store(folder)
    assert (
        store.dense_scheme("lm_head.weight" if not tied else "model.embed_tokens.weight").name
        == "q6_k"
    )
    loaded = load_model(folder, StreamConfig(resident=True, kernel="ref"))
    ref = dequantized_float_model(folder, loaded.provider)
    assert torch.equal(logits(loaded.model), logits(ref))
    if tied:
        assert loaded.model.lm_head.qweight is loaded.model.model.embed_tokens.qweight
    if native.available():
        nat = load_model(folder, StreamConfig(resident=True, kernel="native"))
        head = nat.model.lm_head
        x = torch.randn(2, 256)
        assert torch.equal(head(x), qlinear_q8(x, head.qweight.sections(), "w"))


@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_dense_equals_the_dequantized_float_model(dense_store, arch):
    """ref kernel: the quantized modules (fused q/k/v, the gathered embedding rows, lm_head) give
    the bits of nn.Linear / nn.Embedding holding the dequantized weights, on every architecture."""
    folder = dense_store(arch)
    assert Store(folder).dense_formats  # something was quantized
    loaded = load_model(folder, StreamConfig(resident=True, kernel="ref"))
    assert any(isinstance(m, QuantLinear) for m in loaded.model.modules())
    ref = dequantized_float_model(folder, loaded.provider)
    assert torch.equal(logits(loaded.model), logits(ref))


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_tied_embedding_is_one_quantized_table(dense_store, quant):
    folder = dense_store("qwen3_moe", quant, tied=True)
    assert Store(folder).dense_scheme("model.embed_tokens.weight").name == "int8"
    loaded = load_model(folder, StreamConfig(resident=True, kernel="ref"))
    m = loaded.model
    assert isinstance(m.model.embed_tokens, QuantEmbedding)
    assert m.lm_head.qweight is m.model.embed_tokens.qweight  # shared, not copied
    assert torch.equal(logits(m), logits(dequantized_float_model(folder, loaded.provider)))


@pytest.mark.parametrize("scheme", ["int4", "int8", "q4_0", "q4_1", "q5_0"])
@pytest.mark.parametrize("n,k", [(160, 96), (320, 64), (2, 32)])  # 160: a partial int4 block
def test_native_dense_linear_equals_its_spec(scheme, n, k):
    if not native.available():
        pytest.skip("native kernels did not build here")
    g = torch.Generator().manual_seed(n + k)
    w, x = torch.randn(n, k, generator=g), torch.randn(3, k, generator=g)
    s = make_scheme(scheme)
    qw = QuantWeight(s, (n, k), quantize(s, w))
    bias = torch.randn(n, generator=g)
    wide = scheme == "int8"  # a down projection's int16 activations
    got = QuantLinear(qw, bias, "native", wide=wide)(x)
    assert torch.equal(got, qlinear_q8(x, qw.sections(), "w", wide=wide) + bias)
    ref = QuantLinear(qw, bias, "ref")(x)
    assert torch.equal(
        ref, torch.nn.functional.linear(x, dequantize(qw.sections(), "w", 32, x.dtype), bias)
    )
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()  # Q8_0 activations: close, not equal


@pytest.mark.parametrize("scheme", ["int4", "int8", "q4_0", "q4_1", "q5_0"])
def test_embedding_dequantizes_only_the_rows_asked_for(scheme):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(130, 64, generator=g)  # 130 rows: the last int4 block has 2
    s = make_scheme(scheme)
    qw = QuantWeight(s, (130, 64), quantize(s, w))
    ids = torch.tensor([0, 129, 64, 65, 127, 128, 3, 3])
    got = QuantEmbedding(qw, torch.float32)(ids)
    full = dequantize(qw.sections(), "w", 32, torch.float32)
    assert torch.equal(got, full[ids])
    assert torch.equal(
        dequantize_rows(qw.sections(), "w", ids, 32, torch.bfloat16), full[ids].bfloat16()
    )


def test_streaming_with_quantized_dense_gives_the_resident_bits(dense_store):
    folder = dense_store("qwen3_moe")
    want = logits(load_model(folder, StreamConfig(resident=True)).model)
    store = Store(folder)
    io = IOConfig(mode="pagecache", threads=2)
    got = load_model(folder, StreamConfig(memory_budget=min_budget(store), io=io))
    assert torch.equal(logits(got.model), want)
    assert got.provider.stats()["evictions"] > 0
    got.provider.close()


def _edit_manifest(folder, tmp_path, edit):
    import shutil

    dst = tmp_path / "edited"
    shutil.copytree(folder, dst)
    m = json.loads((dst / MANIFEST).read_text())
    edit(m)
    (dst / MANIFEST).write_text(json.dumps(m))
    return dst


def test_an_older_or_unknown_dense_layout_says_convert_again(dense_store, tmp_path):
    folder = dense_store("qwen3_moe")
    name = "model.layers.0.self_attn.o_proj.weight"

    def older(m):
        m["version"] = 1

    def unknown(m):
        m["dense_formats"][name]["scheme"]["name"] = "int3"

    def lost_section(m):
        del m["dense"][f"{name}.sz"]

    def int4_before_v6(m):  # its int4 (scale, zero) pairs would be in the order before version 6
        m["version"] = 5

    cases = ((older, "version 1"), (unknown, "does not read"), (lost_section, "lacks"),
             (int4_before_v6, "version 5 store with int4 sections"))  # fmt: skip
    for edit, words in cases:
        with pytest.raises(StoreError, match=f"{words}.*convert the model again"):
            Store(_edit_manifest(folder, tmp_path / edit.__name__, edit))


def test_a_damaged_or_relabelled_section_is_refused(dense_store, tmp_path):
    folder = dense_store("qwen3_moe")
    name = "model.layers.0.self_attn.o_proj.weight"

    def crc(m):
        m["dense"][f"{name}.q"] ^= 1

    with pytest.raises(StoreError, match="damaged.*convert the model again"):
        load_model(_edit_manifest(folder, tmp_path / "crc", crc))

    def dtype(m):  # what a relabelled header would be checked against
        m["dense_dtypes"][f"{name}.q"] = "int8"

    with pytest.raises(StoreError, match="lacks its section"):
        Store(_edit_manifest(folder, tmp_path / "dtype", dtype))


def test_cli_convert_dense_flag(tiny_dir, tmp_path):
    src = tiny_dir("qwen3_moe")
    base = [sys.executable, "-m", "moestream", "convert", str(src)]
    r = subprocess.run(
        base + [str(tmp_path / "f"), "--quant", "int4", "--dense", "float"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    m = json.loads((tmp_path / "f" / MANIFEST).read_text())
    assert m["dense_formats"] == {} and m["dense_quant"]["weights"] is None
    r = subprocess.run(
        base + [str(tmp_path / "g"), "--dense", "int2"], capture_output=True, text=True
    )
    assert r.returncode == 2 and "--dense" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.cuda
@pytest.mark.parametrize("scheme", ["int4", "int8"])
def test_quantized_dense_on_cuda_is_the_dequantized_linear(scheme):
    """On the GPU the CPU kernels and ref dequantize into the activation dtype per call and
    multiply: the bits of F.linear with the dequantized weight there, and no copy is kept; the
    embedding gathers the same rows."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    g = torch.Generator().manual_seed(5)
    s = make_scheme(scheme)
    qw = QuantWeight(s, (320, 128), quantize(s, torch.randn(320, 128, generator=g))).cuda()
    x = torch.randn(3, 128, generator=g).cuda().bfloat16()
    want = torch.nn.functional.linear(x, dequantize(qw.sections(), "w", 32, torch.bfloat16))
    for kernel in ("native", "ref"):  # native: CPU only, ref here
        lin = QuantLinear(qw, None, kernel)
        assert torch.equal(lin(x), want) and torch.equal(lin(x), want)
        assert {n for n, _ in lin.named_buffers()} == {"qweight.q", f"qweight.{qw.suffixes[1]}"}
    ids = torch.tensor([0, 319, 64, 5]).cuda()
    rows = QuantEmbedding(qw, torch.bfloat16)(ids)
    assert torch.equal(rows, dequantize(qw.sections(), "w", 32, torch.bfloat16)[ids])
