"""Reading expert records: a preallocated, page-aligned slot pool and a pread thread pool.

Slots are one anonymous mmap (page aligned, so every record-sized slot is aligned for O_DIRECT).
Misses are read with os.preadv straight into their slots, optionally split into N parallel
page-aligned parts (each part one pool job; the last part to finish checksums the record), all in
the pool's threads (pread and zlib.crc32 release the GIL). The pool is a priority queue: demand
reads (the layer computing now waits on them) jump ahead of queued prefetch reads, and a demand
read waits at most for the parts already running, not for whole queued records.
"""

from __future__ import annotations

import itertools
import mmap
import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

try:  # ISA-L's crc32 is zlib's checksum at ~10x the speed (12.7 vs 1.3 GB/s on the dev box)
    from isal.isal_zlib import crc32 as _crc32

    CRC_IMPL = "isal"
except ImportError:  # isal is a dependency; zlib (same values) where it has no wheel
    from zlib import crc32 as _crc32

    CRC_IMPL = "zlib"

from moestream.config import ConfigError
from moestream.quant import RECORD_ALIGN
from moestream.store.format import Store, StoreError


@dataclass(frozen=True, slots=True)
class IOConfig:
    mode: str = "direct"  # direct (O_DIRECT) | pagecache (buffered pread) | mmap (OS page cache)
    threads: int = 4
    split: int = 1  # parallel reads per record
    verify: bool = True  # crc32 of every record read

    def __post_init__(self):
        if self.mode not in ("direct", "pagecache", "mmap"):
            raise ConfigError(f"unknown --io {self.mode!r}; use direct, pagecache or mmap")
        if self.threads < 1 or self.split < 1:
            raise ConfigError("IO threads and record split must be >= 1")


DEMAND, PREFETCH, PREFETCH_LOW = 0, 1, 2  # IO priorities: lower runs first


class PriorityPool:
    """A thread pool whose queue is ordered by (priority, arrival): a demand read submitted after
    queued prefetches starts before them. Jobs already running are not preempted."""

    def __init__(self, threads: int, name: str = "moestream-io"):
        self.q: queue.PriorityQueue = queue.PriorityQueue()
        self.seq = itertools.count()
        self.workers = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
            for i in range(threads)
        ]
        for w in self.workers:
            w.start()

    def submit(self, fn, *args, priority: int = DEMAND) -> Future:
        fut: Future = Future()
        self.q.put((priority, next(self.seq), fut, fn, args))
        return fut

    def _work(self) -> None:
        while True:
            _, _, fut, fn, args = self.q.get()
            if fut is None:
                return
            if not fut.set_running_or_notify_cancel():
                continue  # cancelled while queued
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # handed to whoever waits on the future
                fut.set_exception(e)

    def shutdown(self) -> None:
        for _ in self.workers:  # sentinels sort after every queued job
            self.q.put((PREFETCH_LOW + 1, next(self.seq), None, None, None))
        for w in self.workers:
            w.join()


class RecordRead:
    """One record read as several part jobs; future-like (`done`, `result`, `cancel`). The last
    part to finish runs the checksum and completes it. `cancel` succeeds only before any part
    has started (a started read must finish: its slot is being written)."""

    def __init__(self, parts: int, nbytes: int):
        self.nbytes = nbytes  # the record's size
        self.lock = threading.Lock()
        self.left, self.started, self.cancelled = parts, False, False
        self.error: BaseException | None = None
        self.fut: Future = Future()

    def begin(self) -> bool:
        """A part is about to run; False when the read was cancelled (the part is skipped)."""
        with self.lock:
            if not self.cancelled:
                self.started = True
            return not self.cancelled

    def end(self, error: BaseException | None) -> bool:
        """A part ended; True for the last one."""
        with self.lock:
            self.error = self.error or error
            self.left -= 1
            return self.left == 0

    def cancel(self) -> bool:
        with self.lock:
            if self.started:
                return False
            self.cancelled = True
        return self.fut.cancel() or self.fut.cancelled()

    def done(self) -> bool:
        return self.fut.done()

    def result(self, timeout: float | None = None):
        return self.fut.result(timeout)


def record_memory(nbytes: int) -> mmap.mmap:
    """Page-aligned anonymous memory for expert records: private, and asking for transparent huge
    pages (a decode streams ~20 MB of records per layer; 4 KiB pages cost a TLB walk each and stop
    the prefetchers at every page: the layer op ran ~10% faster on huge pages, docs/cpu.md)."""
    mem = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux
        mem.madvise(mmap.MADV_HUGEPAGE)
    return mem


