"""The student path over a whole window in one forward pass: the routing that `--routing predicted
--predictor prerouter` gives the window token by token (moestream/experts/predicting.py), so the
adapter can be trained with gradients through every position at once.

Token by token, head N at token t-1 (its router input, the router's own top-k at t-1 and t-2)
names layer N+1's experts for token t; layer 0 and token 0 route exactly. Every input of that
prediction is known when layer N has run over the window, so `StudentPath` computes head N's
predictions for rows 1..T-1 at column N and forces them at column N+1, weighted by the block's
own rule (`weights_for`). The KV cache makes decode attend to the same keys and values, so the
logits equal the stepwise ones (tests/test_recovery.py checks it). Next-state heads also read
column 0's router input of rows 1..T-1, known once column 0 has run over the window.
"""

from __future__ import annotations

import torch

from moestream.experts.base import ExpertProvider
from moestream.predict.prerouter import PrerouterHeads


class StudentPath(ExpertProvider):
    """ExpertProvider wrapper for one window [T] starting at position 0 per forward."""

    def __init__(self, inner: ExpertProvider, heads: PrerouterHeads, blocks):
        self.inner, self.heads, self.blocks = inner, heads, list(blocks)
        self.col = {b.layer: i for i, b in enumerate(self.blocks)}
        self.pred: torch.Tensor | None = None  # [T-1, K]: next column's routing of rows 1..T-1
        self.x0: torch.Tensor | None = None  # [T, D]: column 0's router input (next-state heads)

    def experts(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """x [T, D], ids/weights [T, K] (the router's) -> [T, D] on the student's routing."""
        col = self.col[layer]
        if col == 0:
            self.pred, self.x0 = None, x.detach()
        routed = ids  # the heads read the router's own choice, as PrerouterPredictor does
        if self.pred is not None:
            ids = torch.cat((ids[:1], self.pred.to(ids.dtype)))
            weights = torch.cat((weights[:1], self.blocks[col].weights_for(x[1:], ids[1:])))
        self.pred = self._predict(col, x, routed) if col < len(self.heads.heads) else None
        return self.inner.experts(layer, x, ids, weights)

    @torch.no_grad()
    def _predict(self, col: int, x: torch.Tensor, routed: torch.Tensor) -> torch.Tensor | None:
        """Head `col` on rows 0..T-2 -> the experts [T-1, K] of column col+1 for rows 1..T-1, in
        ascending id (as predict.base.topk_list)."""
        if x.shape[0] < 2:
            return None
        cur = routed[:-1]
        prev = torch.cat((torch.full_like(cur[:1], -1), cur[:-1]))
        nxt = self.x0[1:] if self.heads.next_state else None
        probs = self.heads.probs(col, x[:-1].detach(), cur, prev, nxt)
        return torch.topk(probs, self.heads.top_k, dim=-1).indices.sort(dim=-1).values

    def stats(self) -> dict:
        return self.inner.stats()

    def describe(self) -> dict:
        return {**self.inner.describe(), "predictor": "prerouter", "routing": "student path"}

    def reset(self) -> None:
        self.pred = self.x0 = None
        self.inner.reset()

    def close(self) -> None:
        self.inner.close()
