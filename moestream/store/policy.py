"""Expert slot table and eviction policies: plain Python, no tensors, so traces can be replayed.

The streaming provider and the cache simulator (router traces) drive exactly this code.

Interface
---------
A key is `(layer, expert)`. `SlotTable(n_slots, policy)` maps resident keys to slot numbers
`0..n_slots-1`. Per MoE layer and forward step the caller passes the experts that layer needs::

    table = SlotTable(n_slots, make_policy("lru"))
    step = table.access(layer, [3, 17, 42])   # experts routed in this layer (any order)
    step.slots        # slot of each requested expert, in request order
    step.misses       # [(expert, slot)]: not resident; the caller must fill these slots
    step.evicted      # [(layer, expert)] keys whose slots were taken for the misses
    table.hits, table.misses, table.evictions   # running counters

A caller that can serve a miss without keeping it (the GPU pool's device misses read the pinned
host copy) passes `scored=True`: a miss that would evict is admitted only when the policy's
history of it beats the victim's (`admits`, TinyLFU's rule); otherwise its use is recorded
(`seen`), its slot in `step.slots` is -1 and it is listed in `step.declined`. Where moving a
record costs the same link as reading it, this keeps one-off experts from churning the pool.

All experts of one `access` are resident together (none of them is chosen as a victim), so a
call may name at most `n_slots` experts. An `EvictionPolicy` sees every use of a key
(`touch`, also right after it is inserted), every eviction (`evicted`), and picks victims:

    wants_victim(incoming, free_slots) -> bool   evict even though free slots exist?
    victim(incoming, protected) -> key           a resident key not in `protected`
    admits(incoming, victim) -> bool             scored access: worth the victim's slot?
    seen(key)                                    scored access: a use of a key not admitted
    watch_busy(busy) / released(keys)            the table's busy keys (reads in flight)

Policies: `lru`, `lfu` (frequency kept across evictions, LRU tie-break), `lrfu` (the engine's
default: uses weighed by a per-token decay, recency and frequency in one score), `pinned`
(a fixed hot set is never evicted, LRU for the rest), `sticky` (Edge0-style: every layer owns
an equal share of the slots, and a miss replaces the layer's least recently used expert, so a
layer's slots only change where its routing changed).
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass, field

from moestream.config import ConfigError

Key = tuple[int, int]  # (layer, expert)


POLICIES = ("lru", "lfu", "lrfu", "pinned", "sticky")


class PolicyError(ConfigError):
    """A slot count or policy setting that cannot work; the message states the limit.
    `evicted`: keys a failed `SlotTable.access` had already evicted (they stay evicted), for
    callers that mirror the table (the GPU provider's slot_map)."""

    evicted: tuple = ()


class AnyOf:
    """Membership in any of several sets without building their union: a victim search tests a
    few keys, and the busy set can hold hundreds (one union per miss was most of the table's
    time with reads in flight)."""

    __slots__ = ("sets",)

    def __init__(self, *sets: Container[Key]):
        self.sets = sets

    def __contains__(self, key: object) -> bool:
        for s in self.sets:  # a loop, not any(): this runs once per candidate victim
            if key in s:
                return True
        return False

    def __or__(self, other: Container[Key]) -> AnyOf:
        return AnyOf(*self.sets, other)


def heap_victim(heap: list[tuple], valid, protected: Container[Key]) -> Key:
    """Victim from a lazily updated heap of entries ending in their key: the smallest entry
    that `valid(entry)` still holds and whose key is not protected. Stale entries are dropped;
    the valid ones looked at stay."""
    skipped = []
    try:
        while heap:
            entry = heapq.heappop(heap)
            if not valid(entry):
                continue
            skipped.append(entry)
            if entry[-1] not in protected:
                return entry[-1]
    finally:
        for entry in skipped:
            heapq.heappush(heap, entry)
    raise PolicyError("every resident expert is in use by this step; add slots")


class EvictionPolicy:
    """Base class; subclasses keep whatever order they need to answer `victim` cheaply."""

    name = "base"

    def touch(self, key: Key) -> None:
        raise NotImplementedError

    def inserted(self, key: Key) -> None:
        """A key made resident ahead of use (a prefetch); most policies count it as a use."""
        self.touch(key)

    def begin(self, layer: int) -> None:
        """An access of `layer` starts (one per MoE layer and forward step)."""

    def evicted(self, key: Key) -> None:
        raise NotImplementedError

    def victim(self, incoming: Key, protected: Container[Key]) -> Key:
        raise NotImplementedError

    def wants_victim(self, incoming: Key, free_slots: int) -> bool:
        return free_slots == 0

    def admits(self, incoming: Key, victim: Key) -> bool:
        """Scored access: take `victim`'s slot for `incoming` (not yet touched for this use)?
        Policies without a history beyond residency admit every miss."""
        return True

    def seen(self, key: Key) -> None:
        """A use of `key` that a scored access did not admit: history only, not resident."""

    def watch_busy(self, busy: set[Key]) -> None:
        """The table's set of busy keys (reads in flight; never victims: the table protects
        them). Heap policies read it to drop busy keys' entries instead of stepping over them at
        every miss (a just-admitted key is the lowest there)."""

    def released(self, keys: list[Key]) -> None:
        """These keys left the busy set: victims again."""

    def check(self, n_slots: int, min_slots: int) -> None:
        """Raise PolicyError if this policy cannot run with n_slots (min_slots = top-k)."""

    def capacity(self, n_slots: int) -> int:
        """Most experts of one layer a single `access` may name (a prefill chunk's size)."""
        return n_slots


class HeldHeap(EvictionPolicy):
    """A policy with a lazily updated heap (`heap`, entries ending in their key): a busy key's
    entries are dropped when popped (the victim test checks `held`, the table's busy set) and
    its current entry pushed again when released, so each busy key costs one pop and one push
    instead of one per miss."""

    heap: list[tuple]
    held: frozenset[Key] | set[Key] = frozenset()

    def _entry(self, key: Key) -> tuple | None:
        """The key's current heap entry, or None when it is not resident."""
        raise NotImplementedError

    def watch_busy(self, busy: set[Key]) -> None:
        self.held = busy

    def released(self, keys: list[Key]) -> None:
        for key in keys:
            entry = self._entry(key)
            if entry is not None:
                heapq.heappush(self.heap, entry)


class LRU(EvictionPolicy):
    name = "lru"

    def __init__(self):
        self.order: OrderedDict[Key, None] = OrderedDict()  # oldest first

    def touch(self, key: Key) -> None:
        self.order[key] = None
        self.order.move_to_end(key)

    def evicted(self, key: Key) -> None:
        del self.order[key]

    def victim(self, incoming: Key, protected: Container[Key]) -> Key:
        for key in self.order:
            if key not in protected:
                return key
        raise PolicyError("every resident expert is in use by this step; add slots")


class LFU(HeldHeap):
    """Least frequently used; counts survive eviction (an expert that was hot comes back hot)."""

    name = "lfu"

    def __init__(self):
        self.count: dict[Key, int] = {}
        self.last: dict[Key, int] = {}
        self.clock = 0
        self.heap: list[tuple[int, int, Key]] = []  # (count, last use, key); stale entries skipped

    def touch(self, key: Key) -> None:
        self.clock += 1
        self.count[key] = self.count.get(key, 0) + 1
        self.last[key] = self.clock
        heapq.heappush(self.heap, (self.count[key], self.clock, key))
        if len(self.heap) > 4 * len(self.last) + 64:  # hits leave stale entries: compact
            self.heap = [(self.count[k], t, k) for k, t in self.last.items()]
            heapq.heapify(self.heap)

    def evicted(self, key: Key) -> None:
        del self.last[key]  # the count is kept as history

    def admits(self, incoming: Key, victim: Key) -> bool:
        return self.count.get(incoming, 0) > self.count[victim]

    def seen(self, key: Key) -> None:
        self.count[key] = self.count.get(key, 0) + 1

    def _entry(self, key: Key) -> tuple | None:
        return (self.count[key], self.last[key], key) if key in self.last else None

    def victim(self, incoming: Key, protected: Container[Key]) -> Key:
        # stale: the key was touched again or evicted since the entry was pushed, or is held
        return heap_victim(
            self.heap,
            lambda e: (
                e[2] not in self.held and self.last.get(e[2]) == e[1] and self.count[e[2]] == e[0]
            ),
            protected,
        )


class LRFU(HeldHeap):
    """Least recently/frequently used (Lee et al., 1999): each key's score is its uses, each
    weighed by `decay` ** (tokens since that use); the lowest score goes. Scores survive eviction.
    A token is one access of every MoE layer. At decay 0.9 (half-life ~6.6 tokens), replaying
    the reference model's held-out trace misses 16-27% fewer experts than LRU at 10-50% budgets
    (docs/prediction.md). A prefetched key enters with its history only: a wrong prediction of a
    rarely used expert is the first to go."""

    name = "lrfu"

    def __init__(self, layers: Sequence[int], decay: float = 0.9):
        if not 0.0 < decay < 1.0:
            raise PolicyError(f"lrfu decay must be in (0, 1), got {decay}")
        self.step = 1.0 / max(len(layers), 1)  # clock advance per layer access, in tokens
        self.ln_decay = math.log(decay)
        self.clock = 0.0
        self.score: dict[Key, tuple[float, float]] = {}  # key -> (score at time t, t)
        self.resident: dict[Key, float] = {}  # key -> its heap priority
        self.heap: list[tuple[float, Key]] = []  # (ln score - t ln decay, key); stale skipped

    def begin(self, layer: int) -> None:
        self.clock += self.step

    def _now(self, key: Key) -> float:
        c, t = self.score.get(key, (0.0, self.clock))
        return c * math.exp((self.clock - t) * self.ln_decay)

    def _set(self, key: Key, c: float) -> None:
        self.score[key] = (c, self.clock)
        # Ranking by c * decay**(clock - t) at any common clock = ranking by ln c - t ln decay.
        prio = (math.log(c) if c > 0 else -math.inf) - self.clock * self.ln_decay
        self.resident[key] = prio
        heapq.heappush(self.heap, (prio, key))
        if len(self.heap) > 4 * len(self.resident) + 64:  # hits leave stale entries: compact
            self.heap = [(p, k) for k, p in self.resident.items()]
            heapq.heapify(self.heap)

    def touch(self, key: Key) -> None:
        c, t = self.score.get(key, (0.0, self.clock))  # _now, inlined: once per routed expert
        self._set(key, c * math.exp((self.clock - t) * self.ln_decay) + 1.0)

    def inserted(self, key: Key) -> None:
        self._set(key, self._now(key))

    def evicted(self, key: Key) -> None:
        del self.resident[key]

    def admits(self, incoming: Key, victim: Key) -> bool:
        # both scores at this clock, before this use is counted: a key never seen (score 0)
        # waits for its second use
        return self._now(incoming) > self._now(victim)

    def seen(self, key: Key) -> None:
        self.score[key] = (self._now(key) + 1.0, self.clock)

    def _entry(self, key: Key) -> tuple | None:
        return (self.resident[key], key) if key in self.resident else None

    def victim(self, incoming: Key, protected: Container[Key]) -> Key:
        return heap_victim(
            self.heap,
            lambda e: e[1] not in self.held and self.resident.get(e[1]) == e[0],
            protected,
        )


class Pinned(LRU):
    """A fixed hot set (e.g. the most used experts of a trace) never leaves; LRU for the rest."""

    name = "pinned"

    def __init__(self, pinned: Iterable[Key]):
        super().__init__()
        self.pinned = frozenset(pinned)

    def victim(self, incoming: Key, protected: Container[Key]) -> Key:
        return super().victim(incoming, protected | self.pinned)

    def capacity(self, n_slots: int) -> int:
        return n_slots - len(self.pinned)

    def check(self, n_slots: int, min_slots: int) -> None:
        if len(self.pinned) + min_slots > n_slots:
            raise PolicyError(
                f"{len(self.pinned)} pinned experts + top-k {min_slots} need {len(self.pinned) + min_slots} "
                f"slots, the budget gives {n_slots}; pin fewer experts or raise the budget"
            )


class Sticky(EvictionPolicy):
    """Edge0-style per-layer slots: layer L owns n_slots // n_layers slots; misses replace the
    layer's own least recently used expert, never another layer's."""

    name = "sticky"

    def __init__(self, layers: Sequence[int]):
        self.per_layer: dict[int, LRU] = {layer: LRU() for layer in layers}
        self.quota = 0

    def capacity(self, n_slots: int) -> int:
        return n_slots // len(self.per_layer)

    def check(self, n_slots: int, min_slots: int) -> None:
        self.quota = n_slots // len(self.per_layer)
        if self.quota < min_slots:
            raise PolicyError(
                f"sticky slots give each of {len(self.per_layer)} layers {self.quota} slots, below "
                f"top-k {min_slots}; the minimum budget for sticky is {min_slots * len(self.per_layer)} "
                "slots (or use lru)"
            )

    def touch(self, key: Key) -> None:
        self.per_layer[key[0]].touch(key)

    def evicted(self, key: Key) -> None:
        self.per_layer[key[0]].evicted(key)

    def wants_victim(self, incoming: Key, free_slots: int) -> bool:
        return free_slots == 0 or len(self.per_layer[incoming[0]].order) >= self.quota

    def victim(self, incoming: Key, protected: Container[Key]) -> Key:
        return self.per_layer[incoming[0]].victim(incoming, protected)


def make_policy(
    name: str, layers: Sequence[int] = (), pinned: Iterable[Key] = ()
) -> EvictionPolicy:
    """Build a policy by name: lru | lfu | lrfu (needs `layers`) | pinned (needs `pinned`) |
    sticky (needs `layers`)."""
    if name == "lru":
        return LRU()
    if name == "lfu":
        return LFU()
    if name == "lrfu":
        if not layers:
            raise PolicyError("lrfu needs the list of MoE layers")
        return LRFU(layers)
    if name == "pinned":
        return Pinned(pinned)
    if name == "sticky":
        if not layers:
            raise PolicyError("sticky needs the list of MoE layers")
        return Sticky(layers)
    raise PolicyError(f"unknown eviction policy {name!r}; use {', '.join(POLICIES)}")


@dataclass
class Step:
    slots: list[int] = field(default_factory=list)  # -1: declined (scored access)
    misses: list[tuple[int, int]] = field(default_factory=list)  # (expert, slot)
    evicted: list[Key] = field(default_factory=list)
    declined: list[int] = field(default_factory=list)  # missed experts left out (scored access)


class SlotTable:
    """Expert -> slot table over a fixed pool of n_slots, with hit/miss/eviction counters."""

    def __init__(self, n_slots: int, policy: EvictionPolicy, min_slots: int = 1):
        if n_slots < min_slots:
            raise PolicyError(f"{n_slots} slots is below the minimum of {min_slots} (top-k)")
        policy.check(n_slots, min_slots)
        self.n_slots, self.policy = n_slots, policy
        self._slot_of: dict[Key, int] = {}
        self.free = list(range(n_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self.hits = self.misses = self.evictions = 0
        # Keys whose slots are being written by an asynchronous read: never victims.
        self._busy: set[Key] = set()
        policy.watch_busy(self._busy)
        # Keys a predictor expects to be used soon: victims only when nothing else can go.
        self._keep: set[Key] = set()

    def __contains__(self, key: Key) -> bool:
        return key in self._slot_of

    def slot(self, key: Key) -> int | None:
        """The slot holding key, or None."""
        return self._slot_of.get(key)

    def reserve(self, keys: Iterable[Key]) -> None:
        """Mark keys busy: their slots are being written (a read in flight) and cannot be taken."""
        self._busy.update(keys)

    def release(self, keys: Iterable[Key]) -> None:
        """The reads of these keys ended (landed or failed)."""
        done = [key for key in keys if key in self._busy]
        if done:
            self._busy.difference_update(done)
            self.policy.released(done)

    def is_busy(self, key: Key) -> bool:
        return key in self._busy

    def keep(self, keys: Iterable[Key]) -> None:
        """Replace the set of keys eviction takes last (predicted to be used soon)."""
        self._keep = set(keys)

    def access(self, layer: int, experts: Sequence[int], scored: bool = False) -> Step:
        """One layer's routed experts: hits, misses given slots (evicting where needed). With
        `scored`, a miss that needs a victim is admitted only if the policy `admits` it."""
        if len(experts) > self.n_slots:
            raise PolicyError(
                f"{len(experts)} experts requested at once but only {self.n_slots} slots"
            )
        step = Step()
        protected = {(layer, e) for e in experts}
        self.policy.begin(layer)
        counts = self.hits, self.misses
        try:
            for e in experts:
                key = (layer, e)
                slot = self._slot_of.get(key)
                if slot is None:
                    self.misses += 1
                    slot = self._take_slot(key, protected, step, scored)
                    if slot < 0:
                        self.policy.seen(key)
                        step.declined.append(e)
                        step.slots.append(slot)
                        continue
                    self._slot_of[key] = slot
                    step.misses.append((e, slot))
                else:
                    self.hits += 1
                self.policy.touch(key)
                step.slots.append(slot)
        except PolicyError as err:
            # No victim (busy slots): undo the half-done step so no key is resident unfilled.
            # The evictions it made stand; the error names them.
            for e, _ in step.misses:
                self.discard((layer, e))
            self.hits, self.misses = counts
            err.evicted = tuple(step.evicted)
            raise
        return step

    def insert(self, key: Key, protected: set[Key]) -> tuple[int, list[Key]] | None:
        """Make room for one non-resident key without counting a hit or miss (a prefetch).
        Returns (slot, evicted keys), or None when every candidate victim is protected or busy."""
        step = Step()
        try:
            slot = self._take_slot(key, protected, step)
        except PolicyError:
            return None
        self._slot_of[key] = slot
        self.policy.inserted(key)
        return slot, step.evicted

    def _take_slot(self, key: Key, protected: set[Key], step: Step, scored: bool = False) -> int:
        """A slot for key, evicting a victim if needed; -1 when `scored` and the policy would
        keep the victim."""
        if self.free and not self.policy.wants_victim(key, len(self.free)):
            return self.free.pop()
        hard = AnyOf(protected, self._busy) if self._busy else protected
        old = None
        if self._keep:
            try:
                old = self.policy.victim(key, hard | self._keep)
            except PolicyError:
                pass  # every other candidate is kept: fall back to the policy's own choice
        if old is None:
            old = self.policy.victim(key, hard)
        if scored and not self.policy.admits(key, old):
            return -1
        self.policy.evicted(old)
        step.evicted.append(old)
        self.evictions += 1
        return self._slot_of.pop(old)

    def discard(self, key: Key) -> None:
        """Forget a resident key and free its slot (e.g. its read failed)."""
        slot = self._slot_of.pop(key, None)
        if slot is not None:
            self.policy.evicted(key)
            self.free.append(slot)

    def resident(self) -> dict[Key, int]:
        return dict(self._slot_of)
