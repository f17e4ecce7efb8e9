"""The on-disk expert store: manifest, file names, integrity checks, and `Store` (the reader).

A store folder holds `manifest.json`, `dense.safetensors` (every non-expert weight),
`experts-L{layer:03d}.bin` (one per MoE layer: expert e's record at e * record size, each record
4 KiB aligned), and the model's config.json / tokenizer files / generation_config.json, whose
crc32s the manifest's "files" holds (stores written before it have none and open unchecked).
Version 2: a dense weight that convert quantized (quant.DenseQuant) is stored as its sections
`{name}.q` and `{name}.s` / `{name}.sz`; the manifest's "dense_formats" names its scheme and shape,
"dense" / "dense_dtypes" hold the crc32 and dtype of every stored tensor, sections included.
Version 3 adds the q4_0 scheme (GGUF Q4_0 blocks: `q` nibbles + `d` fp16), for experts and dense
weights; version 4 the GGUF K-quant schemes q4_k / q5_k / q6_k (`q` uint8 [N, K/256, block bytes]);
version 5 the q8_0 scheme (GGUF Q8_0 blocks: `q` int8 + `d` fp16), the q4_1 scheme (GGUF Q4_1
blocks: `q` nibbles + `dm` fp16 (d, m) pairs), the q5_0 scheme (GGUF Q5_0 blocks as stored: `q` uint8
[N, K/32, 22]), the mxfp4 scheme (GGUF MXFP4 blocks as stored: `q` uint8 [N, K/32, 17]) and per-layer record layouts
with a scheme per projection ("records": layer -> schemes and layout, instead of "record"),
written only where a store needs them (q8_0, q4_1, q5_0 or mxfp4 sections, or a GGUF's kept blocks that differ in type
across projections or layers: a Q4_K_M file): every other store is still written as version 4, and
version 2 and 3 stores are read as they are. Version 6 keeps int4's (scale, zero) pairs blocked per
64 rows (quant.int4_sz_blocked), one stream beside each block's nibbles for the native kernels:
every store with int4 sections is written as version 6, and an older one with int4 sections is
refused (convert again).
Checksums are zlib.crc32 (1.3 GB/s on the dev box, computed in the IO threads, which release the
GIL; md5/sha1/blake2b measured 0.3-0.6 GB/s).
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from moestream.config import ConfigError, ModelArgs
from moestream.errors import CheckpointError
from moestream.models import model_args_from_dict
from moestream.quant import DTYPE_NAMES, QuantScheme, RecordLayout, tensor_sections

FORMAT = "moestream-store"
VERSION = 4  # written; 2: quantized dense weights (dense_formats); 3: the q4_0 scheme; 4: K-quants
# written for per-layer record layouts ("records") or q8_0 / q4_1 / q5_0 / mxfp4 sections (older readers refuse)
MIXED_VERSION = 5
# written for a store with int4 sections (experts or dense): their (scale, zero) pairs blocked per
# 64 rows (quant.int4_sz_blocked); an older store's int4 sections hold them in another order
INT4_VERSION = 6
NEWEST = INT4_VERSION  # cache keys carry it: a cached store of an older layout is not reused
READS = (2, 3, 4, 5, 6)  # an older store is a newer one without the newer schemes: still read
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


def _open_dense(path: Path):
    """safe_open with its errors named: a cut file fails here (header short, or data not covering
    what the header lists), before any tensor is read."""
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as e:
        raise StoreError(
            f"{path}: cannot be read ({e}): the file is truncated or damaged; convert the model "
            "again"
        ) from e


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


def check_manifest(m, path: Path) -> None:
    """The manifest's structure, key by key, before anything reads it (one rule for every key)."""

    def bad(what: str):
        raise StoreError(f"{path}: {what}; convert the model again")

    if not isinstance(m, dict):
        bad(f"a JSON {type(m).__name__}, not an object")
    if m.get("format") != FORMAT or m.get("version") not in READS:
        bad(
            f"format {m.get('format')!r} version {m.get('version')!r}, this moestream reads "
            f"{FORMAT!r} version {' or '.join(map(str, READS))}"
        )
    is_crc = lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**32  # noqa: E731
    rules = {  # key -> (required, check of each value)
        "quant": (True, None),
        "record": ("records" not in m, None),
        "records": (False, lambda v: isinstance(v, dict)),  # checked by record_layouts
        "dense": (True, is_crc),
        "experts": (True, lambda v: isinstance(v, list) and all(map(is_crc, v))),
        "files": (False, is_crc),
        "dense_dtypes": (False, lambda v: isinstance(v, str)),
        "dense_shapes": (
            False,
            lambda v: isinstance(v, list) and all(isinstance(i, int) for i in v),
        ),
        "dense_formats": (False, lambda v: isinstance(v, dict)),  # checked by _dense_formats
    }
    for key, (required, ok) in rules.items():
        if key not in m and not required:
            continue
        if not isinstance(m.get(key), dict):
            bad(f"'{key}' is {'missing' if key not in m else 'not an object'}")
        if ok is not None:
            wrong = [k for k, v in m[key].items() if not ok(v)]
            if wrong:
                bad(f"'{key}' has invalid entries for {', '.join(map(str, wrong[:5]))}")
    for key in ("experts", "records"):
        if not all(k.isdigit() for k in m.get(key, {})):
            bad(f"'{key}' keys must be layer numbers, got {sorted(m[key])[:5]}")
    if "records" in m and m["version"] < MIXED_VERSION:
        bad(f"'records' (per-layer record layouts) in a version {m['version']} manifest")


