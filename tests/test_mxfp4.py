"""gpt_oss hub checkpoints: MXFP4 experts (`*_blocks` + `*_scales`) dequantized exactly as
transformers does, a whole MXFP4 checkpoint loading and converting like its dequantized twin, and
the hub config.json read like transformers reads it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from gen_gpt_oss import HUB_CONFIG
from safetensors.torch import load_file, save_file
from test_parity import PROMPT

from moestream.convert.hf import CheckpointError, HFCheckpoint
from moestream.convert.mxfp4 import Mxfp4Error, dequantize_mxfp4
from moestream.engine.kv_cache import KVCache
from moestream.loader import load_model


def _random_mxfp4(shape, seed: int, exps=(118, 136)):
    """blocks uint8 [*shape, 16] (every byte value likely) and scales uint8 [*shape]."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(*exps, shape, dtype=torch.uint8, generator=g)
    return blocks, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_matches_transformers(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _random_mxfp4((3, 10, 4), seed=0, exps=(100, 160))
    blocks[0, 0, 0] = torch.arange(16, dtype=torch.uint8) * 17  # both nibbles: every code
    want = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, in, out]
    got = dequantize_mxfp4(blocks, scales)  # [E, out, in] fp32
    assert got.dtype == torch.float32 and got.shape == (3, 10, 128)
    assert torch.equal(got.transpose(1, 2).to(dtype), want)
    if dtype == torch.float32:  # every FP4 value times 2^k is exact in fp32
        assert torch.equal(got.transpose(1, 2), want)
    # One expert's slice (what the checkpoint reader dequantizes) equals its part of the whole.
    assert torch.equal(dequantize_mxfp4(blocks[1], scales[1]), got[1])


def test_dequantize_rejects_mismatched_tensors():
    blocks, scales = _random_mxfp4((2, 4), seed=1)
    with pytest.raises(Mxfp4Error, match="do not match"):
        dequantize_mxfp4(blocks, scales[:, :3])
    with pytest.raises(Mxfp4Error, match="uint8"):
        dequantize_mxfp4(blocks.to(torch.int32), scales)


def _mxfp4_twins(tiny_dir, tmp_path, exps=(118, 136)):
    """(dense, mxfp4): the tiny gpt_oss checkpoint with random MXFP4 experts, stored once
    dequantized by transformers (bf16 values, exact in fp32) and once as blocks + scales."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    src = tiny_dir("gpt_oss", "fused")
    dense, quant = tmp_path / "dense", tmp_path / "mxfp4"
    shutil.copytree(src, dense)
    shutil.copytree(src, quant)
    (shard,) = dense.glob("*.safetensors")
    tensors = load_file(str(shard))
    qtensors = dict(tensors)
    for i, name in enumerate(n for n in tensors if n.endswith(("gate_up_proj", "down_proj"))):
        E, n_in, n_out = tensors[name].shape
        blocks, scales = _random_mxfp4((E, n_out, n_in // 32), seed=10 + i, exps=exps)
        tensors[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        del qtensors[name]
        qtensors[f"{name}_blocks"], qtensors[f"{name}_scales"] = blocks, scales
    save_file(tensors, str(shard), metadata={"format": "pt"})
    save_file(qtensors, str(quant / shard.name), metadata={"format": "pt"})
    config = json.loads((quant / "config.json").read_text())
    config["quantization_config"] = HUB_CONFIG["quantization_config"]  # as on the hub
    (quant / "config.json").write_text(json.dumps(config))
    return dense, quant


def test_mxfp4_checkpoint_loads_like_its_dequantized_twin(tiny_dir, tmp_path):
    """Ours on the MXFP4 folder == ours on the dequantized twin (bit for bit), and within 1e-4
    of transformers loading the MXFP4 folder itself (its CPU path dequantizes on load)."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    dense, quant = _mxfp4_twins(tiny_dir, tmp_path)
    ckpt = HFCheckpoint(quant)
    assert not [n for n in ckpt.dense_names if "experts" in n]
    want, got = load_model(dense), load_model(quant)
    ref = AutoModelForCausalLM.from_pretrained(
        quant,
        dtype=torch.float32,
        attn_implementation="eager",
        quantization_config=Mxfp4Config(dequantize=True),
    ).eval()
    with torch.no_grad():
        a = want.model(PROMPT, KVCache(want.args, 64, torch.float32), 0)
        b = got.model(PROMPT, KVCache(got.args, 64, torch.float32), 0)
        theirs = ref(PROMPT[None]).logits[0]
    assert torch.equal(a, b)
    assert (theirs - b).abs().max().item() < 1e-4


