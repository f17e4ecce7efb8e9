"""The prefetching provider: route -> predict/prefetch -> make resident -> compute -> combine.

`PredictingExperts` wraps an expert provider. At each MoE layer of each token it scores the
prediction made earlier for this (layer, token) against the router's choice, feeds the predictor,
starts prefetch reads for its new predictions (a wrapped `Prefetcher`, the streamed slot cache,
reads them in the IO pool while this layer computes), then computes. Routing modes:

- exact (default): predictions only prefetch; the router's own top-k is computed, so tokens are
  identical to resident.
- predicted (Edge0 prediction as routing): at decode, a layer with a prediction uses the
  predicted set as its routing, weighted by the block's own rule (`SparseMoe.weights_for`), so
  what was staged is what runs. Lossy; gate it with `moestream eval`. Layers without a
  prediction (e.g. layer 0 for the prerouter) and prefill route exactly.
"""

from __future__ import annotations

import torch

from moestream.config import ConfigError
from moestream.experts.base import ExpertProvider, Prefetcher
from moestream.experts.config import ROUTINGS
from moestream.predict.base import Prediction, Predictor
from moestream.store.io import PREFETCH, PREFETCH_LOW


class PredictingExperts(ExpertProvider):
    """ExpertProvider wrapper; `inner` is the wrapped provider (prefetched when a Prefetcher)."""

    def __init__(
        self, inner, predictor: Predictor, blocks, routing: str = "exact", min_score: float = 0.0
    ):
        """min_score: prefetch only predicted experts whose confidence score reaches it (for
        predictors that give scores); ignored with predicted routing, which runs them all."""
        if routing not in ROUTINGS:
            raise ConfigError(f"unknown --routing {routing!r}; use exact or predicted")
        self.inner, self.predictor, self.routing = inner, predictor, routing
        self.min_score = min_score if routing == "exact" else 0.0
        self.blocks = list(blocks)
        self.layers = [b.layer for b in self.blocks]
        self.col = {layer: i for i, layer in enumerate(self.layers)}
        self.can_prefetch = isinstance(inner, Prefetcher)
        self.c = dict.fromkeys(("predicted", "correct", "routed", "forced"), 0)
        self.pos = 0
        self.pending: dict[tuple[int, int], tuple[int, ...]] = {}

    def reset(self) -> None:
        """A new sequence starts at position 0 (the generator calls this before prefill)."""
        self.pos = 0
        self.pending = {}
        self.predictor.reset()
        self.inner.reset()

    def close(self) -> None:
        self.inner.close()

    def describe(self) -> dict:
        return {**self.inner.describe(), "predictor": self.predictor.name, "routing": self.routing,
                "prefetch": self.can_prefetch}  # fmt: skip

    def experts(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """x [T, D], ids [T, K], weights [T, K] -> [T, D]."""
        col, T = self.col[layer], x.shape[0]
        if col == 0:
            self.pending = {k: v for k, v in self.pending.items() if k[1] >= self.pos}
        last = self.pos + T - 1
        guess = self.pending.pop((col, last), None)
        routed = ids  # the router's own choice: scored against, and the predictor's input
        if T == 1:
            self._score(guess, ids[0].tolist())
            if guess is not None and self.routing == "predicted":
                ids = torch.tensor([guess], dtype=ids.dtype, device=ids.device)
                weights = self.blocks[col].weights_for(x, ids)
                self.c["forced"] += 1
        if guess is not None and self.can_prefetch:
            self._cancel_wrong(col, last, guess, ids[-1].tolist())
        if T == 1 and self.can_prefetch:
            self.inner.request(layer, sorted(ids[0].tolist()))  # demand reads queue first
        # Prefill: the predictor needs only the last tokens' state.
        for row in range(max(0, T - 2), T):
            preds = self.predictor.observe(col, self.pos + row, x[row], routed[row].tolist())
            if row == T - 1:
                self._stage(preds, col, self.pos + row, ids[row].tolist())
        if col == len(self.layers) - 1:
            self.pos += T
        return self.inner.experts(layer, x, ids, weights)

    def _cancel_wrong(self, col: int, pos: int, guess, used: list[int]) -> None:
        """Queued reads of a prediction the router just contradicted are dropped, unless a later
        prediction for this layer still wants them."""
        keep = set(used)
        for (c, p), experts in self.pending.items():
            if c == col and p > pos:
                keep.update(experts)
        wrong = [e for e in guess if e not in keep]
        if wrong:
            self.inner.cancel_prefetch(self.layers[col], wrong)

    def _score(self, guess, routed: list[int]) -> None:
        self.c["routed"] += len(routed)
        if guess is not None:
            self.c["predicted"] += len(guess)
            self.c["correct"] += len(set(guess) & set(routed))

    def _stage(self, preds: list[Prediction], col: int, pos: int, now: list[int]) -> None:
        """Record the predictions and prefetch them, nearest target first, each most confident
        expert first; reads for the next layer queue ahead of those further out. Neither the
        computing layer's slots nor those of other pending predictions are taken."""
        L = len(self.layers)
        preds = sorted(preds, key=lambda p: (p.pos - pos) * L + p.layer - col)
        old = {(p.layer, p.pos): self.pending.get((p.layer, p.pos)) for p in preds}
        for p in preds:
            self.pending[(p.layer, p.pos)] = p.experts
        if not self.can_prefetch:
            return
        protect = {(self.layers[col], e) for e in now}
        for (c, _), experts in self.pending.items():
            protect.update((self.layers[c], e) for e in experts)
        self.inner.hint(protect - {(self.layers[col], e) for e in now})
        for p in preds:
            layer = self.layers[p.layer]
            stale = old[(p.layer, p.pos)]
            if stale:  # a replaced prediction: its reads not started are dropped
                self.inner.cancel_prefetch(layer, [e for e in stale if e not in p.experts])
            lead = (p.pos - pos) * L + p.layer - col
            prio = PREFETCH if lead <= 1 else PREFETCH_LOW
            self.inner.prefetch(layer, p.ranked(self.min_score), protect, priority=prio)

    def stats(self) -> dict:
        s = self.inner.stats()
        c = self.c
        return {
            **s,
            "predict_routed": c["routed"],
            "predict_predicted": c["predicted"],
            "predict_correct": c["correct"],
            "predict_forced_layers": c["forced"],
        }


def attach(
    model,
    provider: ExpertProvider,
    predictor: Predictor,
    routing: str = "exact",
    min_score: float = 0.0,
) -> PredictingExperts:
    """Wrap `provider` (the model's, unwrapped) with prediction/prefetch and give the wrapper to
    the model's MoE blocks; returns the wrapper, the provider the owner now holds."""
    if isinstance(provider, PredictingExperts):
        provider = provider.inner
    wrapper = PredictingExperts(provider, predictor, model.moe_blocks, routing, min_score)
    model.set_provider(wrapper)
    return wrapper
