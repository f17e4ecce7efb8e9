"""Decode steps as captured CUDA graphs: one replay per token instead of ~35 launches per layer
issued from Python (the host, not the GPU, bounded eager decode: 14 ms of host time per token
against 2.4 ms of GPU work on the H200).

A `DecodeGraph` owns a `StaticKVCache` of one capacity bucket, its static token and position
tensors and the graph of one step `model(tok, cache, pos)`. The prompt runs eagerly into the same
cache; the first decode step runs eagerly too (compiling every kernel at these shapes), then the
step is captured and replayed. The Triton attention (kernels/triton/attention.py) reads the
position from the device and only the valid cache rows; the torch attention (its reference, and
the path of modules it does not take) reads the whole bucket with later positions masked, so its
logits can differ from eager decode in the last bits (a longer masked reduction); the tokens are
checked against eager and the CPU by the margin rule (tests/test_gpu_provider.py).

Only models whose every layer is plain attention qualify (recurrent layers decide on the host when
a sequence starts), with every expert resident in VRAM or streamed with device-side misses (a pool
that resolves misses on the host syncs per layer) and a RoPE table that does not depend on the
length (`graphable` says why not).
"""

from __future__ import annotations

import torch

from moestream.engine.kv_cache import StaticKVCache

MIN_BUCKET = 256  # KV capacity buckets: powers of two from here (attention reads the bucket)


def graphable(model, args, provider) -> str | None:
    """Why a decode step of this model cannot be captured (None when it can)."""
    from moestream.experts.gpu import GpuExperts

    if not isinstance(provider, GpuExperts) or provider.device.type != "cuda":
        return "the experts are not in a CUDA pool"
    if not (provider.cfg.resident or provider.device_misses):  # the provider's own rule
        return "streamed experts resolve misses on the host (--gpu-budget without --pin-experts)"
    if not all(args.attention_layers):
        return "recurrent layers (linear attention, short convolutions) reset on the host"
    if model.rope.r.rope_type == "dynamic":
        return "dynamic-NTK RoPE changes its table with the length"
    return None


def bucket(total: int, limit: int) -> int:
    """The KV capacity for a sequence of `total` positions: the next power of two >= MIN_BUCKET,
    at most the model's context `limit`."""
    n = MIN_BUCKET
    while n < total:
        n *= 2
    return min(n, limit)


class DecodeGraph:
    """One capacity bucket's static cache and captured decode step. `compiled`: the step is
    torch.compile'd (fixed shapes; the expert provider's call stays outside, a graph break) and
    its first eager call compiles, so the capture records the fused kernels.

    The step ends with the greedy pick (kernels/triton/pick.py) into a static buffer, and writes
    the picked token into its own input: `launch` without a token replays the next greedy step
    before the host has seen this one's token (the host reads it through one of two pinned
    buffers), so the host's per-token work overlaps the GPU's. `step` keeps the logits for
    sampling and penalties (the host's token then overwrites the fed-back one)."""

    AHEAD = 2  # pinned result buffers: a step in flight while the host reads the one before

    def __init__(self, model, args, capacity: int, dtype: torch.dtype, device, pool,
                 compiled: bool = False):  # fmt: skip
        self.model, self.capacity, self.pool = model, capacity, pool
        self.cache = StaticKVCache(args, capacity, dtype, device)
        self.tok = torch.zeros(1, dtype=torch.int64, device=device)
        self.pick = torch.zeros(2, dtype=torch.float64, device=device)  # (token, log-prob)
        self.host = torch.zeros(self.AHEAD, 2, dtype=torch.float64, pin_memory=True)
        self.events = [torch.cuda.Event() for _ in range(self.AHEAD)]
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        # emulate_precision_casts: inductor rounds to bf16 where eager does (a fused kernel
        # would otherwise keep fp32 between ops, and the logits drift from eager's by more than
        # rounding: a near-tied router flips an expert)
        self._fn = (torch.compile(self._forward, dynamic=False,
                                  options={"emulate_precision_casts": True})
                    if compiled else self._forward)  # fmt: skip

    def _forward(self) -> torch.Tensor:
        return self.model(self.tok, self.cache, self.cache.pos, last_only=True)[-1]

    def _run(self) -> torch.Tensor:
        """One step: logits, the greedy pick, and the picked token fed back as the next input."""
        from moestream.engine.sampling import device_greedy

        logits = self._fn()
        device_greedy(logits, out=self.pick)
        self.tok.copy_(self.pick[:1])  # float64 -> int64, exact for any vocabulary id
        return logits

    def step(self, token: int, pos: int) -> torch.Tensor:
        """Logits [V] of `token` at position `pos`; the first call runs eagerly and captures,
        later ones replay. The result is a static buffer: read it before the next step."""
        self.tok.fill_(token)  # fills are kernels with a scalar argument: no host->device copy
        return self._replay(pos)

    def launch(self, pos: int, token: int | None = None) -> int:
        """Issue the step at `pos` (its input `token`, or the token the last step picked) and the
        copy of its pick to the host; returns the buffer `read` takes it from."""
        if token is not None:
            self.tok.fill_(token)
        self._replay(pos)
        j = pos % self.AHEAD
        self.host[j].copy_(self.pick, non_blocking=True)
        self.events[j].record()
        return j

    def read(self, j: int) -> tuple[int, float]:
        """(token, log-prob) of the step `launch` returned `j` for (waits for it)."""
        self.events[j].synchronize()
        token, logprob = self.host[j].tolist()
        return int(token), logprob

    def _replay(self, pos: int) -> torch.Tensor:
        self.cache.pos.fill_(pos)
        if self.graph is None:
            out = self._run()
            self._capture()
            return out
        self.graph.replay()
        return self.logits

    def _capture(self) -> None:
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            self.logits = self._run()
        self.graph = g


class DecodeGraphs:
    """The captured steps of one model, one per KV capacity bucket, sharing one memory pool."""

    def __init__(self, model, args, dtype: torch.dtype, device, compiled: bool = False):
        self.model, self.args, self.dtype, self.device = model, args, dtype, device
        self.compiled = compiled
        self.pool = torch.cuda.graph_pool_handle()
        self.by_capacity: dict[int, DecodeGraph] = {}

    def for_length(self, total: int) -> DecodeGraph:
        """The graph whose cache holds `total` positions; its cache is reused across sequences
        (a new prompt overwrites it from position 0, later positions are masked)."""
        cap = bucket(total, self.args.max_position_embeddings)
        g = self.by_capacity.get(cap)
        if g is None:
            g = self.by_capacity[cap] = DecodeGraph(
                self.model, self.args, cap, self.dtype, self.device, self.pool, self.compiled
            )
        return g
