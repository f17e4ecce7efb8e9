"""The store fault catalogue: every file of a converted store damaged the ways a disk, a careless
edit or an interrupted copy damage it, and the classification of one run on the result.

Shared by tests/test_faults_matrix.py (every kind x IO mode, in-process) and
scripts/fault_matrix.py (the same matrix, printed as a table). A run ends well in exactly two
ways: the resident bits (the same greedy ids as the undamaged store) or a named error (exit 2,
one line, naming the damaged file). Anything else is a hole: exit 0 with other ids ("wrong"), a
traceback, or an error that does not say which file.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import struct
import traceback
from collections.abc import Callable
from pathlib import Path

PROMPT = "def fibonacci(n):"
TOKENS = 6
# IO mode -> generate flags: resident copies, the slot cache through pread / O_DIRECT, mmap.
MODES = {
    "resident": ["--resident"],
    "pagecache": ["--memory-budget", "40%", "--io", "pagecache"],
    "direct": ["--memory-budget", "40%", "--io", "direct"],
    "mmap": ["--io", "mmap"],
}
OUTCOMES = ("clean error", "unchanged", "wrong", "traceback", "unnamed error")


def _json(folder: Path, name: str) -> dict:
    return json.loads((folder / name).read_text())


def _put_json(folder: Path, name: str, obj) -> None:
    (folder / name).write_text(json.dumps(obj, indent=1))


def _manifest(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def fault(folder: Path) -> None:
        m = _json(folder, "manifest.json")
        edit(m)
        _put_json(folder, "manifest.json", m)

    return fault


def _del(*keys):
    def edit(m):
        d = m
        for k in keys[:-1]:
            d = d[k]
        del d[keys[-1]]

    return _manifest(edit)


def _set(value, *keys):
    def edit(m):
        d = m
        for k in keys[:-1]:
            d = d[k]
        d[keys[-1]] = value(d[keys[-1]]) if callable(value) else value

    return _manifest(edit)


def _truncate(name: str, keep: float = 0.5):
    def fault(folder: Path) -> None:
        p = folder / name
        os.truncate(p, int(p.stat().st_size * keep))

    return fault


def _overwrite(name: str, data: bytes):
    return lambda folder: (folder / name).write_bytes(data)


def _remove(name: str):
    return lambda folder: (folder / name).unlink()


def _dangle(name: str):
    def fault(folder: Path) -> None:
        (folder / name).unlink()
        (folder / name).symlink_to(folder / "gone" / name)  # a cache whose blob is missing

    return fault


def _flip(name: str, at: Callable[[Path], list[int]]):
    def fault(folder: Path) -> None:
        p = folder / name
        data = bytearray(p.read_bytes())
        for i in at(folder):
            data[i] ^= 0x10
        p.write_bytes(bytes(data))

    return fault


def _edit_config(name: str, **changes):
    def fault(folder: Path) -> None:
        cfg = _json(folder, name)
        cfg.update(changes)
        _put_json(folder, name, cfg)

    return fault


def _record_size(folder: Path) -> int:
    return _json(folder, "manifest.json")["record"]["size"]


def _first_layer(folder: Path) -> str:
    return f"experts-L{min(map(int, _json(folder, 'manifest.json')['experts'])):03d}.bin"


def _every_record(folder: Path) -> list[int]:
    size = _record_size(folder)
    n = (folder / _first_layer(folder)).stat().st_size // size
    return [e * size + 200 for e in range(n)]


def _dense_header(folder: Path) -> tuple[int, dict]:
    raw = (folder / "dense.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, json.loads(raw[8 : 8 + n])


def _dense_edit(edit: Callable[[dict], None]):
    """Rewrite dense.safetensors' header (padded to its old length, so offsets keep)."""

    def fault(folder: Path) -> None:
        p = folder / "dense.safetensors"
        raw = p.read_bytes()
        n, header = _dense_header(folder)
        edit(header)
        new = json.dumps(header, separators=(",", ":")).encode()
        assert len(new) <= n, "edited header grew"
        p.write_bytes(raw[:8] + new.ljust(n) + raw[8 + n :])

    return fault


def _relabel(dtype_map: dict[str, str]):
    def edit(header: dict) -> None:
        name = "model.norm.weight"
        header[name]["dtype"] = dtype_map[header[name]["dtype"]]

    return _dense_edit(edit)


def _dense_data_flip(folder: Path) -> list[int]:
    n, header = _dense_header(folder)
    start = header["model.norm.weight"]["data_offsets"][0]
    return [8 + n + start + 1]


def _expert(name_of: Callable[[Path], str], make):
    """A fault on the first MoE layer's expert file (its name depends on the model)."""
    return lambda folder: make(name_of(folder))(folder)


def _no_manifest_from(folder: Path) -> None:
    (folder / "manifest.json").unlink()


def _layer_key_removed(m: dict) -> None:
    del m["experts"][min(m["experts"], key=int)]


