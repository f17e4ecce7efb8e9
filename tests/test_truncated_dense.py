"""A store whose dense.safetensors was cut short (issue 18) stops generate, eval and serve's
startup with the error the README promises: the file named, "convert the model again", exit 2,
wherever the cut falls (inside the length prefix, the JSON header, or the tensor data)."""

from __future__ import annotations

import shutil
import struct

import pytest

from moestream.cli import main
from moestream.convert.writer import convert
from moestream.quant import make_scheme
from moestream.store.format import DENSE_FILE

# where the file is cut: a fraction of the header or data, or a byte count
CUTS = [
    "empty",
    "in the length",
    "in the header",
    "at the header's end",
    "in the data",
    "last byte",
]


@pytest.fixture(scope="module")
def store(tiny_dir, tmp_path_factory):
    return convert(
        tiny_dir("qwen3_moe"), tmp_path_factory.mktemp("s") / "s", make_scheme("int8"), False
    )


def cut_at(data: bytes, where: str) -> int:
    header = 8 + struct.unpack("<Q", data[:8])[0]
    return {
        "empty": 0,
        "in the length": 4,
        "in the header": header // 2,
        "at the header's end": header,
        "in the data": (header + len(data)) // 2,
        "last byte": len(data) - 1,
    }[where]


@pytest.fixture(params=CUTS)
def cut_store(request, store, tmp_path):
    folder = shutil.copytree(store, tmp_path / "cut")
    f = folder / DENSE_FILE
    data = f.read_bytes()
    f.write_bytes(data[: cut_at(data, request.param)])
    return folder


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "-p", "x", "-n", "2"],
        ["generate", "-p", "x", "-n", "2", "--memory-budget", "50%"],
        ["eval", "--text", "TEXT", "--no-reference"],
        ["serve", "--port", "1"],  # fails while opening the model, before it binds a port
    ],
    ids=["generate", "generate-stream", "eval", "serve"],
)
def test_a_truncated_dense_file_is_a_named_error(cut_store, tmp_path, capsys, argv):
    text = tmp_path / "t.txt"
    text.write_text("def fibonacci(n):\n    return n\n")
    argv = [str(text) if x == "TEXT" else x for x in argv]
    capsys.readouterr()
    assert main([argv[0], "-m", str(cut_store), *argv[1:]]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"moestream: error: {cut_store / DENSE_FILE}: cannot be read")
    assert "truncated or damaged; convert the model again" in err and "Traceback" not in err