def test_mxfp4_checkpoint_converts_to_the_same_store(tiny_dir, tmp_path):
    from moestream.convert.writer import convert
    from moestream.quant import make_scheme

    dense, quant = _mxfp4_twins(tiny_dir, tmp_path)
    stores = [
        convert(f, tmp_path / f"{f.name}-store", make_scheme("bf16"), False) for f in (dense, quant)
    ]
    m = [json.loads((s / "manifest.json").read_text()) for s in stores]
    assert m[0]["experts"] == m[1]["experts"]  # crc32 of every record: same bytes
    assert [s["name"] for s in m[1]["record"]["sections"]] == ["w13.q", "w2.q", "b13", "b2"]


def test_quant_mxfp4_keeps_the_hub_values(tiny_dir, tmp_path):
    """`convert --quant mxfp4` of a hub MXFP4 folder: every record holds the checkpoint's values
    (those of the bf16 store, which holds them all) in 17 bytes a block of 32, so the torch spec's
    logits are the bf16 store's bit for bit; the native layer op's are within the Q8_0
    activations' rounding of them (gpt-oss's clamped SwiGLU and biases inside it; scales of
    gpt-oss's size, weights <= 0.2: the default test exponents reach 2^9 and blow the activations
    up past what 8 bits resolve, int8's store included)."""
    from moestream.convert.writer import convert
    from moestream.experts.config import StreamConfig
    from moestream.kernels.ref import dequantize
    from moestream.quant import DenseQuant, make_scheme
    from moestream.store.format import Store

    _, quant = _mxfp4_twins(tiny_dir, tmp_path, exps=(114, 122))
    mx = convert(quant, tmp_path / "mx", make_scheme("mxfp4"), False, DenseQuant())
    bf = convert(quant, tmp_path / "bf", make_scheme("bf16"), False)
    a, b = Store(mx), Store(bf)
    assert a.scheme.name == "mxfp4" and a.layouts[0].size < b.layouts[0].size / 3
    for layer in a.args.moe_layer_ids:
        for e in range(a.args.num_experts):
            secs = [s.layouts[layer].views(torch.frombuffer(bytearray(s.read_record(layer, e)),
                                                            dtype=torch.uint8)) for s in (a, b)]  # fmt: skip
            for name in ("w13", "w2"):
                x, y = (dequantize(sec, name, 32, torch.float32) for sec in secs)
                assert torch.equal(x, y), (layer, e, name)

    def logits(store, cfg):
        loaded = load_model(store, cfg)
        with torch.no_grad():
            return loaded.model(PROMPT, KVCache(loaded.args, 64, torch.float32), 0)

    spec = logits(mx, StreamConfig(resident=True, kernel="ref"))
    assert torch.equal(spec, logits(bf, StreamConfig(resident=True, kernel="ref")))
    native = logits(mx, StreamConfig(resident=True))
    assert (native - spec).abs().max().item() < 0.002 * spec.abs().max().item()  # 2e-4 measured