# kind -> (the file the error must name, or a tuple of acceptable ones: a manifest checksum that
# disagrees with its file may be blamed on either), the fault.
KINDS: dict[str, tuple[str, Callable[[Path], None]]] = {
    # manifest.json
    "manifest: invalid json": ("manifest.json", _truncate("manifest.json")),
    "manifest: empty": ("manifest.json", _overwrite("manifest.json", b"")),
    "manifest: a list": ("manifest.json", _overwrite("manifest.json", b"[]")),
    "manifest: no format": ("manifest.json", _del("format")),
    "manifest: no version": ("manifest.json", _del("version")),
    "manifest: no quant": ("manifest.json", _del("quant")),
    "manifest: no quant name": ("manifest.json", _del("quant", "name")),
    "manifest: unknown quant": ("manifest.json", _set("int3", "quant", "name")),
    "manifest: group size 0": ("manifest.json", _set(0, "quant", "group_size")),
    "manifest: no record": ("manifest.json", _del("record")),
    "manifest: record size changed": ("manifest.json", _set(lambda v: v + 4096, "record", "size")),
    "manifest: no dense": ("manifest.json", _del("dense")),
    "manifest: dense a list": ("manifest.json", _set([], "dense")),
    "manifest: dense crc changed": (
        ("manifest.json", "dense.safetensors"),
        _set(lambda v: v ^ 1, "dense", "model.norm.weight"),
    ),
    "manifest: dense tensor dropped": ("manifest.json", _del("dense", "model.norm.weight")),
    "manifest: dense dtype changed": (
        ("manifest.json", "dense.safetensors"),
        _set("int32", "dense_dtypes", "model.norm.weight"),
    ),
    "manifest: no experts": ("manifest.json", _del("experts")),
    "manifest: experts a list": ("manifest.json", _set([], "experts")),
    "manifest: a layer dropped": ("manifest.json", _manifest(_layer_key_removed)),
    "manifest: layer key not a number": (
        "manifest.json",
        _manifest(lambda m: m["experts"].update({"x": m["experts"].pop(min(m["experts"]))})),
    ),
    "manifest: too few checksums": (
        "manifest.json",
        _manifest(lambda m: m["experts"][min(m["experts"])].pop()),
    ),
    "manifest: too many checksums": (
        "manifest.json",
        _manifest(lambda m: m["experts"][min(m["experts"])].append(0)),
    ),
    "manifest: checksum a string": (
        "manifest.json",
        _manifest(lambda m: m["experts"][min(m["experts"])].__setitem__(0, "x")),
    ),
    "manifest: no files": ("manifest.json", _del("files")),  # older stores: opens unchecked
    "manifest: files a list": ("manifest.json", _set([], "files")),
    "manifest: file crc changed": (
        ("manifest.json", "config.json"),
        _set(lambda v: v ^ 1, "files", "config.json"),
    ),
    "manifest: no manifest": ("manifest.json", _no_manifest_from),
    "manifest: dangling symlink": ("manifest.json", _dangle("manifest.json")),
    # config.json and the other copied files
    "config.json: truncated": ("config.json", _truncate("config.json")),
    "config.json: empty": ("config.json", _overwrite("config.json", b"")),
    "config.json: invalid": ("config.json", _overwrite("config.json", b"{not json")),
    "config.json: a list": ("config.json", _overwrite("config.json", b"[]")),
    "config.json: top-k changed": (
        "config.json",
        _edit_config("config.json", num_experts_per_tok=1),
    ),
    "config.json: rms_norm_eps": ("config.json", _edit_config("config.json", rms_norm_eps=1e-2)),
    "config.json: norm_topk_prob": (
        "config.json",
        _edit_config("config.json", norm_topk_prob=False),
    ),
    "config.json: removed": ("config.json", _remove("config.json")),
    "config.json: dangling symlink": ("config.json", _dangle("config.json")),
    "generation_config.json: truncated": (
        "generation_config.json",
        _truncate("generation_config.json"),
    ),
    "generation_config.json: invalid": (
        "generation_config.json",
        _overwrite("generation_config.json", b"{x"),
    ),
    "generation_config.json: eos changed": (
        "generation_config.json",
        _edit_config("generation_config.json", eos_token_id=5),
    ),
    "generation_config.json: removed": (
        "generation_config.json",
        _remove("generation_config.json"),
    ),
    "tokenizer.json: truncated": ("tokenizer.json", _truncate("tokenizer.json")),
    "tokenizer.json: invalid": ("tokenizer.json", _overwrite("tokenizer.json", b"{x")),
    "tokenizer.json: removed": ("tokenizer.json", _remove("tokenizer.json")),
    "tokenizer.json: dangling symlink": ("tokenizer.json", _dangle("tokenizer.json")),
    "tokenizer_config.json: truncated": (
        "tokenizer_config.json",
        _truncate("tokenizer_config.json"),
    ),
    "tokenizer_config.json: invalid": (
        "tokenizer_config.json",
        _overwrite("tokenizer_config.json", b"[1,"),
    ),
    "tokenizer_config.json: template changed": (
        "tokenizer_config.json",
        _edit_config("tokenizer_config.json", chat_template="{{ 'x' }}"),
    ),
    # dense.safetensors
    "dense: header length garbage": (
        "dense.safetensors",
        _flip("dense.safetensors", lambda f: [5, 6]),
    ),
    "dense: header json damaged": ("dense.safetensors", _flip("dense.safetensors", lambda f: [9])),
    "dense: header only": ("dense.safetensors", lambda f: _truncate_to_header(f)),
    "dense: truncated": ("dense.safetensors", _truncate("dense.safetensors", 0.9)),
    "dense: empty": ("dense.safetensors", _overwrite("dense.safetensors", b"")),
    "dense: dtype relabel, same size": (
        "dense.safetensors",
        _relabel({"F32": "I32", "BF16": "I16", "F16": "I16"}),
    ),
    "dense: dtype relabel, float": (
        "dense.safetensors",
        _relabel({"F32": "F16", "BF16": "F16", "F16": "BF16"}),
    ),
    "dense: shape changed": (
        "dense.safetensors",
        _dense_edit(
            lambda h: h["model.norm.weight"].update(shape=[1, *h["model.norm.weight"]["shape"]])
        ),
    ),
    "dense: tensor renamed": (
        "dense.safetensors",
        _dense_edit(lambda h: h.update({"model.norm.weighx": h.pop("model.norm.weight")})),
    ),
    "dense: data bit flip": ("dense.safetensors", _flip("dense.safetensors", _dense_data_flip)),
    "dense: removed": ("dense.safetensors", _remove("dense.safetensors")),
    "dense: dangling symlink": ("dense.safetensors", _dangle("dense.safetensors")),
    # the first MoE layer's expert file
    "experts: truncated half": ("experts-L", _expert(_first_layer, _truncate)),
    "experts: one byte short": ("experts-L", lambda f: _cut(f, 1)),
    "experts: empty": ("experts-L", lambda f: _overwrite(_first_layer(f), b"")(f)),
    "experts: bit flip, every record": (
        "experts-L",
        lambda f: _flip(_first_layer(f), _every_record)(f),
    ),
    "experts: zeroed": ("experts-L", lambda f: _zero(f)),
    "experts: removed": ("experts-L", _expert(_first_layer, _remove)),
    "experts: dangling symlink": ("experts-L", _expert(_first_layer, _dangle)),
    "experts: bytes appended": ("experts-L", lambda f: _append(f)),  # unused: unchanged is fine
}


