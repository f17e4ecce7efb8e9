"""GGUF files: metadata and tensor names -> native models, Q8_0 / Q4_0 / Q4_1 experts and dense weights
kept exactly, other types requantized and said so, the vocabulary -> tokenizer.json, the CLI, bad input; transformers on
the same (dequantized) weights is the oracle. GGUF files are written in-test (tests/gguf_models);
test_gguf_llama_cpp.py runs llama.cpp's own converter where its source is present."""

from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest
import torch
from gguf_models import assert_records_are, expert_name, rewrite_gguf, write_gguf
from tiny_models import perturbed_model, save

from moestream.cli import main
from moestream.config import ConfigError
from moestream.convert.gguf import GGUFCheckpoint
from moestream.convert.writer import convert, source_scheme
from moestream.engine.kv_cache import KVCache
from moestream.engine.tokenizer import Tokenizer
from moestream.experts.config import GpuConfig, StreamConfig, min_budget
from moestream.kernels.ref import dequantize
from moestream.loader import load_model
from moestream.store.format import MIXED_VERSION, VERSION, Store

ARCHS = ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "glm4_moe", "lfm2_moe", "deepseek_v3",
         "qwen3_5_moe_text", "gpt_oss")  # fmt: skip
PROMPT = torch.randint(0, 320, (12,), generator=torch.Generator().manual_seed(5))
Q8 = ("Q8_0",) * 3
FP32_TOL = 1e-4  # the fp32 parity tolerance of tests/test_parity.py


# What llama.cpp's GGUF can hold: qwen3moe has no dense-MLP layers; LFM2 has no conv biases, a
# tied output layer, no routed scaling factor (LFM2's own is 1) and one norm eps (the tiny
# config's norm_eps, which transformers reads, and rms_norm_eps, which the converter writes).
# DeepSeek's yarn: llama.cpp keeps only mscale_all_dim (as yarn_log_multiplier) and takes mscale
# equal to it; its converter writes the sigmoid gating from config.json's scoring_func.
# gpt-oss: llama.cpp fixes the SwiGLU clamp at 7 and rounds yarn's correction dims (truncate).
GGUF_FORM = {
    "qwen3_moe": {"mlp_only_layers": []},
    "lfm2_moe": dict(conv_bias=False, tie_word_embeddings=True, routed_scaling_factor=1.0,
                     norm_eps=1e-6),
    "deepseek_v3": dict(scoring_func="sigmoid", rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
        mscale=0.8, mscale_all_dim=0.8)),
    "gpt_oss": dict(swiglu_limit=7.0, rope_parameters=dict(
        rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0,
        truncate=True, original_max_position_embeddings=64)),
}  # fmt: skip


def hf_checkpoint(arch: str, folder, **extra):
    over = {**GGUF_FORM.get(arch, {}), **extra}
    model = perturbed_model(arch, seed=2, **over)
    if arch == "gpt_oss":  # a clamp at 7 binds: gate / up pre-activations of std ~4
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.experts.gate_up_proj.mul_(4.0)
    return save(model, folder, "per_expert")


@pytest.fixture(scope="module")
def q8(tmp_path_factory):
    """arch -> (HF folder, Q8_0-expert GGUF, values stored, its int8 store), built once."""
    root = tmp_path_factory.mktemp("gguf")
    cache = {}

    def get(arch: str):
        if arch not in cache:
            hf = hf_checkpoint(arch, root / f"{arch}-hf")
            path = root / f"{arch}.gguf"
            stored = write_gguf(hf, path, {layer: Q8 for layer in range(3)})
            store = convert(path, root / f"{arch}-store", source_scheme(path, None), False)
            cache[arch] = (hf, path, stored, store)
        return cache[arch]

    return get


