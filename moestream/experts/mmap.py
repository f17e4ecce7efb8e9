"""The mmap provider: expert records read through the OS page cache (`--io mmap`), the way
llama.cpp reads a model by default. No budget of its own: the kernel decides what stays.

What it promises: a record's crc32 is checked on its first use (which faults its pages in), and
a change to a layer's file afterwards is noticed before the next use of that layer: each use
compares the open file's fstat (size, mtime, ctime) with the one seen last, and on a
change re-verifies the layer's used records (a damaged one is a StoreError naming it) or refuses
a truncated file (reading past its end would be SIGBUS). A crc32 on every use would add ~1.4x
the native GEMV's time (ISA-L crc32 11.7 GB/s on the dev box, the GEMV ~16 GB/s; fstat 1.3 us).
A write landing between the
check and the multiply, or one that keeps size and times, is not seen; pread / slot-cache modes
verify every read instead.
"""

from __future__ import annotations

import mmap
import os
import time

import torch

from moestream.experts.config import StreamConfig
from moestream.experts.streaming import Run, StoreExperts
from moestream.store.format import Store, StoreError


def _stamp(fd: int) -> tuple[int, int, int]:
    st = os.fstat(fd)
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns


class MmapExperts(StoreExperts):
    """Each layer's expert file mapped privately; records verified on first use and again after
    the file changes. `stats()`: first touches as misses, their fault-in time."""

    def __init__(self, store: Store, cfg: StreamConfig):
        super().__init__(store, cfg)
        self._files = {layer: open(store.path(layer), "rb") for layer in store.crc}
        self._stamps = {layer: _stamp(f.fileno()) for layer, f in self._files.items()}
        self._maps = {layer: self._map(f) for layer, f in self._files.items()}
        self._touched: dict[int, set[int]] = {layer: set() for layer in store.crc}
        self._io = 0.0

    @staticmethod
    def _map(f) -> torch.Tensor:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private: reads share pages
        return torch.frombuffer(mm, dtype=torch.uint8)

    def describe(self) -> dict:
        return {"experts": "mmap", "quant": self.store.quant_name, "kernel": self.cfg.kernel}

    def _capacity(self) -> int:
        return self.store.args.num_experts

    def _resident_run(self, layer: int, experts: list[int], run: Run) -> list:
        if self.cfg.io.verify:
            self._recheck(layer)
        return [run(i, self._mapped(layer, e)) for i, e in enumerate(experts)]

    def _recheck(self, layer: int) -> None:
        """Re-verify the layer's used records when its file changed since they were checked."""
        stamp = _stamp(self._files[layer].fileno())
        if stamp == self._stamps[layer]:
            return
        need = len(self.store.crc[layer]) * self.store.layouts[layer].size
        if stamp[0] < need:
            raise StoreError(
                f"{self.store.path(layer)} was truncated while the model ran ({stamp[0]} of "
                f"{need} bytes, layer {layer}); convert the model again"
            )
        for e in sorted(self._touched[layer]):
            self.store.check_record(layer, e, self._record(layer, e).numpy())
        self._stamps[layer] = stamp

    def _record(self, layer: int, e: int) -> torch.Tensor:
        size = self.store.layouts[layer].size
        return self._maps[layer][e * size : (e + 1) * size]

    def _mapped(self, layer: int, e: int) -> dict:
        rec = self._record(layer, e)
        if e not in self._touched[layer]:
            t0 = time.perf_counter()
            if self.cfg.io.verify:
                self.store.check_record(layer, e, rec.numpy())  # faults the pages in
            self._io += time.perf_counter() - t0
            self._touched[layer].add(e)
        return self.store.layouts[layer].views(rec)

    def stats(self) -> dict:
        n = sum(len(t) for t in self._touched.values())  # the OS may re-read dropped pages unseen
        nbytes = sum(len(t) * self.store.layouts[layer].size for layer, t in self._touched.items())
        return {
            "bytes_read": nbytes,
            "demand_bytes_read": nbytes,
            "hits": 0,
            "misses": n,
            "evictions": 0,
            "io_seconds": self._io,
            "compute_seconds": self.compute_seconds,
        }

    def close(self) -> None:
        self._maps = {}
        for f in self._files.values():
            f.close()
        self._files = {}