def _truncate_to_header(folder: Path) -> None:
    n, _ = _dense_header(folder)
    os.truncate(folder / "dense.safetensors", 8 + n)


def _cut(folder: Path, n: int) -> None:
    p = folder / _first_layer(folder)
    os.truncate(p, p.stat().st_size - n)


def _zero(folder: Path) -> None:
    p = folder / _first_layer(folder)
    p.write_bytes(bytes(p.stat().st_size))


def _append(folder: Path) -> None:
    with open(folder / _first_layer(folder), "ab") as f:
        f.write(b"\xff" * 4096)


def generate(folder: Path, mode: str) -> tuple[int, str, str]:
    """`moestream generate` in-process: (exit code, stdout, stderr); an escaping exception is
    returned as exit code None with its traceback as stderr."""
    from moestream.cli import main

    argv = ["generate", "-m", str(folder), "-p", PROMPT, "-n", str(TOKENS), "--temp", "0"]
    argv += ["--ignore-eos", "--json", "--threads", "1", "--no-memory-guard", *MODES[mode]]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except BaseException:  # noqa: BLE001 - a traceback is what is being measured
            return None, out.getvalue(), err.getvalue() + traceback.format_exc()
    return rc, out.getvalue(), err.getvalue()


def classify(rc, out: str, err: str, file: str, want: list[int]) -> str:
    if rc is None:
        return "traceback"
    if rc == 0:
        return "unchanged" if json.loads(out)["ids"] == want else "wrong"
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("moestream: error:")]
    names = (file,) if isinstance(file, str) else file
    named = any(n in lines[0] for n in names) if len(lines) == 1 else False
    if rc == 2 and named and "Traceback" not in err:
        return "clean error"
    return "unnamed error"


def run_case(store: Path, scratch: Path, kind: str, mode: str, want: list[int]) -> tuple[str, str]:
    """Copy the store, apply the fault, generate: (outcome, the error line or ids)."""
    file, fault = KINDS[kind]
    folder = scratch / "case"
    if folder.exists():
        shutil.rmtree(folder)
    shutil.copytree(store, folder)
    fault(folder)
    rc, out, err = generate(folder, mode)
    outcome = classify(rc, out, err, file, want)
    detail = err.strip().splitlines()[-1] if err.strip() else out.strip()[:200]
    return outcome, detail
