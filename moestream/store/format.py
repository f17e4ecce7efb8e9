"""The on-disk expert store: manifest, file names, integrity checks, and `Store` (the reader).

A store folder holds `manifest.json`, `dense.safetensors` (every non-expert weight),
`experts-L{layer:03d}.bin` (one per MoE layer: expert e's record at e * record size, each record
4 KiB aligned), and the model's config.json / tokenizer files / generation_config.json, whose
crc32s the manifest's "files" holds (stores written before it have none and open unchecked).
Version 2: a dense weight that convert quantized (quant.DenseQuant) is stored as its sections
`{name}.q` and `{name}.s` / `{name}.sz`; the manifest's "dense_formats" names its scheme and shape,
"dense" / "dense_dtypes" hold the crc32 and dtype of every stored tensor, sections included.
Version 3 adds the q4_0 scheme (GGUF Q4_0 blocks: `q` nibbles + `d` fp16), for experts and dense
weights; version 2 stores are read as they are.
Checksums are zlib.crc32 (1.3 GB/s on the dev box, computed in the IO threads, which release the
GIL; md5/sha1/blake2b measured 0.3-0.6 GB/s).
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import torch
from safetensors import safe_open

from moestream.config import ConfigError, ModelArgs
from moestream.errors import CheckpointError
from moestream.models import model_args_from_dict
from moestream.quant import DTYPE_NAMES, QuantScheme, RecordLayout, tensor_sections

FORMAT = "moestream-store"
VERSION = 3  # written; 2: quantized dense weights (dense_formats); 3: the q4_0 scheme
READS = (2, 3)  # a version-2 store is a version-3 one without q4_0: still read
MANIFEST = "manifest.json"
DENSE_FILE = "dense.safetensors"
COPIED_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
)


class StoreError(CheckpointError):
    """A store that is damaged, truncated or from another format version; says what to redo."""


def expert_file(layer: int) -> str:
    return f"experts-L{layer:03d}.bin"


def is_store(folder: str | Path) -> bool:
    return (Path(folder) / MANIFEST).is_file()


def crc32(buf) -> int:
    return zlib.crc32(buf) & 0xFFFFFFFF


def file_checksums(folder: Path) -> dict[str, int]:
    """crc32 of each COPIED_FILES file present in folder (they are small: read whole)."""
    return {n: crc32((folder / n).read_bytes()) for n in COPIED_FILES if (folder / n).is_file()}


def check_copied_files(folder: Path, want: dict[str, int]) -> None:
    """Refuse a store whose config/tokenizer files differ from what convert wrote: a changed
    num_experts_per_tok or rms_norm_eps would otherwise change the output silently."""
    for name, crc in want.items():
        path = folder / name
        if not path.is_file():
            raise StoreError(f"{path}: {name} of the store is missing; convert again")
        if crc32(path.read_bytes()) != crc:
            raise StoreError(
                f"{path}: {name} of the store was changed after convert; convert again"
            )


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_crc(t: torch.Tensor) -> int:
    return crc32(t.contiguous().view(torch.uint8).numpy().tobytes()) if t.numel() else 0


def _dense_formats(path: Path, m: dict) -> dict[str, tuple[QuantScheme, tuple[int, int]]]:
    """The manifest's quantized dense tensors -> (scheme, [N, K]); refuses a layout this version
    does not write (an unknown scheme, sections missing from the dense file)."""
    out = {}
    for name, f in m.get("dense_formats", {}).items():
        try:
            q, shape = f["scheme"], tuple(f["shape"])
            scheme = QuantScheme(q["name"], q["group_size"], q["symmetric"])
            if scheme.name == "bf16" or len(shape) != 2:
                raise ConfigError(f"{scheme.name} {list(shape)}")
            specs = tensor_sections(scheme, name, *shape)
        except (ConfigError, KeyError, TypeError, ValueError) as e:
            raise StoreError(
                f"{path}: dense tensor {name!r} has a format this moestream does not read ({e}); "
                "convert the model again"
            ) from e
        for sec, dt, _ in specs:
            if m.get("dense_dtypes", {}).get(sec) != DTYPE_NAMES[dt] or sec not in m["dense"]:
                raise StoreError(
                    f"{path}: dense tensor {name!r} lacks its section {sec!r} "
                    f"({DTYPE_NAMES[dt]}); convert the model again"
                )
        out[name] = (scheme, shape)
    return out


class Store:
    """A converted model: `args`, `layout`, dense tensors (checked), expert record locations.

    Duck-types the parts of HFCheckpoint the dense loader uses (args, folder, dense_names, tensor).
    """

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        path = self.folder / MANIFEST
        try:
            m = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise StoreError(f"{path}: unreadable manifest ({e}); convert the model again") from e
        if m.get("format") != FORMAT or m.get("version") not in READS:
            raise StoreError(
                f"{path}: format {m.get('format')!r} version {m.get('version')!r}, this moestream "
                f"reads {FORMAT!r} version {' or '.join(map(str, READS))}; convert the model again"
            )
        self.manifest = m
        check_copied_files(self.folder, m.get("files", {}))
        self.config = json.loads((self.folder / "config.json").read_text())
        self.args: ModelArgs = model_args_from_dict(self.config, str(self.folder / "config.json"))
        q = m["quant"]
        self.scheme = QuantScheme(q["name"], q["group_size"], q["symmetric"])
        a = self.args
        self.layout = RecordLayout.build(
            self.scheme, a.hidden_size, a.moe_intermediate_size, a.expert_bias
        )
        if self.layout.to_json() != m["record"]:
            raise StoreError(f"{path}: record layout differs from this version's; convert again")
        self.dense_crc: dict[str, int] = m["dense"]
        self.dense_dtypes: dict[str, str] = m.get("dense_dtypes", {})
        self.dense_formats = _dense_formats(path, m)
        sections = {sec for name in self.dense_formats for sec in self._section_specs(name)}
        self.dense_names = sorted((set(self.dense_crc) - sections) | set(self.dense_formats))
        self.crc = {int(k): v for k, v in m["experts"].items()}  # layer -> [crc per expert]
        self._dense = None
        self._check_files()

    def _check_files(self) -> None:
        size = self.layout.size
        for layer, crcs in self.crc.items():
            path = self.path(layer)
            if not path.is_file():
                raise StoreError(f"{path} (layer {layer}) is missing; convert the model again")
            have = path.stat().st_size
            if have < len(crcs) * size:
                first = have // size
                raise StoreError(
                    f"{path} is truncated: layer {layer} expert {first} (and later) are cut off "
                    f"({have} of {len(crcs) * size} bytes); convert the model again"
                )

    def path(self, layer: int) -> Path:
        return self.folder / expert_file(layer)

    def offset(self, e: int) -> int:
        return e * self.layout.size

    def check_record(self, layer: int, e: int, buf) -> None:
        """Raise StoreError naming layer and expert when the record's checksum does not match."""
        got, want = crc32(buf), self.crc[layer][e]
        if got != want:
            raise StoreError(
                f"{self.path(layer)}: layer {layer} expert {e} is damaged (crc32 {got:08x}, "
                f"manifest {want:08x}); convert the model again"
            )

    def tensor(self, name: str) -> torch.Tensor:
        if self._dense is None:
            self._dense = safe_open(str(self.folder / DENSE_FILE), framework="pt")
        t = self._dense.get_tensor(name)
        want = self.dense_dtypes.get(name, dtype_name(t.dtype))
        if dtype_name(t.dtype) != want:
            raise StoreError(
                f"{self.folder / DENSE_FILE}: dense tensor {name!r} is {dtype_name(t.dtype)}, "
                f"convert wrote {want} (its header is damaged); convert the model again"
            )
        if tensor_crc(t) != self.dense_crc[name]:
            raise StoreError(
                f"{self.folder / DENSE_FILE}: dense tensor {name!r} is damaged (checksum mismatch); "
                "convert the model again"
            )
        return t

    def dense_scheme(self, name: str) -> QuantScheme | None:
        """The scheme dense tensor `name` is stored in (None: float, as in the checkpoint)."""
        f = self.dense_formats.get(name)
        return None if f is None else f[0]

    def _section_specs(self, name: str) -> dict[str, tuple]:
        scheme, (n, k) = self.dense_formats[name]
        return {sec: (dt, shape) for sec, dt, shape in tensor_sections(scheme, name, n, k)}

    def dense_sections(self, name: str) -> dict[str, torch.Tensor]:
        """A quantized dense tensor's sections by suffix ('q', 's' / 'sz'), each checked (crc32,
        dtype, shape) against what convert wrote."""
        out = {}
        for sec, (dt, shape) in self._section_specs(name).items():
            t = self.tensor(sec)
            if t.dtype != dt or tuple(t.shape) != shape:
                raise StoreError(
                    f"{self.folder / DENSE_FILE}: section {sec!r} is {dtype_name(t.dtype)} "
                    f"{list(t.shape)}, its format needs {dtype_name(dt)} {list(shape)}; convert the "
                    "model again"
                )
            out[sec.rpartition(".")[2]] = t
        return out

    def release_dense(self) -> None:
        """Drop the dense file's mapping once its tensors are copied (else its pages count twice)."""
        self._dense = None

    def read_record(self, layer: int, e: int) -> bytes:
        """One record through the page cache (tests, mmap/resident fill)."""
        with open(self.path(layer), "rb") as f:
            buf = os.pread(f.fileno(), self.layout.size, self.offset(e))
        return buf

    @property
    def expert_bytes(self) -> int:
        return sum(len(c) for c in self.crc.values()) * self.layout.size