def hf_logits(hf_folder, stored: dict[str, torch.Tensor], tmp) -> torch.Tensor:
    """transformers' logits with the GGUF's values (dequantized) as its weights."""
    import shutil

    from safetensors.torch import save_file
    from test_parity import hf_load

    folder = tmp / "dequantized"
    shutil.copytree(hf_folder, folder)
    save_file(stored, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with torch.no_grad():
        return hf_load(folder)(PROMPT[None]).logits[0]


def our_logits(store, cfg: StreamConfig | None = None) -> torch.Tensor:
    loaded = load_model(store, cfg or StreamConfig(resident=True, kernel="ref"))
    with torch.no_grad():
        out = loaded.model(PROMPT, KVCache(loaded.args, 64, torch.float32), 0)
    loaded.provider.close()
    return out


def stepwise_logits(store, cfg, n: int) -> torch.Tensor:
    """our_logits's first n rows, computed one token a call (the decode path's kernels)."""
    loaded = load_model(store, cfg)
    cache = KVCache(loaded.args, 64, torch.float32)
    with torch.no_grad():
        out = torch.cat([loaded.model(PROMPT[i : i + 1], cache, i) for i in range(n)])
    loaded.provider.close()
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_q8_0_gguf_matches_transformers_on_its_weights(q8, arch, tmp_path):
    hf, path, stored, store = q8(arch)
    assert Store(store).scheme.name == "int8"  # default for 8-bit experts
    want = hf_logits(hf, stored, tmp_path)
    got = our_logits(store)
    assert (want - got).abs().max().item() < FP32_TOL


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_q8_0_experts_are_bit_identical(q8, arch):
    """The store's int8 records dequantize to exactly the GGUF's Q8_0 values (no requantization)."""
    _, _, stored, store = q8(arch)
    assert_records_are(Store(store), stored)


def test_q8_0_gguf_kept_as_q8_0_blocks(tmp_path, capsys):
    """--quant q8_0 keeps a Q8_0 file's blocks with their fp16 d (8.5 bits per weight): records
    and dense sections equal the file's bytes, the logits the int8 store's on the native kernels
    (the same values and arithmetic), and the GPU provider refuses the store."""
    from moestream.config import ConfigError
    from moestream.experts.gpu import check_scheme
    from moestream.quant import make_scheme

    hf = hf_checkpoint("qwen3_moe", tmp_path / "hf")
    path = tmp_path / "q8.gguf"
    stored = write_gguf(hf, path, {layer: Q8 for layer in range(3)}, dense_type="Q8_0")
    stores = {}
    for name in ("int8", "q8_0"):
        capsys.readouterr()
        stores[name] = convert(path, tmp_path / name, make_scheme(name), False)
        err = capsys.readouterr().err
        assert f"Q8_0 expert tensor(s): kept exactly as {name}" in err
        assert f"Q8_0 dense tensor(s): kept exactly as {name}" in err
    s = Store(stores["q8_0"])
    assert s.scheme.name == "q8_0"
    assert {sec.name: sec.dtype for sec in s.layout.sections}["w13.d"] == torch.float16
    assert s.layout.size <= Store(stores["int8"]).layout.size
    assert_records_are(s, stored)
    name = "model.embed_tokens.weight"
    assert s.dense_scheme(name).name == "q8_0"
    got = dequantize(
        {f"w.{k}": v for k, v in s.dense_sections(name).items()}, "w", 32, torch.float32
    )
    assert torch.equal(got, stored[name])
    native = StreamConfig(resident=True, kernel="native")
    assert torch.equal(our_logits(stores["q8_0"], native), our_logits(stores["int8"], native))
    with pytest.raises(ConfigError, match="q8_0 experts, which have no GPU kernel"):
        check_scheme(s)  # (the loader calls it before anything is loaded)


def test_mixed_types_are_kept_or_requantized_and_said(tmp_path, capsys):
    """Per-tensor types in one file (Q8_0, Q4_0, F16, Q4_1, a Q8_0 dense embedding): each expert
    projection whose type a scheme holds keeps its blocks (Q8_0 as int8, Q4_0 as q4_0, Q4_1 as
    q4_1, per layer),
    the rest is requantized into the default (int4: some tensors have < 8 bits); convert prints,
    per type, what it did. `--quant int8` puts every expert in int8 (Q8_0 kept)."""
    hf = hf_checkpoint("qwen3_moe", tmp_path / "hf")
    path = tmp_path / "mixed.gguf"
    types = {0: Q8, 1: ("Q4_0", "Q4_0", "Q8_0"), 2: ("F16", "F16", "Q4_1")}
    stored = write_gguf(hf, path, types, dense_type="Q8_0")
    experts = source_scheme(path, None)
    assert experts.scheme.name == "int4" and experts.keep_source
    store = convert(path, tmp_path / "store", experts, False)
    err = capsys.readouterr().err
    assert "4 Q8_0 expert tensor(s): kept exactly as int8" in err
    assert "2 Q4_0 expert tensor(s): kept exactly as q4_0" in err
    assert "2 F16 expert tensor(s): dequantized and requantized to int4" in err
    assert "1 Q4_1 expert tensor(s): kept exactly as q4_1 (same values)" in err
    # Dense Q8_0 weights are kept exactly as int8 sections (routers, which have no quantized
    # form, dequantized).
    assert "Q8_0 dense tensor(s): kept exactly as int8" in err
    assert "3 Q8_0 dense tensor(s): dequantized once to float32" in err
    s = Store(store)
    name = "model.embed_tokens.weight"
    assert s.dense_scheme(name).name == "int8"
    got = dequantize(
        {f"w.{k}": v for k, v in s.dense_sections(name).items()}, "w", 32, torch.float32
    )
    assert torch.equal(got, stored[name])
    assert_records_are(s, stored, {0: ("int8", "int8"), 1: ("q4_0", "int8")}, layers=[0, 1])
    buf = torch.frombuffer(bytearray(s.read_record(2, 3)), dtype=torch.uint8)
    assert [x.name for x in s.layouts[2].schemes] == ["int4", "q4_1"]
    sec = s.layouts[2].views(buf)
    assert torch.equal(
        dequantize(sec, "w2", 32, torch.float32), stored[expert_name("qwen3_moe", 2, 3, "down")]
    )
    w13, I = dequantize(sec, "w13", 32, torch.float32), s.args.moe_intermediate_size
    src = stored[expert_name("qwen3_moe", 2, 3, "up")]  # F16: requantized to int4
    step = (src.view(-1, 32).amax(-1) - src.view(-1, 32).amin(-1)) / 15
    assert ((w13[I:] - src).view(-1, 32).abs().amax(-1) <= step * 0.51 + 1e-2).all()
    # With --quant int8 the Q8_0 tensors are exact again and the rest requantized to int8.
    capsys.readouterr()
    convert(path, tmp_path / "store8", source_scheme(path, "int8"), False)
    err = capsys.readouterr().err
    assert "4 Q8_0 expert tensor(s): kept exactly as int8" in err
    assert "2 Q4_0 expert tensor(s): dequantized and requantized to int8" in err
    assert "1 Q4_1 expert tensor(s): dequantized and requantized to int8" in err
    assert not Store(tmp_path / "store8").mixed


def test_requantized_types_say_their_measured_cost(tmp_path, capsys):
    """Q5_1 experts (no store scheme holds them) are requantized into int4 by default: the bits
    of the int4 store of a folder holding the file's values; convert's note gives the cost
    measured on the reference model (REQUANT_COST: int4, and int8 under --quant int8); a type
    not measured (F16) gets the plain note."""
    import shutil

    from safetensors.torch import save_file

    from moestream.convert.gguf_blocks import REQUANT_COST
    from moestream.quant import DenseQuant, make_scheme

    hf = hf_checkpoint("qwen3_moe", tmp_path / "hf")
    path = tmp_path / "q5.gguf"
    stored = write_gguf(hf, path, {0: ("Q5_1",) * 3, 1: ("Q5_1",) * 3, 2: ("F16", "F16", "Q5_1")})
    capsys.readouterr()
    ours = convert(path, tmp_path / "store", source_scheme(path, None), False, DenseQuant())
    err = capsys.readouterr().err
    (added, own), (added8, _) = REQUANT_COST["Q5_1", "int4"], REQUANT_COST["Q5_1", "int8"]
    assert (
        "7 Q5_1 expert tensor(s): dequantized and requantized to int4 g32 (lossy: a second "
        f"rounding; on the 29M reference model it added KL {added:.4f} to the file's own "
        f"{own:.4f} against the original; --quant int8 added {added8:.4f} (docs/gguf.md); "
        "measure yours with `moestream eval`)"
    ) in err
    plain = "2 F16 expert tensor(s): dequantized and requantized to int4 g32 (lossy: a second "
    assert plain + "rounding; measure yours" in err
    folder = tmp_path / "values"
    shutil.copytree(hf, folder)
    save_file(stored, str(folder / "model.safetensors"), metadata={"format": "pt"})
    theirs = convert(folder, tmp_path / "hf-store", make_scheme("int4"), False, DenseQuant())
    assert torch.equal(our_logits(ours), our_logits(theirs))
    convert(path, tmp_path / "store8", source_scheme(path, "int8"), False)
    added, own = REQUANT_COST["Q5_1", "int8"]
    assert (
        f"requantized to int8 g32 (lossy: a second rounding; on the 29M reference model it "
        f"added KL {added:.4f}" in capsys.readouterr().err
    )


# GGUF type -> (the scheme it is kept as, the store version: q4_1 and q5_0 are schemes version 4
# readers do not know, so their stores are version 5)
NIBBLE_KEPT = {
    "Q4_0": ("q4_0", VERSION),
    "Q4_1": ("q4_1", MIXED_VERSION),
    "Q5_0": ("q5_0", MIXED_VERSION),
}


@pytest.fixture(scope="module")
def nibbles(tmp_path_factory):
    """(arch, Q4_0, Q4_1 or Q5_0) -> (HF folder, GGUF with every expert and dense tensor of that type,
    values stored, its store, convert's stderr), built once."""
    root = tmp_path_factory.mktemp("gguf-nibbles")
    cache = {}

    def get(arch: str, kind: str, capsys):
        if (arch, kind) not in cache:
            hf = hf_checkpoint(arch, root / f"{arch}-{kind}-hf")
            path = root / f"{arch}-{kind}.gguf"
            stored = write_gguf(hf, path, {layer: (kind,) * 3 for layer in range(3)},
                                dense_type=kind)  # fmt: skip
            capsys.readouterr()
            store = convert(path, root / f"{arch}-{kind}-store", source_scheme(path, None), False)
            cache[arch, kind] = (hf, path, stored, store, capsys.readouterr().err)
        return cache[arch, kind]

    return get


@pytest.mark.parametrize("kind", list(NIBBLE_KEPT))
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_nibble_gguf_is_kept_exactly(nibbles, arch, kind, tmp_path, capsys):
    """Q4_0 / Q4_1 / Q5_0 experts and dense weights go into q4_0 / q4_1 sections byte for byte
    (Q5_0: its blocks as they are; the default for a file of that one type; no second rounding):
    every record and dense section dequantizes to the GGUF's values, the logits are transformers'
    on those values, and convert says so (Q4_1, Q5_0: a version 5 store)."""
    hf, _, stored, store, err = nibbles(arch, kind, capsys)
    scheme, version = NIBBLE_KEPT[kind]
    s = Store(store)
    assert s.scheme.name == scheme and s.manifest["version"] == version
    assert f"9 {kind} expert tensor(s): kept exactly as {scheme} (same values)" in err
    assert f"{kind} dense tensor(s): kept exactly as {scheme} (same values)" in err
    assert_records_are(s, stored)
    # q_proj: mixtral's rows were permuted by the converter; the reader undoes it per section.
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.embed_tokens.weight"):
        assert s.dense_scheme(name).name == scheme
        sec = {f"w.{k}": v for k, v in s.dense_sections(name).items()}
        assert torch.equal(dequantize(sec, "w", 32, torch.float32), stored[name])
    want = hf_logits(hf, stored, tmp_path)
    assert (want - our_logits(store)).abs().max().item() < FP32_TOL
    if kind == "Q4_1":
        # the native kernels (Q8_0 activations): the activation rounding (3.2-4.2% measured;
        # all-Q4_0 and all-Q8_0 files of qwen3_moe: 2.6%, 3.0%; all-Q5_0: 20% at the last
        # token, where the rounding moves one token's experts in layers 0 and 1 (router scores
        # 0.02-0.04 apart): its projections are held to the spec's bits instead, below)
        native = our_logits(store, StreamConfig(resident=True))
        assert (want - native).abs().max().item() < 0.05 * want.abs().max().item()


def gpu_gives_the_spec(store, monkeypatch, steps: int, triton: bool = True, tile=None) -> None:
    """The GPU provider on device "cpu" (its spec, kernel "ref", and with `triton` the Triton
    kernels on the interpreter, decode tiles `tile` if given) gives the CPU spec's logits: a
    prompt (the Triton kernels: the grouped GEMMs) and `steps` tokens one a call (the decode
    kernels); the kernels ran, not the reference fallback."""
    from moestream.experts.config import GpuConfig

    spec = our_logits(store)  # the CPU's pure-torch spec, fp32 activations
    # Triton on device "cpu" is its interpreter, which conftest turns on only without a GPU (on
    # the GPU machine a CPU tensor cannot reach a compiled kernel): there the stores' CUDA tests
    # (test_kquant_store_streams_on_cuda, test_gpu_provider's) run the kernels instead
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    kernels = (
        ("ref", "triton") if triton and interp and importlib.util.find_spec("triton") else ("ref",)
    )
    calls = []
    if "triton" in kernels:
        from moestream.kernels.triton import decode, grouped

        if tile is not None:
            monkeypatch.setattr(decode, "default_config", lambda *a: tile)
        for mod, name in ((decode, "moe_decode"), (grouped, "moe_grouped")):
            f = getattr(mod, name)
            monkeypatch.setattr(
                mod, name, lambda *a, f=f, n=name, **k: calls.append(n) or f(*a, **k)
            )
    for kernel in kernels:
        cfg = GpuConfig(resident=True, kernel=kernel, device="cpu")
        assert (our_logits(store, cfg) - spec).abs().max().item() < FP32_TOL, kernel
        got = stepwise_logits(store, cfg, steps)  # one token a call: the decode kernels
        assert (got - spec[:steps]).abs().max().item() < FP32_TOL, kernel
    assert set(calls) == ({"moe_decode", "moe_grouped"} if "triton" in kernels else set())


@pytest.mark.parametrize("kind", list(NIBBLE_KEPT))
def test_nibble_store_streams_the_resident_bits_and_the_gpu_reads_q4(nibbles, kind, capsys,
                                                                      monkeypatch):  # fmt: skip
    """On the native kernel (q4_0 / q4_1 / q5_0 x Q8_0 activations) streaming at the minimum budget
    gives the resident bits. The GPU provider reads Q4_0's and Q4_1's records as stored: its spec
    and its Triton kernels (the interpreter, a prompt and decode steps) give the CPU spec's
    logits; q5_0, which it has no kernel for, it refuses by name."""
    from moestream.config import ConfigError
    from moestream.experts.config import GpuConfig

    store = nibbles("qwen3_moe", kind, capsys)[3]
    scheme = NIBBLE_KEPT[kind][0]
    want = our_logits(store, StreamConfig(resident=True))
    got = our_logits(store, StreamConfig(memory_budget=min_budget(Store(store))))
    assert torch.equal(want, got)
    if scheme not in ("q4_0", "q4_1"):
        match = f"{scheme} experts, which have no GPU kernel.*--quant int4"
        with pytest.raises(ConfigError, match=match):
            load_model(store, GpuConfig(resident=True, kernel="ref", device="cpu"))
        return
    gpu_gives_the_spec(store, monkeypatch, 4)


@pytest.mark.parametrize("kind", ["Q4_1", "Q5_0"])
def test_mixed_records_are_kept_and_run_natively(tmp_path, capsys, kind):
    """Q4_1 (Q5_0) beside Q8_0 and Q4_0 projections (per layer: kind gate/up + Q8_0 down, Q4_0
    gate/up + kind down, all kind): each kept in its own scheme, the logits transformers' on the
    file's values, each mixed record's projections equal to the native spec bit for bit, and
    streaming at the minimum budget gives the resident bits on the native kernels."""
    from moestream.kernels import native
    from moestream.kernels.ref import qlinear_q8

    hf = hf_checkpoint("qwen3_moe", tmp_path / "hf")
    path = tmp_path / "mixed.gguf"
    types = {0: (kind, kind, "Q8_0"), 1: ("Q4_0", "Q4_0", kind), 2: (kind,) * 3}
    stored = write_gguf(hf, path, types, dense_type="Q8_0")
    store = convert(path, tmp_path / "store", source_scheme(path, None), False)
    k = kind.lower()
    assert f"6 {kind} expert tensor(s): kept exactly as {k}" in capsys.readouterr().err
    s = Store(store)
    schemes = {0: (k, "int8"), 1: ("q4_0", k), 2: (k, k)}
    assert_records_are(s, stored, schemes)
    want = hf_logits(hf, stored, tmp_path)
    assert (want - our_logits(store)).abs().max().item() < FP32_TOL
    x = torch.randn(3, s.args.hidden_size, generator=torch.Generator().manual_seed(9))
    for layer in (0, 1):
        buf = torch.frombuffer(bytearray(s.read_record(layer, 1)), dtype=torch.uint8)
        sec = s.layouts[layer].views(buf)
        h = x[:, : s.args.moe_intermediate_size]
        for name, xin in (("w13", x), ("w2", h)):
            for isa in ("scalar", native.best_isa()):
                assert torch.equal(native.linear(xin, sec, name, isa), qlinear_q8(xin, sec, name))
    resident = our_logits(store, StreamConfig(resident=True))
    streamed = our_logits(store, StreamConfig(memory_budget=min_budget(s)))
    assert torch.equal(resident, streamed)


def _qwen2_style_tokenizer(folder) -> None:
    """The tiny tokenizer with Qwen2's pre-tokenizer (regex split, then bytes) and NFC."""
    from tokenizers import Regex, Tokenizer, normalizers
    from tokenizers import pre_tokenizers as pre

    from moestream.convert.gguf_vocab import _QWEN2

    tk = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre.Sequence(
        [
            pre.Split(Regex(_QWEN2), behavior="isolated", invert=False),
            pre.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tk.save(str(folder / "tokenizer.json"))


def _llama3_style_tokenizer(folder) -> None:
    """The tiny tokenizer with Llama 3's pre-tokenizer (its tokenizer.json's split regex, then
    bytes) and ignore_merges: what GLM-4 (chatglm4 in llama.cpp) and LFM2 files use too."""
    doc = json.loads((folder / "tokenizer.json").read_text())
    regex = (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
        r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    )
    doc["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
             "use_regex": False},
        ],
    }  # fmt: skip
    doc["model"]["ignore_merges"] = True
    (folder / "tokenizer.json").write_text(json.dumps(doc))


def _o200k_style_tokenizer(folder) -> None:
    """The tiny tokenizer with o200k's pre-tokenizer (GPT-4o, gpt-oss: its split regex, then
    bytes; no normalizer), and a merge `n F` across the lower -> upper case boundary o200k splits
    at (Llama 3's regex does not: `xnFoo` would encode differently)."""
    from tiny_models import VOCAB

    from moestream.convert.gguf_vocab import _O200K

    doc = json.loads((folder / "tokenizer.json").read_text())
    assert len(doc["model"]["vocab"]) < VOCAB
    doc["model"]["vocab"]["nF"] = len(doc["model"]["vocab"])
    doc["model"]["merges"].append(["n", "F"])
    doc["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": _O200K}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
             "use_regex": False},
        ],
    }  # fmt: skip
    (folder / "tokenizer.json").write_text(json.dumps(doc))


