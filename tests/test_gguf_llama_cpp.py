"""GGUF files written by llama.cpp's own converter (convert_hf_to_gguf.py) from tiny random
checkpoints: moestream's logits on the GGUF-derived store match transformers on the same
(dequantized) weights. Skipped where llama.cpp's source is absent (it is not in CI): set
MOESTREAM_LLAMA_CPP to a folder holding src/convert_hf_to_gguf.py and venv/ (see
../shared/peers/README.md), or keep it at .cache/peers/llama in the checkout."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from gguf_models import GGUF_ARCH, expert_name
from test_gguf import FP32_TOL, hf_checkpoint, hf_logits, our_logits
from tiny_models import perturbed_model, save

from moestream.convert.writer import convert, source_scheme
from moestream.quant import make_scheme
from moestream.store.format import Store

LLAMA = Path(
    os.environ.get("MOESTREAM_LLAMA_CPP", Path(__file__).parents[1] / ".cache/peers/llama")
)
CONVERTER, PYTHON = LLAMA / "src/convert_hf_to_gguf.py", LLAMA / "venv/bin/python"
pytestmark = pytest.mark.skipif(
    not (CONVERTER.is_file() and PYTHON.is_file()), reason=f"llama.cpp not at {LLAMA}"
)


def tiny(arch: str, folder: Path) -> Path:
    if arch != "olmoe":
        return hf_checkpoint(arch, folder)
    # llama.cpp's OLMoE converter writes rms eps 1e-5 whatever the config says and drops clip_qkv.
    return save(
        perturbed_model(arch, seed=2, rms_norm_eps=1e-5, clip_qkv=None), folder, "per_expert"
    )


def llama_convert(hf: Path, out: Path, outtype: str) -> Path:
    cmd = [str(PYTHON), str(CONVERTER), str(hf), "--outtype", outtype, "--outfile", str(out)]
    subprocess.run(cmd, check=True, capture_output=True)
    return out


def dequantized_state(path: Path, hf: Path) -> dict[str, torch.Tensor]:
    """HF name -> the GGUF's values, each HF name found through the gguf package's own tensor
    map and llama.cpp's Q/K permutation undone, independently of moestream's reader."""
    import gguf
    from safetensors import safe_open

    r = gguf.GGUFReader(str(path))
    tensors = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in r.tensors}
    meta = {k: f.contents() for k, f in r.fields.items()}
    arch = meta["general.architecture"]
    model_type = {v: k for k, v in GGUF_ARCH.items()}[arch]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], meta[f"{arch}.block_count"])
    out = {}
    for name, w in tensors.items():
        if "_exps." in name:  # blk.L.ffn_{gate,up,down}_exps.weight: [E, N, K]
            layer, role = int(name.split(".")[1]), name.split(".")[2][4:-5]
            for e in range(w.shape[0]):
                out[expert_name(model_type, layer, e, role)] = torch.tensor(w[e])
    with safe_open(str(hf / "model.safetensors"), "pt") as f:
        dense = [k for k in f.keys() if ".experts." not in k]
    for key in dense:
        w = tensors[names.get_name(key, try_suffixes=(".weight", ".bias"))]
        if model_type == "mixtral" and key.endswith(("q_proj.weight", "k_proj.weight")):
            kv = "head_count" if "q_proj" in key else "head_count_kv"
            n = meta[f"{arch}.attention.{kv}"]
            w = w.reshape(n, w.shape[0] // n // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)
        out[key] = torch.tensor(w)
    return out


@pytest.mark.parametrize(
    "arch,outtype",
    [(a, "q8_0") for a in ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral")]
    + [("qwen3_moe", "f32"), ("mixtral", "f32")],
)
def test_llama_cpp_gguf_matches_transformers(tmp_path, arch, outtype):
    hf = tiny(arch, tmp_path / "hf")
    path = llama_convert(hf, tmp_path / "m.gguf", outtype)
    store = convert(path, tmp_path / "store", source_scheme(path, None), False)
    assert Store(store).scheme.name == "int8"
    got = our_logits(store)
    if outtype == "f32":
        # The same fp32 weights through the same int8 quantizer: the GGUF-derived store runs
        # the bits of the store converted from the Hugging Face folder itself.
        want = our_logits(convert(hf, tmp_path / "hf-store", make_scheme("int8"), False))
        assert torch.equal(want, got)
        return
    # q8_0: transformers runs the GGUF's values (the store holds them exactly).
    stored = dequantized_state(path, hf)
    want = hf_logits(hf, stored, tmp_path)
    assert (want - got).abs().max().item() < FP32_TOL
