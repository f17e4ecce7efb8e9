"""Temporal predictor (flash-moe): token t routes like token t-1 at the same layer.

The prediction for (layer N+1, token t) is issued while layer N of token t runs (one layer of
lead time), from what layer N+1 chose at token t-1; the last layer predicts layer 0 of t+1.
"""

from __future__ import annotations

import torch

from moestream.predict.base import Prediction, Predictor


class TemporalPredictor(Predictor):
    name = "temporal"

    def __init__(self, n_layers: int):
        self.L = n_layers
        self.last: dict[int, tuple[int, ...]] = {}  # col -> experts of the latest token seen

    def reset(self) -> None:
        self.last = {}

    def observe(self, col: int, pos: int, x: torch.Tensor, ids: list[int]) -> list[Prediction]:
        self.last[col] = tuple(sorted(ids))
        nxt, npos = (col + 1, pos) if col + 1 < self.L else (0, pos + 1)
        prev = self.last.get(nxt)
        # At the last column, last[0] is already this token's layer-0 choice: the t-1 rule for t+1.
        return [] if prev is None else [Prediction(nxt, npos, prev)]
