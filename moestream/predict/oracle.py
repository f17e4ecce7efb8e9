"""Oracle: replays a recorded trace, so every prediction is the true routing (the upper bound).

Sequence i of the trace is replayed for the i-th sequence the engine runs (reset() advances);
it predicts (N+1, t) while layer N of token t runs and layer 0 of t+1 at the last layer.
"""

from __future__ import annotations

import torch

from moestream.obs.trace import Trace
from moestream.predict.base import Prediction, Predictor


class OraclePredictor(Predictor):
    name = "oracle"

    def __init__(self, trace: Trace):
        self.trace = trace
        self.seq = -1  # the engine resets before each sequence: the first becomes 0

    def reset(self) -> None:
        self.seq += 1

    def observe(self, col: int, pos: int, x: torch.Tensor, ids: list[int]) -> list[Prediction]:
        seq = max(self.seq, 0)
        if seq >= len(self.trace.sequences):
            return []
        s = self.trace.sequences[seq]
        nxt, npos = (col + 1, pos) if col + 1 < self.trace.n_layers else (0, pos + 1)
        if npos >= s["length"]:
            return []
        row = self.trace.ids[s["offset"] + npos, nxt]
        return [Prediction(nxt, npos, tuple(sorted(int(e) for e in row)))]
