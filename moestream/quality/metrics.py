"""Quality metrics on logits, no model code: perplexity (+ stderr), margin-rule flips, KL.

- perplexity = exp(mean NLL); its standard error by the delta method:
  stderr = perplexity * std(NLL, ddof=1) / sqrt(n)  (llama.cpp's perplexity reports the same).
- flips (seed 001): greedy top-1 of candidate vs oracle; a disagreement counts as a flip only if
  the oracle's logit margin between its own top-1 and the candidate's top-1 is >= 0.1, else it
  is a statistical tie.
- KL(oracle || candidate) per position, natural log, averaged.
"""

from __future__ import annotations

import math

import torch

MARGIN = 0.1


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logits [T, V] predicting targets [T] -> NLL [T] (fp32)."""
    return -torch.log_softmax(logits.float(), dim=-1).gather(1, targets[:, None].long())[:, 0]


def perplexity(nll: torch.Tensor) -> dict:
    n = nll.numel()
    mean = float(nll.double().mean())
    sd = float(nll.double().std(unbiased=True)) if n > 1 else 0.0
    ppl = math.exp(mean)
    return {
        "perplexity": ppl,
        "stderr": ppl * sd / math.sqrt(n) if n else 0.0,
        "nll_mean": mean,
        "tokens": n,
    }


def flips(cand: torch.Tensor, oracle: torch.Tensor, margin: float = MARGIN) -> dict:
    """cand/oracle logits [T, V] -> {"flips", "ties", "positions", "flip_positions"}."""
    c, o = cand.float().argmax(-1), oracle.float().argmax(-1)
    diff = c != o
    gap = oracle.float().gather(1, o[:, None])[:, 0] - oracle.float().gather(1, c[:, None])[:, 0]
    hard = diff & (gap >= margin)
    return {
        "flips": int(hard.sum()),
        "ties": int((diff & ~hard).sum()),
        "positions": int(c.numel()),
        "flip_positions": hard.nonzero()[:, 0].tolist(),
    }


def kl_div(cand: torch.Tensor, oracle: torch.Tensor) -> torch.Tensor:
    """KL(oracle || candidate) [T] in nats."""
    lo = torch.log_softmax(oracle.float(), dim=-1)
    lc = torch.log_softmax(cand.float(), dim=-1)
    return (lo.exp() * (lo - lc)).sum(-1)
