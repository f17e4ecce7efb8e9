"""Slot residency for the streamed expert cache: which (layer, expert) records sit in which slot of
a fixed pool, the reads that fill them, and the prefetch reads in flight. Bytes and bookkeeping
only; the provider (experts/streaming.py) decides what to compute when.

A step (`PendingStep`) makes one layer's experts resident: the slot table's access, then its
misses as queued demand reads. A slot being read is reserved in the table (never a victim); a
demand access that needs an in-flight prefetch waits for it. Prefetch counters: reads, used (a
demand access found the record before it was evicted), late (demand had to wait for the read),
wasted (evicted unused), dropped (no slot could be freed), cancelled (still queued when the
router proved the prediction wrong: never read).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from moestream.store.format import Store, StoreError
from moestream.store.io import PREFETCH, IOConfig, RecordRead, RecordReader, SlotPool
from moestream.store.policy import Key, PolicyError, SlotTable, Step, make_policy


@dataclass
class PendingStep:
    """One layer's experts being made resident: the table's step and its demand reads."""

    layer: int
    experts: list[int]
    step: Step
    reads: list[RecordRead]  # one per step.misses, same order

    @property
    def keys(self) -> list[Key]:
        return [(self.layer, e) for e, _ in self.step.misses]


class SlotResidency:
    """A pool of `n_slots` record slots over a store, its slot table and its IO pool."""

    def __init__(self, store: Store, n_slots: int, policy: str, io: IOConfig):
        self.store, self.n_slots = store, n_slots
        layers = sorted(store.crc)
        self.table = SlotTable(
            n_slots, make_policy(policy, layers=layers), store.args.num_experts_per_tok
        )
        self.pool = SlotPool(store, n_slots)
        self.reader = RecordReader(store, self.pool, io)
        self.inflight: dict[Key, RecordRead] = {}  # prefetch reads not yet reaped
        self.prefetched: set[Key] = set()  # read ahead, not yet used by demand
        self.requested: PendingStep | None = None  # queued by request(), not yet settled
        self.pf = dict.fromkeys(("reads", "used", "late", "wasted", "dropped", "cancelled"), 0)
        self.pf_bytes = dict.fromkeys(("reads", "wasted"), 0)  # records' own sizes (per layer)
        self.pf_wait = 0.0

    def views(self, layer: int, slot: int) -> dict:
        return self.pool.views(layer, slot)

    def capacity(self) -> int:
        """Experts one layer may hold at once (sticky/pinned policies hold fewer than n_slots)."""
        return self.table.policy.capacity(self.n_slots)

    # ---- demand --------------------------------------------------------------------------------
    def begin(self, layer: int, experts: list[int]) -> PendingStep:
        """The step making `experts` resident: the one `request` started, or a new one."""
        req, self.requested = self.requested, None
        if req is None or (req.layer, req.experts) != (layer, experts):
            if req is not None:
                self.complete(req)  # requested but not computed: settle its reads first
            req = self.start(layer, experts)
        return req

    def request(self, layer: int, experts: list[int]) -> None:
        """Queue a step's demand reads now; the next `begin` for the same experts takes it."""
        req, self.requested = self.requested, None
        if req is not None:
            self.complete(req)
        self.requested = self.start(layer, experts)

    def start(self, layer: int, experts: list[int]) -> PendingStep:
        """Slot-table access now; misses become queued demand reads (reserved until completed)."""
        self.reap()
        try:
            step = self.table.access(layer, experts)
        except PolicyError:
            if not self.inflight:
                raise
            self.drain()  # every free candidate was busy with a prefetch read
            step = self.table.access(layer, experts)
        self.forget(step.evicted)
        for e in experts:
            if (layer, e) in self.prefetched:
                self.prefetched.discard((layer, e))
                self.pf["used"] += 1
        reads = [self.reader.submit(layer, e, slot) for e, slot in step.misses]
        req = PendingStep(layer, experts, step, reads)
        self.table.reserve(req.keys)
        return req

    def complete(self, req: PendingStep) -> Step:
        """Wait for a step's demand reads; a failed read gives its slots back and raises."""
        try:
            self.reader.wait(req.reads)
        except BaseException:
            for key in req.keys:
                self.table.discard(key)
            raise
        finally:
            self.table.release(req.keys)
        return req.step

    def settle(self, req: PendingStep) -> list[int]:
        """Wait for every read the step needs; the slot of each expert."""
        self.await_prefetch(req.layer, req.experts)
        step = self.complete(req)
        if any((req.layer, e) not in self.table for e in req.experts):
            step = self.complete(self.start(req.layer, req.experts))  # a prefetch failed: again
        return step.slots

    def pending_reads(self, req: PendingStep) -> dict[int, RecordRead]:
        """expert -> the read (demand or prefetch) its slot is still waiting for."""
        waiting = {e: rr for (e, _), rr in zip(req.step.misses, req.reads) if not rr.done()}
        for e in req.experts:
            rr = self.inflight.get((req.layer, e))
            if rr is not None and not rr.done():
                waiting[e] = rr
        return waiting

    @staticmethod
    def landed(rr: RecordRead | None) -> bool:
        """No read pending, or it finished without error (a failed one is never computed on)."""
        return rr is None or (rr.done() and not rr.fut.cancelled() and rr.fut.exception() is None)

    def wait_read(self, layer: int, e: int, rr: RecordRead) -> None:
        """Block on one record's read; the time counts as demand stall or as a late prefetch."""
        prefetch = (layer, e) in self.inflight
        t0 = time.perf_counter()
        rr.fut.exception()  # waits; an error is raised (or retried) by settle
        dt = time.perf_counter() - t0
        if prefetch:
            self.pf_wait += dt
            self.pf["late"] += 1
        else:
            self.reader.io_seconds += dt

    # ---- prefetch ------------------------------------------------------------------------------
    def prefetch(
        self, layer: int, experts, protect: Iterable[Key] = (), priority: int = PREFETCH
    ) -> int:
        """Start reads of the non-resident `experts` of `layer` in order without taking the
        slots of `protect`; returns the reads started."""
        self.reap()
        protected = set(protect) | {(layer, e) for e in experts}
        started = 0
        for e in experts:
            key = (layer, e)
            if key in self.table:
                continue
            got = self.table.insert(key, protected)
            if got is None:
                self.pf["dropped"] += 1
                continue
            slot, evicted = got
            self.forget(evicted)
            self.inflight[key] = self.reader.read_async(layer, e, slot, priority)
            self.table.reserve((key,))
            self.prefetched.add(key)
            started += 1
        self.pf["reads"] += started
        self.pf_bytes["reads"] += started * self.store.layouts[layer].size
        return started

    def cancel_prefetch(self, layer: int, experts: Iterable[int]) -> int:
        """Drop prefetch reads of these experts that have not started; returns how many."""
        n = 0
        req = self.requested
        for e in experts:
            key = (layer, e)
            if req is not None and req.layer == layer and e in req.experts:
                continue  # the step being made resident counts on this read
            rr = self.inflight.get(key)
            if rr is not None and rr.cancel():
                del self.inflight[key]
                self.table.release((key,))
                self.table.discard(key)
                self.prefetched.discard(key)
                n += 1
        self.pf["reads"] -= n
        self.pf_bytes["reads"] -= n * self.store.layouts[layer].size
        self.pf["cancelled"] += n
        return n

    def _finish(self, key: Key, rr: RecordRead) -> None:
        """A prefetch read ended: release its slot; a failed read gives the slot back (the
        demand access then reads it again and reports the damage)."""
        del self.inflight[key]
        self.table.release((key,))
        try:
            rr.result()
        except (OSError, StoreError):
            self.table.discard(key)
            self.prefetched.discard(key)

    def reap(self) -> None:
        for key, rr in list(self.inflight.items()):
            if rr.done():
                self._finish(key, rr)

    def await_prefetch(self, layer: int, experts: list[int]) -> None:
        self.reap()
        waits = [(layer, e) for e in experts if (layer, e) in self.inflight]
        if waits:
            t0 = time.perf_counter()
            for key in waits:
                self._finish(key, self.inflight[key])
            self.pf_wait += time.perf_counter() - t0
            self.pf["late"] += len(waits)

    def drain(self) -> None:
        t0 = time.perf_counter()
        for key, rr in list(self.inflight.items()):
            self._finish(key, rr)
        self.pf_wait += time.perf_counter() - t0

    def forget(self, evicted: Iterable[Key]) -> None:
        for key in evicted:
            if key in self.prefetched:
                self.prefetched.discard(key)
                self.pf["wasted"] += 1
                self.pf_bytes["wasted"] += self.store.layouts[key[0]].size

    # ---- stats / close -------------------------------------------------------------------------
    def stats(self) -> dict:
        t, r = self.table, self.reader
        return {
            "bytes_read": r.bytes_read + self.pf_bytes["reads"],
            "demand_bytes_read": r.bytes_read,  # read while decode waited (io_seconds)
            "hits": t.hits,
            "misses": t.misses,
            "evictions": t.evictions,
            "io_seconds": r.io_seconds,
            "prefetch_reads": self.pf["reads"],
            "prefetch_used": self.pf["used"],
            "prefetch_late": self.pf["late"],
            "prefetch_dropped": self.pf["dropped"],
            "prefetch_cancelled": self.pf["cancelled"],
            "prefetch_wasted_bytes": self.pf_bytes["wasted"],
            "prefetch_wait_seconds": self.pf_wait,
        }

    def close(self) -> None:
        if self.requested is not None:
            req, self.requested = self.requested, None
            self.complete(req)
        self.drain()
        self.reader.close()
