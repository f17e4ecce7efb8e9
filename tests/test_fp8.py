"""FP8 block-scaled checkpoints (DeepSeek-V3 hub format): our dequantization against transformers'
own (`integrations/finegrained_fp8.py`, pure torch, runs on CPU), and a quantized tiny
checkpoint loaded end to end against transformers on the same dequantized weights."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import VOCAB

from moestream.convert.fp8 import Fp8Error, dequantize_fp8
from moestream.convert.hf import CheckpointError, HFCheckpoint
from moestream.engine.kv_cache import KVCache
from moestream.loader import load_model

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


def random_fp8(shape, block, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(shape, generator=g) * 100).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    grid = (*shape[:-2], math.ceil(shape[-2] / block[0]), math.ceil(shape[-1] / block[1]))
    return q, torch.rand(grid, generator=g) * 1e-2 + 1e-4


@pytest.mark.parametrize(
    "shape",
    [
        (256, 384),
        (576, 7168 // 16),
        (300, 200),
        (2, 130, 260),
    ],  # divisible, kv_a-like, ragged, experts
)
def test_dequantize_matches_transformers(shape):
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    block = (128, 128)
    q, s = random_fp8(shape, block)
    want = _dequantize_fp8_weight(q, s, list(block), torch.float32)
    torch.testing.assert_close(dequantize_fp8(q, s, block), want, rtol=0, atol=0)


def test_dequantize_matches_transformers_loader_op():
    """The op transformers runs when loading FP8 checkpoints with dequantize=True."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    q, s = random_fp8((384, 256), (128, 128), seed=1)
    want = Fp8Dequantize(None)._dequantize_one(q, s, output_dtype=torch.float32)
    torch.testing.assert_close(dequantize_fp8(q, s, (128, 128)), want, rtol=0, atol=0)


def test_dequantize_is_blockwise():
    """Rows 0-1 / 2 and cols 0-2 / 3-4 take their own block's scale (ragged edge blocks)."""
    q = torch.ones(3, 5).to(FP8)
    s = torch.tensor([[2.0, 3.0], [5.0, 7.0]])
    want = torch.tensor([[2.0, 2, 2, 3, 3]] * 2 + [[5.0, 5, 5, 7, 7]])
    assert torch.equal(dequantize_fp8(q, s, (2, 3)), want)
    with pytest.raises(Fp8Error, match="does not match"):
        dequantize_fp8(q, s[:1], (2, 3))


BLOCK = (16, 16)


def _quantize(w: torch.Tensor):
    """Per-block amax/448 scales, as DeepSeek's and transformers' quantizers do."""
    rows, cols = w.shape[-2:]
    gr, gc = math.ceil(rows / BLOCK[0]), math.ceil(cols / BLOCK[1])
    pad = torch.zeros(*w.shape[:-2], gr * BLOCK[0], gc * BLOCK[1])
    pad[..., :rows, :cols] = w
    amax = pad.unflatten(-1, (gc, BLOCK[1])).unflatten(-3, (gr, BLOCK[0])).abs().amax(dim=(-3, -1))
    s = (amax / FP8_MAX).clamp(min=1e-12)  # [..., gr, gc]
    full = s.repeat_interleave(BLOCK[0], -2)[..., :rows, :].repeat_interleave(BLOCK[1], -1)[
        ..., :cols
    ]
    return (w / full).to(FP8), s.float()


def _fp8_pair(src, tmp_path, layout):
    """(FP8 checkpoint folder, the same weights dequantized by transformers in a plain folder)."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    quant, plain = tmp_path / "fp8", tmp_path / "plain"
    for d in (quant, plain):
        shutil.copytree(src, d)
    tensors = load_file(str(src / "model.safetensors"))
    q_out, p_out = {}, {}
    for name, w in tensors.items():
        skip = w.ndim < 2 or "embed_tokens" in name or "lm_head" in name or "mlp.gate." in name
        if skip:
            q_out[name] = p_out[name] = w
            continue
        q, s = _quantize(w)
        q_out[name], q_out[name + "_scale_inv"] = q, s  # `X.weight_scale_inv` / `X_scale_inv`
        p_out[name] = _dequantize_fp8_weight(q, s, list(BLOCK), torch.float32)
    save_file(q_out, str(quant / "model.safetensors"))
    save_file(p_out, str(plain / "model.safetensors"))
    cfg = json.loads((quant / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(BLOCK),
    }
    (quant / "config.json").write_text(json.dumps(cfg))
    return quant, plain


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_fp8_checkpoint_matches_transformers(tiny_dir, tmp_path, layout):
    from test_parity import PROMPT, hf_load

    quant, plain = _fp8_pair(tiny_dir("deepseek_v3", layout), tmp_path, layout)
    ckpt = HFCheckpoint(quant)
    assert not [n for n in ckpt.dense_names if n.endswith("_scale_inv")]
    assert len(ckpt._scale_of) > 20
    ref = hf_load(plain)
    ours = load_model(quant)
    with torch.no_grad():
        want = ref(PROMPT[None]).logits[0]
        got = ours.model(PROMPT, KVCache(ours.args, 64, torch.float32), 0)
        # The quantization error itself is visible: FP8 weights are not the originals.
        orig = load_model(tiny_dir("deepseek_v3", layout)).model(
            PROMPT, KVCache(ours.args, 64, torch.float32), 0
        )
    assert (want - got).abs().max().item() < 1e-4
    assert (orig - got).abs().max().item() > 1e-3
    assert got.shape[-1] == VOCAB


def test_fp8_scale_errors(tiny_dir, tmp_path):
    quant, _ = _fp8_pair(tiny_dir("deepseek_v3", "per_expert"), tmp_path, "per_expert")
    cfg = json.loads((quant / "config.json").read_text())
    del cfg["quantization_config"]
    (quant / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="no quantization_config"):
        HFCheckpoint(quant)
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [16, 16]}
    (quant / "config.json").write_text(json.dumps(cfg))
    save_file(
        {"model.layers.0.nothing.weight_scale_inv": torch.ones(1, 1)}, str(quant / "x.safetensors")
    )
    with pytest.raises(CheckpointError, match="has no weight"):
        HFCheckpoint(quant)


def test_fp8_weight_without_scale_is_an_error(tiny_dir, tmp_path):
    quant, _ = _fp8_pair(tiny_dir("deepseek_v3", "per_expert"), tmp_path, "per_expert")
    tensors = load_file(str(quant / "model.safetensors"))
    del tensors["model.layers.0.mlp.down_proj.weight_scale_inv"]
    save_file(tensors, str(quant / "model.safetensors"))
    with pytest.raises(CheckpointError, match="is FP8 but has no"):
        load_model(quant)
