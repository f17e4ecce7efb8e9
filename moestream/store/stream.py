"""The store-backed expert provider: streamed slot cache, OS mmap, or all experts resident.

route -> make resident (slot table, pread misses) -> compute (quantized kernels) -> combine.
All three modes run the same compute code in the same order (decode: the token's experts in
ascending id order; prefill: tokens grouped by expert in ascending id order, as ResidentExperts),
so at one quantization their greedy tokens are bit-identical.

Prefetch (`prefetch(layer, experts)`, driven by moestream/predict/): predicted experts get slots
now and are read by the IO pool behind demand reads while compute proceeds; a slot being read is
`busy` (never a victim); a demand access that needs an in-flight record waits for it. Counters:
prefetch reads, used (a demand access found the record before it was evicted), late (demand had
to wait for the read), wasted (evicted unused), dropped (no slot could be freed), cancelled (still
queued when the router proved the prediction wrong: never read).
"""

from __future__ import annotations

import mmap
import time
from dataclasses import dataclass, field

import torch

from moestream.config import ConfigError
from moestream.kernels.dispatch import qlinear
from moestream.kernels.ref import ExpertActivation, expert_ffn_q
from moestream.store.format import Store, StoreError
from moestream.store.io import PREFETCH, IOConfig, RecordReader, SlotPool
from moestream.store.policy import PolicyError, SlotTable, make_policy


@dataclass(frozen=True, slots=True)
class StreamConfig:
    memory_budget: int | None = None  # bytes of expert slots (direct/pagecache)
    resident: bool = False  # every expert in RAM (ignores the budget)
    io: IOConfig = field(default_factory=IOConfig)
    policy: str = "lrfu"
    kernel: str = "cpu"
    # A layer's resident experts run while its misses are read (decode and prefill chunks);
    # False = read, then compute (the plain schedule, for ablations: bench_predict.py).
    overlap: bool = True

    def __post_init__(self):
        streamed = not self.resident and self.io.mode != "mmap"
        if streamed and self.memory_budget is None:
            raise ConfigError("streaming needs --memory-budget (or use --resident / --io mmap)")
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise ConfigError(f"--memory-budget must be > 0, got {self.memory_budget}")


def min_budget(store: Store) -> int:
    """The smallest legal budget: the top-k experts of one layer."""
    return store.args.num_experts_per_tok * store.layout.size