TEXTS = [
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)",
    "<|user|>hi there<|end|><|assistant|>",
    "  spaces   and\ttabs\n\n\nnewlines 12345 3.14 don't WE'LL",
    "unicode: café naïve 東京 🙂 e\u0301",
    "CamelCaseWord xnFoo HTTPServer I'M x/y/z\n/path 1234567",  # o200k's case split
]


@pytest.mark.parametrize("pre", ["gpt-2", "qwen2", "llama-bpe", "glm4", "lfm2", "gpt-4o"])
def test_tokenizer_encodes_like_the_hf_tokenizer(tmp_path, pre):
    hf = hf_checkpoint("olmoe", tmp_path / "hf")
    if pre == "qwen2":
        _qwen2_style_tokenizer(hf)
    if pre in ("llama-bpe", "glm4", "lfm2"):
        _llama3_style_tokenizer(hf)
    if pre == "gpt-4o":
        _o200k_style_tokenizer(hf)
    write_gguf(hf, tmp_path / "m.gguf", pre=pre)
    out = tmp_path / "files"
    out.mkdir()
    GGUFCheckpoint(tmp_path / "m.gguf").write_files(out)
    ours, theirs = Tokenizer(out), Tokenizer(hf)
    for text in TEXTS:
        ids = theirs.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == theirs.decode(ids)
    assert ours.eos_token == "<|end|>"
    msgs = [{"role": "user", "content": "hi"}]
    assert ours.encode_chat(msgs) == theirs.encode_chat(msgs)


