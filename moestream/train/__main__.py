"""CLI: python -m moestream.train {tokenizer,fit,bench,export} ...

Usage:
    python scripts/build_corpus.py --out data/corpus
    python -m moestream.train tokenizer --corpus data/corpus --out data/tok --vocab 8192
    python -m moestream.train fit --data data/tok --out runs/pystd --steps 1200
    python -m moestream.train export --ckpt runs/pystd/ckpt --tokenizer data/tok --out models/NAME
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

_TYPES = {"int": int, "float": float, "str": str, "bool": bool, "dict": dict}


def _add_fields(ap, cls, skip=()):
    """One --option per dataclass field (bools as --x/--no-x)."""
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        typ = _TYPES.get(f.type, f.type) if isinstance(f.type, str) else f.type
        opt = "--" + f.name.replace("_", "-")
        if typ is bool:
            ap.add_argument(opt, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            ap.add_argument(opt, type=typ, default=f.default)


def _spec_args(ap):
    from .trainer import ModelSpec

    _add_fields(ap, ModelSpec, skip=("vocab_size", "eot_id"))


def _train_args(ap):
    from .trainer import TrainArgs

    _add_fields(ap, TrainArgs, skip=("spec", "data"))


def _load_data(data_dir):
    import numpy as np

    with open(os.path.join(data_dir, "meta.json")) as f:
        meta = json.load(f)
    train = np.load(os.path.join(data_dir, "train.npy"))
    valid = np.load(os.path.join(data_dir, "valid.npy"))
    return meta, train, valid


def _build(ns):
    from .trainer import ModelSpec, TrainArgs, Trainer

    meta, train, valid = _load_data(ns.data)
    spec_kw = {
        f.name: getattr(ns, f.name) for f in dataclasses.fields(ModelSpec) if hasattr(ns, f.name)
    }
    spec = ModelSpec(**spec_kw, vocab_size=meta["vocab_size"], eot_id=meta["eot_id"])
    targs = TrainArgs(
        **{
            f.name: getattr(ns, f.name)
            for f in dataclasses.fields(TrainArgs)
            if hasattr(ns, f.name) and f.name != "spec"
        }
    )
    targs.spec = dataclasses.asdict(spec)
    return Trainer(spec, targs, train, valid), meta


def cmd_tokenizer(ns):
    import numpy as np

    from .tokenizer import EOT, load_tokenizer, save_tokenizer, tokenize_file, train_tokenizer

    def corpus_file(split):
        path = os.path.join(ns.corpus, f"{split}.txt")
        return path if os.path.exists(path) else path + ".xz"

    t = time.time()
    if ns.tokenizer:  # tokenize only, with an existing tokenizer
        tok = load_tokenizer(ns.tokenizer)
        os.makedirs(ns.out, exist_ok=True)
    else:
        tok = train_tokenizer([corpus_file("train")], ns.vocab)
        save_tokenizer(tok, ns.out)
    meta = {"vocab_size": tok.get_vocab_size(), "eot_id": tok.token_to_id(EOT)}
    for split in ("train", "valid"):
        arr = tokenize_file(tok, corpus_file(split))
        np.save(os.path.join(ns.out, f"{split}.npy"), arr)
        meta[f"{split}_tokens"] = int(arr.size)
        print(f"{split}: {arr.size} tokens, {time.time() - t:.0f}s", flush=True)
    with open(os.path.join(ns.out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)


def cmd_fit(ns):
    tr, meta = _build(ns)
    n_params = sum(p.numel() for p in tr.model.parameters())
    print(
        f"device {tr.device}, experts impl {tr.experts_impl}, params {n_params / 1e6:.2f}M, "
        f"train tokens {meta['train_tokens']}",
        flush=True,
    )
    if ns.resume:
        had_opt = tr.load(ns.resume)
        print(
            f"resumed at step {tr.step} ({tr.tokens_seen} tokens), optimizer restored: {had_opt}",
            flush=True,
        )
    tr.fit()


def cmd_bench(ns):
    """Time a few steps for each experts implementation (and compile on/off)."""
    import torch

    results = []
    # correctness of the local grouped bf16 experts forward against HF's eager loop in fp32
    from .trainer import ModelSpec, _grouped_bf16_experts_forward, make_model

    torch.manual_seed(1)
    m = make_model(ModelSpec(), seed=1).cuda()
    ex = m.model.layers[0].mlp.experts
    with torch.no_grad():
        for p_ in (ex.gate_up_proj, ex.down_proj):
            p_.normal_(0, 0.05)
        x = torch.randn(4096, m.config.hidden_size, device="cuda")
        logits = torch.randn(4096, m.config.num_experts, device="cuda")
        w, idx = torch.topk(logits.softmax(-1), m.config.num_experts_per_tok, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        m.set_experts_implementation("eager")
        ref = ex(x.double().float(), idx, w)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            got = _grouped_bf16_experts_forward(ex, x, idx, w)
        rel = ((got.float() - ref).norm() / ref.norm()).item()
    print(json.dumps({"check": "grouped_bf16 vs eager fp32", "rel_err": rel}), flush=True)
    del m
    for variant in ns.variants.split(","):
        impl, _, comp = variant.partition("+")
        ns.experts_impl, ns.compile = impl, comp == "compile"
        try:
            tr, _ = _build(ns)
            a = tr.args
            for s in range(ns.warm + ns.timed):
                if s == ns.warm:
                    torch.cuda.synchronize()
                    t0 = time.time()
                m = tr.train_step(
                    [tr.train.batch(s, k, a.batch_size, a.seq_len) for k in range(a.grad_accum)]
                )
            torch.cuda.synchronize()
            dt = (time.time() - t0) / ns.timed
            tok = a.batch_size * a.grad_accum * a.seq_len
            r = {
                "variant": variant,
                "s_per_step": round(dt, 4),
                "tok_s": round(tok / dt),
                "ce": float(m["ce"]),
                "aux": float(m["aux"]),
                "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1),
            }
        except Exception as e:  # report and go on with the next variant
            r = {"variant": variant, "error": repr(e)[:300]}
        print(json.dumps(r), flush=True)
        results.append(r)
        del tr
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    if ns.out:
        os.makedirs(ns.out, exist_ok=True)
        with open(os.path.join(ns.out, "bench.json"), "w") as f:
            json.dump(results, f, indent=1)


def cmd_export(ns):
    from .trainer import export_hf

    export_hf(ns.ckpt, ns.out, ns.tokenizer)
    print(f"wrote {ns.out}")


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m moestream.train",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("tokenizer", help="train the BPE tokenizer and tokenize the corpus")
    p.add_argument("--corpus", default="data/corpus")
    p.add_argument("--out", default="data/tok")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--tokenizer", default="", help="existing tokenizer folder: tokenize only")
    p.set_defaults(fn=cmd_tokenizer)

    for name, fn in (("fit", cmd_fit), ("bench", cmd_bench)):
        p = sub.add_parser(name)
        p.add_argument("--data", default="data/tok")
        _spec_args(p)
        _train_args(p)
        if name == "bench":
            p.add_argument(
                "--variants", default="grouped_bf16,grouped_mm,batched_mm,grouped_bf16+compile"
            )
            p.add_argument("--warm", type=int, default=3)
            p.add_argument("--timed", type=int, default=10)
        p.set_defaults(fn=fn)

    p = sub.add_parser("export", help="checkpoint folder -> HF folder (bf16)")
    p.add_argument("--ckpt", required=True)
    p.add_argument("--tokenizer", default="data/tok")
    p.add_argument("--out", required=True)
    p.set_defaults(fn=cmd_export)

    ns = ap.parse_args(argv)
    ns.fn(ns)
    return 0


if __name__ == "__main__":
    sys.exit(main())