def test_a_hub_mxfp4_folder_converts_to_mxfp4_by_default(tiny_dir, tmp_path):
    """`convert` of a hub MXFP4 folder without --quant (and -m with store flags, through the same
    source_scheme) writes mxfp4 experts and keeps the dense weights as the checkpoint holds them:
    nothing rounded, the torch spec's logits those of the bf16 store bit for bit, in about a
    quarter of its expert bytes; a bf16 folder still converts to bf16."""
    from moestream.cli import main
    from moestream.convert.writer import convert, source_scheme
    from moestream.experts.config import StreamConfig
    from moestream.quant import DenseQuant, make_dense, make_scheme
    from moestream.store.format import Store

    dense, quant = _mxfp4_twins(tiny_dir, tmp_path, exps=(114, 122))
    assert source_scheme(quant, None).scheme.name == "mxfp4"
    assert source_scheme(dense, None).scheme.name == "bf16"
    assert make_dense("auto", make_scheme("mxfp4")) == DenseQuant(keep_source=True)
    assert main(["convert", str(quant), str(tmp_path / "mx"), "-q"]) == 0
    bf = convert(quant, tmp_path / "bf", make_scheme("bf16"), False)
    a, b = Store(tmp_path / "mx"), Store(bf)
    assert a.scheme.name == "mxfp4" and not a.dense_formats
    assert a.layouts[0].size < b.layouts[0].size / 3

    def logits(store):
        loaded = load_model(store, StreamConfig(resident=True, kernel="ref"))
        with torch.no_grad():
            return loaded.model(PROMPT, KVCache(loaded.args, 64, torch.float32), 0)

    assert torch.equal(logits(tmp_path / "mx"), logits(bf))


def test_a_hub_mxfp4_folder_opens_through_an_mxfp4_store(tiny_dir, tmp_path):
    """-m of a hub MXFP4 folder without store flags converts it once into the cache (mxfp4
    experts, as a GGUF is), where loaded directly its experts would be fp32: the same logits
    as the explicit mxfp4 store's, on the native kernels, every expert resident."""
    from moestream.runtime import open_model

    _, quant = _mxfp4_twins(tiny_dir, tmp_path, exps=(114, 122))
    from moestream.store.format import Store

    with open_model(quant, progress=False) as rt:
        assert rt.folder != quant and Store(rt.folder).scheme.name == "mxfp4"
        with torch.no_grad():
            got = rt.model(PROMPT, KVCache(rt.args, 64, torch.float32), 0)
    loaded = load_model(rt.folder)
    with torch.no_grad():
        want = loaded.model(PROMPT, KVCache(loaded.args, 64, torch.float32), 0)
    assert torch.equal(got, want)


def test_mxfp4_missing_scales_is_an_error(tiny_dir, tmp_path):
    _, quant = _mxfp4_twins(tiny_dir, tmp_path)
    (shard,) = quant.glob("*.safetensors")
    tensors = load_file(str(shard))
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="layer 1: fused experts tensor 'down_proj'"):
        HFCheckpoint(quant)


# config.json of openai/gpt-oss-20b (24 layers alternate), less its quantization_config
GPT_OSS_20B = {k: v for k, v in HUB_CONFIG.items() if k != "quantization_config"}


@pytest.mark.parametrize("drop", [(), ("rope_scaling", "rope_theta", "layer_types")])
def test_hub_config_reads_like_transformers(drop):
    """The hub config (and one relying on transformers' defaults) gives the same windows, expert
    fields and yarn RoPE frequencies / attention scale as transformers derives."""
    import transformers as T
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from moestream.models import model_args_from_dict
    from moestream.models.layers import rope_inv_freq

    raw = {k: v for k, v in GPT_OSS_20B.items() if k not in drop}
    a = model_args_from_dict(raw)
    cfg = T.AutoConfig.for_model(**raw)
    want_windows = tuple(128 if t == "sliding_attention" else None for t in cfg.layer_types)
    assert a.sliding_windows == want_windows and a.sliding_windows[:2] == (128, None)
    assert (a.num_experts, a.num_experts_per_tok, a.moe_intermediate_size) == (32, 4, 2880)
    assert (a.swiglu_limit, a.swiglu_alpha) == (cfg.swiglu_limit, cfg.swiglu_alpha)
    assert a.expert_bias and a.attention_bias and all(a.moe_layers)
    want, want_scale = ROPE_INIT_FUNCTIONS[cfg.rope_parameters["rope_type"]](cfg, "cpu")
    got, got_scale = rope_inv_freq(a.rope, a.rotary_dim, a.max_position_embeddings)
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)
    assert got_scale == pytest.approx(want_scale)