def test_generate_and_convert_gguf_cli(q8, tmp_path, capsys):
    """`generate -m x.gguf` converts once into the cache and gives the store's greedy tokens."""
    _, path, _, store = q8("qwen2_moe")
    args = ["generate", "-p", "def fib", "-n", "6", "--ignore-eos", "--kernel", "ref"]
    assert main([*args, "-m", str(store)]) == 0
    want = capsys.readouterr().out
    assert main([*args, "-m", str(path)]) == 0
    first = capsys.readouterr()
    assert first.out == want and "converting" in first.err and "int8 store" in first.err
    assert main([*args, "-m", str(path)]) == 0
    again = capsys.readouterr()
    assert again.out == want and "converting" not in again.err  # cached
    assert main(["convert", str(path), str(tmp_path / "s")]) == 0
    assert Store(tmp_path / "s").scheme.name == "int8"


def test_split_gguf_reads_every_part(tmp_path):
    hf = hf_checkpoint("olmoe", tmp_path / "hf")
    whole = tmp_path / "whole.gguf"
    write_gguf(hf, whole, {layer: Q8 for layer in range(3)})
    # Re-write the same tensors and metadata as three parts with the gguf package's splitter.
    rewrite_gguf(whole, tmp_path / "m.gguf", "olmoe", split_max_tensors=20)
    parts = sorted(tmp_path.glob("m-*-of-*.gguf"))
    assert len(parts) > 1
    a = convert(whole, tmp_path / "a", source_scheme(whole, None), False)
    b = convert(parts[0], tmp_path / "b", source_scheme(parts[0], None), False)
    assert torch.equal(our_logits(a), our_logits(b))
    parts[-1].unlink()
    assert main(["convert", str(parts[0]), str(tmp_path / "c")]) == 2


