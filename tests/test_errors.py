"""Bad inputs give errors that name the problem (and never a half-loaded model)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from moestream.config import ConfigError, parse_size
from moestream.convert.hf import CheckpointError
from moestream.loader import load_model


def copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_folder_and_config(tmp_path):
    with pytest.raises(CheckpointError, match="no such folder"):
        load_model(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="config.json not found"):
        load_model(tmp_path / "empty")


def test_unsupported_model_type(tiny_dir, tmp_path):
    d = copy(tiny_dir("qwen3_moe"), tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "llama"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="'llama' is not supported"):
        load_model(d)


def test_invalid_config_json(tiny_dir, tmp_path):
    d = copy(tiny_dir("qwen3_moe"), tmp_path / "m")
    (d / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_model(d)


def test_missing_shard(tiny_dir, tmp_path):
    d = copy(tiny_dir("mixtral", "sharded"), tmp_path / "m")
    shard = sorted(d.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"missing: {shard.name}"):
        load_model(d)


def test_truncated_shard(tiny_dir, tmp_path):
    d = copy(tiny_dir("olmoe"), tmp_path / "m")
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match="model.safetensors: file is truncated"):
        load_model(d)


def _rewrite(folder, fn):
    """Load the single-file checkpoint's tensors, let fn edit the dict, save it back."""
    from safetensors.torch import load_file, save_file

    f = folder / "model.safetensors"
    tensors = load_file(f)
    fn(tensors)
    save_file(tensors, f)


def test_unknown_tensor(tiny_dir, tmp_path):
    d = copy(tiny_dir("qwen2_moe"), tmp_path / "m")
    _rewrite(
        d, lambda t: t.__setitem__("model.layers.0.mystery.weight", t["model.norm.weight"].clone())
    )
    with pytest.raises(CheckpointError, match="unknown tensor.*model.layers.0.mystery.weight"):
        load_model(d)


def test_missing_dense_tensor(tiny_dir, tmp_path):
    d = copy(tiny_dir("qwen3_moe"), tmp_path / "m")
    _rewrite(d, lambda t: t.pop("model.layers.2.self_attn.k_norm.weight"))
    with pytest.raises(CheckpointError, match="missing.*model.layers.2.self_attn.k_norm.weight"):
        load_model(d)


def test_missing_expert(tiny_dir, tmp_path):
    d = copy(tiny_dir("mixtral"), tmp_path / "m")
    _rewrite(d, lambda t: t.pop("model.layers.1.block_sparse_moe.experts.5.w3.weight"))
    with pytest.raises(CheckpointError, match="layer 1 expert 5: missing up_proj"):
        load_model(d)


def test_wrong_shape(tiny_dir, tmp_path):
    d = copy(tiny_dir("qwen3_moe", "fused"), tmp_path / "m")
    _rewrite(
        d,
        lambda t: t.__setitem__(
            "model.layers.0.mlp.experts.down_proj", t["model.layers.0.mlp.experts.down_proj"][:4]
        ),
    )
    with pytest.raises(CheckpointError, match="down_proj' has shape \\[4, 64, 32\\]"):
        load_model(d)


def test_expert_beyond_config(tiny_dir, tmp_path):
    d = copy(tiny_dir("olmoe"), tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_experts"] = 6  # the checkpoint has 8
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="unexpected expert tensor"):
        load_model(d)


def test_sizes():
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size("2G") == 2 * 2**30
    assert parse_size("1.5GiB") == int(1.5 * 2**30)
    assert parse_size("4096") == 4096
    with pytest.raises(ConfigError, match="KiB/MiB/GiB"):
        parse_size("lots")


def test_cli_reports_errors_without_traceback(tiny_dir, tmp_path):
    d = copy(tiny_dir("qwen3_moe"), tmp_path / "m")
    (d / "tokenizer.json").unlink()
    r = subprocess.run(
        [sys.executable, "-m", "moestream", "generate", "-m", str(d), "-p", "x"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2
    assert "tokenizer.json not found" in r.stderr
    assert "Traceback" not in r.stderr


def test_prompt_longer_than_context(tiny_dir):
    from moestream.config import SamplingConfig
    from moestream.runtime import open_model

    rt = open_model(tiny_dir("qwen3_moe"))
    with pytest.raises(ConfigError, match="exceeds the model's context of 256"):
        rt.generator.generate([1] * 250, SamplingConfig(max_new_tokens=10))
