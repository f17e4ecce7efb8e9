"""GGUF files written by llama.cpp's own converter (convert_hf_to_gguf.py) from tiny random
checkpoints, and quantized by its llama-quantize: moestream's logits on the GGUF-derived store
match transformers on the same (dequantized) weights (Q8_0, Q4_0, Q4_1, Q5_0, the K-quants and
Q4_K_M's mix of them: kept exactly), greedy tokens equal llama-completion's
on the reference model by the margin rule, llama-perplexity's distributions on f32 files of the
newer architectures (and qwen35moe's one known difference, mrope sections that leave a pair
unrotated in llama.cpp), and a SentencePiece vocabulary encodes to llama-completion's prompt ids. Skipped where llama.cpp is absent (it is not in CI):
set MOESTREAM_LLAMA_CPP to a folder holding src/convert_hf_to_gguf.py, venv/ and build/bin/ (see
../shared/peers/README.md), or keep it at .cache/peers/llama in the checkout."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_models import GGUF_ARCH, expert_name, gguf_arch, gguf_key
from test_gguf import FP32_TOL, hf_checkpoint, hf_logits, our_logits
from tiny_models import perturbed_model, save

from moestream.convert.writer import convert, source_scheme
from moestream.kernels.ref import dequantize
from moestream.quant import make_scheme
from moestream.store.format import Store

LLAMA = Path(
    os.environ.get("MOESTREAM_LLAMA_CPP", Path(__file__).parents[1] / ".cache/peers/llama")
)
CONVERTER, PYTHON = LLAMA / "src/convert_hf_to_gguf.py", LLAMA / "venv/bin/python"
QUANTIZE, COMPLETION = LLAMA / "build/bin/llama-quantize", LLAMA / "build/bin/llama-completion"
pytestmark = pytest.mark.skipif(
    not (CONVERTER.is_file() and PYTHON.is_file()), reason=f"llama.cpp not at {LLAMA}"
)
needs_build = pytest.mark.skipif(
    not (QUANTIZE.is_file() and COMPLETION.is_file()), reason=f"llama.cpp not built in {LLAMA}"
)


GLM_SPECIALS = ["[gMASK]", "<|endoftext|>", "<|observation|>"]  # llama.cpp's GLM vocab reads them


def tiny(arch: str, folder: Path, **over) -> Path:
    if arch == "glm4_moe":
        # llama.cpp's GLM vocabulary needs GLM's special tokens: three more ids after the tiny
        # tokenizer's (it already has <|user|>), and an embedding that holds them.
        from tiny_models import VOCAB
        from tokenizers import Tokenizer

        model = perturbed_model(arch, seed=2, vocab_size=VOCAB + len(GLM_SPECIALS), **over)
        hf = save(model, folder, "per_expert")
        tok = Tokenizer.from_file(str(hf / "tokenizer.json"))
        tok.add_special_tokens(GLM_SPECIALS)
        tok.save(str(hf / "tokenizer.json"))
        return hf
    if arch != "olmoe":
        return hf_checkpoint(arch, folder, **over)
    # llama.cpp's OLMoE converter writes rms eps 1e-5 whatever the config says and drops clip_qkv.
    return save(
        perturbed_model(arch, seed=2, rms_norm_eps=1e-5, clip_qkv=None), folder, "per_expert"
    )


def llama_convert(hf: Path, out: Path, outtype: str, *flags: str) -> Path:
    cmd = [str(PYTHON), str(CONVERTER), str(hf), "--outtype", outtype, "--outfile", str(out)]
    cmd += flags
    if json.loads((hf / "config.json").read_text())["model_type"].startswith("qwen3_5"):
        cmd.append("--no-mtp")  # its converter expects MTP layers otherwise (the tiny has none)
    subprocess.run(cmd, check=True, capture_output=True)
    return out


def llama_quantize(src: Path, out: Path, qtype: str) -> Path:
    subprocess.run([str(QUANTIZE), str(src), str(out), qtype], check=True, capture_output=True)
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
    names = gguf.get_tensor_name_map(gguf_arch(arch), meta[f"{arch}.block_count"])
    out = {}
    if arch == "gpt-oss":
        out.update(gpt_oss_experts(tensors, meta[f"{arch}.block_count"]))
    for name, w in tensors.items():
        if "_exps." in name and arch == "gpt-oss":
            continue
        if "_exps." in name:  # blk.L.ffn_{gate,up,down}_exps.weight: [E, N, K]
            layer, role = int(name.split(".")[1]), name.split(".")[2][4:-5]
            for e in range(w.shape[0]):
                out[expert_name(model_type, layer, e, role)] = torch.tensor(w[e])
    with safe_open(str(hf / "model.safetensors"), "pt") as f:
        dense = {k: f.get_slice(k).get_shape() for k in f.keys() if ".experts." not in k}
    for key, shape in dense.items():
        if arch == "deepseek2" and key.endswith("kv_b_proj.weight"):
            out[key] = joined_kv_b(tensors, key)
            continue
        w = tensors[names.get_name(gguf_key(key), try_suffixes=(".weight", ".bias"))]
        if arch == "qwen35moe":
            w = qwen35_hf_values(w, key, meta)
        w = w.reshape(shape)  # llama.cpp squeezes LFM2's depthwise conv [D, 1, L]
        if model_type == "mixtral" and key.endswith(("q_proj.weight", "k_proj.weight")):
            kv = "head_count" if "q_proj" in key else "head_count_kv"
            n = meta[f"{arch}.attention.{kv}"]
            w = w.reshape(n, w.shape[0] // n // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)
        out[key] = torch.tensor(w)
    return out


def gpt_oss_experts(tensors: dict, n_layers: int) -> dict[str, torch.Tensor]:
    """gpt-oss: the fused HF expert tensors (and biases) of every layer from the GGUF's."""
    from gguf_models import gpt_oss_fused

    out = {}
    for layer in range(n_layers):
        parts = [
            torch.tensor(tensors[f"blk.{layer}.ffn_{r}_exps.{p}"])
            for p in ("weight", "bias")
            for r in ("gate", "up", "down")
        ]
        out.update(gpt_oss_fused(layer, *parts))
    return out


