"""`moestream eval`: run a candidate configuration and an fp32 oracle over the same text, in
independent windows of `ctx` tokens (fresh KV cache each), and compare them.

Exact routing runs each window as one forward pass; `stepwise` (needed for predicted routing,
whose predictions are made token by token) feeds the window one token at a time through the
KV cache, exactly as decode does.
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


def evaluate(cand, ref, ids: list[int], ctx: int, stepwise: bool = False, log=None) -> dict:
    """cand/ref: Runtimes (ref = the oracle, or None to skip flips/KL) -> metrics dict."""
    nll, ref_nll, kls, flip, ties, pos = [], [], [], 0, 0, 0
    for w, win in enumerate(windows(ids, ctx)):
        tgt = torch.tensor(win[1:])
        lc = window_logits(cand, win, stepwise)[:-1]
        nll.append(token_nll(lc, tgt))
        if ref is not None:
            lo = window_logits(ref, win, False)[:-1]
            ref_nll.append(token_nll(lo, tgt))
            kls.append(kl_div(lc, lo))
            f = flips(lc, lo)
            flip, ties, pos = flip + f["flips"], ties + f["ties"], pos + f["positions"]
        if log is not None:
            log(w, len(win))
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
