"""--io mmap after the store's files change on disk: a record used earlier is re-verified once its
file changes (a damaged one is a named StoreError, a truncated file is refused before it could
SIGBUS), a file replaced by rename leaves the mapped bytes as they were, and a touch re-verifies
and runs on with the same tokens."""

from __future__ import annotations

import os

import pytest
import torch

from moestream.convert.writer import convert
from moestream.engine.kv_cache import KVCache
from moestream.experts.config import StreamConfig
from moestream.loader import load_model
from moestream.quant import make_scheme
from moestream.store.format import Store, StoreError
from moestream.store.io import IOConfig

PROMPT = torch.randint(0, 320, (8,), generator=torch.Generator().manual_seed(3))
N = 12


@pytest.fixture(scope="module")
def store(tiny_dir, tmp_path_factory):
    return convert(
        tiny_dir("qwen3_moe"), tmp_path_factory.mktemp("mmap") / "s", make_scheme("int8"), False
    )


def greedy(folder, cfg: StreamConfig, fault=None, at: int = 4) -> list[int]:
    """N greedy tokens; fault(folder) runs once `at` tokens are out."""
    loaded = load_model(folder, cfg)
    cache = KVCache(loaded.args, len(PROMPT) + N, torch.float32)
    out = []
    try:
        with torch.no_grad():
            logits = loaded.model(PROMPT, cache, 0, last_only=True)[-1]
            for pos in range(len(PROMPT), len(PROMPT) + N):
                out.append(int(logits.argmax()))
                if fault and len(out) == at:
                    fault(folder)
                logits = loaded.model(torch.tensor([out[-1]]), cache, pos, last_only=True)[-1]
    finally:
        loaded.provider.close()
    return out


MMAP = StreamConfig(io=IOConfig(mode="mmap"))


@pytest.fixture(scope="module")
def want(store):
    return greedy(store, StreamConfig(resident=True))


def _flip_every_record(folder) -> None:
    s = Store(folder)
    layer = min(s.crc)
    with open(s.path(layer), "r+b") as f:  # in place: the mapping sees the new bytes
        for e in range(len(s.crc[layer])):
            f.seek(s.offset(layer, e) + 100)
            b = f.read(1)
            f.seek(s.offset(layer, e) + 100)
            f.write(bytes([b[0] ^ 0xFF]))


def _truncate(folder) -> None:
    s = Store(folder)
    os.truncate(s.path(min(s.crc)), s.layout.size)


def _replace(folder) -> None:
    s = Store(folder)
    path = s.path(min(s.crc))
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    tmp = path.with_suffix(".new")
    tmp.write_bytes(data)
    os.replace(tmp, path)  # a new inode: the open mapping keeps the old one's bytes


def _touch(folder) -> None:
    s = Store(folder)
    os.utime(s.path(min(s.crc)))


def test_undamaged_mmap_gives_the_resident_tokens(store, want):
    assert greedy(store, MMAP) == want


def test_bytes_changed_after_first_use_are_a_named_error(store, tmp_path):
    import shutil

    copy = shutil.copytree(store, tmp_path / "s")
    with pytest.raises(StoreError, match=r"experts-L000\.bin: layer 0 expert \d+ is damaged"):
        greedy(copy, MMAP, _flip_every_record)


def test_truncated_after_first_use_is_refused(store, tmp_path):
    import shutil

    copy = shutil.copytree(store, tmp_path / "s")
    with pytest.raises(StoreError, match=r"experts-L000\.bin was truncated while the model ran"):
        greedy(copy, MMAP, _truncate)


@pytest.mark.parametrize("fault", [_replace, _touch])
def test_replaced_or_touched_file_keeps_the_resident_tokens(store, tmp_path, want, fault):
    import shutil

    copy = shutil.copytree(store, tmp_path / "s")
    assert greedy(copy, MMAP, fault) == want