def joined_kv_b(tensors: dict, key: str):
    """deepseek2: kv_b_proj [H * (nope + vd), r] from attn_k_b [H, r, nope], attn_v_b [H, vd, r]."""
    blk = f"blk.{key.split('.')[2]}"
    k_b, v_b = tensors[f"{blk}.attn_k_b.weight"], tensors[f"{blk}.attn_v_b.weight"]
    kv = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)
    return torch.tensor(kv.reshape(-1, kv.shape[-1]))


def qwen35_hf_values(w, key: str, meta: dict):
    """qwen35moe: the converter's 1 + w norms, -exp(A_log) and tiled value heads undone."""
    from gguf_models import SHIFTED_NORMS, v_heads_tiled

    if key.endswith(SHIFTED_NORMS) and ".linear_attn." not in key:
        w = w - 1.0
    if key.endswith("A_log"):
        w = np.log(-w)
    ssm = {k: meta[f"qwen35moe.ssm.{k}"] for k in ("group_count", "time_step_rank", "state_size")}
    dims = {
        "linear_num_key_heads": ssm["group_count"],
        "linear_num_value_heads": ssm["time_step_rank"],
        "linear_key_head_dim": ssm["state_size"],
        "linear_value_head_dim": meta["qwen35moe.ssm.inner_size"] // ssm["time_step_rank"],
    }
    order = v_heads_tiled(dims, key)
    return w if order is None else np.take(w, np.argsort(order[1]), axis=order[0])


