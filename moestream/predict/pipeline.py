"""The prefetching provider: route -> predict/prefetch -> make resident -> compute -> combine.

`PredictingExperts` wraps an expert provider. At each MoE layer of each token it scores the
prediction made earlier for this (layer, token) against the router's choice, feeds the predictor,
starts prefetch reads for its new predictions (the wrapped StreamingExperts reads them in the IO
pool while this layer computes), then computes. Routing modes:

- exact (default): predictions only prefetch; the router's own top-k is computed, so tokens are
  identical to resident.
- predicted (Edge0 prediction as routing): at decode, a layer with a prediction uses the
  predicted set as its routing (weights: the router's probabilities of those experts, normalised
  as the model's own rule), so what was staged is what runs. Lossy; gate it with `moestream eval`.
  Layers without a prediction (e.g. layer 0 for the prerouter) and prefill route exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moestream.config import ConfigError
from moestream.models.layers import SparseMoe, softmax_topk
from moestream.predict.base import PREDICTORS, Prediction, Predictor
from moestream.store.io import PREFETCH, PREFETCH_LOW

ROUTINGS = ("exact", "predicted")


def routing_weights(block, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Gate weights [1, K] for a forced expert set ids [1, K], by the block's own scoring rule."""
    gate = block.gate
    if isinstance(gate, torch.nn.Linear):  # softmax routers (qwen, mixtral, olmoe)
        w = torch.softmax(gate(x), dim=-1, dtype=torch.float32).gather(1, ids)
        return w / w.sum(dim=-1, keepdim=True) if block.renorm else w
    a = gate.args  # sigmoid routers (glm4_moe, deepseek_v3)
    w = F.linear(x.float(), gate.weight.float()).sigmoid().gather(1, ids)
    if a.norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * a.routed_scaling_factor


class PredictingExperts:
    """ExpertProvider wrapper; other attributes (store, table, close...) reach the wrapped one."""

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
        self.can_prefetch = hasattr(inner, "prefetch") and hasattr(inner, "cancel_prefetch")
        self.can_request = hasattr(inner, "request")
        self.can_hint = hasattr(inner, "hint")
        self.c = dict.fromkeys(("predicted", "correct", "routed", "forced"), 0)
        self.pos = 0
        self.pending: dict[tuple[int, int], tuple[int, ...]] = {}

    def reset(self) -> None:
        """A new sequence starts at position 0 (the generator calls this before prefill)."""
        self.pos = 0
        self.pending = {}
        self.predictor.reset()

    def __getattr__(self, name):
        return getattr(self.inner, name)

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
                weights = routing_weights(self.blocks[col], x, ids).to(weights.dtype)
                self.c["forced"] += 1
        if guess is not None and self.can_prefetch:
            self._cancel_wrong(col, last, guess, ids[-1].tolist())
        if T == 1 and self.can_request:
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
        if self.can_hint:
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
        s = self.inner.stats() if hasattr(self.inner, "stats") else {}
        c = self.c
        return {
            **s,
            "predict_routed": c["routed"],
            "predict_predicted": c["predicted"],
            "predict_correct": c["correct"],
            "predict_forced_layers": c["forced"],
        }


def _router(block):
    """The block's routing rule x [T, D] -> (weights, ids); softmax top-k unless it has its own."""
    route = getattr(block, "route", None)
    if route is not None:
        return route
    return lambda x: softmax_topk(block.gate(x), block.k, block.renorm)


def _scorer(block):
    """Router probabilities x [T, D] -> [T, E] for softmax routers; None for other rules."""
    gate = getattr(block, "gate", None)
    if type(block).route is not SparseMoe.route or not isinstance(gate, torch.nn.Linear):
        return None
    return lambda x: torch.softmax(gate(x), dim=-1, dtype=torch.float32)


def make_predictor(name: str, model, *, heads=None, trace=None, ahead: int = 1) -> Predictor:
    """Build a predictor for a loaded model: heads = PrerouterHeads, trace = a Trace (oracle);
    ahead = how many layers ahead the stale gate names."""
    from moestream.predict.base import Predictor as NoPredictor
    from moestream.predict.oracle import OraclePredictor
    from moestream.predict.prerouter import PrerouterPredictor
    from moestream.predict.stale_gate import StaleGatePredictor
    from moestream.predict.temporal import TemporalPredictor

    blocks = model.moe_blocks
    if name == "none":
        return NoPredictor()
    if name == "temporal":
        return TemporalPredictor(len(blocks))
    if name == "stale-gate":
        scorers = [_scorer(b) for b in blocks]
        return StaleGatePredictor(
            [_router(b) for b in blocks], None if None in scorers else scorers, ahead
        )
    if name == "prerouter":
        if heads is None:
            raise ConfigError(
                "--predictor prerouter needs trained heads (prerouter.heads beside the "
                "model); make them with `moestream train-prerouter -m PATH --traces TRACE`"
            )
        if (len(heads.heads) + 1, heads.experts) != (len(blocks), model.args.num_experts):
            raise ConfigError("the prerouter heads were trained for another model shape")
        return PrerouterPredictor(heads)
    if name == "oracle":
        if trace is None:
            raise ConfigError("--predictor oracle replays a trace: pass --trace FOLDER")
        return OraclePredictor(trace)
    raise ConfigError(f"unknown --predictor {name!r}; use one of {', '.join(PREDICTORS)}")


def attach(
    model, predictor: Predictor, routing: str = "exact", min_score: float = 0.0
) -> PredictingExperts:
    """Wrap the model's expert provider with prediction/prefetch; returns the wrapper."""
    blocks = model.moe_blocks
    inner = blocks[0].provider
    if isinstance(inner, PredictingExperts):
        inner = inner.inner
    wrapper = PredictingExperts(inner, predictor, blocks, routing, min_score)
    model.set_provider(wrapper)
    return wrapper
