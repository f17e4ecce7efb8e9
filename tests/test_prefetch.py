"""Prefetch pipeline in the store: demand reads jump ahead of queued prefetches; prefetched
records are the right bytes; precision/used/wasted counters add up."""

from __future__ import annotations

import threading

import pytest
import torch

from moestream.convert.writer import convert
from moestream.experts.base import stats_delta
from moestream.experts.config import StreamConfig
from moestream.loader import load_model
from moestream.quant import make_scheme
from moestream.store.io import DEMAND, PREFETCH, IOConfig, PriorityPool


def test_demand_reads_jump_ahead_of_queued_prefetches():
    pool = PriorityPool(1)
    gate, order = threading.Event(), []
    pool.submit(gate.wait)  # occupies the only worker
    futs = [pool.submit(order.append, name, priority=PREFETCH) for name in ("p1", "p2")]
    futs.append(pool.submit(order.append, "d1", priority=DEMAND))
    cancelled = pool.submit(order.append, "p3", priority=PREFETCH)
    assert cancelled.cancel()
    gate.set()
    for f in futs:
        f.result(timeout=10)
    pool.shutdown()
    assert order == ["d1", "p1", "p2"]


@pytest.fixture(scope="module")
def store(tiny_dir, tmp_path_factory):
    return convert(
        tiny_dir("olmoe"), tmp_path_factory.mktemp("pf") / "s", make_scheme("int8"), False
    )


def provider(store, slots: int, **cfg):
    from moestream.store.format import Store

    size = Store(store).layout.size
    io = IOConfig(mode="pagecache", threads=2)
    loaded = load_model(store, StreamConfig(memory_budget=slots * size, io=io, **cfg))
    return loaded.provider, size


def test_prefetch_counters_add_up(store):
    p, size = provider(store, 4)
    ref = load_model(store, StreamConfig(resident=True)).provider
    x = torch.randn(1, p.store.args.hidden_size)
    w = torch.tensor([[0.6, 0.4]])
    before = p.stats()
    assert p.prefetch(0, [1, 2]) == 2
    assert p.prefetch(0, [1, 2]) == 0  # already resident or in flight: nothing new
    out = p.experts(0, x, torch.tensor([[1, 3]]), w)  # 1 was prefetched, 3 is a demand miss
    assert torch.equal(out, ref.experts(0, x, torch.tensor([[1, 3]]), w))  # the right bytes
    s = p.stats()
    assert (s["prefetch_reads"], s["prefetch_used"], s["misses"], s["hits"]) == (2, 1, 1, 1)
    assert s["bytes_read"] == 3 * size
    # Expert 2 (prefetched, never used: LRFU score 0) is the first victim once 4 new experts arrive.
    p.res.drain()  # its read landed (on a loaded machine it can still be in flight: never a victim)
    p.experts(0, x, torch.tensor([[4, 5]]), w)
    p.experts(0, x, torch.tensor([[6, 7]]), w)
    d = stats_delta(before, p.stats())
    assert d["prefetch_wasted_bytes"] == size
    assert d["prefetch_precision"] == 0.5
    assert d["prefetch_used"] + d["prefetch_wasted_bytes"] // size == d["prefetch_reads"]
    p.close()


def test_prefetch_never_takes_the_computing_layers_slots(store):
    p, _ = provider(store, 2)  # the minimum: top-k 2 slots
    x = torch.randn(1, p.store.args.hidden_size)
    w = torch.tensor([[0.5, 0.5]])
    p.experts(0, x, torch.tensor([[0, 1]]), w)
    # Both slots hold layer 0's experts, which are protected: nothing can be prefetched.
    assert p.prefetch(1, [3, 4], protect=[(0, 0), (0, 1)]) == 0
    assert p.stats()["prefetch_dropped"] == 2
    assert p.prefetch(1, [3], protect=[(0, 0)]) == 1  # (0, 1) may go
    # A demand access while the prefetch may still be in flight: waits for or drains it.
    ref = load_model(store, StreamConfig(resident=True)).provider
    out = p.experts(1, x, torch.tensor([[5, 6]]), w)
    assert torch.equal(out, ref.experts(1, x, torch.tensor([[5, 6]]), w))
    out = p.experts(1, x, torch.tensor([[3, 6]]), w)
    assert torch.equal(out, ref.experts(1, x, torch.tensor([[3, 6]]), w))
    p.close()


def test_queued_prefetch_of_a_wrong_prediction_is_cancelled(store):
    p, size = provider(store, 4)
    gate = threading.Event()
    blocker = p.res.reader.exec.submit(gate.wait)  # holds one IO thread...
    blocker2 = p.res.reader.exec.submit(gate.wait)  # ...and the other: prefetches stay queued
    assert p.prefetch(0, [1, 2]) == 2
    assert p.cancel_prefetch(0, [2]) == 1
    assert (0, 2) not in p.table.resident() and not p.table.is_busy((0, 2))
    gate.set()
    blocker.result(timeout=10)
    blocker2.result(timeout=10)
    x = torch.randn(1, p.store.args.hidden_size)
    p.experts(0, x, torch.tensor([[1, 3]]), torch.tensor([[0.5, 0.5]]))
    s = p.stats()
    assert (s["prefetch_reads"], s["prefetch_cancelled"], s["prefetch_used"]) == (1, 1, 1)
    assert s["bytes_read"] == 2 * size  # expert 1 prefetched, 3 on demand, 2 never read
    p.close()


