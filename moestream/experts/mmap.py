"""The mmap provider: expert records read through the OS page cache (`--io mmap`), the way
llama.cpp reads a model by default. No budget of its own: the kernel decides what stays."""

from __future__ import annotations

import mmap
import time

import torch

from moestream.experts.config import StreamConfig
from moestream.experts.streaming import Run, StoreExperts
from moestream.store.format import Store


class MmapExperts(StoreExperts):
    """Each layer's expert file mapped privately; a record's crc32 is checked on its first use
    (which faults its pages in). `stats()`: first touches as misses, their fault-in time."""

    def __init__(self, store: Store, cfg: StreamConfig):
        super().__init__(store, cfg)
        self._maps = {layer: self._map(layer) for layer in store.crc}
        self._touched: set[tuple[int, int]] = set()
        self._io = 0.0

    def _map(self, layer: int) -> torch.Tensor:
        with open(self.store.path(layer), "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private: reads share pages
        return torch.frombuffer(mm, dtype=torch.uint8)

    def describe(self) -> dict:
        return {"experts": "mmap", "quant": self.store.scheme.name, "kernel": self.cfg.kernel}

    def _capacity(self) -> int:
        return self.store.args.num_experts

    def _resident_run(self, layer: int, experts: list[int], run: Run) -> list:
        return [run(i, self._mapped(layer, e)) for i, e in enumerate(experts)]

    def _mapped(self, layer: int, e: int) -> dict:
        size = self.store.layout.size
        rec = self._maps[layer][e * size : (e + 1) * size]
        if (layer, e) not in self._touched:
            t0 = time.perf_counter()
            if self.cfg.io.verify:
                self.store.check_record(layer, e, rec.numpy())  # faults the pages in
            self._io += time.perf_counter() - t0
            self._touched.add((layer, e))
        return self.store.layout.views(rec)

    def stats(self) -> dict:
        n = len(self._touched)  # first touches; the OS may re-read dropped pages unseen
        return {
            "bytes_read": n * self.store.layout.size,
            "demand_bytes_read": n * self.store.layout.size,
            "hits": 0,
            "misses": n,
            "evictions": 0,
            "io_seconds": self._io,
            "compute_seconds": self.compute_seconds,
        }

    def close(self) -> None:
        self._maps = {}