def _scheme_names(m: dict) -> set:
    """The schemes of a (checked) manifest's sections: its records' (per-layer ones, or its quant's
    for every layer) and its dense tensors'. (With per-layer records, quant names the scheme a
    requantized projection would take, which may hold no section.)"""
    if "records" in m:
        out = {q.get("name") for r in m["records"].values() for q in r.get("schemes", [])}
    else:
        out = {m["quant"].get("name")}
    return out | {f.get("scheme", {}).get("name") for f in m.get("dense_formats", {}).values()}


def record_layouts(path: Path, m: dict, scheme: QuantScheme, a: ModelArgs) -> dict:
    """MoE layer -> its RecordLayout: the one of `scheme` for every layer ("record"), or each
    layer's own ("records": its projections' schemes); refuses a layout this version would not
    build from the same schemes."""
    D, I, bias = a.hidden_size, a.moe_intermediate_size, a.expert_bias
    if "records" not in m:
        layout = RecordLayout.build(scheme, D, I, bias)
        if layout.to_json() != m["record"]:
            raise StoreError(f"{path}: record layout differs from this version's; convert again")
        return dict.fromkeys(a.moe_layer_ids, layout)
    out = {}
    for key, rec in m["records"].items():
        try:
            w13, w2 = (
                QuantScheme(q["name"], q["group_size"], q["symmetric"]) for q in rec["schemes"]
            )
            layout = RecordLayout.build(w13, D, I, bias, w2=w2)
        except (ConfigError, KeyError, TypeError, ValueError) as e:
            raise StoreError(
                f"{path}: layer {key}'s record has schemes this moestream does not read ({e}); "
                "convert the model again"
            ) from e
        if layout_json(layout) != rec:
            raise StoreError(
                f"{path}: layer {key}'s record layout differs from this version's; convert again"
            )
        out[int(key)] = layout
    if sorted(out) != sorted(a.moe_layer_ids):
        raise StoreError(
            f"{path}: record layouts for layers {sorted(out)}, config.json's MoE layers are "
            f"{a.moe_layer_ids}; convert the model again"
        )
    return out


def layout_json(layout: RecordLayout) -> dict:
    """A layer's entry in a version-5 manifest's "records": its schemes, then its layout."""
    return {"schemes": [s.to_json() for s in layout.schemes], **layout.to_json()}


