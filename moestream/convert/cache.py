"""Where Hugging Face folders given to -m are converted on first use (under config.cache_root)."""

from __future__ import annotations

from pathlib import Path

from moestream.config import cache_root
from moestream.convert.writer import convert, source_fingerprint
from moestream.quant import QuantScheme


def cached_store(src: str | Path, scheme: QuantScheme, progress: bool = True) -> Path:
    """The store for (src, scheme), converting it first if the cache lacks it. The key holds the
    source fingerprint, so a replaced checkpoint is converted again."""
    src = Path(src)
    key = f"{src.resolve().name}-{source_fingerprint(src)[:16]}-{scheme.name}-g{scheme.group_size}"
    dst = cache_root() / key
    if not (dst / "manifest.json").is_file():
        dst.parent.mkdir(parents=True, exist_ok=True)
        convert(src, dst, scheme, progress)
    return dst
