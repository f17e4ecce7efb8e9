"""Wrong types are refused with the key or tensor named: a safetensors header relabelling a float
weight to a same-size integer dtype (generate, convert, a store's dense file), and config.json
numbers of the wrong type or sign."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

from moestream.cli import main
from moestream.config import ConfigError
from moestream.convert.writer import convert
from moestream.models import load_model_args
from moestream.quant import make_scheme
from moestream.store.format import DENSE_FILE, Store, StoreError

SAME_SIZE_INT = {"F32": "I32", "BF16": "I16", "F16": "I16"}
ARGS = ["-p", "def", "-n", "2", "--threads", "1", "--json"]  # --json: no progress bars


def relabel(path: Path, tensor: str) -> None:
    """Give `tensor` a same-size integer dtype in the file's header; the bytes stay as they are."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header[tensor]["dtype"] = SAME_SIZE_INT[header[tensor]["dtype"]]
    raw = json.dumps(header, separators=(",", ":")).encode()
    assert len(raw) <= n
    path.write_bytes(data[:8] + raw.ljust(n) + data[8 + n :])


@pytest.fixture
def hf(tiny_dir, tmp_path) -> Path:
    return shutil.copytree(tiny_dir("qwen3_moe"), tmp_path / "hf")


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize(
    "tensor", ["model.norm.weight", "model.layers.0.mlp.experts.3.down_proj.weight"]
)
def test_relabelled_dtype_refused_by_generate_and_convert(hf, tmp_path, capsys, tensor):
    relabel(hf / "model.safetensors", tensor)
    assert main(["generate", "-m", str(hf), *ARGS]) == 2
    err = _one_line_error(capsys)
    assert repr(tensor) in err and "torch.int32" in err
    assert main(["convert", str(hf), str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err
    last = err[err.rindex("moestream: error:") :]  # after convert's progress bar
    assert repr(tensor) in last and "\n" not in last.strip()
    assert not (tmp_path / "s").exists()


def test_relabelled_dtype_in_store_dense_file(tiny_dir, tmp_path, capsys):
    folder = convert(tiny_dir("qwen3_moe"), tmp_path / "s", make_scheme("int8"), False)
    relabel(folder / DENSE_FILE, "model.norm.weight")
    store = Store(folder)
    with pytest.raises(StoreError, match="'model.norm.weight' is int32, convert wrote float32"):
        store.tensor("model.norm.weight")
    assert main(["generate", "-m", str(folder), *ARGS]) == 2
    assert "'model.norm.weight'" in _one_line_error(capsys)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("num_experts", 8.5, "num_experts must be a positive integer, got 8.5"),
        ("num_experts", True, "num_experts must be a positive integer, got True"),
        ("num_experts_per_tok", "2", "num_experts_per_tok must be a positive integer"),
        ("hidden_size", -64, "hidden_size must be a positive integer, got -64"),
        ("hidden_size", 0, "hidden_size must be a positive integer, got 0"),
        ("intermediate_size", -1, "intermediate_size must be a non-negative integer"),
        ("rope_theta", -1, "rope_theta must be a positive number, got -1"),
        ("rms_norm_eps", 0, "rms_norm_eps must be a positive number, got 0"),
        ("rms_norm_eps", "1e-6", "rms_norm_eps must be a positive number"),
        ("vocab_size", None, "missing required field 'vocab_size'"),
    ],
)
def test_bad_config_values_name_the_key(hf, key, value, message):
    cfg = json.loads((hf / "config.json").read_text())
    cfg[key] = value
    (hf / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=message):
        load_model_args(hf)


def test_rope_theta_in_rope_parameters_is_checked(hf):
    cfg = json.loads((hf / "config.json").read_text())
    cfg.pop("rope_theta", None)
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": -1.0}
    (hf / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="rope_parameters.rope_theta must be a positive number"):
        load_model_args(hf)


def test_bad_config_value_exits_2_from_generate(hf, capsys):
    cfg = json.loads((hf / "config.json").read_text())
    cfg["num_experts"] = 64.5
    (hf / "config.json").write_text(json.dumps(cfg))
    assert main(["generate", "-m", str(hf), *ARGS]) == 2
    assert "num_experts must be a positive integer, got 64.5" in _one_line_error(capsys)
