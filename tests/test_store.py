"""Expert store: convert, exactness of streaming vs resident, budgets, integrity, memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from tiny_models import ARCHS

from moestream.config import ConfigError
from moestream.convert import writer
from moestream.convert.writer import convert
from moestream.engine.kv_cache import KVCache
from moestream.experts.config import StreamConfig, min_budget
from moestream.loader import load_model
from moestream.quant import make_scheme
from moestream.store.format import Store, StoreError, is_store
from moestream.store.io import IOConfig

PROMPT = torch.randint(0, 320, (12,), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def stores(tiny_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("stores")
    cache = {}

    def get(arch: str, quant: str = "int4", layout: str = "fused"):
        key = (arch, quant, layout)
        if key not in cache:
            cache[key] = convert(
                tiny_dir(arch, layout), root / f"{arch}-{quant}-{layout}", make_scheme(quant), False
            )
        return cache[key]

    return get


def greedy(folder, cfg: StreamConfig, n: int = 16):
    loaded = load_model(folder, cfg)
    cache = KVCache(loaded.args, len(PROMPT) + n, torch.float32)
    out, logits_seen = [], []
    with torch.no_grad():
        logits = loaded.model(PROMPT, cache, 0, last_only=True)[-1]
        for pos in range(len(PROMPT), len(PROMPT) + n):
            logits_seen.append(logits)
            out.append(int(logits.argmax()))
            logits = loaded.model(torch.tensor([out[-1]]), cache, pos, last_only=True)[-1]
    provider = loaded.provider
    stats = provider.stats()
    provider.close()
    return out, torch.stack(logits_seen), stats


@pytest.mark.parametrize("arch", ARCHS)
def test_streaming_is_bit_identical_to_resident(stores, arch):
    folder = stores(arch)
    store = Store(folder)
    want, want_logits, _ = greedy(folder, StreamConfig(resident=True))
    total = len(store.crc) * store.args.num_experts * store.layout.size
    for budget in (min_budget(store), total // 2):
        got, logits, stats = greedy(folder, StreamConfig(memory_budget=budget))
        assert got == want
        assert torch.equal(logits, want_logits)
        assert stats["hits"] + stats["misses"] > 0
        if budget == min_budget(store):
            assert stats["evictions"] > 0  # the minimum budget really streams
    got, logits, _ = greedy(folder, StreamConfig(io=IOConfig(mode="mmap")))
    assert torch.equal(logits, want_logits)


def test_prefill_rows_split_does_not_change_bits(stores, monkeypatch):
    """The resident native prefill runs the prompt in PREFILL_ROWS slices: any split, same bits."""
    from moestream.experts import streaming
    from moestream.kernels import native

    if not native.available():
        pytest.skip("native kernels did not build here")
    folder = stores("qwen3_moe")
    want = greedy(folder, StreamConfig(resident=True), n=2)[1]
    calls, op = [], native.moe_grouped
    monkeypatch.setattr(
        native, "moe_grouped", lambda x, *a, **k: calls.append(len(x)) or op(x, *a, **k)
    )
    monkeypatch.setattr(streaming, "PREFILL_ROWS", 5)
    assert torch.equal(greedy(folder, StreamConfig(resident=True), n=2)[1], want)
    assert calls == [5, 5, 2] * len(Store(folder).crc)  # 12 prompt rows, every MoE layer


@pytest.mark.parametrize("quant", ["bf16", "int8"])
def test_other_quants_and_layouts_stream_exactly(stores, quant):
    folder = stores("qwen2_moe", quant, "per_expert")
    _, want, _ = greedy(folder, StreamConfig(resident=True), n=8)
    io = IOConfig(mode="pagecache", split=3, threads=2)
    _, got, _ = greedy(folder, StreamConfig(memory_budget=min_budget(Store(folder)), io=io), n=8)
    assert torch.equal(got, want)


def test_only_routed_experts_are_read(stores):
    folder = stores("olmoe")
    loaded = load_model(folder, StreamConfig(memory_budget=1 << 20))
    p = loaded.provider
    x = torch.randn(1, loaded.args.hidden_size)
    p.experts(0, x, torch.tensor([[5, 2]]), torch.tensor([[0.5, 0.5]]))
    assert p.stats()["misses"] == 2 and p.stats()["bytes_read"] == 2 * p.store.layout.size
    assert set(p.table.resident()) == {(0, 2), (0, 5)}
    p.experts(0, x, torch.tensor([[2, 5]]), torch.tensor([[0.5, 0.5]]))
    assert p.stats()["hits"] == 2 and p.stats()["bytes_read"] == 2 * p.store.layout.size


def test_budget_below_minimum_states_it(stores):
    folder = stores("mixtral")
    need = min_budget(Store(folder))
    with pytest.raises(ConfigError, match=f"below the minimum {need} bytes"):
        load_model(folder, StreamConfig(memory_budget=need - 1))
    with pytest.raises(ConfigError, match="needs --memory-budget"):
        StreamConfig()


def test_budget_too_small_fails_before_the_dense_load(stores, monkeypatch):
    """The budget rule needs only the manifest: no dense weight is read, no model is built, on
    the CPU slot cache, the GPU pool (reference kernel on the CPU) and through open_model."""
    import moestream.loader as loader
    from moestream.experts.config import GpuConfig
    from moestream.runtime import open_model

    def never(*a, **k):
        raise AssertionError("the dense loader ran before the budget was checked")

    monkeypatch.setattr(loader, "load_dense", never)
    monkeypatch.setattr(loader, "build_model", never)
    folder = stores("qwen3_moe")
    for cfg in (
        StreamConfig(memory_budget=1024),
        GpuConfig(gpu_budget=1024, kernel="ref", device="cpu"),
    ):
        with pytest.raises(ConfigError, match="below the minimum"):
            load_model(folder, cfg)
        with pytest.raises(ConfigError, match="below the minimum"):
            open_model(folder, experts=cfg)


def _corrupt(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def test_damaged_record_names_layer_and_expert(stores, tmp_path):
    import shutil

    folder = tmp_path / "s"
    shutil.copytree(stores("qwen3_moe"), folder)
    store = Store(folder)
    _corrupt(store.path(2), store.offset(2, 5) + 100)
    loaded = load_model(folder, StreamConfig(memory_budget=1 << 20))
    p = loaded.provider
    x = torch.randn(1, loaded.args.hidden_size)
    with pytest.raises(StoreError, match="layer 2 expert 5 is damaged"):
        p.experts(2, x, torch.tensor([[5, 1]]), torch.tensor([[0.5, 0.5]]))
    assert (2, 5) not in p.table.resident()  # a failed read leaves no slot behind
    with pytest.raises(StoreError, match="layer 2 expert 5 is damaged"):
        load_model(folder, StreamConfig(resident=True))


def test_truncated_store_names_layer_and_expert(stores, tmp_path):
    import shutil

    folder = tmp_path / "s"
    shutil.copytree(stores("qwen3_moe"), folder)
    store = Store(folder)
    os.truncate(store.path(0), store.offset(0, 6) + 10)
    with pytest.raises(StoreError, match="layer 0 expert 6 .*cut off"):
        Store(folder)


def test_damaged_dense_tensor_is_an_error(stores, tmp_path):
    import shutil

    folder = tmp_path / "s"
    shutil.copytree(stores("qwen3_moe"), folder)
    size = (folder / "dense.safetensors").stat().st_size
    _corrupt(folder / "dense.safetensors", size - 8)
    with pytest.raises(StoreError, match="dense tensor .* is damaged"):
        load_model(folder, StreamConfig(resident=True))


def test_killed_convert_leaves_nothing(tiny_dir, tmp_path, monkeypatch):
    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(writer, "_write_experts", boom)
    with pytest.raises(KeyboardInterrupt):
        convert(tiny_dir("olmoe"), tmp_path / "out", make_scheme("int8"), False)
    assert list(tmp_path.iterdir()) == []


def test_convert_refuses_existing_destination_and_writes_manifest(stores, tiny_dir):
    folder = stores("qwen3_moe")
    with pytest.raises(ConfigError, match="already exists"):
        convert(tiny_dir("qwen3_moe", "fused"), folder, make_scheme("int4"), False)
    m = json.loads((folder / "manifest.json").read_text())
    assert m["quant"] == {"name": "int4", "group_size": 32, "symmetric": False}
    assert len(m["source"]["fingerprint"]) == 64 and set(m["experts"]) == {"0", "2"}
    assert all(len(v) == 8 for v in m["experts"].values())
    assert (folder / "tokenizer.json").is_file() and is_store(folder)


def test_cli_hf_folder_is_converted_on_first_use(tiny_dir, tmp_path):
    env = dict(os.environ, MOESTREAM_CACHE=str(tmp_path / "cache"))
    cmd = [sys.executable, "-m", "moestream", "generate", "-m", str(tiny_dir("olmoe"))]
    cmd += ["-p", "def fib", "-n", "6", "--json", "--ignore-eos", "--quant", "int8"]
    outs = []
    for extra in (["--resident"], ["--memory-budget", "1KiB"], ["--memory-budget", "64KiB"]):
        r = subprocess.run(cmd + extra, env=env, capture_output=True, text=True, timeout=120)
        outs.append(r)
    assert outs[1].returncode == 2 and "below the minimum" in outs[1].stderr
    # The first run says where the copy goes and how big it is; later runs reuse it silently.
    assert "store in" in outs[0].stderr and "GiB)" in outs[0].stderr
    assert "converting" not in outs[2].stderr
    a, c = json.loads(outs[0].stdout), json.loads(outs[2].stdout)
    assert a["ids"] == c["ids"]
    keys = ("bytes_read", "hits", "misses", "evictions", "read_gbps", "stall_read_gbps")
    for key in (*keys, "io_seconds"):
        assert key in c["stats"]
    assert c["stats"]["bytes_read"] > 0 and len(list((tmp_path / "cache").iterdir())) == 1
    # Without --json the stats line carries the expert cache's numbers.
    text = subprocess.run(
        [x for x in cmd if x != "--json"] + ["--memory-budget", "64KiB"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    hit = 100 * c["stats"]["hits"] / (c["stats"]["hits"] + c["stats"]["misses"])
    assert f"experts hit {hit:.0f}%" in text.stderr and "MiB read/tok" in text.stderr


def test_record_checksum_is_isal_and_equals_zlib():
    import zlib

    from moestream.store.io import CRC_IMPL, _crc32

    assert CRC_IMPL == "isal"  # a declared dependency: a slow fallback here means a broken install
    data = torch.randint(0, 256, (1 << 16,), generator=torch.Generator().manual_seed(0))
    raw = data.to(torch.uint8).numpy().tobytes()
    assert _crc32(raw) == zlib.crc32(raw)
    assert _crc32(raw[7:], 12345) == zlib.crc32(raw[7:], 12345)
