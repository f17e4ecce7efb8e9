"""The store's CPU providers' shared compute, and the streamed slot-cache provider.

route -> make resident (store/residency.py: slot table, pread misses) -> compute (quantized
kernels) -> combine. Every store provider (resident, slot cache, mmap) runs the same compute code
in the same order (decode: the token's experts added in ascending id order; prefill: tokens grouped
by expert in ascending id order, as ResidentExperts), so at one quantization their greedy tokens
are bit-identical. `resident` is the slot cache with a slot for every record, filled at start.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Callable

import torch

from moestream.experts.base import ExpertProvider, Prefetcher
from moestream.experts.config import StreamConfig, slot_count
from moestream.kernels import native
from moestream.kernels.dispatch import qlinear
from moestream.kernels.ref import ExpertActivation, expert_ffn_q, group_by_expert
from moestream.store.format import Store
from moestream.store.io import PREFETCH
from moestream.store.residency import SlotResidency

Run = Callable[[int, dict], object]  # run(i, sections of experts[i]) -> result
# Prompt rows per native prefill call over resident records: bounds its gate|up buffer (rows x K
# x 2I fp32: 25 MB at Qwen3-30B-A3B's shapes); each token's sum does not depend on the split.
PREFILL_ROWS = 512


class StoreExperts(ExpertProvider):
    """Compute over a Store's quantized records; subclasses make records resident."""

    def __init__(self, store: Store, cfg: StreamConfig):
        self.store, self.cfg = store, cfg
        self.groups = {layer: lay.groups for layer, lay in store.layouts.items()}  # (w13, w2)
        self.act = ExpertActivation.from_args(store.args)
        # kernel "native": the C++ layer op where it reads this store's records (int4/int8/q4_0/
        # q4_1, K-quants, each projection its own; biases and gpt-oss's clamped SwiGLU too) and
        # it built; otherwise, and for "cpu"/"ref", the torch kernels.
        layouts = store.layouts.values()
        self.biased = any(sec.name.startswith("b") for lay in layouts for sec in lay.sections)
        self.native = (
            cfg.kernel == "native"
            and all(native.supports(s) for lay in layouts for s in lay.schemes)
            and native.available()
        )
        self.linear = qlinear("ref" if cfg.kernel == "ref" else "cpu")
        self.compute_seconds = 0.0

    @abstractmethod
    def _resident_run(self, layer: int, experts: list[int], run: Run) -> list:
        """[run(i, sections of experts[i])] once each expert is resident, in any order."""

    @abstractmethod
    def _capacity(self) -> int:
        """Experts of one layer that can be resident at once (prefill chunks)."""

    # One native call per layer and token (all records first); False where compute must overlap
    # the reads (slot cache): per-expert calls then, added with the same fp32 arithmetic.
    layer_op = True
    # layer -> expert -> the native layer op's four tensors, where every record stays resident,
    # and (records with biases: gpt-oss) their fp32 biases, apart so the plain step slices nothing.
    _flat: dict[int, dict[int, list]] | None = None
    _bias: dict[int, dict[int, list]] | None = None

    def experts(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """x [T, D], ids [T, K], weights [T, K] -> [T, D]."""
        if x.shape[0] > 1:
            return self._grouped(layer, x, ids, weights)
        order = sorted(zip(ids[0].tolist(), range(ids.shape[1])))
        experts = [e for e, _ in order]
        if self.native and self._flat is not None:  # resident: the records' tensors kept flat
            flat, self.res.table.hits = self._flat[layer], self.res.table.hits + len(experts)
            t0 = time.perf_counter()
            bias = self._bias and [t for e in experts for t in self._bias[layer][e]]
            y = native.moe_flat(x, [t for e in experts for t in flat[e]], weights,
                                cols=[k for _, k in order], biases=bias, act=self.act)  # fmt: skip
            self.compute_seconds += time.perf_counter() - t0
            return y.to(x.dtype)
        if self.native and self.layer_op:  # the token's experts added inside in ascending id
            secs = self._resident_run(layer, experts, lambda i, sec: sec)
            return self._native_moe(x, secs, weights, [k for _, k in order]).to(x.dtype)
        ys = self._resident_run(layer, experts, lambda i, sec: self._ffn(layer, x, sec))
        if self.native:  # the layer op's combine: out + w * y in fp32, one cast at the end
            out = torch.zeros(x.shape)
            for (_, k), y in zip(order, ys):
                out = out + weights[:, k : k + 1].float() * y
            return out.to(x.dtype)
        out = torch.zeros_like(x)  # summed in ascending expert id, whatever order ran
        for (_, k), y in zip(order, ys):
            out += (y * weights[:, k : k + 1]).to(x.dtype)
        return out

    def _ffn(self, layer: int, x: torch.Tensor, sec: dict) -> torch.Tensor:
        """One expert over x [T, D] -> [T, D] (native: fp32, exactly the layer op's expert term)."""
        if self.native:
            return self._native_moe(x, [sec], torch.ones(x.shape[0], 1))
        t0 = time.perf_counter()
        y = expert_ffn_q(x, sec, self.groups[layer], self.linear, self.act)
        self.compute_seconds += time.perf_counter() - t0
        return y

    def _native_moe(
        self, x: torch.Tensor, secs: list[dict], w: torch.Tensor, cols: list[int] | None = None
    ) -> torch.Tensor:
        """sum_e w[:, e] * expert_e(x) over records secs, x [T, D], w [T, E] -> [T, D] fp32
        (cols: expert e's weight is w[:, cols[e]])."""
        t0 = time.perf_counter()
        y = native.moe(x, secs, w, cols=cols, act=self.act)
        self.compute_seconds += time.perf_counter() - t0
        return y

    def _grouped(self, layer: int, x, ids, weights) -> torch.Tensor:
        """Prefill: tokens grouped by expert; experts made resident in chunks the pool can hold,
        each chunk's outputs added in ascending expert id whatever order they were computed in."""
        if self.native and self._flat is not None and x.dtype == torch.float32:
            return torch.cat([self._grouped_flat(layer, x[c : c + PREFILL_ROWS],
                                                 ids[c : c + PREFILL_ROWS],
                                                 weights[c : c + PREFILL_ROWS])
                              for c in range(0, x.shape[0], PREFILL_ROWS)])  # fmt: skip
        groups = group_by_expert(ids)
        cap = self._capacity()
        out = torch.zeros_like(x)
        for c in range(0, len(groups), cap):
            chunk, done, nxt = groups[c : c + cap], {}, 0

            def run(i, sec, chunk=chunk, done=done):
                nonlocal nxt
                _, t, s = chunk[i]
                done[i] = self._ffn(layer, x[t], sec) * weights[t, s, None]
                while nxt in done:  # add in id order as soon as it allows: outputs freed early
                    out.index_add_(0, chunk[nxt][1], done.pop(nxt).to(out.dtype))
                    nxt += 1

            self._resident_run(layer, [e for e, _, _ in chunk], run)
            assert not done, "an expert output was never added"
        return out

    def _grouped_flat(self, layer: int, x, ids, weights) -> torch.Tensor:
        """Prefill over resident records in one native call: `_grouped`'s bits (each token's
        terms added in ascending expert id, in fp32 as index_add_ adds them)."""
        groups = group_by_expert(ids)
        flat, self.res.table.hits = self._flat[layer], self.res.table.hits + len(groups)
        tok = torch.cat([t for _, t, _ in groups])
        pw = torch.cat([weights[t, s] for _, t, s in groups])
        off = [0]
        for _, t, _ in groups:
            off.append(off[-1] + t.numel())
        t0 = time.perf_counter()
        bias = self._bias and [a for e, _, _ in groups for a in self._bias[layer][e]]
        y = native.moe_grouped(x, [a for e, _, _ in groups for a in flat[e]], tok, off, pw,
                               biases=bias, act=self.act)  # fmt: skip
        self.compute_seconds += time.perf_counter() - t0
        return y

    # ---- expert parallelism (experts/parallel.py): the routed pairs' terms, then their sum ------
    def term_dtype(self, x: torch.Tensor) -> torch.dtype:
        """The dtype of one (token, slot) term before the sum: fp32 out of the native kernels."""
        return torch.float32 if self.native else x.dtype

    def terms(self, layer: int, x: torch.Tensor, groups: list, weights: torch.Tensor):
        """The weighted outputs of `groups` [(expert, tok, slot)] (ascending expert id, as
        group_by_expert gives them), rows in group order: [n pairs, D] in term_dtype, each row
        exactly the term experts() adds for that pair (same kernel calls, same shapes)."""
        rows: list = [None] * len(groups)
        cap = self._capacity()
        for c in range(0, len(groups), cap):
            chunk = groups[c : c + cap]

            def run(i, sec, c=c, chunk=chunk):
                _, t, s = chunk[i]
                rows[c + i] = self._ffn(layer, x[t], sec) * weights[t, s, None]

            self._resident_run(layer, [e for e, _, _ in chunk], run)
        if not rows:
            return torch.empty(0, x.shape[1], dtype=self.term_dtype(x))
        return torch.cat(rows)

    def combine(self, x: torch.Tensor, ids: torch.Tensor, terms: torch.Tensor) -> torch.Tensor:
        """terms [T, K, D] summed as experts() sums them: per token in ascending expert id from
        zero; a native one-token step in fp32 with one cast at the end, else in x's dtype."""
        order = torch.argsort(ids, dim=1, stable=True)  # [T, K] slots by ascending expert id
        ranked = terms.gather(1, order[..., None].expand(-1, -1, terms.shape[2])).unbind(1)
        if x.shape[0] == 1 and self.native:
            out = torch.zeros(x.shape)
            for t in ranked:
                out = out + t
            return out.to(x.dtype)
        out = torch.zeros_like(x)
        for t in ranked:
            out += t.to(x.dtype)
        return out


class StreamingExperts(StoreExperts, Prefetcher):
    """Slot cache of `memory_budget` bytes (or every record, `resident`) fed by the IO pool.
    `stats()` returns cumulative IO and cache counters."""

    def __init__(self, store: Store, cfg: StreamConfig):
        super().__init__(store, cfg)
        self.layer_op = cfg.resident  # a slot cache computes while its misses are read
        self.n_slots = slot_count(store, cfg)
        self.res = SlotResidency(store, self.n_slots, cfg.policy, cfg.io)
        # Resident: every record of this rank's shard (all of them without one) gets its slot
        # for good, so a step looks its slots up instead of asking the slot table (the table's
        # hit counter still counts each lookup).
        self._fixed: dict[int, dict[int, dict]] | None = None
        if cfg.resident:
            E = store.args.num_experts
            mine = list(range(E) if cfg.shard is None else cfg.shard.experts(E))
            self._fixed = {}
            for layer in sorted(store.crc):
                slots = self.res.settle(self.res.begin(layer, mine))
                self._fixed[layer] = {e: self.res.views(layer, s) for e, s in zip(mine, slots)}
            if self.native and cfg.shard is None:  # (a shard's pairs go through terms())
                self._flat = {
                    layer: {e: native.record_tensors(v) for e, v in views.items()}
                    for layer, views in self._fixed.items()
                }
                if self.biased:
                    self._bias = {
                        layer: {e: native.bias_tensors(v) for e, v in views.items()}
                        for layer, views in self._fixed.items()
                    }

    @property
    def table(self):
        return self.res.table

    def native_tables(self) -> dict[int, dict[int, list]] | None:
        return self._flat if self.native else None

    def native_extras(self) -> tuple[dict[int, dict[int, list]] | None, ExpertActivation | None]:
        return self._bias, self.act

    def note_native_step(self, hits: int, seconds: float) -> None:
        self.res.table.hits += hits
        self.compute_seconds += seconds

    def describe(self) -> dict:
        E = self.store.args.num_experts  # a shard's fraction is of its own experts
        total = len(self.store.crc) * (
            E if self.cfg.shard is None else len(self.cfg.shard.experts(E))
        )
        d = {"experts": "resident" if self.cfg.resident else "slot cache",
             "quant": self.store.quant_name, "kernel": self.cfg.kernel}  # fmt: skip
        if not self.cfg.resident:
            d.update(cache_bytes=self.n_slots * self.store.slot_size, cache_slots=self.n_slots,
                     cache_fraction=self.n_slots / total, policy=self.cfg.policy,
                     io=self.cfg.io.mode)  # fmt: skip
        return d

    def _capacity(self) -> int:
        return self.res.capacity()

    def _resident_run(self, layer: int, experts: list[int], run: Run) -> list:
        """The experts already in their slots run while the others are read, each of those as
        soon as its record lands: compute hides behind the reads instead of following them.
        Callers combine the results in their own fixed order, so the bits do not depend on the
        order things ran in."""
        res = self.res
        if self._fixed is not None:
            views = self._fixed[layer]
            res.table.hits += len(experts)
            return [run(i, views[e]) for i, e in enumerate(experts)]
        req = res.begin(layer, experts)
        if not self.cfg.overlap:  # read, then compute
            return [run(i, res.views(layer, slot)) for i, slot in enumerate(res.settle(req))]
        waiting = res.pending_reads(req)
        ys: list = [None] * len(experts)
        ran = [False] * len(experts)
        todo = sorted(range(len(experts)), key=lambda i: experts[i] in waiting)
        while todo:
            # The first expert whose record is in; else block on the earliest queued read.
            i = next((i for i in todo if res.landed(waiting.get(experts[i]))), None)
            if i is None:
                i = todo[0]
                res.wait_read(layer, experts[i], waiting[experts[i]])
                if not res.landed(waiting[experts[i]]):
                    break  # the read failed: settle reads it again or raises
            todo.remove(i)
            ys[i], ran[i] = run(i, res.views(layer, req.step.slots[i])), True
        # A retry after a failed read re-reads only that expert: the step's other keys are
        # protected, so what already ran keeps its slot and runs exactly once.
        for i, slot in enumerate(res.settle(req)):
            if not ran[i]:
                ys[i] = run(i, res.views(layer, slot))
        return ys

    # ---- Prefetcher: the residency does the work -------------------------------------------------
    def prefetch(self, layer: int, experts, protect=(), priority: int = PREFETCH) -> int:
        return self.res.prefetch(layer, experts, protect, priority)

    def cancel_prefetch(self, layer: int, experts) -> int:
        return self.res.cancel_prefetch(layer, experts)

    def hint(self, keys) -> None:
        self.res.table.keep(keys)

    def request(self, layer: int, experts: list[int]) -> None:
        self.res.request(layer, experts)

    def stats(self) -> dict:
        return {**self.res.stats(), "compute_seconds": self.compute_seconds}

    def close(self) -> None:
        self.res.close()
