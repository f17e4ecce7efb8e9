"""`moestream eval`: run a candidate configuration and an fp32 oracle over the same text, in
independent windows of `ctx` tokens (fresh KV cache each), and compare them.

Exact routing runs each window as one forward pass; `stepwise` (needed for predicted routing,
whose predictions are made token by token) feeds the window one token at a time through the
KV cache, exactly as decode does.

`llama_chunks` lays the text out as llama.cpp's `llama-perplexity` does (chunks of n_ctx tokens,
the first token of each replaced by BOS when the vocabulary adds one, only the second half of
each chunk scored), so `evaluate_windows` scores the positions that tool scores, with the same
context, and the two engines' figures can be set side by side.
"""

from __future__ import annotations

from pathlib import Path

import torch

from moestream.config import ConfigError
from moestream.engine.kv_cache import KVCache
from moestream.quality.metrics import flips, kl_div, perplexity, token_nll


@torch.inference_mode()
def window_logits(rt, ids: list[int], stepwise: bool) -> torch.Tensor:
    """logits [T, V] (fp32) of every position of one window of a Runtime's model."""
    model = rt.model
    cache = KVCache(rt.args, len(ids), model.dtype)
    rt.provider.reset()  # predictions restart with the window's positions
    if not stepwise:
        return model(torch.tensor(ids), cache, 0).float()
    rows = [model(torch.tensor([t]), cache, p, last_only=True)[-1] for p, t in enumerate(ids)]
    return torch.stack(rows).float()


def windows(ids: list[int], ctx: int) -> list[list[int]]:
    return [ids[i : i + ctx] for i in range(0, len(ids), ctx) if len(ids[i : i + ctx]) > 1]


def llama_chunks(ids: list[int], n_ctx: int, bos: int | None) -> tuple[list[list[int]], int]:
    """llama-perplexity's layout of `ids` (the text's tokens as it tokenizes them, its BOS
    included): len(ids) // n_ctx chunks of n_ctx tokens (a partial last chunk is dropped), the
    first token of each set to `bos` (None: the vocabulary adds none), and the first scored
    position n_ctx // 2: the logits of positions n_ctx // 2 .. n_ctx - 2 predict the rest."""
    if n_ctx < 4:
        raise ConfigError(f"n_ctx {n_ctx}: llama-perplexity's chunks need at least 4 tokens")
    chunks = [ids[i : i + n_ctx] for i in range(0, len(ids) - n_ctx + 1, n_ctx)]
    if bos is not None:
        chunks = [[bos, *c[1:]] for c in chunks]
    return chunks, n_ctx // 2


def evaluate(cand, ref, ids: list[int], ctx: int, stepwise: bool = False, log=None) -> dict:
    """cand/ref: Runtimes (ref = the oracle, or None to skip flips/KL) -> metrics dict; windows
    of `ctx` tokens, every next token of each scored."""
    return evaluate_windows(cand, ref, windows(ids, ctx), 0, stepwise, log)


def evaluate_windows(
    cand, ref, wins: list[list[int]], first: int, stepwise: bool = False, log=None
) -> dict:
    """`evaluate` over given windows, each scored from position `first` on: the logits of
    positions first .. len(win) - 2 against the tokens after them (the context is the whole
    window either way)."""
    nll, ref_nll, kls, flip, ties, pos = [], [], [], 0, 0, 0
    for w, win in enumerate(wins):
        tgt = torch.tensor(win[first + 1 :])
        lc = window_logits(cand, win, stepwise)[first:-1]
        nll.append(token_nll(lc, tgt))
        if ref is not None:
            lo = window_logits(ref, win, False)[first:-1]
            ref_nll.append(token_nll(lo, tgt))
            kls.append(kl_div(lc, lo))
            f = flips(lc, lo)
            flip, ties, pos = flip + f["flips"], ties + f["ties"], pos + f["positions"]
        if log is not None:
            log(w, len(win) - first)
    out = perplexity(torch.cat(nll))
    if ref is not None:
        r = perplexity(torch.cat(ref_nll))
        out["oracle"] = {"perplexity": r["perplexity"], "stderr": r["stderr"]}
        kl = torch.cat(kls)
        out["kl_mean"] = float(kl.mean())
        out["kl_max"] = float(kl.max())
        out["flips"], out["ties"], out["positions"] = flip, ties, pos
    return out


def oracle_folder(model: str | Path, reference: str | Path | None) -> tuple[Path, str]:
    """The fp32 oracle for a candidate `model` and where it came from: an explicit `reference`;
    for a store, the Hugging Face folder it was converted from (its manifest's source, checked
    unchanged since); for a Hugging Face folder, the folder itself. A store never judges itself:
    its own quantized experts would give 0 flips and KL 0 whatever they are."""
    from moestream.convert.writer import source_fingerprint
    from moestream.store.format import MANIFEST, Store, is_store

    if reference is not None:
        if is_store(reference):
            raise ConfigError(f"--reference {reference} is a store: give the Hugging Face folder")
        return Path(reference), "--reference"
    model = Path(model)
    if not is_store(model):
        return model, "the Hugging Face folder given to -m"
    src = Store(model).manifest.get("source", {})
    path = Path(src["path"]) if src.get("path") else None
    fix = "pass --reference HF_FOLDER (or --no-reference for perplexity only)"
    if path is None or not (path / "config.json").is_file():
        raise ConfigError(
            f"{model} is a store and the Hugging Face folder it was converted from "
            f"({path or 'not recorded in ' + MANIFEST}) is not there: {fix}"
        )
    if src.get("fingerprint") and source_fingerprint(path) != src["fingerprint"]:
        raise ConfigError(f"{path}, the source of store {model}, changed since the convert: {fix}")
    return path, f"the source of store {model} (its manifest)"
