"""Store faults: files besides the payload (config.json, tokenizer files, generation_config.json)
are covered by the manifest's checksums; a changed file is a named error (exit 2), not a
silently different output. Stores written before the checksums existed still open."""

from __future__ import annotations

import json
import shutil

import pytest

from moestream.cli import main
from moestream.convert.writer import convert
from moestream.quant import make_scheme
from moestream.store.format import MANIFEST, Store, StoreError


@pytest.fixture(scope="module")
def store(tiny_dir, tmp_path_factory):
    dst = tmp_path_factory.mktemp("faults") / "store"
    return convert(tiny_dir("qwen3_moe"), dst, make_scheme("int8"), False)


@pytest.fixture
def copy(store, tmp_path):
    return shutil.copytree(store, tmp_path / "s")


def _edit_config(folder, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))


def test_manifest_lists_copied_files(store):
    files = json.loads((store / MANIFEST).read_text())["files"]
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= set(files)


@pytest.mark.parametrize("change", [{"num_experts_per_tok": 4}, {"rms_norm_eps": 1e-3}])
def test_changed_config_is_refused_by_generate(copy, capsys, change):
    _edit_config(copy, **change)
    rc = main(["generate", "-m", str(copy), "-p", "def", "-n", "2", "--threads", "1"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "config.json of the store was changed after convert; convert again" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "name", ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]
)
def test_changed_tokenizer_files_are_named(copy, name):
    path = copy / name
    if not path.is_file():
        pytest.skip(f"the tiny checkpoint has no {name}")
    path.write_bytes(path.read_bytes() + b" ")
    with pytest.raises(StoreError, match=f"{name} of the store was changed after convert"):
        Store(copy)


def test_removed_copied_file_is_named(copy):
    (copy / "tokenizer_config.json").unlink()
    with pytest.raises(StoreError, match="tokenizer_config.json of the store is missing"):
        Store(copy)


def test_store_without_file_checksums_still_opens(copy):
    m = json.loads((copy / MANIFEST).read_text())
    del m["files"], m["dense_dtypes"]  # as written before they existed
    (copy / MANIFEST).write_text(json.dumps(m))
    _edit_config(copy, rms_norm_eps=1e-5)  # unchecked: the old format has nothing to compare with
    store = Store(copy)
    assert store.args.rms_norm_eps == 1e-5
    assert store.tensor("model.norm.weight").numel() == store.args.hidden_size
