"""Stage-1 distillation of the prerouter heads (Edge0): teach head N to predict, from token t's
state at layer N, the experts layer N+1 routes token t+1 to, using traces recorded with hidden
states (`moestream trace --hidden`). The rest of the model is frozen (it is not even loaded:
the traces hold the router inputs).

Loss: mean negative log-softmax of the K true experts (a listwise top-k target). Sequences are
split into train and held-out; recall@K on the held-out part is reported before (warm start =
next layer's router on the stale state) and after training.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moestream.config import ConfigError
from moestream.obs.trace import Trace
from moestream.predict.prerouter import PrerouterHeads


@dataclass(frozen=True, slots=True)
class TrainConfig:
    hidden: int = 256
    epochs: int = 30
    lr: float = 2e-3
    batch: int = 512
    weight_decay: float = 1e-4
    val_fraction: float = 0.15
    seed: int = 0
    device: str = "cpu"
    next_state: bool = False  # heads also read the next token's column-0 router input


def pairs(trace: Trace, seqs: list[int], col: int, next_state: bool = False):
    """Head `col` training rows: (h [N, D], ids [N, K], prev [N, K] (-1: none), target [N, K],
    and with next_state nxt [N, D]: column 0's router input of the next token)."""
    h, ids, prev, tgt, nxt = [], [], [], [], []
    for i in seqs:
        s = trace.sequences[i]
        a, n = s["offset"], s["length"]
        if n < 2:
            continue
        rows = np.arange(a, a + n - 1)  # token t has a successor t+1 in the sequence
        h.append(np.asarray(trace.hidden[rows, col], dtype=np.float32))
        cur = np.asarray(trace.ids[rows, col], dtype=np.int64)
        ids.append(cur)
        p = np.full_like(cur, -1)
        p[1:] = cur[:-1]
        prev.append(p)
        tgt.append(np.asarray(trace.ids[rows + 1, col + 1], dtype=np.int64))
        if next_state:
            nxt.append(np.asarray(trace.hidden[rows + 1, 0], dtype=np.float32))
    cols = (h, ids, prev, tgt, nxt) if next_state else (h, ids, prev, tgt)
    return tuple(torch.from_numpy(np.concatenate(x)) for x in cols)


def split(n_seq: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    order = np.random.default_rng(seed).permutation(n_seq).tolist()
    n_val = max(1, round(n_seq * val_fraction)) if n_seq > 1 and val_fraction > 0 else 0
    return sorted(order[n_val:]), sorted(order[:n_val])


def topk_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return -torch.log_softmax(logits, dim=-1).gather(1, target).mean()


@torch.no_grad()
def recall_at_k(logits: torch.Tensor, target: torch.Tensor) -> float:
    K = target.shape[1]
    pred = torch.topk(logits, K, dim=-1).indices
    hit = (pred.unsqueeze(2) == target.unsqueeze(1)).any(dim=2).sum()
    return float(hit) / target.numel()


def train_heads(
    trace: Trace, router_weights: list[torch.Tensor], cfg: TrainConfig, log=None
) -> tuple[PrerouterHeads, dict]:
    """Distil one head per MoE column 0..L-2; returns the heads and a per-head report
    {col: {loss_before, loss_after, recall_before, recall_after, train_rows, val_rows}}."""
    if trace.hidden is None:
        raise ConfigError(
            "the trace has no hidden states; record it with `moestream trace --hidden`"
        )
    L, E, K = trace.n_layers, trace.num_experts, trace.top_k
    D = trace.hidden.shape[2]
    torch.manual_seed(cfg.seed)
    heads = PrerouterHeads(L, D, E, K, cfg.hidden, cfg.next_state)
    heads.warm_start(router_weights)
    heads.to(cfg.device)
    tr, va = split(len(trace.sequences), cfg.val_fraction, cfg.seed)
    report = {}
    for col, head in enumerate(heads.heads):
        x, y = _rows(heads, trace, tr, col, cfg)
        vx, vy = (x, y) if not va else _rows(heads, trace, va, col, cfg)
        with torch.no_grad():
            before = (topk_loss(head(vx), vy).item(), recall_at_k(head(vx), vy))
        opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        g = torch.Generator(device="cpu").manual_seed(cfg.seed + col)
        for _ in range(cfg.epochs):
            for idx in torch.randperm(len(x), generator=g).split(cfg.batch):
                loss = topk_loss(head(x[idx]), y[idx])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
        with torch.no_grad():
            after = (topk_loss(head(vx), vy).item(), recall_at_k(head(vx), vy))
        report[col] = {
            "loss_before": before[0],
            "loss_after": after[0],
            "recall_before": before[1],
            "recall_after": after[1],
            "train_rows": len(x),
            "val_rows": len(vx),
        }
        if log is not None:
            log(col, report[col])
    return heads.cpu().eval(), report


def _rows(heads, trace: Trace, seqs: list[int], col: int, cfg: TrainConfig):
    """(features [N, F], targets [N, K]) of head `col` on cfg.device."""
    d = [t.to(cfg.device) for t in pairs(trace, seqs, col, cfg.next_state)]
    return heads.features(*d[:3], *d[4:]), d[3]


def merge_traces(traces: list[Trace]) -> Trace:
    """One trace from several of the same model (arrays loaded into memory)."""
    first = traces[0]
    if any(t.hidden is None for t in traces):
        raise ConfigError("every trace needs hidden states (moestream trace --hidden)")
    if any(t.ids.shape[1:] != first.ids.shape[1:] for t in traces):
        raise ConfigError("the traces come from models with different MoE shapes")
    seqs, off = [], 0
    for t in traces:
        seqs += [{**s, "offset": s["offset"] + off} for s in t.sequences]
        off += t.n_positions
    return Trace(
        model=first.model,
        ids=np.concatenate([t.ids for t in traces]),
        weights=np.concatenate([t.weights for t in traces]),
        tokens=np.concatenate([t.tokens for t in traces]),
        sequences=seqs,
        hidden=np.concatenate([t.hidden for t in traces]),
    )