def test_a_record_read_cancels_only_before_it_starts(store):
    p, _ = provider(store, 4)
    gate = threading.Event()
    blockers = [p.res.reader.exec.submit(gate.wait) for _ in range(2)]  # both IO threads held
    queued = p.res.reader.submit(0, 1, 0, PREFETCH)
    assert queued.cancel() and queued.done()
    gate.set()
    for b in blockers:
        b.result(timeout=10)
    read = p.res.reader.submit(0, 2, 1, PREFETCH)
    read.result(timeout=10)
    assert not read.cancel()  # finished: its slot holds the record
    p.close()


def test_requested_demand_reads_run_before_prefetches_issued_after(store):
    p, _ = provider(store, 6)
    ref = load_model(store, StreamConfig(resident=True)).provider
    order, read_part = [], p.res.reader._read_part
    p.res.reader._read_part = lambda layer, e, slot, start: (
        order.append((layer, e)) or read_part(layer, e, slot, start)
    )
    gate = threading.Event()
    blockers = [p.res.reader.exec.submit(gate.wait) for _ in range(2)]
    assert p.prefetch(1, [2]) == 1  # queued first, behind the blockers
    p.request(0, [1, 3])  # the computing layer's misses: demand reads, queued after
    gate.set()
    for b in blockers:
        b.result(timeout=10)
    x = torch.randn(1, p.store.args.hidden_size)
    ids, w = torch.tensor([[1, 3]]), torch.tensor([[0.5, 0.5]])
    assert torch.equal(p.experts(0, x, ids, w), ref.experts(0, x, ids, w))
    p.close()
    assert order[:2] == [(0, 1), (0, 3)] and order[-1] == (1, 2)
    s = p.stats()
    assert (s["misses"], s["prefetch_reads"]) == (2, 1)


@pytest.mark.parametrize("tokens", [1, 3])  # decode, and a prefill's grouped experts
def test_resident_experts_compute_while_the_misses_are_read(store, tokens):
    """A layer's resident experts run before its demand reads land; results are added in
    ascending expert id, so the output is bit-identical."""
    p, _ = provider(store, 4)
    ref = load_model(store, StreamConfig(resident=True)).provider
    x = torch.randn(tokens, p.store.args.hidden_size)
    p.experts(0, x[:1], torch.tensor([[1, 2]]), torch.tensor([[0.5, 0.5]]))  # 1, 2 resident
    events, gate = [], threading.Event()
    ffn, read_part = p._ffn, p.res.reader._read_part

    def traced_ffn(layer, xx, sec):
        events.append("ffn")
        gate.set()  # the miss may be read only once an expert has been computed
        return ffn(layer, xx, sec)

    def gated_read(layer, e, slot, start):
        gate.wait(10)  # without the overlap nothing sets the gate: the test fails, not hangs
        events.append(("read", e))
        return read_part(layer, e, slot, start)

    p._ffn, p.res.reader._read_part = traced_ffn, gated_read
    ids = torch.tensor([[3, 1], [2, 3], [1, 2]])[:tokens]  # 3 is a miss; routed order != id order
    w = torch.rand(tokens, 2)
    out = p.experts(0, x, ids, w)
    assert events[0] == "ffn" and ("read", 3) in events  # a hit ran before the miss's read
    assert events[-1] == "ffn"  # and the miss after it landed
    assert torch.equal(out, ref.experts(0, x, ids, w))
    assert p.stats()["io_seconds"] > 0  # the wait for the miss counts as stall
    p.close()


def test_a_failed_prefetch_read_is_read_again_on_demand(store):
    p, _ = provider(store, 4)
    ref = load_model(store, StreamConfig(resident=True)).provider
    read_part, failed = p.res.reader._read_part, []

    def flaky(layer, e, slot, start):
        if (layer, e) == (1, 4) and not failed:
            failed.append(slot)
            raise OSError("transient read error")
        return read_part(layer, e, slot, start)

    p.res.reader._read_part = flaky
    assert p.prefetch(1, [4]) == 1
    x = torch.randn(1, p.store.args.hidden_size)
    ids, w = torch.tensor([[4, 0]]), torch.tensor([[0.5, 0.5]])
    assert torch.equal(p.experts(1, x, ids, w), ref.experts(1, x, ids, w))
    assert failed and (1, 4) in p.table.resident()
    p.close()


def test_without_overlap_the_layer_reads_then_computes(store):
    p, _ = provider(store, 4, overlap=False)  # the plain on-demand schedule (ablation)
    ref = load_model(store, StreamConfig(resident=True)).provider
    x = torch.randn(1, p.store.args.hidden_size)
    w = torch.tensor([[0.3, 0.7]])
    p.experts(0, x, torch.tensor([[1, 2]]), w)
    events, ffn, read_part = [], p._ffn, p.res.reader._read_part
    p._ffn = lambda layer, xx, sec: events.append("ffn") or ffn(layer, xx, sec)
    p.res.reader._read_part = lambda *a: events.append("read") or read_part(*a)
    ids = torch.tensor([[3, 1]])
    assert torch.equal(p.experts(0, x, ids, w), ref.experts(0, x, ids, w))
    assert events[0] == "read" and events[-2:] == ["ffn", "ffn"]
    p.close()
