"""Convert a Hugging Face folder (or a GGUF file: convert/gguf.py) into an expert store, tensor
by tensor.

Peak memory is the dense weights plus one expert being quantized: experts are read one at a time
through HFCheckpoint.expert and written as they are done. Everything goes into a hidden sibling
folder `.DST.partial-PID` that is renamed at the end, so a convert killed midway leaves nothing
that loads (a store is only recognised by its manifest, which is written last). Crash-consistency:
- one conversion per destination at a time: an flock on `.DST.lock` beside it (removed after);
  a second process waits, then reuses the finished store
  (`reuse=True`, the conversion cache) or refuses it as existing (explicit `convert`);
- SIGTERM / SIGHUP while converting remove the partial folder, then exit 128 + signal;
- SIGKILL cannot be caught: the next conversion into the destination removes partial folders
  whose process is dead;
- an OSError writing (a full disk, a read-only or vanished destination) is a ConfigError naming
  the destination, with the partial folder removed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import signal
import sys
import threading
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from moestream.config import ConfigError
from moestream.convert.gguf import GGUF_FLOAT_TYPES, GGUFCheckpoint, gguf_fingerprint, is_gguf
from moestream.convert.hf import HFCheckpoint
from moestream.convert.mxfp4 import is_mxfp4_checkpoint
from moestream.errors import TokenizerError
from moestream.models import checkpoint_renamer, model_module
from moestream.quant import (
    DenseQuant,
    ExpertQuant,
    QuantScheme,
    RecordLayout,
    expert_quant,
    is_kquant,
    kquant_source_error,
    make_dense,
    make_scheme,
    quantize,
    quantize_expert,
    record_bytes,
    tensor_width,
)
from moestream.store.format import (
    COPIED_FILES,
    DENSE_FILE,
    FORMAT,
    INT4_VERSION,
    MANIFEST,
    MIXED_VERSION,
    VERSION,
    crc32,
    dtype_name,
    expert_file,
    file_checksums,
    is_store,
    layout_json,
    tensor_crc,
)

Checkpoint = HFCheckpoint | GGUFCheckpoint


def source_scheme(src: str | Path, quant: str | None, group_size: int = 32) -> ExpertQuant:
    """`--quant` if given (every expert in that scheme), else the source's default: bf16 for a
    Hugging Face folder (lossless for bf16 weights), mxfp4 for one whose experts are MXFP4
    (gpt-oss on the hub: their values kept in their 4.25 bits, quant.quantize_mxfp4); for a
    GGUF, every expert projection whose blocks a scheme holds kept in it, the rest requantized
    into `default_scheme` (int8 when every expert tensor has >= 8 bits, else int4)."""
    if quant is not None:
        return ExpertQuant(make_scheme(quant, group_size))
    if is_gguf(src):
        return ExpertQuant(GGUFCheckpoint(src).default_scheme(group_size), keep_source=True)
    if is_mxfp4_checkpoint(src):
        return ExpertQuant(make_scheme("mxfp4"))
    return ExpertQuant(make_scheme("bf16", group_size))


def source_fingerprint(folder: str | Path) -> str:
    """sha256 over config.json and each weight file's name, size and mtime: cheap (no weight
    bytes are hashed) and changes whenever a file is replaced or re-downloaded."""
    folder = Path(folder)
    if is_gguf(folder):
        return gguf_fingerprint(folder)
    h = hashlib.sha256((folder / "config.json").read_bytes())
    for p in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.index.json")):
        st = p.stat()
        h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def convert(
    src: str | Path,
    dst: str | Path,
    scheme: QuantScheme | ExpertQuant,
    progress: bool = True,
    dense: DenseQuant | None = None,
    reuse: bool = False,
) -> Path:
    """Write the store for src into dst (which must not exist; with `reuse`, a store already there
    is returned as it is). Returns dst. `scheme`: the experts' (a plain scheme: every expert in
    it). `dense`: how the non-expert weights are stored (default: `make_dense("auto", scheme)`,
    the --quant format)."""
    scheme = expert_quant(scheme)
    dense = make_dense("auto", scheme.scheme) if dense is None else dense
    src, dst = Path(src), Path(dst)
    _check_destination(dst)
    if os.path.lexists(dst) and not reuse:
        raise ConfigError(f"{dst} already exists; remove it or choose another destination")
    _check_source(src)
    with destination_lock(dst):
        if reuse and is_store(dst):
            return dst  # another process converted it while this one waited
        if os.path.lexists(dst):
            raise ConfigError(
                f"{dst} already exists (another convert wrote it while this one waited); "
                "remove it or choose another destination"
            )
        remove_stale_partials(dst)
        tmp = dst.parent / f".{dst.name}.partial-{os.getpid()}"
        try:
            with _removed_on_signal(tmp):
                _write_store(src, tmp, scheme, dense, progress)
                os.rename(tmp, dst)
        except OSError as e:
            raise ConfigError(_os_error_text(dst, e)) from e
    return dst


def _os_error_text(dst: Path, e: OSError) -> str:
    fix = {
        errno.ENOSPC: "free space there or choose another destination",
        errno.EDQUOT: "free space there or choose another destination",
        errno.EROFS: "choose a writable destination",
        errno.EACCES: "choose a writable destination",
        errno.ENOENT: "restore the missing file (a dangling symlink?)",
    }.get(e.errno, "fix it")
    where = f": {e.filename}" if e.filename else ""
    return f"converting into {dst} failed: {e.strerror or e}{where}; {fix}, then convert again"


def _write_store(src: Path, tmp: Path, eq: ExpertQuant, dense: DenseQuant, progress: bool) -> None:
    ckpt = GGUFCheckpoint(src) if is_gguf(src) else HFCheckpoint(src)
    scheme = eq.scheme
    _check_kquant_source(ckpt, scheme)
    a = ckpt.args
    layout = RecordLayout.build(scheme, a.hidden_size, a.moe_intermediate_size, a.expert_bias)
    layouts = (
        ckpt.record_layouts(eq)
        if isinstance(ckpt, GGUFCheckpoint)
        else dict.fromkeys(a.moe_layer_ids, layout)
    )
    tmp.mkdir()
    crcs, dtypes, shapes, formats = _write_dense(ckpt, tmp, dense)
    experts = _write_experts(ckpt, layouts, tmp, progress, eq.keep_source)
    _write_files(ckpt, src, tmp)
    # One layout for every layer: version 4's "record" (as before); else each layer's own.
    uniform = all(lay == layout for lay in layouts.values())
    records = (
        {"record": layout.to_json()}
        if uniform
        else {"records": {str(layer): layout_json(lay) for layer, lay in layouts.items()}}
    )
    manifest = {
        "format": FORMAT,
        "version": _version(uniform, layouts, formats),
        "model_type": a.model_type,
        "source": {"path": str(src.resolve()), "fingerprint": source_fingerprint(src)},
        "quant": scheme.to_json(),
        **records,
        "dense_quant": dense.to_json(),
        "dense_formats": formats,
        "dense": crcs,
        "dense_dtypes": dtypes,
        "dense_shapes": shapes,
        "experts": {str(layer): crcs for layer, crcs in experts.items()},
        "files": file_checksums(tmp),
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    _fsync_dir(tmp)


def _check_kquant_source(ckpt: Checkpoint, scheme: QuantScheme) -> None:
    """A K-quant store holds a GGUF's blocks as they are (nothing quantizes into one): refused,
    before anything is written, unless every expert tensor of a GGUF is that type."""
    if not is_kquant(scheme):
        return
    if isinstance(ckpt, GGUFCheckpoint) and set(ckpt.expert_type_counts()) == {scheme.name.upper()}:
        return
    raise ConfigError(f"{ckpt.folder}: {kquant_source_error(scheme)}")


def _check_destination(dst: Path) -> None:
    if dst.is_symlink() and not dst.exists():
        raise ConfigError(
            f"{dst} is a dangling symlink (to {os.readlink(dst)}); remove it or choose another "
            "destination"
        )
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"{dst.parent}: cannot create the destination's folder ({e.strerror})"
        ) from e
    if not os.access(dst.parent, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{dst.parent} is not writable; choose another destination for {dst.name}"
        )


@contextlib.contextmanager
def destination_lock(dst: Path):
    """Hold an exclusive flock on `.DST.lock` (says so when it must wait for another process);
    the file is removed when done. A waiter that got the lock of a file already removed (its
    inode is no longer the path's) takes the new one instead."""
    path = dst.parent / f".{dst.name}.lock"
    while True:
        f = open(path, "a")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"moestream: waiting for another conversion into {dst}", file=sys.stderr)
            fcntl.flock(f, fcntl.LOCK_EX)
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path).st_ino == os.fstat(f.fileno()).st_ino:
                break
        f.close()
    try:
        yield
    finally:
        path.unlink(missing_ok=True)  # before the close: a waiter then sees a stale inode
        f.close()


