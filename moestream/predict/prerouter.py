"""Edge0 prerouter heads: a head at MoE layer N, run at token t, predicts layer N+1's routing
for token t+1 (one token ahead, so a whole token's predictions can be staged at once).

Input  x = concat(h [D], onehot(top-k of t at N) [E], onehot(top-k of t-1 at N) [E])
Output logits [E] = fc2(gelu_erf(fc1(x))) + l(x), `l` warm-started from layer N+1's router
(its one-hot columns and fc2 start at zero, so an untrained head is the stale gate).
Heads are saved beside the model as prerouter.heads (safetensors format) and found by `find_heads`.

Next-state heads (`next_state`, not Edge0's): x also holds layer 0's router input of token t+1
[D], so every head waits for token t+1's layer 0 and all of them run there, in one batch (still
a single staging point per token); layer N+1's reads then have layers 0..N of token t+1 to hide
behind instead of a whole token. Knowing which token comes next is most of what one token ahead
cannot know: held-out recall 54 -> 86% for layer 1 (docs/prediction.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from moestream.predict.base import Prediction, Predictor, topk_list

HEADS_FILE = "prerouter.heads"  # safetensors bytes; not *.safetensors, which HF loaders scan


class PrerouterHead(nn.Module):
    def __init__(self, dim: int, experts: int, hidden: int, extra: int = 0):
        super().__init__()
        n_in = dim + 2 * experts + extra
        self.fc1 = nn.Linear(n_in, hidden)
        self.fc2 = nn.Linear(hidden, experts)
        self.l = nn.Linear(n_in, experts, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D + 2E (+ D next-state)] -> logits [T, E]."""
        return self.fc2(F.gelu(self.fc1(x))) + self.l(x)


class PrerouterHeads(nn.Module):
    """One head per MoE column 0..L-2 (head N predicts column N+1); `next_state`: each head also
    reads layer 0's router input of the token it predicts for."""

    def __init__(
        self,
        n_layers: int,
        dim: int,
        experts: int,
        top_k: int,
        hidden: int = 256,
        next_state: bool = False,
    ):
        super().__init__()
        self.dim, self.experts, self.top_k, self.hidden = dim, experts, top_k, hidden
        self.next_state = next_state
        extra = dim if next_state else 0
        self.heads = nn.ModuleList(
            PrerouterHead(dim, experts, hidden, extra) for _ in range(n_layers - 1)
        )

    def warm_start(self, router_weights: list[torch.Tensor]) -> None:
        """router_weights[col] [E, D]: head N's `l` starts as router N+1 on the hidden part."""
        with torch.no_grad():
            for n, head in enumerate(self.heads):
                head.l.weight.zero_()
                head.l.weight[:, : self.dim].copy_(router_weights[n + 1].float())
                head.fc2.weight.zero_()
                head.fc2.bias.zero_()

    def features(
        self,
        h: torch.Tensor,
        ids: torch.Tensor,
        prev: torch.Tensor,
        nxt: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """h [T, D], ids/prev [T, K] (prev rows of -1 = no previous token), nxt [T, D] (next-state
        heads: layer 0's router input of each row's next token) -> [T, D + 2E (+ D)]."""
        assert (nxt is not None) == self.next_state, "nxt is given exactly to next-state heads"
        T = h.shape[0]
        ids, prev = ids.to(h.device), prev.to(h.device)  # a decode step's lists arrive on the CPU
        one = torch.zeros(T, 2 * self.experts, dtype=torch.float32, device=h.device)
        one.scatter_(1, ids.long(), 1.0)
        has_prev = prev[:, 0] >= 0
        p = prev.long().clamp(min=0) + self.experts
        one[has_prev] = one[has_prev].scatter(1, p[has_prev], 1.0)
        parts = (h.float(), one) if nxt is None else (h.float(), one, nxt.float())
        return torch.cat(parts, dim=1)

    def probs(
        self,
        col: int,
        h: torch.Tensor,
        ids: torch.Tensor,
        prev: torch.Tensor,
        nxt: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Head `col`'s expert probabilities [T, E] for layer col+1 of each row's next token."""
        return torch.softmax(self.heads[col](self.features(h, ids, prev, nxt)), dim=-1)

    def save(self, path: str | Path) -> Path:
        from safetensors.torch import save_file

        meta = {
            "dim": self.dim,
            "experts": self.experts,
            "top_k": self.top_k,
            "hidden": self.hidden,
            "layers": len(self.heads) + 1,
            "next_state": self.next_state,
        }
        sd = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        save_file(sd, str(path), metadata={"moestream_prerouter": json.dumps(meta)})
        return Path(path)

    @classmethod
    def load(cls, path: str | Path) -> PrerouterHeads:
        from safetensors import safe_open
        from safetensors.torch import load_file

        with safe_open(str(path), "pt") as f:
            meta = json.loads(f.metadata()["moestream_prerouter"])
        heads = cls(
            meta["layers"], meta["dim"], meta["experts"], meta["top_k"], meta["hidden"],
            meta.get("next_state", False),
        )  # fmt: skip
        heads.load_state_dict(load_file(str(path)))
        return heads.eval()


def find_heads(*folders: str | Path) -> Path | None:
    """The first prerouter.heads among the folders (the -m folder, then the store)."""
    for folder in folders:
        p = Path(folder) / HEADS_FILE
        if p.is_file():
            return p
    return None


class PrerouterPredictor(Predictor):
    name = "prerouter"

    def __init__(self, heads: PrerouterHeads):
        self.heads = heads
        self.prev: dict[int, list[int]] = {}  # col -> top-k of the previous token
        self.state: dict[int, tuple] = {}  # next-state heads: col -> (pos, x, ids, prev)

    def reset(self) -> None:
        self.prev = {}
        self.state = {}

    @torch.no_grad()
    def observe(self, col: int, pos: int, x: torch.Tensor, ids: list[int]) -> list[Prediction]:
        prev = self.prev.get(col, [-1] * len(ids))
        self.prev[col] = list(ids)
        if self.heads.next_state:
            return self._next_state(col, pos, x, ids, prev)
        if col >= len(self.heads.heads):
            return []
        probs = self.heads.probs(col, x.reshape(1, -1), torch.tensor([ids]), torch.tensor([prev]))
        return [self._prediction(col + 1, pos + 1, probs[0])]

    def _next_state(self, col: int, pos: int, x, ids, prev) -> list[Prediction]:
        """Token pos-1's states wait for token pos's layer 0, where every head runs."""
        out = []
        if col == 0:
            for c, (p, h, i, pv) in sorted(self.state.items()):
                if p == pos - 1:
                    probs = self.heads.probs(
                        c, h.reshape(1, -1), torch.tensor([i]), torch.tensor([pv]), x.reshape(1, -1)
                    )
                    out.append(self._prediction(c + 1, pos, probs[0]))
        if col < len(self.heads.heads):
            self.state[col] = (pos, x.detach().clone(), list(ids), prev)
        return out

    def _prediction(self, layer: int, pos: int, probs: torch.Tensor) -> Prediction:
        experts = topk_list(probs, self.heads.top_k)
        scores = tuple(probs[list(experts)].tolist())  # confidence, for ranked prefetch
        return Prediction(layer, pos, experts, scores)
