"""Tensors llama.cpp's converter writes fused on request: `--fuse-qkv` (attn_qkv: q, k, v rows,
and their biases; every architecture but deepseek2) and `--fuse-gate-up-exps` (ffn_gate_up_exps:
each expert's gate rows then up rows; qwen35moe among ours). A fused file converts into the same
store, byte for byte, as the file its parts came from: blocks kept exactly stay kept, the rest
requantized alike. test_gguf_llama_cpp.py runs the converter's own flags."""

from __future__ import annotations

import pytest
from gguf_models import GGUF_ARCH, fuse_gguf, rewrite_gguf, write_gguf
from safetensors.torch import load_file
from test_gguf import Q8, _convert_error, hf_checkpoint

from moestream.convert.writer import convert, source_scheme

# qwen2moe and gpt-oss: q/k/v biases; mixtral: permuted q/k rows; lfm2moe: conv layers between
# the attention ones; qwen35moe: q with its output gate, Gated DeltaNet layers whose own
# attn_qkv (in_proj_qkv) stays as it is
FUSED = {
    "qwen3_moe": ("Q8_0", Q8),
    "qwen2_moe": ("Q8_0", Q8),
    "mixtral": ("Q8_0", Q8),
    "lfm2_moe": ("Q8_0", Q8),
    "qwen3_5_moe_text": ("Q8_0", Q8),
    "gpt_oss": ("F32", Q8),
    "olmoe": ("F32", ("F32", "F32", "Q8_0")),  # gate|up requantized from F32, down kept
}


def _store_files(store) -> dict:
    out = {p.name: p.read_bytes() for p in sorted(store.glob("experts-L*.bin"))}
    out.update(load_file(str(store / "dense.safetensors")))
    return out


@pytest.mark.parametrize("arch", FUSED)
def test_fused_file_converts_to_the_same_store(arch, tmp_path, capsys):
    dense, experts = FUSED[arch]
    hf = hf_checkpoint(arch, tmp_path / "hf")
    plain, fused = tmp_path / "plain.gguf", tmp_path / "fused.gguf"
    write_gguf(hf, plain, {layer: experts for layer in range(3)}, dense_type=dense)
    fuse_gguf(plain, fused, GGUF_ARCH[arch])
    import gguf

    names = {t.name for t in gguf.GGUFReader(str(fused)).tensors}
    assert any(n.endswith("ffn_gate_up_exps.weight") for n in names)
    assert not any(n.endswith(("ffn_gate_exps.weight", "attn_q.weight")) for n in names)
    stores = [convert(p, tmp_path / p.stem, source_scheme(p, None), False) for p in (plain, fused)]
    a, b = (_store_files(s) for s in stores)
    assert a.keys() == b.keys()
    for k in a:
        assert (a[k] == b[k]) if isinstance(a[k], bytes) else a[k].equal(b[k]), k
    assert "q_proj" in " ".join(a)


def test_fused_qkv_of_the_wrong_size_is_named(tmp_path, capsys):
    hf = hf_checkpoint("qwen3_moe", tmp_path / "hf")
    write_gguf(hf, tmp_path / "plain.gguf", {layer: Q8 for layer in range(3)})
    fuse_gguf(tmp_path / "plain.gguf", tmp_path / "fused.gguf", "qwen3moe")
    bad = tmp_path / "bad.gguf"
    rewrite_gguf(tmp_path / "fused.gguf", bad, "qwen3moe", {"qwen3moe.attention.head_count_kv": 1})
    err = _convert_error(capsys, bad, tmp_path / "s")
    assert "tensor 'blk.0.attn_qkv.weight' has" in err and "q, k and v" in err