def remove_stale_partials(dst: Path) -> list[Path]:
    """Remove `.DST.partial-PID` folders whose process is dead (a SIGKILLed convert). Called
    under the destination's lock, so no live conversion is writing one of them."""
    removed = []
    for p in dst.parent.glob(f".{glob_escape(dst.name)}.partial-*"):
        pid = p.name.rsplit("-", 1)[1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def glob_escape(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # ours from an earlier attempt in this process: not being written now
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


@contextlib.contextmanager
def _removed_on_signal(tmp: Path):
    """Remove tmp when the body fails, and turn SIGTERM / SIGHUP into an exit that does it too.
    Handlers can only be set from the main thread; elsewhere (a server's worker) only failures
    are covered."""

    def on_signal(signum, frame):
        raise SystemExit(128 + signum)

    main = threading.current_thread() is threading.main_thread()
    saved = (
        {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGHUP)} if main else {}
    )
    try:
        yield
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def _write_files(ckpt: Checkpoint, src: Path, out: Path) -> None:
    """config and tokenizer files: copied from a folder, built from a GGUF's metadata."""
    if isinstance(ckpt, GGUFCheckpoint):
        ckpt.write_files(out)
        return
    for name in COPIED_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)


def _check_source(src: Path) -> None:
    """Refuse, before anything is written, a folder that would not give a store that runs."""
    if is_store(src):
        origin = json.loads((src / MANIFEST).read_text()).get("source", {}).get("path", "")
        raise ConfigError(
            f"{src} is already a moestream store; run it as it is (-m {src}), or convert its "
            f"Hugging Face folder{f' ({origin})' if origin else ''} for another --quant"
        )
    if src.is_dir() and not (src / "tokenizer.json").is_file():
        raise TokenizerError(
            f"{src / 'tokenizer.json'} not found: a store needs the checkpoint's tokenizer.json "
            "(fast tokenizer) to run; copy it from the original model folder, then convert"
        )