class Store:
    """A converted model: `args`, `layouts` (per MoE layer), dense tensors (checked), expert
    record locations.

    Duck-types the parts of HFCheckpoint the dense loader uses (args, folder, dense_names, tensor).
    """

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        path = self.folder / MANIFEST
        try:
            m = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise StoreError(f"{path}: unreadable manifest ({e}); convert the model again") from e
        check_manifest(m, path)
        self.manifest = m
        check_copied_files(self.folder, m.get("files", {}))
        self.config = json.loads((self.folder / "config.json").read_text())
        self.args: ModelArgs = model_args_from_dict(self.config, str(self.folder / "config.json"))
        q = m["quant"]
        try:
            self.scheme = QuantScheme(q["name"], q["group_size"], q["symmetric"])
        except (KeyError, ConfigError) as e:
            raise StoreError(f"{path}: invalid 'quant' {q} ({e}); convert the model again") from e
        if m["version"] < INT4_VERSION and "int4" in _scheme_names(m):
            raise StoreError(
                f"{path}: a version {m['version']} store with int4 sections, whose (scale, zero) "
                f"pairs are in the order before version {INT4_VERSION}; convert the model again"
            )
        # `scheme`: every record's, or (per-layer layouts) the one requantized projections took.
        self.layouts: dict[int, RecordLayout] = record_layouts(path, m, self.scheme, self.args)
        # Slots hold the largest record: one pool and one slot table across layers (a Q4_K_M
        # store's Q4_K-down records then leave 13% of a Q6_K-down slot unused at Qwen3-30B-A3B's
        # shapes; a pool per layout would split the budget and the eviction policy in parts).
        self.slot_size = max(layout.size for layout in self.layouts.values())
        self.dense_crc: dict[str, int] = m["dense"]
        self.dense_dtypes: dict[str, str] = m.get("dense_dtypes", {})
        self.dense_shapes: dict[str, list[int]] = m.get("dense_shapes", {})
        self.dense_formats = _dense_formats(path, m)
        sections = {sec for name in self.dense_formats for sec in self._section_specs(name)}
        self.dense_names = sorted((set(self.dense_crc) - sections) | set(self.dense_formats))
        self.crc = {int(k): v for k, v in m["experts"].items()}  # layer -> [crc per expert]
        self._check_layers(path)
        self._dense = None
        self._open_dense()
        self._check_files()

    def _check_layers(self, path: Path) -> None:
        """The manifest's checksums cover every MoE layer of config.json and every expert."""
        want = self.args.moe_layer_ids
        if sorted(self.crc) != sorted(want):
            raise StoreError(
                f"{path}: checksums for layers {sorted(self.crc)}, config.json's MoE layers are "
                f"{want}; convert the model again"
            )
        for layer, crcs in self.crc.items():
            if len(crcs) != self.args.num_experts:
                raise StoreError(
                    f"{path}: {len(crcs)} checksums for layer {layer}, config.json has "
                    f"{self.args.num_experts} experts; convert the model again"
                )

    def _open_dense(self) -> None:
        """Open dense.safetensors (its header parsed) and check it holds the manifest's tensors."""
        path = self.folder / DENSE_FILE
        self._dense = _open_dense(path)
        have = set(self._dense.keys())
        if have != set(self.dense_crc):
            diff = sorted(have ^ set(self.dense_crc))
            raise StoreError(
                f"{path}: its tensors and manifest.json's differ ({', '.join(diff[:5])}); "
                "convert the model again"
            )

    @property
    def layout(self) -> RecordLayout:
        """The record layout every layer shares (a store of per-layer layouts has none)."""
        first = next(iter(self.layouts.values()))
        if any(layout != first for layout in self.layouts.values()):
            raise ValueError(f"{self.folder}: its layers' record layouts differ; use layouts")
        return first

    @property
    def mixed(self) -> bool:
        """Records differ in scheme across projections or layers (a kept Q4_K_M file)."""
        return len({s for layout in self.layouts.values() for s in layout.schemes}) > 1

    @property
    def quant_name(self) -> str:
        """The experts' scheme as said to users: 'int4', or e.g. 'q4_k+q6_k' for mixed records."""
        names = (s.name for layout in self.layouts.values() for s in layout.schemes)
        return "+".join(dict.fromkeys(names))

    def _check_files(self) -> None:
        for layer, crcs in self.crc.items():
            size = self.layouts[layer].size
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

    def offset(self, layer: int, e: int) -> int:
        return e * self.layouts[layer].size

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
            self._open_dense()
        try:
            t = self._dense.get_tensor(name)
        except SafetensorError as e:
            raise StoreError(
                f"{self.folder / DENSE_FILE}: dense tensor {name!r} unreadable ({e}); "
                "convert the model again"
            ) from e
        shape = self.dense_shapes.get(name, list(t.shape))
        if list(t.shape) != shape:
            raise StoreError(
                f"{self.folder / DENSE_FILE}: dense tensor {name!r} has shape {list(t.shape)}, "
                f"convert wrote {shape} (its header is damaged); convert the model again"
            )
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
            buf = os.pread(f.fileno(), self.layouts[layer].size, self.offset(layer, e))
        return buf

    @property
    def expert_bytes(self) -> int:
        return sum(len(c) * self.layouts[layer].size for layer, c in self.crc.items())
