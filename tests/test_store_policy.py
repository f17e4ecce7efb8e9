"""Slot table and eviction policies (plain Python, no tensors)."""

from __future__ import annotations

import random

import pytest

from moestream.store.policy import PolicyError, SlotTable, make_policy


def test_lru_evicts_least_recently_used():
    t = SlotTable(3, make_policy("lru"))
    assert t.access(0, [1, 2]).misses == [(1, 0), (2, 1)]
    t.access(0, [3])
    t.access(0, [1])  # 1 is now the most recent; 2 the oldest
    step = t.access(0, [4])
    assert step.evicted == [(0, 2)] and step.misses == [(4, 1)]
    assert (t.hits, t.misses, t.evictions) == (1, 4, 1)


def test_experts_of_one_access_are_never_victims():
    t = SlotTable(2, make_policy("lru"))
    t.access(0, [1, 2])
    step = t.access(0, [2, 3])  # 1 is the only legal victim, although 2 is older
    assert step.evicted == [(0, 1)]
    assert set(t.resident()) == {(0, 2), (0, 3)}


def test_lfu_keeps_frequent_experts():
    t = SlotTable(2, make_policy("lfu"))
    for _ in range(3):
        t.access(0, [1])
    t.access(0, [2])
    step = t.access(0, [3])
    assert step.evicted == [(0, 2)]


def test_pinned_experts_stay():
    t = SlotTable(3, make_policy("pinned", pinned=[(0, 1)]), min_slots=2)
    t.access(0, [1, 2])
    for e in range(3, 10):
        step = t.access(0, [e])
        assert (0, 1) not in step.evicted
    assert (0, 1) in t.resident()


def test_sticky_layers_only_replace_their_own_slots():
    t = SlotTable(4, make_policy("sticky", layers=[0, 1]), min_slots=2)
    t.access(0, [1, 2])
    t.access(1, [1, 2])
    step = t.access(0, [5, 1])
    assert step.evicted == [(0, 2)]
    assert step.slots[1] == t.resident()[(0, 1)]
    assert {k for k in t.resident() if k[0] == 1} == {(1, 1), (1, 2)}


def test_sticky_needs_topk_slots_per_layer():
    with pytest.raises(PolicyError, match="minimum budget for sticky is 6"):
        SlotTable(4, make_policy("sticky", layers=[0, 1, 2]), min_slots=2)


def test_below_minimum_is_an_error():
    with pytest.raises(PolicyError, match="minimum of 8"):
        SlotTable(4, make_policy("lru"), min_slots=8)


def test_lrfu_weighs_frequency_against_recency():
    layers = [0]  # one layer: one access = one token
    t = SlotTable(2, make_policy("lrfu", layers=layers))
    for _ in range(3):
        t.access(0, [1])  # score 1 + 0.9 + 0.81 = 2.71, then decays
    t.access(0, [2])  # score 1: newer, but used once
    assert t.access(0, [3]).evicted == [(0, 2)]  # LRU would evict 1
    # Unused for long enough, the frequent expert's score decays below a fresh one's.
    for _ in range(12):
        t.access(0, [3])  # 1's score: 2.71 * 0.9**13 ~ 0.69; 3 keeps being used
    t.access(0, [4])  # evicts 1 (0.69 < 3's score)
    assert t.access(0, [5]).evicted == [(0, 4)]  # 4 (score 0.9) < 3 (score ~ 9)
    assert set(t.resident()) == {(0, 3), (0, 5)}


def test_lrfu_prefetched_keys_enter_with_their_history_only():
    t = SlotTable(3, make_policy("lrfu", layers=[0, 1]))
    t.access(0, [1, 2])
    slot, evicted = t.insert((1, 5), protected=set())  # a prediction, never used before
    assert evicted == []
    # A miss must evict: the unused prediction (score 0) goes before used experts.
    assert t.access(0, [3]).evicted == [(1, 5)]
    t.access(0, [1])
    t.insert((1, 5), protected=set())  # predicted again: still no use counted
    assert t.access(1, [6]).evicted == [(1, 5)]


def test_lrfu_misses_less_than_lru_on_a_skewed_trace():
    """Hot experts with random recent noise: the regime of MoE routing, where a decayed count
    holds the hot set that LRU lets one-off experts push out."""
    layers = [0, 1]
    misses = {}
    for name in ("lru", "lrfu"):
        t = SlotTable(12, make_policy(name, layers=layers), min_slots=4)
        r = random.Random(1)
        for _ in range(400):
            for layer in layers:
                hot = r.sample(range(6), 2)  # 6 hot experts per layer
                cold = r.sample(range(6, 64), 2)
                t.access(layer, sorted(hot + cold))
        misses[name] = t.misses
    assert misses["lrfu"] < 0.9 * misses["lru"], misses


def test_lrfu_needs_layers_and_a_decay_in_range():
    from moestream.store.policy import LRFU

    with pytest.raises(PolicyError, match="layers"):
        make_policy("lrfu")
    with pytest.raises(PolicyError, match="decay"):
        LRFU([0], decay=1.0)


