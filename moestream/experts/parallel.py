"""Expert parallelism: each rank holds one shard of every MoE layer's experts (`Shard`: expert
e on rank e % world), the dense weights are replicated, and torch.distributed moves the routed
rows (gloo on CPUs; NCCL on GPUs is the same code once a GPU provider takes a shard).

Every rank runs the same dense compute on the same tokens, so x, ids and weights agree bit for
bit without communication. Per MoE layer: each rank computes the weighted terms of the (token,
slot) pairs routed to its experts (the inner provider's own kernel calls) -> one all_gather of
fixed-size buffers (the largest rank's pair count, known to all from ids) -> every rank puts
each term at its (token, slot) and sums them as the single-process provider does (ascending
expert id per token, the same dtype). The result is the one-process bits at that quantization.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from moestream.errors import RankError
from moestream.experts.base import ExpertProvider
from moestream.experts.config import Shard
from moestream.experts.streaming import StoreExperts
from moestream.kernels.ref import group_by_expert

# Ranks load at their own pace (a big store reads for minutes); the per-layer collectives run
# under the process group's short timeout, so a hung rank is named instead of waited for.
LOAD_TIMEOUT = timedelta(minutes=30)


class ExpertParallel(ExpertProvider):
    """Wraps this rank's store provider (built with `StreamConfig.shard`: resident, slot cache
    of its own budget, or mmap) in the default process group of `shard.world` ranks."""

    def __init__(self, inner: StoreExperts, shard: Shard):
        if not dist.is_initialized() or dist.get_world_size() != shard.world:
            have = dist.get_world_size() if dist.is_initialized() else "no"
            raise RankError(
                f"expert parallelism over {shard.world} ranks needs a process group of that "
                f"size ({have} here); launch with `moestream generate --devices cpu:N` or torchrun"
            )
        self.inner, self.shard = inner, shard
        self.comm_seconds, self.comm_bytes, self.comm_calls = 0.0, 0, 0
        try:  # every rank has loaded before the first layer's collective
            dist.monitored_barrier(timeout=LOAD_TIMEOUT, wait_all_ranks=True)
        except RuntimeError as e:
            raise RankError(f"rank {shard.rank}: a rank did not finish loading: {_first(e)}") from e

    def describe(self) -> dict:
        return {**self.inner.describe(), "ranks": self.shard.world, "rank": self.shard.rank}

    def experts(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        T, K = ids.shape
        D, W = x.shape[1], self.shard.world
        groups = group_by_expert(ids)
        by_rank: list[list] = [[] for _ in range(W)]
        for g in groups:
            by_rank[self.shard.owner(g[0])].append(g)
        counts = [sum(len(t) for _, t, _ in gs) for gs in by_rank]
        mine = self.inner.terms(layer, x, by_rank[self.shard.rank], weights)  # [n_mine, D]
        rows = self._gather(layer, mine, max(counts))  # [W, n, D]
        flat = torch.empty(T * K, D, dtype=mine.dtype)  # every term at its (token, slot)
        for r, gs in enumerate(by_rank):
            if gs:
                flat[torch.cat([t * K + s for _, t, s in gs])] = rows[r, : counts[r]]
        return self.inner.combine(x, ids, flat.view(T, K, D))

    def _gather(self, layer: int, mine: torch.Tensor, n: int) -> torch.Tensor:
        """Every rank's rows padded to n: [W, n, D]. A lost peer is a RankError, not a hang."""
        buf = torch.zeros(n, mine.shape[1], dtype=mine.dtype)
        buf[: mine.shape[0]] = mine
        out = torch.empty(self.shard.world, *buf.shape, dtype=buf.dtype)
        t0 = time.perf_counter()
        try:
            dist.all_gather(list(out.unbind(0)), buf)
        except RuntimeError as e:
            raise RankError(
                f"rank {self.shard.rank}: layer {layer}: a peer rank stopped answering (died or "
                f"hung past the timeout): {_first(e)}"
            ) from e
        self.comm_seconds += time.perf_counter() - t0
        self.comm_bytes += out.numel() * out.element_size()
        self.comm_calls += 1
        return out

    def stats(self) -> dict:
        return {
            **self.inner.stats(),
            "comm_seconds": self.comm_seconds,
            "comm_bytes": self.comm_bytes,
            "comm_calls": self.comm_calls,
        }

    def reset(self) -> None:
        self.inner.reset()

    def close(self) -> None:
        self.inner.close()  # the process group belongs to the launcher (moestream/distributed.py)


def _first(e: BaseException) -> str:
    """The first line of a backend error (gloo appends a long hint)."""
    return str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
