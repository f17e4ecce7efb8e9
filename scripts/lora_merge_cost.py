#!/usr/bin/env python3
"""What merging the recovery adapter into a quantized base would cost (issue 16; Edge0 reports
that merged-then-requantized keeps 18% of the adapter's logit effect).

Each targeted projection W (float in the reference model: its attention is under the dense
quantization floor) is first put in --scheme (Q(W), the quantized base the adapter sits beside),
then merged: W' = Q(Q(W) + (alpha/r) B A) replaces it and the adapter is removed. Over windows of --text on
the student path (predicted routing through the prerouter heads, in one pass), with
d_u = logits(unmerged adapter) - logits(no adapter) and d_m = logits(merged) - logits(no adapter):
  kept = <d_m, d_u> / <d_u, d_u>   (the share of the adapter's effect the merged model keeps)
  rel_err = |d_m - d_u| / |d_u|

    python scripts/lora_merge_cost.py --store STORE --heads HEADS --lora ADAPTER --text FILE
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from moestream.engine.tokenizer import Tokenizer
from moestream.experts.config import StreamConfig
from moestream.kernels.ref import dequantize
from moestream.loader import load_model
from moestream.predict.prerouter import PrerouterHeads
from moestream.quant import make_scheme, quantize
from moestream.recovery.adapter import adapter_modules, load_adapter, lora_sites, remove_adapter
from moestream.recovery.student import StudentPath
from moestream.recovery.train import logits_of


def requantized(w: torch.Tensor, scheme) -> torch.Tensor:
    """w [N, K] float -> its quantized-then-dequantized value in scheme (fp32)."""
    sec = {f"w.{k}": v for k, v in quantize(scheme, w).items()}
    return dequantize(sec, "w", scheme.group_size, torch.float32)


def quantize_targets(model, scheme) -> int:
    """Every targeted float projection becomes its `scheme` value: the quantized base (in place:
    the fused q/k/v weight is a view of the three and follows)."""
    n = 0
    with torch.no_grad():
        for name, (owner, proj) in lora_sites(model).items():
            lin = getattr(owner, proj)
            if name in adapter_modules(model) and isinstance(lin, torch.nn.Linear):
                lin.weight.copy_(requantized(lin.weight, scheme))
                n += 1
    return n


def weight_stats(model, scheme) -> dict:
    """RMS of the weight deltas (alpha/r) B A, of the weights, and of the quantization error."""
    d2 = w2 = e2 = n = 0.0
    with torch.no_grad():
        for name, m in adapter_modules(model).items():
            owner, proj = lora_sites(model)[name]
            w = getattr(owner, proj).weight.float()
            d2 += float((m.scale * (m.B @ m.A)).pow(2).sum())
            w2 += float(w.pow(2).sum())
            e2 += float((requantized(w, scheme) - w).pow(2).sum())
            n += w.numel()
    return {
        "delta_w_rms": (d2 / n) ** 0.5,
        "w_rms": (w2 / n) ** 0.5,
        "quant_err_rms": (e2 / n) ** 0.5,
    }


def merge(model, scheme) -> None:
    """Fold each adapter into its (quantized) base weight and quantize again; adapters removed."""
    with torch.no_grad():
        for name, m in adapter_modules(model).items():
            owner, proj = lora_sites(model)[name]
            w = getattr(owner, proj).weight
            w.copy_(requantized(w + m.scale * (m.B @ m.A), scheme))
    remove_adapter(model)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--heads", required=True)
    ap.add_argument("--lora", required=True)
    ap.add_argument("--text", required=True)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--scheme", default="int4", choices=["int8", "int4"])
    a = ap.parse_args()
    scheme = make_scheme(a.scheme)
    loaded = load_model(a.store, StreamConfig(resident=True, kernel="ref"))
    model, heads = loaded.model, PrerouterHeads.load(a.heads)
    model.set_provider(StudentPath(loaded.provider, heads, model.moe_blocks))
    ids = Tokenizer(Path(a.store)).encode(Path(a.text).read_text(encoding="utf-8"))
    wins = [ids[i * a.ctx : (i + 1) * a.ctx] for i in range(a.windows)]
    with torch.no_grad():
        info = load_adapter(model, a.lora)
        n_targets = len(adapter_modules(model))
        ws = weight_stats(model, scheme)
        quantized = quantize_targets(model, scheme)  # the base: targets in `scheme`
        unmerged = torch.cat([logits_of(model, w) for w in wins])
        kept = {n: (o, dict(o.lora)) for n, (o, _) in lora_sites(model).items()}
        for o, _ in kept.values():
            o.lora.clear()
        base = torch.cat([logits_of(model, w) for w in wins])
        for o, mods in kept.values():
            o.lora.update(mods)
        merge(model, scheme)
        merged = torch.cat([logits_of(model, w) for w in wins])
    du, dm = unmerged - base, merged - base
    out = {
        "targets": n_targets,
        "quantized_projections": quantized,
        "scheme": a.scheme,
        "rank": info.rank,
        "logit_delta_rms": float(du.pow(2).mean().sqrt()),
        "kept": float((dm * du).sum() / (du * du).sum()),
        "rel_err": float((dm - du).norm() / du.norm()),
        "positions": base.shape[0],
        **ws,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
