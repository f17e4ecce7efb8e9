"""Sweep the decode kernels' tiles on a CUDA GPU, one kernel at a time, at one token.

gate/up and down are timed alone (`moe_decode(..., stages=...)`) in CUDA graphs of `--layers`
layers with the L2 flushed per replay, each against the roofline of its own bytes (w13 or w2
sections of the K routed experts at the copy bandwidth measured here); then the best gate/up and
the best down of each family (CUDA-core, tensor-core `mma`) run together as one layer. Prints
the ranking and writes JSON lines; the defaults in kernels/triton/decode.py come from here.
  python benchmarks/tune_gpu_decode.py --out /tmp/tune.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from ablations.triton_decode import DEFAULTS, MMA_CONFIGS, moe_decode  # noqa: E402
from bench_gpu_moe import MODELS, copy_bandwidth, graph_ms, random_layer, routing  # noqa: E402
from common import commit, hardware, write_jsonl  # noqa: E402

from moestream.kernels.triton.decode import check_shapes  # noqa: E402


def gate_candidates(quant: str):
    """Gate/up tiles: (bn, bk, split, num_warps) for both families."""
    out = [DEFAULTS[quant]]
    if quant == "int4":
        grid = itertools.product([64], [128, 256, 512], [1, 2, 4, 8], [4, 8])
    else:
        grid = itertools.product([16, 32, 64], [256, 512], [1, 2, 4], [4])
    for bn, bk, split, warps in grid:
        out.append(replace(MMA_CONFIGS[quant], bn=bn, bk=bk, split=split, num_warps=warps))
    for stages in (2, 3):  # software-pipelined K loop, on the tiles with several K steps
        for bk, split in ((128, 2), (128, 4), (256, 2)):
            bn = 64 if quant == "int4" else 32
            out.append(replace(MMA_CONFIGS[quant], bn=bn, bk=bk, split=split, stages=stages))
    return out


def down_candidates(quant: str):
    out = [DEFAULTS[quant]]
    if quant == "int4":
        grid = itertools.product([64], [64, 128, 256], [2, 4, 8])
    else:
        grid = itertools.product([16, 32, 64], [128, 256], [2, 4])
    for bn_d, bk_d, warps_d in grid:
        out.append(replace(MMA_CONFIGS[quant], bn_d=bn_d, bk_d=bk_d, warps_d=warps_d))
    return out


def section_bytes(ex, prefix: str) -> int:
    return sum(
        t[0].numel() * t.element_size() for n, t in ex.sections.items() if n.startswith(prefix)
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--quant", nargs="+", default=["int4", "int8", "bf16"])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--commit", default=None)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    bw = copy_bandwidth()
    hw = hardware()
    for model in args.models:
        D, I, E, K = MODELS[model]
        for quant in args.quant:
            rows = []
            exs = [random_layer(quant, D, I, E) for _ in range(args.layers)]
            routes = [routing(1, E, K, gen) for _ in range(args.layers)]
            x = torch.randn(1, D, generator=gen).cuda().bfloat16()
            y = torch.empty_like(x)
            roof = {
                "gate_up": K * section_bytes(exs[0], "w13") / bw * 1e3,
                "down": K * section_bytes(exs[0], "w2") / bw * 1e3,
                "gate_up+down": K * exs[0].expert_bytes() / bw * 1e3,
            }

            def time(cfg, stages):
                def step():
                    for ex, (ids, w) in zip(exs, routes):
                        moe_decode(x, ids, w, ex, cfg, out=y, stages=stages)

                return graph_ms(step, args.layers)

            best = {}
            for stages, cands in (("gate_up", gate_candidates(quant)),
                                  ("down", down_candidates(quant))):  # fmt: skip
                res = []
                for cfg in cands:
                    if check_shapes(quant, D, I, 32, cfg):
                        continue
                    try:
                        ms = time(cfg, stages)
                    except Exception as e:  # a tile that does not compile is skipped, and said
                        print(f"{model} {quant} {stages} {cfg}: {type(e).__name__}: {e}"[:400])
                        continue
                    res.append((ms, cfg))
                    rows.append({"bench": "tune_gpu_decode", "model": model, "quant": quant,
                                 "stages": stages, "config": repr(cfg), "ms": ms,
                                 "roofline_fraction": roof[stages] / ms})  # fmt: skip
                res.sort(key=lambda r: r[0])
                for ms, cfg in res[:5]:
                    print(f"{model} {quant} {stages:8} {ms * 1e3:6.1f} us "
                          f"roof {roof[stages] / ms:4.2f} {cfg}")  # fmt: skip
                for mma in (False, True):
                    fam = [r for r in res if r[1].mma == mma]
                    if fam:
                        best[(stages, mma)] = fam[0][1]
            for mma in (False, True):
                if ("gate_up", mma) not in best or ("down", mma) not in best:
                    continue
                g, d = best[("gate_up", mma)], best[("down", mma)]
                cfg = replace(g, bn_d=d.bn_d, bk_d=d.bk_d, warps_d=d.warps_d)
                ms = time(cfg, "gate_up+down")
                frac = roof["gate_up+down"] / ms
                print(f"{model} {quant} layer mma={mma} {ms * 1e3:6.1f} us roof {frac:4.2f} {cfg}")
                rows.append({"bench": "tune_gpu_decode", "model": model, "quant": quant,
                             "stages": "gate_up+down", "config": repr(cfg), "ms": ms,
                             "roofline_fraction": frac, "best_of_family": True})  # fmt: skip
            torch.cuda.empty_cache()
            for r in rows:  # written per model and format: a cut-short run keeps what it did
                r.update(hardware=hw, copy_bw_gbps=bw / 1e9, source=args.commit or commit())
            write_jsonl(args.out, rows)


if __name__ == "__main__":
    main()