def _write_dense(ckpt: Checkpoint, out: Path, dense: DenseQuant) -> tuple[dict, dict, dict, dict]:
    """Non-expert tensors -> (crc32, dtype and shape per stored tensor, the quantized ones'
    formats). A tensor `dense` gives a scheme is stored as its sections `{name}.q`, `.s` / `.sz` /
    `.d`; under `keep_source` a quantized GGUF weight is never rounded again: its blocks go in as
    they are where a store scheme holds them (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K), else it is
    dequantized (float32). The
    rest as in the source (dtype kept). The crc covers bytes only: a header relabelling dtype or
    shape keeps them, so both are recorded too."""
    roles = _dense_roles(ckpt)
    tensors, formats, done = {}, {}, Counter()
    for name in ckpt.dense_names:
        exact, keep = None, dense.keep_source and _quantized_source(ckpt, name)
        if keep and name in roles:
            exact = ckpt.dense_sections(name, dense.weights)  # no rounding: kept whatever its size
        if exact is not None:
            scheme, secs = exact
            shape = [secs["q"].shape[0], tensor_width(scheme, secs["q"])]
        else:
            t = ckpt.tensor(name).contiguous()
            scheme = None if keep else dense.scheme_for(roles.get(name), tuple(t.shape))
            if scheme is None or not t.is_floating_point():
                tensors[name] = t
                done[_dense_note(ckpt, name, None, False)] += 1
                continue
            secs, shape = quantize(scheme, t), list(t.shape)
        for suffix, sec in secs.items():
            tensors[f"{name}.{suffix}"] = sec.contiguous()
        formats[name] = {"scheme": scheme.to_json(), "shape": shape}
        done[_dense_note(ckpt, name, scheme, exact is not None)] += 1
    for (kind, what), n in sorted((k, n) for k, n in done.items() if k is not None):
        print(f"moestream: {n} {kind} dense tensor(s): {what}", file=sys.stderr)
    save_file(tensors, str(out / DENSE_FILE), metadata={"format": "pt"})
    crcs = {name: tensor_crc(t) for name, t in tensors.items()}
    dtypes = {name: dtype_name(t.dtype) for name, t in tensors.items()}
    return crcs, dtypes, {name: list(t.shape) for name, t in tensors.items()}, formats


