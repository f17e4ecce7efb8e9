#!/usr/bin/env python3
"""Numbers for the reference model's card, computed with transformers on CPU.

  * validation perplexity of the model on the validation tokens (non-overlapping windows), and the
    perplexity of a unigram model (add-one smoothed train-token frequencies) on the same targets;
  * greedy completions of the code prompts;
  * routing over 150 generated tokens for 5 varied prompts, read from hooks on each layer's router
    (`mlp.gate`): per-layer unique experts, temporal reuse (share of token t's top-k also in token
    t-1's at the same layer), load balance, and dead experts (< 0.2% of a layer's selections);
  * the loss curve (loss.png) from the training log.

    python scripts/model_card_stats.py --model models/pystd-moe-29m --data data/tok \
        --log data/runs/pystd/log.jsonl --out /tmp/card
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import numpy as np
import torch
import torch.nn.functional as F

CODE_PROMPTS = ["def fibonacci(n):", "class BinarySearchTree:", "import os\n"]
ROUTING_PROMPTS = [
    "class BinarySearchTree:\n    def insert(self, key):\n",
    'def matrix_power_fibonacci(n):\n    """Return the n-th Fibonacci number by matrix power."""\n',
    "The :mod:`json` module provides",
    "from django.db import models\n\n\nclass Article(models.Model):\n",
    "import numpy as np\n\n\ndef test_broadcast_shapes():\n",
]


@torch.no_grad()
def perplexities(
    model, valid: np.ndarray, train: np.ndarray, vocab: int, seq: int, max_tokens: int
):
    toks = torch.from_numpy(valid[: max_tokens + 1].astype(np.int64))
    n = (toks.numel() - 1) // seq
    total, count = 0.0, 0
    targets = []
    for i in range(0, n, 8):
        j = min(n, i + 8)
        x = torch.stack([toks[k * seq : (k + 1) * seq + 1] for k in range(i, j)])
        logits = model(input_ids=x[:, :-1], use_cache=False).logits.float()
        total += F.cross_entropy(
            logits.reshape(-1, vocab), x[:, 1:].reshape(-1), reduction="sum"
        ).item()
        count += x[:, 1:].numel()
        targets.append(x[:, 1:].reshape(-1).numpy())
    tg = np.concatenate(targets)
    counts = np.bincount(train.astype(np.int64), minlength=vocab).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    uni = -logp[tg].mean()
    return {
        "val_tokens": int(count),
        "model_ce": total / count,
        "model_ppl": math.exp(total / count),
        "unigram_ce": float(uni),
        "unigram_ppl": float(math.exp(uni)),
    }


def routing(model, tok, n_new: int, sample: bool = False):
    layers = model.model.layers
    E, k = model.config.num_experts, model.config.num_experts_per_tok
    trace: list[list[torch.Tensor]] = [[] for _ in layers]

    def hook(li):
        def f(mod, inp, out):
            idx = out[2]  # (tokens, k): router_logits, router_scores, router_indices
            trace[li].append(
                idx[-1].clone()
            )  # the last position: the one that predicts the next token

        return f

    handles = [layer.mlp.gate.register_forward_hook(hook(i)) for i, layer in enumerate(layers)]
    per_prompt = []
    texts = []
    try:
        for p in ROUTING_PROMPTS:
            for t in trace:
                t.clear()
            ids = tok(p, return_tensors="pt").input_ids
            torch.manual_seed(0)
            kw = (
                dict(do_sample=True, temperature=0.8, top_p=0.95)
                if sample
                else dict(do_sample=False)
            )
            out = model.generate(ids, max_new_tokens=n_new, min_new_tokens=n_new, **kw)
            texts.append(tok.decode(out[0, ids.shape[1] :]))
            # one routing record per generated token: prefill's last position, then each decode step
            per_prompt.append(torch.stack([torch.stack(t[:n_new]) for t in trace]))  # (L, T, k)
    finally:
        for h in handles:
            h.remove()
    R = torch.stack(per_prompt)  # (P, L, T, k)
    P, L, T, _ = R.shape
    rows = []
    dead_total = 0
    for li in range(L):
        uniq = [len(torch.unique(R[p, li])) for p in range(P)]
        reuse = []
        for p in range(P):
            for t in range(1, T):
                a, b = set(R[p, li, t].tolist()), set(R[p, li, t - 1].tolist())
                reuse.append(len(a & b) / k)
        counts = torch.bincount(R[:, li].reshape(-1), minlength=E).double()
        share = counts / counts.sum()
        dead = int((share < 0.002).sum())
        dead_total += dead
        rows.append(
            {
                "layer": li,
                "unique_per_prompt": float(np.mean(uniq)),
                "unique_all_prompts": int((counts > 0).sum()),
                "temporal_reuse": float(np.mean(reuse)),
                "max_over_mean_load": float(share.max() / share.mean()),
                "load_cv": float(share.std() / share.mean()),
                "dead": dead,
            }
        )
    return {
        "decoding": "sampled T=0.8 top-p 0.95 seed 0" if sample else "greedy",
        "prompts": ROUTING_PROMPTS,
        "generated": texts,
        "tokens_per_prompt": T,
        "experts": E,
        "top_k": k,
        "random_reuse": k / E,
        "layers": rows,
        "dead_slots": dead_total,
        "dead_fraction": dead_total / (E * L),
    }


def plot_loss(log_path: str, out_png: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tr, va = [], []
    with open(log_path) as f:
        for line in f:
            r = json.loads(line)
            if "ce" in r:
                tr.append((r["tokens"] / 1e6, r["ce"]))
            if "val_ce" in r:
                va.append((r["tokens"] / 1e6, r["val_ce"]))
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(*zip(*tr), lw=1, label="train cross-entropy (per 25 steps)")
    ax.plot(*zip(*va), "o-", label="validation cross-entropy")
    ax.set_xlabel("tokens seen (millions)")
    ax.set_ylabel("nats / token")
    ax.set_ylim(0.8, 4.0)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("pystd-moe-29m training")
    fig.tight_layout()
    fig.savefig(out_png)


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="models/pystd-moe-29m")
    ap.add_argument("--data", default="data/tok")
    ap.add_argument("--log", default="data/runs/pystd/log.jsonl")
    ap.add_argument("--out", default="/tmp/card")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument(
        "--max-val-tokens",
        type=int,
        default=131072,
        help="the first N validation tokens (default: 128 windows of 1024); 0: all",
    )
    ap.add_argument("--new-tokens", type=int, default=150)
    ap.add_argument("--sample-tokens", type=int, default=100)
    args = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.makedirs(args.out, exist_ok=True)
    torch.set_grad_enabled(False)
    tok = AutoTokenizer.from_pretrained(args.model)
    # the bf16 weights, computed in fp32 on CPU
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    res = {}
    t = time.time()
    plot_loss(args.log, os.path.join(args.model, "loss.png"))

    model.set_experts_implementation("batched_mm")  # one token at a time: gather the 8 experts
    samples = {}
    for p in CODE_PROMPTS:
        ids = tok(p, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=args.sample_tokens, do_sample=False)
        samples[p] = tok.decode(out[0, 1:])
    res["samples"] = samples
    print(f"samples done {time.time() - t:.0f}s", flush=True)

    res["routing"] = routing(model, tok, args.new_tokens)
    res["routing_sampled"] = routing(model, tok, args.new_tokens, sample=True)
    print(f"routing done {time.time() - t:.0f}s", flush=True)
    model.set_experts_implementation("grouped_mm")  # many tokens per expert: grouped GEMMs

    valid = np.load(os.path.join(args.data, "valid.npy"))
    train = np.load(os.path.join(args.data, "train.npy"))
    mx = args.max_val_tokens or valid.size - 1
    res["ppl"] = perplexities(model, valid, train, model.config.vocab_size, args.seq_len, mx)
    print(f"ppl done {time.time() - t:.0f}s", flush=True)

    with open(os.path.join(args.out, "card_stats.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res["ppl"], indent=1))
    for key in ("routing", "routing_sampled"):
        print_routing(res[key])
    for p, s in samples.items():
        print("=" * 20, repr(p))
        print(s)


def print_routing(r):
    print(
        f"\nrouting, {r['decoding']}, {r['tokens_per_prompt']} generated tokens x {len(r['prompts'])} prompts"
    )
    print(
        f"\n| layer | unique experts / prompt (of {r['experts']}) | unique, all 5 prompts | temporal reuse "
        f"| max/mean load | load CV | dead (<0.2%) |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in r["layers"]:
        print(
            f"| {row['layer']} | {row['unique_per_prompt']:.1f} | {row['unique_all_prompts']} | "
            f"{row['temporal_reuse']:.3f} | {row['max_over_mean_load']:.2f} | {row['load_cv']:.2f} | {row['dead']} |"
        )
    print(
        f"\ndead slots {r['dead_slots']}/{r['experts'] * len(r['layers'])} = {r['dead_fraction']:.1%}; "
        f"random-routing reuse would be {r['random_reuse']:.3f}"
    )


if __name__ == "__main__":
    main()