def test_streaming_a_gguf_store_gives_the_resident_bits(q8):
    _, _, _, store = q8("qwen3_moe")
    want = our_logits(store, StreamConfig(resident=True))
    got = our_logits(store, StreamConfig(memory_budget=min_budget(Store(store))))
    assert torch.equal(want, got)


# ---- bad input: one line naming the tensor or key, exit code 2 --------------------------------
def _convert_error(capsys, src, dst) -> str:
    capsys.readouterr()
    assert main(["convert", str(src), str(dst)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moestream: error:") and "Traceback" not in err
    return err


def test_truncated_gguf_names_the_tensor(q8, tmp_path, capsys):
    _, path, _, _ = q8("olmoe")
    cut = tmp_path / "cut.gguf"
    data = path.read_bytes()
    cut.write_bytes(data[: len(data) - 5000])
    err = _convert_error(capsys, cut, tmp_path / "s")
    assert "truncated" in err and "blk.2." in err
    cut.write_bytes(data[:100])  # inside the metadata
    assert "truncated or damaged" in _convert_error(capsys, cut, tmp_path / "s")


def test_unknown_architecture_names_it(tmp_path, capsys):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    err = _convert_error(capsys, tmp_path / "x.gguf", tmp_path / "s")
    assert "general.architecture 'gpt2' is not supported" in err and "qwen3moe" in err


def test_unsupported_tensor_type_names_the_tensor(q8, tmp_path, capsys):
    import gguf

    _, path, _, _ = q8("olmoe")
    r = gguf.GGUFReader(str(path))
    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "olmoe")
    for k, f in r.fields.items():
        if not k.startswith(("GGUF.", "general.architecture")):
            w.add_key_value(k, f.contents(), f.types[0], f.types[-1] if len(f.types) > 1 else None)
    for t in r.tensors:
        if t.name == "blk.1.ffn_up_exps.weight":  # Q8_1: no dequantizer anywhere
            n_bytes = t.data.shape[-1] * 40 // 34  # 40-byte blocks of 32
            w.add_tensor(
                t.name,
                np.zeros((*t.data.shape[:-1], n_bytes), np.uint8),
                raw_dtype=gguf.GGMLQuantizationType.Q8_1,
            )
        else:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    err = _convert_error(capsys, tmp_path / "x.gguf", tmp_path / "s")
    assert "'blk.1.ffn_up_exps.weight' has type Q8_1" in err


def test_vocabulary_that_does_not_match_the_embedding(tmp_path, capsys):
    hf = hf_checkpoint("olmoe", tmp_path / "hf")
    cfg = json.loads((hf / "config.json").read_text())
    cfg["vocab_size"] = 300  # the GGUF's token list is padded to this, the embedding has 320
    (hf / "config.json").write_text(json.dumps(cfg))
    write_gguf(hf, tmp_path / "m.gguf")
    err = _convert_error(capsys, tmp_path / "m.gguf", tmp_path / "s")
    assert "tokenizer.ggml.tokens has 300 tokens but token_embd.weight has 320 rows" in err


def test_missing_metadata_key_is_named(tmp_path, capsys):
    hf = hf_checkpoint("olmoe", tmp_path / "hf")
    write_gguf(hf, tmp_path / "m.gguf", skip_key="expert_used_count")
    err = _convert_error(capsys, tmp_path / "m.gguf", tmp_path / "s")
    assert "'olmoe.expert_used_count' is missing" in err


def test_glm4_dense_layers_that_disagree_with_the_metadata(tmp_path, capsys):
    hf = hf_checkpoint("glm4_moe", tmp_path / "hf")
    cfg = json.loads((hf / "config.json").read_text())
    cfg["first_k_dense_replace"] = 2  # written as leading_dense_block_count; layer 1 has experts
    (hf / "config.json").write_text(json.dumps(cfg))
    write_gguf(hf, tmp_path / "m.gguf")
    err = _convert_error(capsys, tmp_path / "m.gguf", tmp_path / "s")
    assert "layers [0] have no experts, but glm4moe.leading_dense_block_count is 2" in err


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_5_moe_text"])
def test_q8_0_dense_of_rewritten_tensors(tmp_path, arch, capsys):
    """Dense Q8_0 where llama.cpp's converter rewrote tensors: deepseek2's kv_b_proj, written as
    attn_k_b + attn_v_b, and qwen35moe's tiled value heads. Rows reordered whole keep their
    blocks exactly (in_proj_qkv, in_proj_z); columns reordered inside blocks (out_proj) and the
    rejoined kv_b are dequantized; the logits are transformers' on the stored values."""
    hf = hf_checkpoint(arch, tmp_path / "hf")
    path = tmp_path / "m.gguf"
    stored = write_gguf(hf, path, {layer: Q8 for layer in range(3)}, dense_type="Q8_0")
    store = convert(path, tmp_path / "store", source_scheme(path, None), False)
    s = Store(store)
    if arch == "deepseek_v3":
        assert s.dense_scheme("model.layers.1.self_attn.kv_b_proj.weight") is None
        kept = ["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"]
    else:
        assert s.dense_scheme("model.layers.0.linear_attn.out_proj.weight") is None
        kept = [f"model.layers.0.linear_attn.in_proj_{p}.weight" for p in ("qkv", "z")]
    for name in kept:
        assert s.dense_scheme(name).name == "int8", name
        sec = {f"w.{k}": v for k, v in s.dense_sections(name).items()}
        assert torch.equal(dequantize(sec, "w", 32, torch.float32), stored[name])
    want = hf_logits(hf, stored, tmp_path)
    assert (want - our_logits(store)).abs().max().item() < FP32_TOL


def test_deepseek2_without_sigmoid_gating_is_refused(tmp_path, capsys):
    """No expert_gating_func: llama.cpp routes a deepseek2 file with softmax (DeepSeek-V2's);
    moestream's deepseek_v3 routes with sigmoid, so it refuses instead of running other math."""
    hf = hf_checkpoint("deepseek_v3", tmp_path / "hf")
    write_gguf(hf, tmp_path / "m.gguf", skip_key="expert_gating_func")
    err = _convert_error(capsys, tmp_path / "m.gguf", tmp_path / "s")
    assert "deepseek2.expert_gating_func is absent: llama.cpp reads 1" in err
    assert "needs deepseek2.expert_gating_func = 2" in err


def _without_tensor(src, dst, drop: str) -> None:
    """src's metadata and tensors, one tensor left out, as dst."""
    import gguf

    r = gguf.GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    for k, f in r.fields.items():
        if not k.startswith(("GGUF.", "general.architecture")):
            w.add_key_value(k, f.contents(), f.types[0], f.types[-1] if len(f.types) > 1 else None)
    for t in r.tensors:
        if t.name != drop:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_deepseek2_half_of_kv_b_missing_names_it(q8, tmp_path, capsys):
    _, path, _, _ = q8("deepseek_v3")
    _without_tensor(path, tmp_path / "x.gguf", "blk.2.attn_v_b.weight")
    err = _convert_error(capsys, tmp_path / "x.gguf", tmp_path / "s")
    assert "'blk.2.attn_k_b.weight' has no 'blk.2.attn_v_b.weight' beside it" in err


def test_qwen35moe_ssm_key_missing_is_named(tmp_path, capsys):
    hf = hf_checkpoint("qwen3_5_moe_text", tmp_path / "hf")
    write_gguf(hf, tmp_path / "m.gguf", skip_key="ssm_time_step_rank")
    err = _convert_error(capsys, tmp_path / "m.gguf", tmp_path / "s")
    assert "'qwen35moe.ssm.time_step_rank' is missing" in err


@pytest.mark.parametrize(
    "sections, left", [([2, 0, 0], [1]), ([1, 0, 1], [1]), ([0, 1, 0], [0, 1]), ([1, 1, 0], [])]
)
def test_qwen35moe_mrope_pair_without_a_text_position_is_refused(tmp_path, capsys, sections, left):
    """2 rotary pairs under llama.cpp's interleaved mrope: pair i's sector i % sum(sections) is
    temporal / height / width by sector % 3 where that section is large enough ([0, 1, 0]: both
    pairs are sector 0, temporal, of size 0); else the 4th position, which llama.cpp holds at 0
    for text (never rotated there, where transformers rotates it): refused, naming the pairs."""
    rope = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                mrope_section=sections)  # fmt: skip
    hf = hf_checkpoint("qwen3_5_moe_text", tmp_path / "hf", rope_parameters=rope)
    write_gguf(hf, tmp_path / "m.gguf")
    if not left:
        assert main(["convert", str(tmp_path / "m.gguf"), str(tmp_path / "s")]) == 0
        return
    err = _convert_error(capsys, tmp_path / "m.gguf", tmp_path / "s")
    assert f"rope.dimension_sections {sections + [0]} leaves rotary pair(s) {left} of 2" in err