def _quantized_source(ckpt: Checkpoint, name: str) -> bool:
    """A GGUF dense tensor stored in a quantized type (not F32/F16/BF16)."""
    return isinstance(ckpt, GGUFCheckpoint) and ckpt.dense_type(name) not in GGUF_FLOAT_TYPES


def _dense_note(ckpt: Checkpoint, name: str, scheme: QuantScheme | None, exact: bool):
    """(GGUF type, what convert did) for a quantized GGUF dense tensor, else None (not said)."""
    if not _quantized_source(ckpt, name):
        return None
    if exact:
        return ckpt.dense_type(name), f"kept exactly as {scheme.name} (same values)"
    if scheme is None:
        return ckpt.dense_type(name), "dequantized once to float32"
    return ckpt.dense_type(name), f"dequantized and requantized to {scheme.name} (lossy)"


def _dense_roles(ckpt: Checkpoint) -> dict[str, str]:
    """Checkpoint name -> role of each dense weight the model may take quantized, from the model
    itself (built on the meta device: no memory)."""
    with torch.device("meta"):
        model = model_module(ckpt.args.model_type).build(ckpt.args)
    roles = model.dense_roles()
    ours = checkpoint_renamer(ckpt.args.model_type)
    return {name: roles[ours(name)] for name in ckpt.dense_names if ours(name) in roles}


def _write_experts(
    ckpt: Checkpoint, layouts: dict[int, RecordLayout], out: Path, progress: bool, keep: bool
) -> dict[int, list[int]]:
    a = ckpt.args
    total = len(a.moe_layer_ids) * a.num_experts
    names = "+".join(dict.fromkeys(s.name for lay in layouts.values() for s in lay.schemes))
    desc = f"converting experts ({names})"
    if isinstance(ckpt, GGUFCheckpoint):
        # Said every time: what happens to each GGUF type (kept exactly or requantized).
        for line in ckpt.conversion_notes(layouts, keep):
            print(f"moestream: {line}", file=sys.stderr)
    crcs: dict[int, list[int]] = {}
    # `with`: a failing expert closes the bar before the error line is printed.
    with tqdm(total=total, desc=desc, disable=not progress) as bar:
        for layer in a.moe_layer_ids:
            crcs[layer] = []
            with open(out / expert_file(layer), "wb") as f:
                for e in range(a.num_experts):
                    rec = _expert_record(ckpt, layouts[layer], layer, e)
                    crcs[layer].append(crc32(rec))
                    f.write(rec)
                    bar.update()
                f.flush()
                os.fsync(f.fileno())
    return crcs


def _expert_record(ckpt: Checkpoint, layout: RecordLayout, layer: int, e: int) -> bytes:
    if isinstance(ckpt, GGUFCheckpoint):  # Q8_0 blocks go in as they are (no requantization)
        return record_bytes(layout, ckpt.expert_sections(layout, layer, e))
    gate, up, down = ckpt.expert(layer, e)  # [I, D], [I, D], [D, I]
    w13 = torch.cat([gate.float(), up.float()])  # [2I, D]
    b13 = b2 = None
    if ckpt.args.expert_bias:
        b_gate, b_up, b2 = ckpt.expert_biases(layer, e)  # [I], [I], [D]
        b13 = torch.cat([b_gate, b_up])
    return record_bytes(layout, quantize_expert(layout, w13, down.float(), b13, b2))


def _fsync_dir(folder: Path) -> None:
    for p in folder.iterdir():
        with open(p, "rb") as f:
            os.fsync(f.fileno())


def _version(uniform: bool, layouts: dict, formats: dict) -> int:
    """The oldest version that reads this store: 6 with int4 sections (their blocked (scale, zero)
    pairs), 5 with per-layer records or a q8_0 / q4_1 / q5_0 / mxfp4 projection or dense tensor (schemes
    version 4 readers do not know), else 4."""
    names = {s.name for lay in layouts.values() for s in lay.schemes}
    names |= {f["scheme"]["name"] for f in formats.values()}
    if "int4" in names:
        return INT4_VERSION
    return VERSION if uniform and not names & {"q8_0", "q4_1", "q5_0", "mxfp4"} else MIXED_VERSION