class SlotPool:
    """n_slots record buffers of the store's largest record size in one aligned allocation;
    `views(layer, slot)` = typed section views of that layer's record layout over the slot."""

    def __init__(self, store: Store, n_slots: int):
        self.size = store.slot_size
        self.mem = record_memory(n_slots * self.size)
        self.buf = torch.frombuffer(self.mem, dtype=torch.uint8, count=n_slots * self.size)
        self._layouts = list(dict.fromkeys(store.layouts.values()))  # distinct, usually one
        self._layout_of = {layer: self._layouts.index(v) for layer, v in store.layouts.items()}
        # (layout index, slot) -> views, made on first use: with per-layer layouts a slot serves
        # any layer, but a resident pool's slot only ever one.
        self._views: dict[tuple[int, int], dict] = {}

    def views(self, layer: int, slot: int) -> dict:
        key = (self._layout_of[layer], slot)
        v = self._views.get(key)
        if v is None:
            buf = self.buf[slot * self.size : (slot + 1) * self.size]
            v = self._views[key] = self._layouts[key[0]].views(buf)
        return v

    def memview(self, slot: int) -> memoryview:
        return memoryview(self.mem)[slot * self.size : (slot + 1) * self.size]


class RecordReader:
    """Reads (layer, expert) records into slots; counts bytes and IO wall time."""

    def __init__(self, store: Store, pool: SlotPool, cfg: IOConfig):
        self.store, self.pool, self.cfg = store, pool, cfg
        flags = os.O_RDONLY | (os.O_DIRECT if cfg.mode == "direct" else 0)
        self.fds: dict[int, int] = {}
        for layer in store.crc:
            try:
                self.fds[layer] = os.open(store.path(layer), flags)
            except OSError as e:
                raise ConfigError(
                    f"cannot open {store.path(layer)} with --io {cfg.mode} ({e}); "
                    "the filesystem may not support O_DIRECT: use --io pagecache"
                ) from e
        self.exec = PriorityPool(cfg.threads)
        part = -(-pool.size // cfg.split)
        self.part = -(-part // RECORD_ALIGN) * RECORD_ALIGN
        self.bytes_read = 0
        self.io_seconds = 0.0

    def _read_part(self, layer: int, e: int, slot: int, start: int) -> None:
        n = min(self.part, self.store.layouts[layer].size - start)
        mv = self.pool.memview(slot)[start : start + n]
        off = self.store.offset(layer, e) + start
        got = os.preadv(self.fds[layer], [mv], off)
        if got != n:
            raise StoreError(
                f"{self.store.path(layer)}: layer {layer} expert {e} is truncated "
                f"(read {got} of {n} bytes at offset {off}); convert the model again"
            )

    def _part(self, rr: RecordRead, layer: int, e: int, slot: int, start: int) -> None:
        if not rr.begin():
            return
        err = None
        try:
            self._read_part(layer, e, slot, start)
        except BaseException as ex:  # handed to whoever waits on the record
            err = ex
        if not rr.end(err):
            return
        if rr.error is None and self.cfg.verify:
            try:
                self.check(layer, e, self.pool.memview(slot)[: rr.nbytes])
            except BaseException as ex:
                rr.error = ex
        if rr.error is None:
            rr.fut.set_result(None)
        else:
            rr.fut.set_exception(rr.error)

    def check(self, layer: int, e: int, buf) -> None:
        """The record's crc32 against the manifest; the store's own check names the damage."""
        if _crc32(buf) & 0xFFFFFFFF != self.store.crc[layer][e]:
            self.store.check_record(layer, e, buf)

    def submit(self, layer: int, e: int, slot: int, priority: int = DEMAND) -> RecordRead:
        """Queue one record's part reads (and its checksum) into its slot."""
        size = self.store.layouts[layer].size  # the record's own size (a slot may be larger)
        starts = range(0, size, self.part)
        rr = RecordRead(len(starts), size)
        for start in starts:
            self.exec.submit(self._part, rr, layer, e, slot, start, priority=priority)
        return rr

    def read(self, layer: int, misses: list[tuple[int, int]]) -> None:
        """Fill slots for misses [(expert, slot)] of one layer; raises StoreError on damage."""
        if not misses:
            return
        self.wait([self.submit(layer, e, slot) for e, slot in misses])

    def wait(self, reads: list[RecordRead]) -> None:
        """Wait for demand reads; counts their bytes and the time spent waiting (the stall)."""
        if not reads:
            return
        t0 = time.perf_counter()
        errors = [r.fut.exception() for r in reads]  # waits for every read: none left writing
        for err in errors:
            if err is not None:
                raise err
        self.io_seconds += time.perf_counter() - t0
        self.bytes_read += sum(r.nbytes for r in reads)

    def read_async(self, layer: int, e: int, slot: int, priority: int = PREFETCH) -> RecordRead:
        """Prefetch one record into its slot behind every queued demand read. The caller must keep
        the slot from being reused until the read is done (SlotTable.busy)."""
        return self.submit(layer, e, slot, priority)

    def close(self) -> None:
        self.exec.shutdown()
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}