# ---- gpt-oss ------------------------------------------------------------------------------------
def test_gpt_oss_records_hold_the_file_values_and_biases(q8):
    """Q8_0 experts kept as int8 exactly, each record's fp32 b13 / b2 the file's F32 biases
    (ffn_{gate,up,down}_exps.bias), and on the native layer op (biases and the clamped SwiGLU
    inside it) streaming at the minimum budget gives the resident bits, within the Q8_0 activations' rounding of the torch spec
    (kernel "ref")."""
    _, _, stored, store = q8("gpt_oss")
    s = Store(store)
    _gpt_oss_records_are(s, stored)
    loaded = load_model(store, StreamConfig(resident=True))
    biases, act = loaded.provider.native_extras()  # what the layer op and the one-call step take
    assert loaded.provider.native and biases is not None and act is not None
    loaded.provider.close()
    want = our_logits(store, StreamConfig(resident=True))
    assert torch.equal(want, our_logits(store, StreamConfig(memory_budget=min_budget(s))))
    spec = our_logits(store)  # (2.8% measured on the clamp-heavy tiny model)
    assert (want - spec).abs().max().item() < 0.05 * spec.abs().max().item()
    with pytest.raises(ConfigError, match=r"biases and the clamped SwiGLU.*--device cpu"):
        load_model(store, GpuConfig(resident=True, kernel="ref", device="cpu"))  # (exit 2)


