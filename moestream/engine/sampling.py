"""Next-token choice: greedy, or temperature with top-k / top-p (nucleus) from a seeded generator."""

from __future__ import annotations

import functools

import torch

from moestream.config import SamplingConfig


def sample(logits: torch.Tensor, cfg: SamplingConfig, gen: torch.Generator | None) -> int:
    """logits [V] (any float dtype) -> token id."""
    logits = logits.float()
    if cfg.temperature == 0:
        return int(torch.argmax(logits))
    # Shift by the max and keep the temperature a normal float32: a tiny one (say 1e-40) would
    # otherwise make inf/inf or 0/0 -> NaN. Shifting leaves the softmax unchanged.
    t = max(cfg.temperature, torch.finfo(torch.float32).tiny)
    logits = (logits - logits.max()) / t
    if cfg.top_k > 0 and cfg.top_k < logits.shape[-1]:
        kth = torch.topk(logits, cfg.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # Drop tokens once the mass before them already reaches top_p (always keep the first).
        drop = (cum - torch.softmax(sorted_logits, dim=-1)) >= cfg.top_p
        drop[0] = False  # explicitly: a top_p that rounds to 0 in float32 would drop every token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(0, order, sorted_logits)
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))


def penalized(logits: torch.Tensor, history: list[int], cfg: SamplingConfig) -> torch.Tensor:
    """logits [V] with the repeat / frequency / presence penalties of the recent tokens applied
    (fp32); the logits themselves when no penalty is set."""
    if not cfg.penalizes or not history:
        return logits
    rp, fp, pp = cfg.repeat_penalty, cfg.frequency_penalty, cfg.presence_penalty
    recent = history[-cfg.repeat_last_n :] if cfg.repeat_last_n else history
    ids, counts = torch.unique(torch.tensor(recent, device=logits.device), return_counts=True)
    out = logits.float().clone()
    v = out[ids]
    if rp != 1:
        v = torch.where(v > 0, v / rp, v * rp)
    out[ids] = v - fp * counts - pp
    return out


def choose(
    logits: torch.Tensor,
    cfg: SamplingConfig,
    gen: torch.Generator | None,
    history: list[int] | None = None,
):
    """logits [V] -> (token, its log-probability under the penalized distribution). Greedy on a
    GPU stays there: argmax and log-softmax on the device, two numbers copied back (not V logits,
    then a host softmax); sampling copies the logits and draws on the host from the seeded
    generator. `history`: the sequence so far (prompt + generated), for the penalties."""
    if history:
        logits = penalized(logits, history, cfg)
    if cfg.temperature == 0 and logits.device.type != "cpu":
        token, logprob = device_greedy(logits).tolist()
        return int(token), logprob
    logits = logits.cpu()
    token = sample(logits, cfg, gen)
    return token, float(torch.log_softmax(logits.float(), -1)[token])


def device_greedy(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """(first argmax, its fp32 log-probability) as a float64 [2] on the device (into `out` when
    given): one pass of the Triton kernel on CUDA (kernels/triton/pick.py), else argmax +
    log_softmax (its spec)."""
    pick = _triton_pick() if logits.device.type == "cuda" else None
    if pick is not None:
        return pick(logits, out)
    tok = torch.argmax(logits)  # the first maximum, as on the CPU
    lp = torch.log_softmax(logits.float(), -1)[tok]
    res = torch.stack((tok.double(), lp.double()))
    return res if out is None else out.copy_(res)


@functools.cache
def _triton_pick():
    """The Triton greedy pick, or None without triton (looked up once, not per token)."""
    try:
        from moestream.kernels.triton.pick import greedy_pick
    except ImportError:
        return None
    return greedy_pick