def _n_slots(store: Store, cfg: StreamConfig) -> int:
    total = len(store.crc) * store.args.num_experts
    if cfg.resident:
        return total
    if cfg.memory_budget < min_budget(store):
        raise ConfigError(
            f"--memory-budget {cfg.memory_budget} bytes is below the minimum {min_budget(store)} "
            f"bytes ({min_budget(store) / 2**20:.2f} MiB = top-k {store.args.num_experts_per_tok} "
            f"experts x {store.layout.size} bytes per record); raise the budget"
        )
    return min(cfg.memory_budget // store.layout.size, total)


class StreamingExperts:
    """ExpertProvider over a Store. `stats()` returns cumulative IO and cache counters."""

    def __init__(self, store: Store, cfg: StreamConfig):
        self.store, self.cfg = store, cfg
        self.g = store.scheme.group_size
        self.act = ExpertActivation.from_args(store.args)
        self.linear = qlinear(cfg.kernel)
        self.compute_seconds = 0.0
        self.inflight: dict[tuple[int, int], object] = {}  # key -> Future of its prefetch read
        self.prefetched: set[tuple[int, int]] = set()  # read ahead, not yet used by demand
        self.requested = None  # a decode step's demand reads queued by request(), not yet awaited
        self.pf = dict.fromkeys(("reads", "used", "late", "wasted", "dropped", "cancelled"), 0)
        self.pf_wait = 0.0
        if cfg.io.mode == "mmap" and not cfg.resident:
            self._maps = {layer: self._map(layer) for layer in store.crc}
            self._touched: set[tuple[int, int]] = set()
            self._mmap_io = 0.0
            self.n_slots = 0
            return
        self.n_slots = _n_slots(store, cfg)
        layers = sorted(store.crc)
        policy = make_policy(cfg.policy, layers=layers)
        self.table = SlotTable(self.n_slots, policy, store.args.num_experts_per_tok)
        self.pool = SlotPool(store, self.n_slots)
        self.reader = RecordReader(store, self.pool, cfg.io)
        if cfg.resident:
            for layer in layers:
                self._slots(layer, list(range(store.args.num_experts)))

    def _map(self, layer: int) -> torch.Tensor:
        with open(self.store.path(layer), "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private: reads share pages
        return torch.frombuffer(mm, dtype=torch.uint8)

    # ---- make resident -------------------------------------------------------------------------
    def _slots(self, layer: int, experts: list[int]) -> list[dict]:
        """Section views of each expert, reading misses from disk."""
        if self.n_slots == 0:
            return [self._mapped(layer, e) for e in experts]
        return [self.pool.views[s] for s in self._settle(self._begin(layer, experts))]

    def _begin(self, layer: int, experts: list[int]):
        """The step making `experts` resident: the one `request` started, or a new one."""
        req, self.requested = self.requested, None
        if req is None or req[:2] != (layer, experts):
            if req is not None:
                self._complete(*req)  # requested but not computed: settle its reads first
            req = self._start(layer, experts)
        return req

    def _settle(self, req) -> list[int]:
        """Wait for every read the step needs; the slot of each expert."""
        layer, experts = req[0], req[1]
        self._await(layer, experts)  # prefetches of these experts still in flight
        step = self._complete(*req)
        if any((layer, e) not in self.table.slot_of for e in experts):
            step = self._complete(*self._start(layer, experts))  # a prefetch read failed: again
        return step.slots

    def _pending_reads(self, req) -> dict[int, object]:
        """expert -> the read (demand or prefetch) its slot is still waiting for."""
        layer, experts, step, reads = req
        waiting = {e: rr for (e, _), rr in zip(step.misses, reads) if not rr.done()}
        for e in experts:
            rr = self.inflight.get((layer, e))
            if rr is not None and not rr.done():
                waiting[e] = rr
        return waiting

    @staticmethod
    def _landed(rr) -> bool:
        """No read pending, or it finished without error (a failed one is never computed on)."""
        return rr is None or (rr.done() and not rr.fut.cancelled() and rr.fut.exception() is None)

    def _wait_read(self, layer: int, e: int, rr) -> None:
        """Block on one record's read; the time counts as demand stall or as a late prefetch."""
        prefetch = (layer, e) in self.inflight
        t0 = time.perf_counter()
        rr.fut.exception()  # waits; an error is raised (or retried) by _settle
        dt = time.perf_counter() - t0
        if prefetch:
            self.pf_wait += dt
            self.pf["late"] += 1
        else:
            self.reader.io_seconds += dt

    def request(self, layer: int, experts: list[int]) -> None:
        """Decode: make `experts` (ascending) of `layer` resident asynchronously: the demand reads
        are queued now, so prefetches issued afterwards run behind them; the next `experts()`
        call for this layer waits for them."""
        if self.n_slots == 0 or self.cfg.resident:
            return
        req, self.requested = self.requested, None
        if req is not None:
            self._complete(*req)
        self.requested = self._start(layer, experts)

    def _start(self, layer: int, experts: list[int]):
        """Slot-table access now; misses become queued demand reads (busy until completed)."""
        self._reap()
        try:
            step = self.table.access(layer, experts)
        except PolicyError:
            if not self.inflight:
                raise
            self._drain()  # every free candidate was busy with a prefetch read
            step = self.table.access(layer, experts)
        self._forget(step.evicted)
        for e in experts:
            if (layer, e) in self.prefetched:
                self.prefetched.discard((layer, e))
                self.pf["used"] += 1
        reads = [self.reader.submit(layer, e, slot) for e, slot in step.misses]
        self.table.busy.update((layer, e) for e, _ in step.misses)
        return layer, experts, step, reads

    def _complete(self, layer: int, experts, step, reads):
        """Wait for a step's demand reads; a failed read gives its slots back and raises."""
        try:
            self.reader.wait(reads)
        except BaseException:
            for e, _ in step.misses:
                self.table.discard((layer, e))
            raise
        finally:
            self.table.busy.difference_update((layer, e) for e, _ in step.misses)
        return step

    # ---- prefetch ------------------------------------------------------------------------------
    def prefetch(self, layer: int, experts, protect=(), priority: int = PREFETCH) -> int:
        """Start asynchronous reads of the non-resident experts among `experts` of `layer`, in the
        given order; slots of `protect` keys (the layer computing now, other pending predictions)
        are not taken. Returns the reads started."""
        if self.n_slots == 0 or self.cfg.resident:
            return 0
        self._reap()
        protected = set(protect) | {(layer, e) for e in experts}
        started = 0
        for e in experts:
            key = (layer, e)
            if key in self.table.slot_of:
                continue
            got = self.table.insert(key, protected)
            if got is None:
                self.pf["dropped"] += 1
                continue
            slot, evicted = got
            self._forget(evicted)
            self.inflight[key] = self.reader.read_async(layer, e, slot, priority)
            self.table.busy.add(key)
            self.prefetched.add(key)
            started += 1
        self.pf["reads"] += started
        return started

    def hint(self, keys) -> None:
        """(layer, expert) keys predicted to be used soon: eviction takes other keys first."""
        if self.n_slots:
            self.table.keep = set(keys)

    def cancel_prefetch(self, layer: int, experts) -> int:
        """Drop prefetch reads of these experts of `layer` that have not started (a prediction
        the router just proved wrong): the disk is left to demand reads. Returns how many."""
        n = 0
        req = self.requested
        for e in experts:
            key = (layer, e)
            if req is not None and req[0] == layer and e in req[1]:
                continue  # the step being made resident counts on this read
            fut = self.inflight.get(key)
            if fut is not None and fut.cancel():
                del self.inflight[key]
                self.table.busy.discard(key)
                self.table.discard(key)
                self.prefetched.discard(key)
                n += 1
        self.pf["reads"] -= n
        self.pf["cancelled"] += n
        return n

    def _finish(self, key, fut) -> None:
        """A prefetch read ended: free its busy mark; a failed read gives the slot back (the
        demand access then reads it again and reports the damage)."""
        del self.inflight[key]
        self.table.busy.discard(key)
        try:
            fut.result()
        except (OSError, StoreError):
            self.table.discard(key)
            self.prefetched.discard(key)

    def _reap(self) -> None:
        for key, fut in list(self.inflight.items()):
            if fut.done():
                self._finish(key, fut)

    def _await(self, layer: int, experts: list[int]) -> None:
        self._reap()
        waits = [(layer, e) for e in experts if (layer, e) in self.inflight]
        if waits:
            t0 = time.perf_counter()
            for key in waits:
                self._finish(key, self.inflight[key])
            self.pf_wait += time.perf_counter() - t0
            self.pf["late"] += len(waits)

    def _drain(self) -> None:
        t0 = time.perf_counter()
        for key, fut in list(self.inflight.items()):
            self._finish(key, fut)
        self.pf_wait += time.perf_counter() - t0

    def _forget(self, evicted) -> None:
        for key in evicted:
            if key in self.prefetched:
                self.prefetched.discard(key)
                self.pf["wasted"] += 1

    def _mapped(self, layer: int, e: int) -> dict:
        size = self.store.layout.size
        rec = self._maps[layer][e * size : (e + 1) * size]
        if (layer, e) not in self._touched:
            t0 = time.perf_counter()
            if self.cfg.io.verify:
                self.store.check_record(layer, e, rec.numpy())  # faults the pages in
            self._mmap_io += time.perf_counter() - t0
            self._touched.add((layer, e))
        return self.store.layout.views(rec)

    # ---- compute -------------------------------------------------------------------------------
    def experts(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """x [T, D], ids [T, K], weights [T, K] -> [T, D]."""
        if x.shape[0] > 1:
            return self._grouped(layer, x, ids, weights)
        order = sorted(zip(ids[0].tolist(), range(ids.shape[1])))
        ys = self._resident_run(layer, [e for e, _ in order], lambda i, sec: self._ffn(x, sec))
        out = torch.zeros_like(x)  # summed in ascending expert id, whatever order ran
        for (_, k), y in zip(order, ys):
            out += (y * weights[:, k : k + 1]).to(x.dtype)
        return out

    def _resident_run(self, layer: int, experts: list[int], run) -> list:
        """[run(i, sections of experts[i])] once each expert is resident. The experts already in
        their slots run while the others are read, each of those as soon as its record lands:
        compute hides behind the reads instead of following them. Callers combine the results
        in their own fixed order, so the bits do not depend on the order things ran in."""
        if self.n_slots == 0:
            return [run(i, sec) for i, sec in enumerate(self._slots(layer, experts))]
        req = self._begin(layer, experts)
        if not self.cfg.overlap:  # read, then compute
            return [run(i, self.pool.views[slot]) for i, slot in enumerate(self._settle(req))]
        step, waiting = req[2], self._pending_reads(req)
        ys: list = [None] * len(experts)
        ran: list[int | None] = [None] * len(experts)  # the slot each result was computed from
        todo = sorted(range(len(experts)), key=lambda i: experts[i] in waiting)
        while todo:
            # The first expert whose record is in; else block on the earliest queued read.
            i = next((i for i in todo if self._landed(waiting.get(experts[i]))), None)
            if i is None:
                i = todo[0]
                self._wait_read(layer, experts[i], waiting[experts[i]])
                if not self._landed(waiting[experts[i]]):
                    break  # the read failed: _settle reads it again or raises
            todo.remove(i)
            ys[i], ran[i] = run(i, self.pool.views[step.slots[i]]), step.slots[i]
        # A retry after a failed read re-reads only that expert: the step's other keys are
        # protected, so what already ran keeps its slot and runs exactly once.
        for i, slot in enumerate(self._settle(req)):
            if ran[i] is None:
                ys[i] = run(i, self.pool.views[slot])
        return ys

    def _ffn(self, x: torch.Tensor, sec: dict) -> torch.Tensor:
        t0 = time.perf_counter()
        y = expert_ffn_q(x, sec, self.g, self.linear, self.act)
        self.compute_seconds += time.perf_counter() - t0
        return y

    def _grouped(self, layer: int, x, ids, weights) -> torch.Tensor:
        """Prefill: tokens grouped by expert; experts made resident in chunks the pool can hold,
        each chunk's outputs added in ascending expert id whatever order they were computed in."""
        T, K = ids.shape
        order = torch.argsort(ids.reshape(-1), stable=True)
        counts = torch.bincount(ids.reshape(-1), minlength=1).tolist()
        tok, slot = order // K, order % K
        begin, present = [], []
        start = 0
        for e, n in enumerate(counts):
            if n:
                present.append(e)
                begin.append((start, n))
            start += n
        # Chunk by what the policy lets one layer hold (sticky/pinned hold fewer than n_slots).
        cap = self.table.policy.capacity(self.n_slots) if self.n_slots else len(present)
        out = torch.zeros_like(x)
        for c in range(0, len(present), cap):
            spans, done, nxt = begin[c : c + cap], {}, 0

            def run(i, sec, spans=spans, done=done):
                nonlocal nxt
                b, n = spans[i]
                t, s = tok[b : b + n], slot[b : b + n]
                done[i] = self._ffn(x[t], sec) * weights[t, s, None]
                while nxt in done:  # add in id order as soon as it allows: outputs freed early
                    b, n = spans[nxt]
                    out.index_add_(0, tok[b : b + n], done.pop(nxt).to(out.dtype))
                    nxt += 1

            self._resident_run(layer, present[c : c + cap], run)
            assert not done, "an expert output was never added"
        return out

    # ---- stats ---------------------------------------------------------------------------------
    def stats(self) -> dict:
        if self.n_slots == 0:
            n = len(self._touched)
            reads, io = n * self.store.layout.size, self._mmap_io
            hits, misses, evictions = 0, n, 0  # first touches; the OS may re-read dropped pages
        else:
            reads, io = self.reader.bytes_read, self.reader.io_seconds
            t = self.table
            hits, misses, evictions = t.hits, t.misses, t.evictions
        size = self.store.layout.size
        return {
            "bytes_read": reads + self.pf["reads"] * size,
            "demand_bytes_read": reads,  # read while decode waited (io_seconds)
            "hits": hits,
            "misses": misses,
            "evictions": evictions,
            "io_seconds": io,
            "compute_seconds": self.compute_seconds,
            "prefetch_reads": self.pf["reads"],
            "prefetch_used": self.pf["used"],
            "prefetch_late": self.pf["late"],
            "prefetch_dropped": self.pf["dropped"],
            "prefetch_cancelled": self.pf["cancelled"],
            "prefetch_wasted_bytes": self.pf["wasted"] * size,
            "prefetch_wait_seconds": self.pf_wait,
        }

    def close(self) -> None:
        if self.n_slots:
            if self.requested is not None:
                req, self.requested = self.requested, None
                self._complete(*req)
            self._drain()
            self.reader.close()


def stats_delta(before: dict, after: dict) -> dict:
    """Counters for one generation, plus the achieved read bandwidth."""
    d = {k: after[k] - before[k] for k in after if isinstance(after[k], (int, float))}
    if d.get("prefetch_reads"):
        d["prefetch_precision"] = d["prefetch_used"] / d["prefetch_reads"]
    io = d.get("io_seconds", 0.0)
    # Demand reads over the time decode waited for them (prefetched bytes overlap compute).
    demand = d.get("demand_bytes_read", d.get("bytes_read", 0))  # providers without prefetch
    d["read_gbps"] = demand / io / 1e9 if io else 0.0
    return d