@pytest.mark.parametrize("name", ["lru", "lfu", "lrfu", "pinned", "sticky"])
def test_random_trace_keeps_table_consistent(name):
    rng = random.Random(0)
    layers = [0, 1, 2]
    policy = make_policy(name, layers=layers, pinned=[(0, 0), (1, 0)])
    t = SlotTable(12, policy, min_slots=3)
    for _ in range(300):
        layer = rng.choice(layers)
        ids = rng.sample(range(16), 3)
        step = t.access(layer, ids)
        res = t.resident()
        assert all(res[(layer, e)] == s for e, s in zip(ids, step.slots))
        assert len(set(res.values())) == len(res) <= 12
    assert t.hits + t.misses == 900
    assert t.misses - t.evictions == len(t.resident())


def test_kept_keys_are_evicted_only_when_nothing_else_can_go():
    t = SlotTable(3, make_policy("lru"))
    t.access(0, [1, 2, 3])
    t.keep({(0, 1), (0, 2)})  # predicted soon: LRU would take (0, 1) first
    assert t.access(1, [7]).evicted == [(0, 3)]
    # (1, 7) goes first; then only kept keys are left: LRU among them
    assert t.access(1, [8, 9]).evicted == [(1, 7), (0, 1)]


@pytest.mark.parametrize("name", ["lfu", "lrfu"])
def test_heap_policies_stay_bounded_under_hits(name):
    """Every hit pushes a heap entry; a long run of hits (a server's lifetime) must not grow
    the heap without bound, and the choices must stay right after compaction."""
    policy = make_policy(name, layers=[0])
    t = SlotTable(3, policy)
    for _ in range(10_000):
        t.access(0, [1, 2])
    t.access(0, [3])
    assert len(policy.heap) <= 4 * 3 + 64
    assert t.access(0, [4]).evicted == [(0, 3)]  # used once, vs 10,000 times


@pytest.mark.parametrize("name", ["lru", "lfu", "lrfu", "pinned", "sticky"])
def test_busy_keys_are_held_out_of_the_order_with_the_same_choices(name, monkeypatch):
    """Keys reserved while their reads are in flight (the GPU pool's admissions, a few steps
    long) are never victims. Heap policies drop their entries while busy (watch_busy /
    released): a just-admitted key is the lowest there, so a victim search would otherwise step
    over every busy one at each miss. The choices equal the same policy's with that disabled
    (the busy set as protection only); lfu and lrfu pop far fewer heap entries."""
    import heapq

    from moestream.store import policy as P

    pops = [0]
    real_pop = heapq.heappop

    def counted(heap):
        pops[0] += 1
        return real_pop(heap)

    monkeypatch.setattr(P.heapq, "heappop", counted)

    def run(hold: bool):
        policy = make_policy(name, layers=[0, 1, 2], pinned=[(0, 0), (1, 0)])
        if not hold:
            policy.watch_busy = policy.released = lambda keys: None
        rng = random.Random(3)
        t = SlotTable(40, policy, min_slots=4)
        pending, log = [], []
        pops[0] = 0
        for _ in range(150):
            if len(pending) > 2:  # reads land three steps later
                t.release(pending.pop(0))
            admitted = []
            for layer in (0, 1, 2):
                try:
                    step = t.access(layer, rng.sample(range(32), 4))
                except PolicyError as err:
                    log.append(("skipped", err.evicted))
                    continue
                log.append((step.slots, step.misses, step.evicted))
                keys = [(layer, e) for e, _ in step.misses]
                t.reserve(keys)
                admitted += keys
            pending.append(admitted)
        return log, pops[0]

    (want, pops_off), (got, pops_on) = run(hold=False), run(hold=True)
    assert got == want and sum(len(s[2]) for s in got if s[0] != "skipped") > 100
    if name in ("lfu", "lrfu"):
        assert pops_on < pops_off / 2, (pops_on, pops_off)


@pytest.mark.parametrize("name", ["lrfu", "lfu"])
def test_scored_access_admits_a_miss_only_when_its_history_beats_the_victims(name):
    t = SlotTable(2, make_policy(name, layers=[0]))
    step = t.access(0, [1, 2], scored=True)  # free slots: admitted without a comparison
    assert step.misses == [(1, 0), (2, 1)] and step.declined == []
    t.access(0, [1, 2], scored=True)
    step = t.access(0, [3], scored=True)  # never seen: 1 and 2 (used twice) stay
    assert step.declined == [3] and step.slots == [-1] and step.misses == []
    assert step.evicted == [] and 3 not in [e for _, e in t.resident()]
    assert (t.hits, t.misses) == (2, 3)
    for _ in range(3):  # each declined use is history: 3 ends up ahead of a victim
        step = t.access(0, [3], scored=True)
        if step.misses:
            break
    assert step.misses and step.evicted and (0, 3) in t.resident()
    # unscored, the same table admits at once
    assert t.access(0, [9]).misses


def test_policies_without_history_admit_every_scored_miss():
    t = SlotTable(2, make_policy("lru"))
    t.access(0, [1, 2], scored=True)
    step = t.access(0, [3], scored=True)
    assert step.misses == [(3, 0)] and step.evicted == [(0, 1)] and step.declined == []


def test_a_scored_access_with_no_victim_undoes_its_counts():
    t = SlotTable(2, make_policy("lrfu", layers=[0, 1]))
    t.access(0, [1, 2], scored=True)
    t.reserve([(0, 1), (0, 2)])  # both copies in flight: nothing can go
    with pytest.raises(PolicyError):
        t.access(1, [1], scored=True)
    assert (t.hits, t.misses) == (0, 2) and len(t.resident()) == 2
