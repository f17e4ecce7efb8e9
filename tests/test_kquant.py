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
from moestream.store.format import VERSION, Store

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
    assert_records_are(s, stored, 256)
    for name, t in DENSE_K.items():
        assert s.dense_scheme(name) == make_scheme(t.lower())
        sec = {f"w.{k}": v for k, v in s.dense_sections(name).items()}
        assert torch.equal(dequantize(sec, "w", 256, torch.float32), stored[name])
    want = hf_logits(hf, stored, tmp_path)
    assert (want - our_logits(store)).abs().max().item() < FP32_TOL


def test_kquant_store_streams_the_resident_tokens_and_refuses_the_gpu(kq, capsys):
    """On the native K-quant kernels, greedy decoding streamed at the minimum budget gives the
    resident tokens (and the prompt's logits their bits); the GPU provider refuses the store by
    name with the fix."""
    from moestream.experts.config import GpuConfig

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
    with pytest.raises(ConfigError, match="q4_k experts, which have no GPU kernel.*--quant int4"):
        load_model(store, GpuConfig(resident=True, kernel="ref", device="cpu"))


def test_mixed_kquant_experts_are_requantized_and_kquant_refused(tmp_path, capsys):
    """A Q4_K_M-style file (Q4_K gate/up, Q6_K down) needs two schemes per record: requantized
    to int4 by default and said; `--quant q4_k` on it, or on a Hugging Face folder, is refused
    (exit 2, one line with the fix) before anything is written."""
    hf = save(perturbed_model("qwen3_moe", seed=2, **WIDE), tmp_path / "hf", "per_expert")
    path = tmp_path / "m.gguf"
    write_gguf(hf, path, {layer: ("Q4_K", "Q4_K", "Q6_K") for layer in range(3)})
    capsys.readouterr()
    assert main(["convert", str(path), str(tmp_path / "s")]) == 0
    err = capsys.readouterr().err
    assert Store(tmp_path / "s").scheme.name == "int4"
    assert "6 Q4_K expert tensor(s): dequantized and requantized to int4" in err
    assert "3 Q6_K expert tensor(s): dequantized and requantized to int4" in err
    for src in (path, hf):
        assert main(["convert", str(src), str(tmp_path / "k"), "--quant", "q4_k"]) == 2
        err = capsys.readouterr().err
        assert "does not quantize into q4_k" in err and "--quant int4" in err
        assert "Traceback" not in err and not (tmp_path / "k").exists()
