"""Decode with CUDA graphs vs eager on one GPU: the same store, every expert in VRAM, greedy
fixed-length generation through the engine's Generator, the two variants interleaved.

Rows (JSON lines, `--out`): per (model, quant, variant) the median decode tok/s over `--reps`,
ms per token, and `tokens_equal_eager` (greedy tokens of the graph run equal to the eager run's).
The ratio graph/eager is printed. `--synthetic-layers N` adds a random checkpoint with
Qwen3-30B-A3B's shapes (hidden 2048, 32/4 heads x 128, 128 experts x 768, top-8, vocab 151936)
written on the spot, so the GPU work per token is a real model's layer, not the tiny one's.

    PYTHONPATH=. python benchmarks/bench_gpu_graph.py [--synthetic-layers 4] --out rows.jsonl
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import bench_row, write_rows  # noqa: E402

from moestream.config import SamplingConfig  # noqa: E402
from moestream.convert.writer import convert  # noqa: E402
from moestream.experts.config import GpuConfig  # noqa: E402
from moestream.quant import make_scheme  # noqa: E402
from moestream.runtime import open_model  # noqa: E402

REF = Path(__file__).resolve().parent.parent / "models" / "pystd-moe-29m"


def synthetic(root: Path, layers: int) -> Path:
    from moestream.convert.synthetic import qwen3_moe_config, write_random_qwen3_moe

    cfg = qwen3_moe_config(2048, 768, 128, 8, layers, vocab=151936)
    write_random_qwen3_moe(root / "hf", cfg, dtype=torch.bfloat16)
    return root / "hf"


def measure(stores: dict, a) -> list[dict]:
    cfg = SamplingConfig(max_new_tokens=a.tokens, ignore_eos=True)
    rows = []
    for (name, quant), store in stores.items():
        rts = {
            v: open_model(store, dtype="bfloat16", experts=GpuConfig(resident=True, cuda_graph=g))
            for v, g in (("eager", False), ("graph", True))
        }
        ids = rts["eager"].encode_prompt(a.prompt)
        runs = {v: [] for v in rts}
        toks = {}
        for rep in range(a.reps + 1):  # rep 0 warms up (compiles, captures)
            order = ("eager", "graph") if rep % 2 else ("graph", "eager")
            for v in order:
                res = rts[v].generator.generate(ids, cfg)
                toks[v] = res.ids
                if rep:
                    runs[v].append(res.stats()["decode_tok_s"])
        for v, tps in runs.items():
            med = statistics.median(tps)
            rows.append({
                "model": name, "quant": quant, "variant": v, "decode_tok_s": med,
                "decode_tok_s_all": tps, "ms_per_token": 1e3 / med, "tokens": a.tokens,
                "tokens_equal_eager": toks[v] == toks["eager"],
            })  # fmt: skip
        for rt in rts.values():
            rt.close()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-p", "--prompt", default="def fibonacci(n):")
    ap.add_argument("-n", "--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quants", default="bf16,int8,int4")
    ap.add_argument("--synthetic-layers", type=int, default=0)
    ap.add_argument("--out", default=None, help="append JSON rows here")
    ap.add_argument("--commit", default=None, help="source commit when the tree has no .git")
    a = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="moestream-graph-"))
    models = {"pystd-moe-29m": REF}
    if a.synthetic_layers:
        models[f"qwen3-30b-shapes-{a.synthetic_layers}L"] = synthetic(tmp, a.synthetic_layers)
    stores = {}
    for name, src in models.items():
        for q in a.quants.split(","):
            stores[(name, q)] = convert(src, tmp / f"{name}-{q}", make_scheme(q), False)
    rows = measure(stores, a)
    by = {(r["model"], r["quant"], r["variant"]): r for r in rows}
    print(f"{'model':<26} {'quant':<5} {'eager tok/s':>11} {'graph tok/s':>11} {'ratio':>6} same")
    for name, q in stores:
        e, g = by[(name, q, "eager")], by[(name, q, "graph")]
        ratio = g["decode_tok_s"] / e["decode_tok_s"]
        print(
            f"{name:<26} {q:<5} {e['decode_tok_s']:>11.1f} {g['decode_tok_s']:>11.1f} "
            f"{ratio:>6.2f} {g['tokens_equal_eager']}"
        )
    if a.out:
        config = {"prompt": a.prompt, "tokens": a.tokens, "reps": a.reps}
        write_rows(a.out, [bench_row("gpu_graph", config, r, a.commit) for r in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
