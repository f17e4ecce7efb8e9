"""The expert-provider interface the MoE blocks call, and the prefetch protocol beside it.

A provider computes the routed experts' weighted sum for a layer's tokens; where the weights come
from (RAM, a streamed slot cache, the OS page cache, a GPU pool) is its business, not the model's.
The `Runtime` owns the one provider of a model and closes it.

    route -> predict/prefetch -> make resident -> compute -> combine
    (block)  (PredictingExperts)  (provider: residency)  (kernels)  (provider, fixed order)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence

import torch

Key = tuple[int, int]  # (layer, expert)


class ExpertProvider(ABC):
    """Every method a caller may use; nobody probes a provider for optional ones."""

    @abstractmethod
    def experts(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """x [T, D], ids [T, K] int64, weights [T, K] -> [T, D]."""

    def stats(self) -> dict:
        """Cumulative counters (bytes read, hits, seconds...); numbers only. None by default."""
        return {}

    @abstractmethod
    def describe(self) -> dict:
        """What runs, for the mode line and --json: `experts` (resident / slot cache / mmap /
        vram ...) and its size, policy, kernel; plain JSON values."""

    def native_tables(self) -> dict[int, dict[int, list[torch.Tensor]]] | None:
        """layer -> expert -> the four record tensors the native layer op reads, where every record
        of every layer stays resident for the native kernels (models/native_step.py then runs a
        whole decode token in one native call); None (the default) where experts() must run."""
        return None

    def native_extras(self) -> tuple[dict[int, dict[int, list[torch.Tensor]]] | None, object]:
        """Beside native_tables' records, what the native layer op takes for experts that are
        not plain SwiGLU (gpt-oss's): (layer -> expert -> [b13, b2] fp32 biases, or None; the
        kernels/ref.py ExpertActivation, or None)."""
        return None, None

    def note_native_step(self, hits: int, seconds: float) -> None:  # noqa: B027
        """A native decode step used `hits` resident records and spent `seconds` in the experts:
        the counters experts() would have kept (providers with native_tables override it)."""

    def decodes_ahead(self) -> bool:
        """Whether a decode step may be issued before the host has read the step before it (a
        captured greedy step feeds its token back on the device); False for providers whose
        decode hooks must see each step done before the next is issued."""
        return True

    def decode_read(self) -> None:  # noqa: B027 (a declared no-op default)
        """The generator read the oldest issued decode step's output on the host, so that step's
        GPU work is done. Step by step this comes before the next step is issued; running
        ahead, after (the next step is in flight)."""

    def decode_issued(self) -> None:  # noqa: B027 (a declared no-op default)
        """A decode step was issued and runs asynchronously: host bookkeeping of steps already
        read overlaps it (the GPU pool's slot table with device misses)."""

    def reset(self) -> None:  # noqa: B027 (a declared no-op default, not a forgotten abstract)
        """A new sequence starts at position 0 (the generator calls this before each prefill)."""

    def close(self) -> None:  # noqa: B027 (a declared no-op default)
        """Release IO threads, pinned buffers and maps; the provider is unusable after."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Prefetcher(ABC):
    """A provider that can read experts ahead of need (the streamed slot cache). The predicting
    wrapper (experts/predicting.py) drives it; providers without it simply are not prefetched."""

    @abstractmethod
    def prefetch(
        self, layer: int, experts: Sequence[int], protect: Iterable[Key] = (), priority: int = 0
    ) -> int:
        """Start reads of the non-resident `experts` of `layer` in the given order without taking
        the slots of `protect`; returns the reads started."""

    @abstractmethod
    def cancel_prefetch(self, layer: int, experts: Iterable[int]) -> int:
        """Drop queued (not started) prefetch reads of these experts; returns how many."""

    @abstractmethod
    def hint(self, keys: Iterable[Key]) -> None:
        """Keys predicted to be used soon: eviction takes other keys first."""

    @abstractmethod
    def request(self, layer: int, experts: list[int]) -> None:
        """Decode: queue the demand reads of `experts` (ascending) now, so prefetches issued after
        run behind them; the next `experts()` call for `layer` waits for them."""


def stats_delta(before: dict, after: dict) -> dict:
    """Counters for one generation, plus the achieved read bandwidth."""
    d = {k: after[k] - before[k] for k in after if isinstance(after[k], (int, float))}
    if d.get("prefetch_reads"):
        d["prefetch_precision"] = d["prefetch_used"] / d["prefetch_reads"]
    io = d.get("io_seconds", 0.0)
    # Demand bytes over the time compute waited for them: a stall rate, not the disk's bandwidth
    # (reads that land while compute runs cost no wait). GenerationResult adds `read_gbps`.
    demand = d.get("demand_bytes_read", d.get("bytes_read", 0))  # providers without prefetch
    d["stall_read_gbps"] = demand / io / 1e9 if io else 0.0
    return d
