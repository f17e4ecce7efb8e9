"""Open a store as a runnable model: dense weights from dense.safetensors, experts streamed."""

from __future__ import annotations

from pathlib import Path

import torch

from moestream.loader import Loaded, build_model, load_dense, resolve_dtype
from moestream.store.format import Store
from moestream.store.stream import StreamConfig, StreamingExperts


def load_store(
    folder: str | Path,
    cfg: StreamConfig,
    dtype: str | torch.dtype = "float32",
    progress: bool = False,
) -> Loaded:
    dtype = resolve_dtype(dtype)
    store = Store(folder)
    model = build_model(store.args, dtype)
    load_dense(store, model, dtype, progress)
    store.release_dense()
    model.set_provider(StreamingExperts(store, cfg))
    return Loaded(store.args, model, Path(folder))
