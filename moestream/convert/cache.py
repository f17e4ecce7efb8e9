"""Where Hugging Face folders given to -m are converted on first use (under config.cache_root)."""

from __future__ import annotations

import sys
from pathlib import Path

from moestream.config import cache_root
from moestream.convert.writer import convert, source_fingerprint
from moestream.quant import ExpertQuant, QuantScheme, expert_quant, make_dense
from moestream.store.format import NEWEST


def cached_store(src: str | Path, scheme: QuantScheme | ExpertQuant, progress: bool = True) -> Path:
    """The store for (src, scheme), converting it first if the cache lacks it. The key holds the
    source fingerprint, so a replaced checkpoint is converted again, and the store version and
    dense format (the --quant default), so an older store in the cache is not reused. Two
    processes asking at once: the second waits on the destination's lock and reuses the first's
    store."""
    src, eq = Path(src), expert_quant(scheme)
    dense = make_dense("auto", eq.scheme)
    dst = cache_root() / store_key(src, eq)
    if not (dst / "manifest.json").is_file():
        # Said every time, progress bars or not: a copy of the model is being written to disk.
        what = f"{eq.scheme.name} store" + (" (GGUF blocks kept)" if eq.keep_source else "")
        print(f"moestream: converting {src} to a {what} in {dst} (once)", file=sys.stderr)
        convert(src, dst, scheme, progress, dense, reuse=True)
        size = sum(p.stat().st_size for p in dst.iterdir() if p.is_file())
        print(f"moestream: wrote {dst} ({size / 2**30:.2f} GiB)", file=sys.stderr)
    return dst


def store_key(src: Path, scheme: QuantScheme | ExpertQuant) -> str:
    """The cache folder name of (src, scheme): source name and fingerprint, expert scheme (and
    whether a GGUF's blocks are kept), dense format and store version."""
    eq = expert_quant(scheme)
    key = f"{src.resolve().name}-{source_fingerprint(src)[:16]}-{eq.tag}"
    return key + f"-d{make_dense('auto', eq.scheme).tag}-v{NEWEST}"