@pytest.mark.parametrize(
    "arch,outtype",
    [
        (a, "q8_0")
        for a in (
            "qwen3_moe",
            "qwen2_moe",
            "olmoe",
            "mixtral",
            "glm4_moe",
            "lfm2_moe",
            "deepseek_v3",
            "qwen3_5_moe_text",
            "gpt_oss",
        )
    ]
    + [(a, "f32") for a in ("qwen3_moe", "mixtral", "deepseek_v3", "qwen3_5_moe_text", "gpt_oss")],
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


# The converter's fusions (--fuse-qkv: every architecture with attn_qkv, not deepseek2;
# --fuse-gate-up-exps: the architectures whose tensor list has ffn_gate_up_exps, qwen35moe here)
FUSED_FLAGS = {a: ("--fuse-qkv",) for a in GGUF_ARCH if a != "deepseek_v3"}
FUSED_FLAGS["qwen3_5_moe_text"] = ("--fuse-qkv", "--fuse-gate-up-exps")


@pytest.mark.parametrize("arch", FUSED_FLAGS)
def test_llama_cpp_fused_tensors_give_the_unfused_store(tmp_path, arch):
    """`convert_hf_to_gguf.py --fuse-qkv` (and `--fuse-gate-up-exps` where the converter writes
    it) at q8_0: the fused file converts into the unfused file's store byte for byte."""
    import gguf
    from test_gguf_fused import _store_files

    hf = tiny(arch, tmp_path / "hf")
    plain = llama_convert(hf, tmp_path / "plain.gguf", "q8_0")
    fused = llama_convert(hf, tmp_path / "fused.gguf", "q8_0", *FUSED_FLAGS[arch])
    names = [t.name.split(".", 2)[-1] for t in gguf.GGUFReader(str(fused)).tensors]
    assert "attn_qkv.weight" in names and "attn_q.weight" not in names
    assert ("ffn_gate_up_exps.weight" in names) == ("--fuse-gate-up-exps" in FUSED_FLAGS[arch])
    a, b = (
        _store_files(convert(p, tmp_path / p.stem, source_scheme(p, None), False))
        for p in (plain, fused)
    )
    assert a.keys() == b.keys()
    for k in a:
        assert (a[k] == b[k]) if isinstance(a[k], bytes) else a[k].equal(b[k]), k


def gguf_types(path: Path) -> Counter:
    import gguf

    return Counter(t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors)


@needs_build
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_llama_quantize_q4_0_is_kept_exactly(tmp_path, arch, capsys):
    """llama-quantize Q4_0: q4_0 experts and dense weights (its blocks as they are), the Q6_K /
    Q8_0 it keeps for some tensors dequantized; transformers on the GGUF's values is the oracle."""
    hf = tiny(arch, tmp_path / "hf")
    f32 = llama_convert(hf, tmp_path / "f32.gguf", "f32")
    path = llama_quantize(f32, tmp_path / "q4_0.gguf", "Q4_0")
    capsys.readouterr()
    store = convert(path, tmp_path / "store", source_scheme(path, None), False)
    err = capsys.readouterr().err
    assert Store(store).scheme.name == "q4_0"
    assert "Q4_0 expert tensor(s): kept exactly as q4_0" in err
    assert "Q4_0 dense tensor(s): kept exactly as q4_0" in err
    want = hf_logits(hf, dequantized_state(path, hf), tmp_path)
    assert (want - our_logits(store)).abs().max().item() < FP32_TOL


@needs_build
@pytest.mark.parametrize("qtype", ["Q4_1", "Q5_0"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_llama_quantize_q4_1_and_q5_0_are_kept_exactly(tmp_path, arch, qtype, capsys):
    """llama-quantize Q4_1 / Q5_0: q4_1 / q5_0 experts and dense weights (its blocks as they are:
    every record dequantizes to the file's values, read by the gguf package), the other types it
    keeps for some tensors dequantized; within 1e-4 of transformers on the GGUF's values (kernel
    ref); the native kernels give their spec's bits on llama.cpp's blocks (a record, a dense
    weight)."""
    from gguf_models import assert_records_are

    from moestream.kernels import native
    from moestream.kernels.ref import qlinear_q8
    from moestream.quant import tensor_width

    hf = tiny(arch, tmp_path / "hf")
    f32 = llama_convert(hf, tmp_path / "f32.gguf", "f32")
    path = llama_quantize(f32, tmp_path / f"{qtype}.gguf", qtype)
    scheme = qtype.lower()
    capsys.readouterr()
    store = convert(path, tmp_path / "store", source_scheme(path, None), False)
    err = capsys.readouterr().err
    s = Store(store)
    assert s.scheme.name == scheme
    assert f"{qtype} expert tensor(s): kept exactly as {scheme}" in err
    assert f"{qtype} dense tensor(s): kept exactly as {scheme}" in err
    values = dequantized_state(path, hf)
    assert_records_are(s, values)
    want = hf_logits(hf, values, tmp_path)
    assert (want - our_logits(store)).abs().max().item() < FP32_TOL
    name = "model.layers.0.self_attn.q_proj.weight"
    assert s.dense_scheme(name).name == scheme
    layer = s.args.moe_layer_ids[0]
    buf = torch.frombuffer(bytearray(s.read_record(layer, 0)), dtype=torch.uint8)
    secs = [(s.layouts[layer].views(buf), "w13"), (s.layouts[layer].views(buf), "w2")]
    secs.append(({f"w.{k}": v for k, v in s.dense_sections(name).items()}, "w"))
    for sec, n in secs:
        x = torch.randn(3, tensor_width(s.scheme, sec[f"{n}.q"]))
        for isa in native.isas():
            assert torch.equal(native.linear(x, sec, n, isa), qlinear_q8(x, sec, n))


@needs_build
def test_llama_quantize_q4_k_m_fallbacks_are_kept_exactly(tmp_path, capsys):
    """llama-quantize Q4_K_M of rows narrower than a K-quant super-block (the tiny qwen3moe, widths
    32 / 64) falls back to Q5_0 for Q4_K and Q8_0 for Q6_K: every expert tensor kept in its own
    scheme (q5_0 gate/up, q5_0 or int8 down by layer), said so, nothing requantized; within 1e-4
    of transformers on the GGUF's values; the native kernels give their spec's bits on each
    layer's records."""
    from gguf_models import assert_records_are

    from moestream.kernels import native
    from moestream.kernels.ref import qlinear_q8

    hf = tiny("qwen3_moe", tmp_path / "hf")
    f32 = llama_convert(hf, tmp_path / "f32.gguf", "f32")
    path = llama_quantize(f32, tmp_path / "km.gguf", "Q4_K_M")
    capsys.readouterr()
    store = convert(path, tmp_path / "store", source_scheme(path, None), False)
    err = capsys.readouterr().err
    assert "Q5_0 expert tensor(s): kept exactly as q5_0" in err and "requantized" not in err
    s = Store(store)
    values = dequantized_state(path, hf)
    kinds = {lay: tuple(x.name for x in s.layouts[lay].schemes) for lay in s.args.moe_layer_ids}
    assert (
        set(kinds.values()) <= {("q5_0", "q5_0"), ("q5_0", "int8")}
        and len(set(kinds.values())) == 2
    ), kinds  # both fallbacks met
    assert_records_are(s, values, kinds)
    want = hf_logits(hf, values, tmp_path)
    assert (want - our_logits(store)).abs().max().item() < FP32_TOL
    x = torch.randn(3, s.args.hidden_size, generator=torch.Generator().manual_seed(5))
    for layer in s.args.moe_layer_ids:
        buf = torch.frombuffer(bytearray(s.read_record(layer, 1)), dtype=torch.uint8)
        sec = s.layouts[layer].views(buf)
        for name, xin in (("w13", x), ("w2", x[:, : s.args.moe_intermediate_size])):
            for isa in native.isas():
                assert torch.equal(native.linear(xin, sec, name, isa), qlinear_q8(xin, sec, name))


@needs_build
@pytest.mark.parametrize("qtype", ["Q4_K_S", "Q5_K_S", "Q6_K"])
def test_llama_quantize_k_quants_are_kept_exactly(tmp_path, qtype, capsys):
    """llama-quantize Q4_K_S / Q5_K_S / Q6_K at widths of 256 (every expert tensor one K-quant
    here): the experts' blocks kept exactly in q4_k / q5_k / q6_k, its K-quant dense tensors
    too; transformers on the GGUF's values is the oracle (kernel ref), and the native kernels
    give their spec's bits on llama.cpp's blocks."""
    from moestream.kernels import native
    from moestream.kernels.ref import qlinear_q8

    wide = {"hidden_size": 256, "moe_intermediate_size": 256, "intermediate_size": 256}
    hf = save(perturbed_model("qwen3_moe", seed=2, mlp_only_layers=[], **wide), tmp_path / "hf",
              "per_expert")  # fmt: skip
    f32 = llama_convert(hf, tmp_path / "f32.gguf", "f32")
    path = llama_quantize(f32, tmp_path / f"{qtype}.gguf", qtype)
    kind = qtype.removesuffix("_S")
    capsys.readouterr()
    store = convert(path, tmp_path / "store", source_scheme(path, None), False)
    err = capsys.readouterr().err
    assert Store(store).scheme == make_scheme(kind.lower())
    assert f"9 {kind} expert tensor(s): kept exactly as {kind.lower()}" in err
    assert f"{kind} dense tensor(s): kept exactly as {kind.lower()}" in err
    want = hf_logits(hf, dequantized_state(path, hf), tmp_path)
    assert (want - our_logits(store)).abs().max().item() < FP32_TOL
    # llama.cpp's own blocks through the native kernel: its spec's bits (one record, lm_head)
    s = Store(store)
    buf = torch.frombuffer(bytearray(s.read_record(s.args.moe_layer_ids[0], 0)), dtype=torch.uint8)
    lay = s.layouts[s.args.moe_layer_ids[0]]
    secs = [(lay.views(buf), "w13"), (lay.views(buf), "w2")]
    secs.append(({f"w.{k}": v for k, v in s.dense_sections("lm_head.weight").items()}, "w"))
    for sec, name in secs:
        x = torch.randn(2, sec[f"{name}.q"].shape[1] * 256)
        assert torch.equal(native.linear(x, sec, name), qlinear_q8(x, sec, name))


@needs_build
def test_llama_quantize_q4_k_m_is_kept_exactly(tmp_path, capsys):
    """llama-quantize Q4_K_M (Q4_K gate/up, Q6_K or Q4_K down by layer): every expert tensor's
    blocks kept in its own scheme (per-layer record layouts), and said so; within 1e-4 of
    transformers on the GGUF's values; the native kernels give their spec's bits on its mixed
    records. `--quant int4` instead gives the bits of the int4 store of a Hugging Face folder
    holding the GGUF's dequantized values (the GPU's fix). Widths of 256: K-quant blocks are 256
    wide (narrower tensors fall back to other types)."""
    from gguf_models import assert_records_are
    from safetensors.torch import save_file

    from moestream.kernels import native
    from moestream.kernels.ref import qlinear_q8
    from moestream.quant import DenseQuant

    wide = {"hidden_size": 256, "moe_intermediate_size": 256, "intermediate_size": 256}
    hf = save(perturbed_model("qwen3_moe", seed=2, mlp_only_layers=[], **wide), tmp_path / "hf",
              "per_expert")  # fmt: skip
    f32 = llama_convert(hf, tmp_path / "f32.gguf", "f32")
    path = llama_quantize(f32, tmp_path / "q4_k_m.gguf", "Q4_K_M")
    kinds = gguf_types(path)
    assert kinds["Q4_K"] and kinds["Q6_K"], kinds
    capsys.readouterr()
    store = convert(path, tmp_path / "store", source_scheme(path, None), False)
    err = capsys.readouterr().err
    assert "Q4_K expert tensor(s): kept exactly as q4_k" in err
    assert "Q6_K expert tensor(s): kept exactly as q6_k" in err
    assert "expert tensor(s): dequantized and requantized" not in err
    s, values = Store(store), dequantized_state(path, hf)
    assert s.mixed
    assert_records_are(s, values)
    want = hf_logits(hf, values, tmp_path)
    assert (want - our_logits(store)).abs().max().item() < FP32_TOL
    for layer, lay in s.layouts.items():  # llama.cpp's mixed records through the native kernel
        sec = lay.views(torch.frombuffer(bytearray(s.read_record(layer, 0)), dtype=torch.uint8))
        for name in ("w13", "w2"):
            x = torch.randn(2, sec[f"{name}.q"].shape[1] * 256)
            assert torch.equal(native.linear(x, sec, name), qlinear_q8(x, sec, name))
    ours = convert(path, tmp_path / "int4", make_scheme("int4"), False, DenseQuant())
    assert "Q4_K expert tensor(s): dequantized and requantized to int4" in capsys.readouterr().err
    folder = tmp_path / "values"  # (hf_logits wrote its own "dequantized")
    shutil.copytree(hf, folder)
    save_file({k: v.contiguous() for k, v in values.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})  # fmt: skip
    theirs = convert(folder, tmp_path / "hf-store", make_scheme("int4"), False, DenseQuant())
    assert torch.equal(our_logits(ours), our_logits(theirs))


@needs_build
@pytest.mark.parametrize("qtype", ["IQ4_XS", "Q3_K"])
def test_llama_quantize_low_bit_types_are_requantized_and_priced(tmp_path, qtype, capsys):
    """llama-quantize --pure IQ4_XS / Q3_K (types no store scheme holds): the experts go into
    int4 by default, the bits of the int4 store of a Hugging Face folder holding the GGUF's
    dequantized values, and convert's note gives the cost measured on the reference model
    (gguf_blocks.REQUANT_COST). Widths of 256: these blocks are 256 wide."""
    from safetensors.torch import save_file

    from moestream.convert.gguf_blocks import REQUANT_COST
    from moestream.quant import DenseQuant

    wide = {"hidden_size": 256, "moe_intermediate_size": 256, "intermediate_size": 256}
    hf = save(perturbed_model("qwen3_moe", seed=2, mlp_only_layers=[], **wide), tmp_path / "hf",
              "per_expert")  # fmt: skip
    f32 = llama_convert(hf, tmp_path / "f32.gguf", "f32")
    path = tmp_path / f"{qtype}.gguf"
    subprocess.run([str(QUANTIZE), "--pure", str(f32), str(path), qtype], check=True,
                   capture_output=True)  # fmt: skip
    assert gguf_types(path)[qtype] >= 9, gguf_types(path)  # three projections of three layers
    capsys.readouterr()
    ours = convert(path, tmp_path / "store", source_scheme(path, None), False, DenseQuant())
    err = capsys.readouterr().err
    added, own = REQUANT_COST[qtype, "int4"]
    assert (
        f"{qtype} expert tensor(s): dequantized and requantized to int4 g32 (lossy: a second "
        f"rounding; on the 29M reference model it added KL {added:.4f} to the file's own {own:.4f}"
    ) in err
    folder = tmp_path / "values"
    shutil.copytree(hf, folder)
    values = dequantized_state(path, hf)
    save_file({k: v.contiguous() for k, v in values.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})  # fmt: skip
    theirs = convert(folder, tmp_path / "hf-store", make_scheme("int4"), False, DenseQuant())
    assert torch.equal(our_logits(ours), our_logits(theirs))


@needs_build
@pytest.mark.parametrize("arch", ["glm4_moe", "lfm2_moe", "deepseek_v3", "qwen3_5_moe_text"])
def test_llama_quantize_q4_k_m_of_more_architectures(tmp_path, arch, capsys):
    """llama-quantize Q4_K_M of GLM-4 MoE, LFM2-MoE, DeepSeek-V3 (MLA) and Qwen3.5 MoE (Gated
    DeltaNet) at widths of 256: the K-quant experts kept exactly per layer, within 1e-4 of
    transformers on the GGUF's values."""
    from gguf_models import assert_records_are

    wide = {"hidden_size": 256, "moe_intermediate_size": 256, "intermediate_size": 256}
    hf = tiny(arch, tmp_path / "hf", **wide)
    f32 = llama_convert(hf, tmp_path / "f32.gguf", "f32")
    path = llama_quantize(f32, tmp_path / "q4_k_m.gguf", "Q4_K_M")
    assert gguf_types(path)["Q4_K"], gguf_types(path)
    capsys.readouterr()
    store = convert(path, tmp_path / "store", source_scheme(path, None), False)
    err = capsys.readouterr().err
    assert "Q4_K expert tensor(s): kept exactly as q4_k" in err
    assert "expert tensor(s): dequantized and requantized" not in err
    values = dequantized_state(path, hf)
    assert_records_are(Store(store), values)
    want = hf_logits(hf, values, tmp_path)
    assert (want - our_logits(store)).abs().max().item() < FP32_TOL


@needs_build
def test_greedy_tokens_equal_llama_completion_by_the_margin_rule(tmp_path):
    """The reference model as llama.cpp's Q8_0 GGUF: llama-completion's 32 greedy tokens (one
    thread) against moestream's on the store converted from that file (int8 experts and dense
    weights, exactly; the native kernels, Q8_0 activations as llama.cpp's), teacher-forced on
    llama.cpp's tokens. By the margin rule a disagreement is a flip only when the oracle, the
    file's exact values in fp32 (kernel "ref": no activation quantization), puts the two tokens
    >= MARGIN apart; both engines approximate that model. Measured: one disagreement, at token
    10, 0.04 nats apart on the oracle (0.13 on the native path): a tie. llama.cpp's text is
    re-encoded with the store's tokenizer (tested equal to the HF one); llama-completion ends
    its output with a blank line, which is dropped."""
    from moestream.engine.kv_cache import KVCache
    from moestream.engine.tokenizer import Tokenizer
    from moestream.experts.config import StreamConfig
    from moestream.loader import load_model
    from moestream.quality.metrics import MARGIN

    prompt = "def fibonacci(n):"
    path = llama_convert(Path(__file__).parents[1] / "models/pystd-moe-29m", tmp_path / "r.gguf",
                         "q8_0")  # fmt: skip
    cmd = [str(COMPLETION), "-m", str(path), "-p", prompt, "-n", "32", "--temp", "0", "-t", "1",
           "--ignore-eos", "-no-cnv", "--no-display-prompt", "--simple-io", "--no-warmup"]  # fmt: skip
    text = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    assert text.endswith("\n\n")
    text = text[:-2]
    store = convert(path, tmp_path / "store", source_scheme(path, None), False)
    tok = Tokenizer(store)
    head, ids = tok.encode(prompt), tok.encode(prompt + text)
    assert ids[: len(head)] == head and tok.decode(ids[len(head) :]) == text
    pos = torch.arange(len(head) - 1, len(ids) - 1)
    logits = {}
    for kernel in ("native", "ref"):
        loaded = load_model(store, StreamConfig(resident=True, kernel=kernel))
        with torch.no_grad():
            cache = KVCache(loaded.args, len(ids), torch.float32)
            logits[kernel] = loaded.model(torch.tensor(ids), cache, 0)[pos]  # [T, V]
        loaded.provider.close()
    theirs, mine, oracle = torch.tensor(ids)[pos + 1], logits["native"].argmax(-1), logits["ref"]
    gap = (oracle.gather(1, mine[:, None]) - oracle.gather(1, theirs[:, None]))[:, 0].abs()
    disagree = mine != theirs
    assert len(pos) >= 24 and disagree.sum() <= 2, disagree.nonzero()[:, 0].tolist()
    assert not (disagree & (gap >= MARGIN)).any(), gap[disagree].tolist()


PERPLEXITY = LLAMA / "build/bin/llama-perplexity"
# qwen35moe as llama.cpp loads it: one head size for keys and values in the Gated DeltaNet
# (ssm.state_size), and mrope sections that give each of the 2 rotary pairs a text position under
# llama.cpp's interleaved rule (pair 0: temporal, pair 1: height; both the token's position)
LLAMA_FORM = {
    "qwen3_5_moe_text": dict(linear_value_head_dim=16, rope_parameters=dict(
        rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
        mrope_section=[1, 1, 0])),
}  # fmt: skip
needs_perplexity = pytest.mark.skipif(
    not (PERPLEXITY.is_file() and QUANTIZE.is_file()), reason=f"no llama-perplexity in {LLAMA}"
)


def llama_cpp_and_ours(tmp_path: Path, arch: str, form: dict, unrotated=()) -> tuple:
    """The tiny model through the converter at f32; (llama-perplexity's log-probabilities on its
    own tokens of a text in chunks of 64, the second half of each scored (fp32 attention and KV
    cache), moestream's fp32 logits of the file's values on the same positions). `unrotated`:
    rotary pairs moestream holds at position 0 (cos 1, sin 0), as llama.cpp does for a pair its
    mrope sections leave on the extra position."""
    from quality_peers import read_kld
    from safetensors.torch import save_file
    from spm_models import CORPUS

    from moestream.engine.kv_cache import KVCache
    from moestream.runtime import open_model

    hf = tiny(arch, tmp_path / "hf", **form)
    path = llama_convert(hf, tmp_path / "m.gguf", "f32")
    (tmp_path / "text.txt").write_text(" ".join(CORPUS * 2) + "\n")
    kld = tmp_path / "base.kld"
    cmd = [str(PERPLEXITY), "-m", str(path), "-f", str(tmp_path / "text.txt"), "-c", "64",
           "-b", "64", "-t", "1", "-fa", "off", "-ctk", "f32", "-ctv", "f32", "--no-warmup",
           "--kl-divergence-base", str(kld)]  # fmt: skip
    subprocess.run(cmd, capture_output=True, text=True, check=True)
    n_ctx, chunks, theirs = read_kld(kld)
    first = n_ctx // 2
    folder = tmp_path / "values"
    shutil.copytree(hf, folder)
    values = dequantized_state(path, hf)
    save_file({k: v.contiguous() for k, v in values.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})  # fmt: skip
    with open_model(folder, dtype="float32", threads=1) as rt, torch.no_grad():
        rope = rt.model.rope
        rope.inv_freq[list(unrotated)] = 0.0
        rope._tables.clear()
        ours = torch.cat([rt.model(c, KVCache(rt.args, n_ctx, torch.float32), 0)[first:-1]
                          for c in chunks])  # fmt: skip
    assert len(ours) == len(theirs) >= 2 * (n_ctx - 1 - first)
    return theirs, ours


def flips_and_kl(theirs: torch.Tensor, ours: torch.Tensor) -> tuple[int, int, float, float]:
    """(greedy choices that differ, those of them a flip by the margin rule, mean KL(llama.cpp ||
    moestream), the largest gap on moestream's logits between the two choices)."""
    from moestream.quality.metrics import MARGIN, kl_div

    mine, other = ours.argmax(-1), theirs.argmax(-1)
    gap = (ours.gather(1, mine[:, None]) - ours.gather(1, other[:, None]))[:, 0].abs()
    disagree = mine != other
    flips = int((disagree & (gap >= MARGIN)).sum())
    return int(disagree.sum()), flips, float(kl_div(ours, theirs).mean()), float(gap.max())


@needs_perplexity
@pytest.mark.parametrize(
    "arch", ["qwen3_5_moe_text", "deepseek_v3", "gpt_oss", "glm4_moe", "lfm2_moe"]
)
def test_next_tokens_equal_llama_cpp_by_the_margin_rule(tmp_path, arch):
    """The newer architectures against llama.cpp itself (llama_cpp_and_ours): every greedy choice
    (the argmax of each position) equal, or a tie by the margin rule, and the distributions
    within KL 1e-5 (one model, two engines). f32, because on these random tiny models the
    activations' int8 rounding alone (llama.cpp's Q8_0 path, or moestream's native kernels)
    moves logits by up to 0.8 nats."""
    theirs, ours = llama_cpp_and_ours(tmp_path, arch, LLAMA_FORM.get(arch, {}))
    disagree, flips, kl, gap = flips_and_kl(theirs, ours)
    print(f"{arch}: {len(ours)} positions, {disagree} differ, {flips} flips, KL {kl:.2e}")
    assert flips == 0 and kl < 1e-5, (disagree, flips, kl, gap)


@needs_perplexity
def test_qwen35moe_mrope_pair_left_on_the_extra_position_is_unrotated_in_llama_cpp(tmp_path):
    """llama.cpp's known difference, pinned: mrope sections [2, 0, 0] over 2 rotary pairs put
    pair 1 on the extra (4th) position under llama.cpp's interleaved rule (ggml-cpu/ops.cpp,
    ggml_mrope_cache_init: sector 1 % 3 == 1 but not < 3 * sections[1]), which llama.cpp holds at
    0 for text tokens (llama-graph.cpp, llm_graph_input_pos::set_input: "4th dim is 0"), so that
    pair never rotates there; transformers (and moestream) rotate every pair with the token's
    position. moestream with pair 1 held at position 0 gives llama.cpp's distributions; as
    transformers computes it, it does not. The reader refuses such a file (test_gguf)."""
    form = dict(LLAMA_FORM["qwen3_5_moe_text"])
    form["rope_parameters"] = {**form["rope_parameters"], "mrope_section": [2, 0, 0]}
    theirs, ours = llama_cpp_and_ours(tmp_path / "hf", "qwen3_5_moe_text", form)
    as_hf = flips_and_kl(theirs, ours)
    theirs_too, held = llama_cpp_and_ours(tmp_path / "held", "qwen3_5_moe_text", form, [1])
    assert torch.equal(theirs, theirs_too)  # llama.cpp is deterministic on one file
    disagree, flips, kl_held, gap = flips_and_kl(theirs, held)
    print(f"[2, 0, 0] as transformers: {as_hf[0]} differ, {as_hf[1]} flips, KL {as_hf[2]:.2e}; "
          f"pair 1 held at 0: {disagree} differ, {flips} flips, KL {kl_held:.2e}")  # fmt: skip
    assert as_hf[2] > 1e-4, as_hf
    assert flips == 0 and kl_held < 1e-5, (disagree, flips, kl_held, gap)


def gpt_oss_mxfp4(tmp_path: Path, outtype: str) -> tuple[Path, Path, Path]:
    """(the tiny gpt-oss float folder, the same model as on the hub: MXFP4 experts with
    quantization_config mxfp4, llama.cpp's converter's GGUF of it at `outtype`)."""
    from safetensors.torch import load_file, save_file
    from test_mxfp4 import _random_mxfp4

    hf = tiny("gpt_oss", tmp_path / "hf")
    quant = tmp_path / "mxfp4"
    shutil.copytree(hf, quant)
    tensors = load_file(str(quant / "model.safetensors"))
    for i, name in enumerate(n for n in list(tensors) if n.endswith(("gate_up_proj", "down_proj"))):
        E, n_in, n_out = tensors.pop(name).shape
        blocks, scales = _random_mxfp4((E, n_out, n_in // 32), seed=10 + i)
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
    save_file(tensors, str(quant / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((quant / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}  # fmt: skip
    (quant / "config.json").write_text(json.dumps(cfg))
    path = llama_convert(quant, tmp_path / f"m-{outtype}.gguf", outtype)
    assert gguf_types(path)["MXFP4"] == 9
    return hf, quant, path


@needs_build
def test_llama_quantize_of_gpt_oss_keeps_mxfp4_experts(tmp_path, capsys):
    """llama-quantize MXFP4_MOE (the type of the hub's gpt-oss GGUFs) of gpt-oss as on the hub,
    converted at f32: llama.cpp leaves the MXFP4 experts as they are and quantizes the 2-D dense
    weights to Q8_0; convert keeps the experts as mxfp4 exactly (the records of the converter's
    own file, byte for byte) and the Q8_0 dense weights as int8, and the logits are within 1e-4
    of transformers on the quantized file's values. (Q4_K_M refuses an MXFP4 source unless told
    --allow-requantize, and then requantizes the experts: Q5_0 at these widths of 64.)"""
    hf, _, src = gpt_oss_mxfp4(tmp_path, "f32")
    path = llama_quantize(src, tmp_path / "mxfp4_moe.gguf", "MXFP4_MOE")
    kinds = gguf_types(path)
    assert kinds["MXFP4"] == 9 and kinds["Q8_0"], kinds
    capsys.readouterr()
    store = convert(path, tmp_path / "store", source_scheme(path, None), False)
    err = capsys.readouterr().err
    assert "9 MXFP4 expert tensor(s): kept exactly as mxfp4" in err
    assert "Q8_0 dense tensor(s): kept exactly as int8" in err
    plain = convert(src, tmp_path / "f32-store", source_scheme(src, None), False)
    for f in sorted(plain.glob("experts-L*.bin")):
        assert f.read_bytes() == (store / f.name).read_bytes(), f.name
    want = hf_logits(hf, dequantized_state(path, hf), tmp_path)
    assert (want - our_logits(store)).abs().max().item() < FP32_TOL


def test_llama_cpp_gpt_oss_mxfp4_is_kept_exactly(tmp_path, capsys):
    """gpt-oss as on the hub (MXFP4 experts, quantization_config mxfp4): llama.cpp's converter
    repacks the blocks into GGUF MXFP4 (scale first, nibbles reordered), which are kept as mxfp4
    exactly: the records equal those of the bf16 store of the Hugging Face MXFP4 folder itself
    (its own reader, tested against transformers; both hold every value), and the logits are
    within 1e-4 of transformers on the GGUF's values."""
    hf, quant, path = gpt_oss_mxfp4(tmp_path, "q8_0")
    capsys.readouterr()
    store = convert(path, tmp_path / "store", source_scheme(path, None), False)
    assert "9 MXFP4 expert tensor(s): kept exactly as mxfp4" in capsys.readouterr().err
    theirs = convert(quant, tmp_path / "hf-store", make_scheme("bf16"), False)
    a, b = Store(store), Store(theirs)
    for layer in a.args.moe_layer_ids:
        for e in range(a.args.num_experts):
            recs = [(s.layouts[layer], bytearray(s.read_record(layer, e))) for s in (a, b)]
            secs = [lay.views(torch.frombuffer(buf, dtype=torch.uint8)) for lay, buf in recs]
            for name, g in (("w13", 0), ("w2", 1)):
                x, y = (dequantize(sec, name, lay.groups[g], torch.float32)
                        for sec, (lay, _) in zip(secs, recs))  # fmt: skip
                assert torch.equal(x, y), (layer, e, name)
            assert torch.equal(secs[0]["b13"], secs[1]["b13"])
    # the float folder's non-expert weights with the GGUF's values: transformers is the oracle
    want = hf_logits(hf, dequantized_state(path, hf), tmp_path)
    assert (want - our_logits(store)).abs().max().item() < FP32_TOL


SPM_TRAIN = """
import json, sys, sentencepiece as spm
corpus, prefix = json.loads(sys.argv[1]), sys.argv[2]
spm.SentencePieceTrainer.train(
    sentence_iterator=iter(corpus), model_prefix=prefix, model_type="bpe", vocab_size=420,
    hard_vocab_limit=False, byte_fallback=True, character_coverage=1.0,
    normalization_rule_name="identity", remove_extra_whitespaces=False,
    control_symbols=["[INST]", "[/INST]"], minloglevel=2)
print(spm.SentencePieceProcessor(model_file=prefix + ".model").vocab_size())
"""
SPM_ENCODE = """
import json, sys, sentencepiece as spm
sp = spm.SentencePieceProcessor(model_file=sys.argv[1])
print(json.dumps([sp.encode(t) for t in json.loads(sys.stdin.read())]))
"""


def llama_prompt_ids(path: Path, text: str, tmp: Path) -> list[int]:
    """llama-completion's ids of `text` as its prompt (--verbose-prompt; -f drops one trailing
    newline, so one is added; no escapes processed)."""
    import re

    (tmp / "prompt.txt").write_text(text + "\n")
    cmd = [str(COMPLETION), "-m", str(path), "-f", str(tmp / "prompt.txt"), "--no-escape",
           "-n", "0", "-no-cnv", "--verbose-prompt", "-t", "1", "--no-warmup"]  # fmt: skip
    for _ in range(5):  # its log thread can lose output when the process exits at once (-n 0)
        run = subprocess.run(cmd, capture_output=True, text=True, errors="replace", check=True)
        log = run.stdout + run.stderr
        n = re.search(r"number of tokens in prompt = (\d+)", log)
        ids = [int(m) for m in re.findall(r"^(?:[\d.]+ I )?\s*(\d+) -> '", log, re.M)]
        if n and len(ids) == int(n.group(1)):
            return ids
    raise AssertionError(log)


@needs_build
def test_sentencepiece_vocabulary_encodes_as_llama_cpp(tmp_path):
    """A real SentencePiece BPE model (trained in-test with byte fallback and [INST] / [/INST]
    control symbols) in a tiny Mixtral folder, through llama.cpp's converter (its SentencePiece
    vocabulary: tokens, scores, token types): the store's tokenizer gives llama-completion's
    prompt ids on every text of test_gguf_spm and 40 random ones, and SentencePiece's own (after
    BOS) on those without special tokens (SentencePiece never reads control symbols from text)."""
    from spm_models import CORPUS
    from test_gguf_spm import SPECIALS, TEXTS, random_texts

    from moestream.convert.gguf import GGUFCheckpoint
    from moestream.engine.tokenizer import Tokenizer

    prefix = tmp_path / "sp"
    train = [str(PYTHON), "-c", SPM_TRAIN, json.dumps(CORPUS * 4), str(prefix)]
    n = int(subprocess.run(train, capture_output=True, text=True, check=True).stdout.split()[-1])
    hf = hf_checkpoint("mixtral", tmp_path / "hf", vocab_size=n, bos_token_id=1, eos_token_id=2)
    (hf / "tokenizer.json").unlink()
    shutil.copy(f"{prefix}.model", hf / "tokenizer.model")
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True}
    (hf / "tokenizer_config.json").write_text(json.dumps(config))
    path = llama_convert(hf, tmp_path / "m.gguf", "f32")
    out = tmp_path / "files"
    out.mkdir()
    GGUFCheckpoint(path).write_files(out)
    ours = Tokenizer(out)
    texts = [t for t in TEXTS if t] + random_texts(40, seed=1)  # (llama.cpp: no empty prompt)
    enc = subprocess.run([str(PYTHON), "-c", SPM_ENCODE, f"{prefix}.model"], input=json.dumps(texts),
                         capture_output=True, text=True, check=True)  # fmt: skip
    for text, sp_ids in zip(texts, json.loads(enc.stdout)):
        ids = ours.encode(text)
        assert ids == llama_prompt_ids(path, text, tmp_path), text
        if not any(s in text for s in SPECIALS):
            assert ids == [1, *sp_ids], text


@needs_build
def test_q6_k_output_layer_is_llama_quantizes_bytes(tmp_path):
    """quant.quantize_q6_k of the F32 file's table gives byte for byte the Q6_K blocks that
    llama-quantize writes for the output layer of its Q4_0 mix (the search, sums and roundings in
    ggml's fp32 order)."""
    import gguf

    from moestream.quant import quantize_q6_k

    hf = tiny("qwen3_moe", tmp_path / "hf", hidden_size=256)
    f32 = llama_convert(hf, tmp_path / "f32.gguf", "f32")
    q4 = llama_quantize(f32, tmp_path / "q4_0.gguf", "Q4_0")
    src = {t.name: t for t in gguf.GGUFReader(str(f32)).tensors}
    checked = 0
    for t in gguf.GGUFReader(str(q4)).tensors:
        if t.tensor_type != gguf.GGMLQuantizationType.Q6_K:
            continue
        w = torch.from_numpy(np.array(src[t.name].data)).float()
        theirs = torch.from_numpy(np.array(t.data)).view(w.shape[0], -1, 210)
        assert torch.equal(quantize_q6_k(w), theirs), t.name
        checked += 1
    assert checked  # the mix keeps the output layer (or the tied table) at Q6_K