def _gpt_oss_records_are(s, stored: dict) -> None:
    """Every record of gpt-oss store `s` dequantizes (fp32) to `stored`'s fused HF tensors."""
    for layer in s.args.moe_layer_ids:
        pre = f"model.layers.{layer}.mlp.experts"
        gate_up = stored[f"{pre}.gate_up_proj"].transpose(1, 2)  # [E, 2I, D], interleaved
        down, b13, b2 = (stored[f"{pre}.{k}"] for k in ("down_proj", "gate_up_proj_bias",
                                                         "down_proj_bias"))  # fmt: skip
        layout = s.layouts[layer]
        for e in range(s.args.num_experts):
            buf = torch.frombuffer(bytearray(s.read_record(layer, e)), dtype=torch.uint8)
            sec = layout.views(buf)
            w13 = dequantize(sec, "w13", layout.groups[0], torch.float32)
            assert torch.equal(w13, torch.cat([gate_up[e, ::2], gate_up[e, 1::2]]))
            assert torch.equal(dequantize(sec, "w2", layout.groups[1], torch.float32), down[e].T)
            assert torch.equal(sec["b13"], torch.cat([b13[e, ::2], b13[e, 1::2]]))
            assert torch.equal(sec["b2"], b2[e])


def test_gpt_oss_mxfp4_experts_are_kept_exactly(tmp_path, capsys):
    """MXFP4 experts (what gpt-oss files hold) are kept by default as mxfp4, their blocks byte for
    byte (4.25 bits a weight), said so: the records are the file's values bit for bit, the logits
    within 1e-4 of transformers on them; on the native layer op streaming at the minimum budget
    gives the resident bits, within the Q8_0 activations' rounding of the spec. `--quant int8`
    keeps them exactly too (q = 2x the e2m1 value, s = half the e8m0 scale: what the GPU and
    the dense kernels read), in 9 bits a weight; `--quant int4` requantizes (said lossy): the
    int4 store of a Hugging Face folder holding the file's values, bit for bit; `--quant bf16`
    holds every MXFP4 value too (said exact)."""
    import shutil

    from safetensors.torch import save_file

    from moestream.quant import DenseQuant, make_scheme

    hf = hf_checkpoint("gpt_oss", tmp_path / "hf")
    path = tmp_path / "m.gguf"
    stored = write_gguf(hf, path, {layer: ("MXFP4",) * 3 for layer in range(3)})
    capsys.readouterr()
    store = convert(path, tmp_path / "store", source_scheme(path, None), False)
    err = capsys.readouterr().err
    assert "9 MXFP4 expert tensor(s): kept exactly as mxfp4 (same values)" in err
    s = Store(store)
    assert s.scheme.name == "mxfp4" and s.manifest["version"] == MIXED_VERSION
    _gpt_oss_records_are(s, stored)
    want = hf_logits(hf, stored, tmp_path)
    assert (want - our_logits(store)).abs().max().item() < FP32_TOL
    resident = our_logits(store, StreamConfig(resident=True))  # the native layer op
    assert torch.equal(resident, our_logits(store, StreamConfig(memory_budget=min_budget(s))))
    assert (resident - want).abs().max().item() < 0.05 * want.abs().max().item()
    int8 = convert(path, tmp_path / "int8", make_scheme("int8"), False)
    assert "9 MXFP4 expert tensor(s): kept exactly as int8 (same values)" in capsys.readouterr().err
    _gpt_oss_records_are(Store(int8), stored)
    sizes = [Store(x).layouts[0].size for x in (store, int8)]
    assert sizes[0] < 0.6 * sizes[1], sizes  # 17 bytes a block of 32 against 36
    int4 = convert(path, tmp_path / "int4", make_scheme("int4"), False, DenseQuant())
    err = capsys.readouterr().err
    assert "9 MXFP4 expert tensor(s): dequantized and requantized to int4 g32 (lossy" in err
    folder = tmp_path / "values"
    shutil.copytree(hf, folder)
    save_file(stored, str(folder / "model.safetensors"), metadata={"format": "pt"})
    theirs = convert(folder, tmp_path / "hf-store", make_scheme("int4"), False, DenseQuant())
    assert torch.equal(our_logits(int4), our_logits(theirs))
    bf16 = convert(path, tmp_path / "bf16", make_scheme("bf16"), False)
    assert "9 MXFP4 expert tensor(s): dequantized into bf16 (exact" in capsys.readouterr().err
    _gpt_oss_records_are(Store(bf16), stored)


def _gpt_oss_error(q8, tmp_path, capsys, drop: str) -> str:
    _, path, _, _ = q8("gpt_oss")
    _without_tensor(path, tmp_path / "x.gguf", drop)
    return _convert_error(capsys, tmp_path / "x.gguf", tmp_path / "s")


@pytest.mark.parametrize(
    "drop", ["blk.1.attn_sinks.weight", "blk.2.ffn_down_exps.bias", "blk.0.ffn_gate_inp.bias"]
)
def test_gpt_oss_missing_sinks_or_bias_names_it(q8, tmp_path, capsys, drop):
    err = _gpt_oss_error(q8, tmp_path, capsys, drop)
    assert f"tensor {drop!r} is missing (gpt-oss layers need it)" in err
    assert len(err.strip().splitlines()) == 1


def test_gpt_oss_missing_sliding_window_is_named(tmp_path, capsys):
    hf = hf_checkpoint("gpt_oss", tmp_path / "hf")
    write_gguf(hf, tmp_path / "m.gguf", skip_key="sliding_window")
    err = _convert_error(capsys, tmp_path / "m.gguf", tmp_path / "s")
    assert "'gpt-oss.attention.sliding_window' is missing" in err
