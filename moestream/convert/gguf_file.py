"""GGUF files on disk: the magic, split sets (`x-00001-of-0000N.gguf`), the conversion cache's
fingerprint, and the reader (the gguf package's, naming the first tensor a truncated file cuts
off)."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import numpy as np

from moestream.errors import CheckpointError

MAGIC = b"GGUF"
_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<n>\d{5})\.gguf$")


def is_gguf(path: str | Path) -> bool:
    """A file that starts with the GGUF magic (the content decides, not the name)."""
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == MAGIC


def split_files(path: Path) -> list[Path]:
    """The files of a (possibly split) GGUF: `x-00001-of-00003.gguf` names all three."""
    m = _SPLIT.match(path.name)
    if m is None:
        return [path]
    n = int(m["n"])
    files = [path.with_name(f"{m['stem']}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(
            f"{path}: split GGUF part(s) missing: {', '.join(missing)}; download every part "
            "into the same folder"
        )
    return files


def gguf_fingerprint(path: str | Path) -> str:
    """sha256 over each part's name, size and mtime (no weight bytes hashed)."""
    h = hashlib.sha256(b"gguf\n")
    for p in split_files(Path(path)):
        st = p.stat()
        h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _reader_class():
    import gguf

    class _Reader(gguf.GGUFReader):
        """GGUFReader that names the first tensor a truncated file cuts off (the library would
        fail reshaping an anonymous short array)."""

        def _build_tensors(self, start_offs, fields):
            size = len(self.data)
            for field in fields:
                _, name, _, dims, raw_type, offset = field.parts
                qtype = gguf.GGMLQuantizationType(int(raw_type[0]))
                block, type_size = gguf.GGML_QUANT_SIZES[qtype]
                end = start_offs + int(offset[0]) + int(np.prod(dims)) * type_size // block
                if end > size:
                    raise CheckpointError(
                        f"{self.path}: file is truncated: tensor {bytes(name).decode()!r} needs "
                        f"{end} bytes, the file has {size}; download it again"
                    )
            super()._build_tensors(start_offs, fields)

    return _Reader


def _open_reader(path: Path):
    cls = _reader_class()
    cls.path = path
    try:
        return cls(str(path), "r")
    except CheckpointError:
        raise
    except (ValueError, IndexError, KeyError, OSError) as e:
        raise CheckpointError(
            f"{path}: not a readable GGUF file ({e}); the file is truncated or damaged, "
            "download it again"
        ) from e


def open_parts(path: Path) -> tuple[list[Path], list, dict]:
    """The parts of a (possibly split) GGUF, their readers, and the first part's metadata."""
    files = split_files(path)
    readers = [_open_reader(p) for p in files]
    meta = {k: f.contents() for k, f in readers[0].fields.items()}
    count = int(meta.get("split.count", 1))
    if count != len(readers):
        raise CheckpointError(
            f"{path}: split.count is {count} but {len(readers)} file(s) were found; "
            "open the first part (-00001-of-N.gguf) with every part beside it"
        )
    for i, r in enumerate(readers):
        no = r.fields.get("split.no")
        if count > 1 and (no is None or int(no.contents()) != i):
            raise CheckpointError(f"{files[i]}: split.no is not {i}; the parts are mixed")
    return files, readers, meta
