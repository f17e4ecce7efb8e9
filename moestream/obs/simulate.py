"""Cache simulator: replay a router trace through the engine's own slot table and eviction policies
(moestream/store/policy.py, not a copy) and report hit rate and bytes read per token; Belady's MIN
(evict the expert used again furthest in the future) is the bound no online policy can beat.

The replay asks the slot table exactly what the streaming provider (store/stream.py) asks: per
forward step and MoE layer in forward order, a decode token's K experts in ascending id order, and
for a prefill the distinct experts of the prompt in ascending order, in chunks of at most n_slots.
One table serves all sequences of the trace, as one engine process serves its requests.

`admit` replays the GPU pool with device-side misses instead (`GpuConfig.admit`): a decode miss
crosses the link for its own step whether or not it is kept, and an admitted one crosses it again
into its slot, so the bytes are misses + admissions; "scored" admits a decode miss only when the
policy's history of it beats its victim's, "all" admits every one. A prompt fills the pool as
on the CPU (every miss admitted, read once). Admissions land at once here: the engine's, a step
or two behind and skipped while every victim is busy, are modelled by
benchmarks/ablations/sim_admission.py on synthetic routing.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from moestream.config import ConfigError, parse_budget
from moestream.obs.stats import expert_counts
from moestream.obs.trace import Trace
from moestream.store.policy import POLICIES as ENGINE_POLICIES
from moestream.store.policy import (
    EvictionPolicy,
    Key,
    PolicyError,
    SlotTable,
    heap_victim,
    make_policy,
)

POLICIES = (*ENGINE_POLICIES, "belady")  # the engine's, plus the offline optimum
ADMIT = ("all", "scored")  # the GPU pool's admission rules (experts/config.py ADMIT)


def accesses(t: Trace, n_slots: int) -> Iterator[tuple[int, list[int], bool]]:
    """(model layer, experts, is_decode) in the order the streaming provider requests them."""
    ids = np.asarray(t.ids, dtype=np.int64)  # [N, L, K]
    layers = t.model.moe_layers
    for s in t.sequences:
        o, P, n = s["offset"], s["prompt_tokens"], s["length"]
        for col, layer in enumerate(layers):  # the prefill: one forward over the prompt
            present = np.unique(ids[o : o + P, col]).tolist()
            for c in range(0, len(present), n_slots):
                yield layer, present[c : c + n_slots], False
        for r in range(o + P, o + n):  # decode: one forward per generated token
            for col, layer in enumerate(layers):
                yield layer, sorted(ids[r, col].tolist()), True


class Belady(EvictionPolicy):
    """MIN: evict the resident expert whose next use is furthest away. Needs the whole future, so
    it is built from the access sequence it will see (the touches must follow it exactly)."""

    name = "belady"

    def __init__(self, keys: Sequence[Key]):
        never = len(keys)
        self.next_use = [never] * len(keys)  # next index at which keys[i] is used again
        seen: dict[Key, int] = {}
        for i in range(len(keys) - 1, -1, -1):
            self.next_use[i] = seen.get(keys[i], never)
            seen[keys[i]] = i
        self.keys = keys
        self.i = 0
        self.when: dict[Key, int] = {}  # resident key -> its next use
        self.heap: list[tuple[int, Key]] = []  # (-next use, key); stale entries skipped

    def touch(self, key: Key) -> None:
        assert self.keys[self.i] == key, f"Belady replay diverged at access {self.i}"
        nu = self.next_use[self.i]
        self.i += 1
        self.when[key] = nu
        heapq.heappush(self.heap, (-nu, key))

    def evicted(self, key: Key) -> None:
        del self.when[key]

    def victim(self, incoming: Key, protected: set[Key]) -> Key:
        return heap_victim(self.heap, lambda e: self.when.get(e[1]) == -e[0], protected)


@dataclass
class SimResult:
    policy: str
    budget: str  # as given
    n_slots: int
    hits: int
    misses: int
    decode_hits: int
    decode_misses: int
    bytes_read: int
    bytes_per_token: float
    decode_bytes_per_token: float
    admit: str | None = None  # None: the CPU streaming provider; else the GPU pool's rule
    decode_admissions: int = 0  # decode misses given a slot

    @property
    def label(self) -> str:
        return self.policy if self.admit is None else f"{self.policy}/{self.admit}"

    @property
    def hit_rate(self) -> float:
        return self.hits / max(self.hits + self.misses, 1)

    @property
    def decode_hit_rate(self) -> float:
        return self.decode_hits / max(self.decode_hits + self.decode_misses, 1)

    def to_json(self) -> dict:
        return {**self.__dict__, "hit_rate": self.hit_rate, "decode_hit_rate": self.decode_hit_rate}


def budget_slots(text: str, total_experts: int, expert_bytes: int) -> int:
    """A --budget as slots: a fraction of all experts (0.25, 25%) or bytes (512MiB, 4096) divided
    by the bytes of one expert; config.parse_budget reads both, as for --memory-budget."""
    b = parse_budget(text, "--budget")
    if b.fraction is not None:
        n = int(b.fraction * total_experts)
    elif expert_bytes <= 0:
        raise ConfigError(
            "this trace does not know the size of an expert; give the budget as a fraction of all "
            "experts (e.g. 0.25) or pass --expert-bytes"
        )
    else:
        n = min(b.nbytes // expert_bytes, total_experts)
    if n < 1:
        raise ConfigError(
            f"--budget {text} holds no expert ({total_experts} experts of {expert_bytes} bytes); "
            "raise it (a unitless integer is bytes; a fraction is written 0.25 or 25%)"
        )
    return n


def hottest_keys(t: Trace, n: int) -> list[Key]:
    """The n (layer, expert) keys selected most often in the trace, over all layers."""
    counts = expert_counts(t)  # [L, E]
    order = np.argsort(-counts.ravel(), kind="stable")[:n]
    layers = t.model.moe_layers
    return [(layers[i // t.num_experts], int(i % t.num_experts)) for i in order]


def make_sim_policy(
    name: str, t: Trace, n_slots: int, pin_fraction: float = 0.5
) -> tuple[EvictionPolicy, list[tuple[int, list[int], bool]]]:
    """The policy object and the access list it will be replayed with. `pinned` pins the trace's
    own hottest experts, filling pin_fraction of the slots (in-sample, like a profile-guided pin)."""
    if name == "belady":
        steps = list(accesses(t, n_slots))
        return Belady([(layer, e) for layer, es, _ in steps for e in es]), steps
    pinned = hottest_keys(t, int(pin_fraction * n_slots)) if name == "pinned" else ()
    policy = make_policy(name, layers=t.model.moe_layers, pinned=pinned)
    # Same prefill chunking as the engine: what the policy lets one layer hold at once.
    return policy, list(accesses(t, policy.capacity(n_slots)))


def simulate(
    t: Trace,
    policy: str,
    n_slots: int,
    expert_bytes: int,
    budget: str = "",
    pin_fraction=0.5,
    record_bytes: dict[int, int] | None = None,
    admit: str | None = None,
) -> SimResult:
    """Replay the trace with one policy and slot count. A miss reads `record_bytes[layer]`
    (a store of per-layer record sizes: `TraceModel.layer_bytes`), else `expert_bytes`.
    `admit`: the GPU pool's rule (module docstring), None for the CPU's streaming provider."""
    if policy not in POLICIES:
        raise ConfigError(f"unknown policy {policy!r}; use {', '.join(POLICIES)}")
    if admit is not None and admit not in ADMIT:
        raise ConfigError(f"unknown admission rule {admit!r}; use {', '.join(ADMIT)}")
    pol, steps = make_sim_policy(policy, t, n_slots, pin_fraction)
    table = SlotTable(n_slots, pol, t.top_k)
    dh = dm = read = dread = admitted = 0
    for layer, experts, decode in steps:
        h0, m0 = table.hits, table.misses
        step = table.access(layer, experts, scored=decode and admit == "scored")
        size = expert_bytes if record_bytes is None else record_bytes[layer]
        moved = table.misses - m0
        if decode and admit is not None:  # the staged read, then the admitted copy
            moved += len(step.misses)
            admitted += len(step.misses)
        read += moved * size
        if decode:
            dh += table.hits - h0
            dm += table.misses - m0
            dread += moved * size
    n_dec = int((~t.is_prompt).sum())
    return SimResult(
        policy=policy,
        budget=budget or str(n_slots),
        n_slots=n_slots,
        hits=table.hits,
        misses=table.misses,
        decode_hits=dh,
        decode_misses=dm,
        bytes_read=read,
        bytes_per_token=read / max(t.n_positions, 1),
        decode_bytes_per_token=dread / max(n_dec, 1),
        admit=admit,
        decode_admissions=admitted,
    )


def run_grid(
    t: Trace,
    policies: list[str],
    budgets: list[str],
    expert_bytes: int,
    pin_fraction=0.5,
    record_bytes: dict[int, int] | None = None,
    admits: Sequence[str | None] = (None,),
) -> tuple[list[SimResult], list[str]]:
    """Every policy x budget x admission rule (`admits`: None = the CPU's streaming provider),
    plus Belady's bound at each budget (once, every miss admitted): a budget buys slots of
    `expert_bytes` each, a miss reads `record_bytes[layer]` where given (simulate). Returns the
    results and one line for each combination the policy cannot run (e.g. sticky below its
    minimum)."""
    total = t.n_layers * t.num_experts
    names = list(dict.fromkeys([*policies, "belady"]))
    out, skipped = [], []
    for b in budgets:
        n_slots = budget_slots(b, total, expert_bytes)
        runs = [(n, ad) for n in names if n != "belady" for ad in admits]
        for name, admit in [*runs, ("belady", None)]:
            try:
                out.append(simulate(t, name, n_slots, expert_bytes, b, pin_fraction, record_bytes,
                                    admit))  # fmt: skip
            except PolicyError as e:
                # The engine's prefill asks for all of a layer's distinct prompt experts (up to
                # n_slots) at once; sticky/pinned can hold fewer, and the engine fails the same way.
                label = name if admit is None else f"{name}/{admit}"
                skipped.append(
                    f"{label} at budget {b} ({n_slots} slots): {e} (the engine fails alike)"
                )
    return out, skipped


def format_results(results: list[SimResult], expert_bytes: int) -> str:
    lines = [
        f"{'policy':<13} {'budget':>10} {'slots':>6} {'hit rate':>8} {'decode hit':>10} "
        f"{'MiB/token':>10} {'decode MiB/token':>16} {'vs belady':>9}"
    ]
    bound = {r.n_slots: r for r in results if r.policy == "belady"}
    for r in results:
        b = bound.get(r.n_slots)
        gap = f"{r.misses / b.misses:.2f}x" if b and b.misses else "-"
        lines.append(
            f"{r.label:<13} {r.budget:>10} {r.n_slots:>6} {r.hit_rate:>8.3f} "
            f"{r.decode_hit_rate:>10.3f} {r.bytes_per_token / 2**20:>10.3f} "
            f"{r.decode_bytes_per_token / 2**20:>16.3f} {gap:>9}"
        )
    lines.append(
        f"(expert = {expert_bytes} bytes; 'vs belady' = misses relative to the optimum at that budget)"
    )
    return "\n".join(lines)
