"""The predictor interface and the `none` predictor.

A predictor watches each MoE layer of each token as it runs and names experts that a later
(layer, token) will route to. Layers are MoE columns 0..L-1 (as in router traces), tokens are
positions in the sequence. `observe` is called in column order for every token, with the router
input x (the post-attention normed hidden state) and the router's own top-k:

    preds = predictor.observe(col, pos, x, ids)   # -> [Prediction(col', pos', experts)]

The pipeline prefetches each prediction at once (most confident experts first when the predictor
gives scores) and, with `--routing predicted`, uses it as the routing of (col', pos'). A
prediction must target a later point: (col', pos') > (col, pos); a later prediction for the same
point replaces an earlier one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PREDICTORS = ("none", "temporal", "stale-gate", "prerouter", "oracle")


@dataclass(frozen=True, slots=True)
class Prediction:
    layer: int  # MoE column
    pos: int  # token position
    experts: tuple[int, ...]
    scores: tuple[float, ...] = ()  # optional confidence of each expert (e.g. router probability)

    def ranked(self, min_score: float = 0.0) -> list[int]:
        """Experts most confident first; those scored below min_score left out."""
        if not self.scores:
            return list(self.experts)
        pairs = sorted(zip(self.scores, self.experts), key=lambda p: -p[0])
        return [e for s, e in pairs if s >= min_score]


class Predictor:
    """Base class and the `none` predictor: predicts nothing (pure on-demand reads)."""

    name = "none"

    def reset(self) -> None:
        """A new sequence starts (position 0)."""

    def observe(self, col: int, pos: int, x: torch.Tensor, ids: list[int]) -> list[Prediction]:
        """x [D] router input of token `pos` at MoE column `col`; ids its top-k experts."""
        return []


def topk_list(logits: torch.Tensor, k: int) -> tuple[int, ...]:
    """Top-k expert ids of logits [E] (any monotone score), ascending id order."""
    return tuple(sorted(torch.topk(logits, k).indices.tolist()))
