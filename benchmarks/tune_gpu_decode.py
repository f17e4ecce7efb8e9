"""Sweep the decode kernels' tiles on a CUDA GPU, one kernel at a time, at one token.

gate/up and down are timed alone (`moe_decode(..., stages=...)`) in CUDA graphs of `--layers`
layers with the L2 flushed per replay, each against the roofline of its own bytes (w13 or w2
sections of the K routed experts at the copy bandwidth measured here); then the best gate/up and
the best down of each family (CUDA-core, tensor-core `mma`) run together as one layer, beside the
current default. Prints the ranking and writes JSON lines; `--write [PATH]` sets the fastest layer
as this GPU's row for the model's shape in moestream/kernels/triton/configs/tiles.json (or a copy
at PATH), which is where the product's decode tiles come from (kernels/triton/tuned.py).
  python benchmarks/tune_gpu_decode.py --out /tmp/tune.jsonl [--write]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import fields, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from ablations.triton_decode import MMA_CONFIGS, default, moe_decode  # noqa: E402
from bench_gpu_moe import MODELS, copy_bandwidth, graph_ms, random_layer, routing  # noqa: E402
from common import bench_row, source, write_rows  # noqa: E402

from moestream.kernels.triton import tuned  # noqa: E402
from moestream.kernels.triton.decode import DecodeConfig, check_shapes  # noqa: E402


def gate_candidates(quant: str, D: int, I: int):
    """Gate/up tiles: (bn, bk, split, num_warps) for both families."""
    out = [default(quant, D, I)]
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


def down_candidates(quant: str, D: int, I: int):
    out = [default(quant, D, I)]
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


def layer_setup(quant: str, D: int, I: int, E: int, K: int, layers: int, bw: float, gen):
    """(time(cfg, stages) -> ms per layer, roofline ms per stage) on `layers` random layers."""
    exs = [random_layer(quant, D, I, E) for _ in range(layers)]
    routes = [routing(1, E, K, gen) for _ in range(layers)]
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

        return graph_ms(step, layers)

    return time, roof


def sweep_stage(name: str, quant: str, stages: str, cands, time, roof, D: int, I: int):
    """Times every candidate of one kernel: (rows, [(ms, cfg)] fastest first)."""
    rows, res = [], []
    for cfg in cands:
        if check_shapes(quant, D, I, 32, cfg):
            continue
        try:
            ms = time(cfg, stages)
        except Exception as e:  # a tile that does not compile is skipped, and said
            print(f"{name} {stages} {cfg}: {type(e).__name__}: {e}"[:400])
            continue
        res.append((ms, cfg))
        rows.append({"stages": stages, "tiles": repr(cfg), "ms": ms,
                     "roofline_fraction": roof[stages] / ms})  # fmt: skip
    res.sort(key=lambda r: r[0])
    for ms, cfg in res[:5]:
        print(f"{name} {stages:8} {ms * 1e3:6.1f} us roof {roof[stages] / ms:4.2f} {cfg}")
    return rows, res


def tune(model: str, quant: str, layers: int, bw: float, gen):
    """Per-kernel sweeps, then the best gate/up + best down of each family as one layer, beside
    the current default: (rows, (ms, winner config))."""
    D, I, E, K = MODELS[model]
    time, roof = layer_setup(quant, D, I, E, K, layers, bw, gen)
    name, rows, best = f"{model} {quant}", [], {}
    for stages, cands in (("gate_up", gate_candidates(quant, D, I)),
                          ("down", down_candidates(quant, D, I))):  # fmt: skip
        r, res = sweep_stage(name, quant, stages, cands, time, roof, D, I)
        rows += r
        for mma in (False, True):
            fam = [c for _, c in res if c.mma == mma]
            if fam:
                best[(stages, mma)] = fam[0]
    layer = {"default": default(quant, D, I)}
    for mma in (False, True):
        if ("gate_up", mma) in best and ("down", mma) in best:
            g, d = best[("gate_up", mma)], best[("down", mma)]
            layer[f"mma={mma}"] = replace(g, bn_d=d.bn_d, bk_d=d.bk_d, warps_d=d.warps_d)
    timed = []
    for tag, cfg in layer.items():
        ms = time(cfg, "gate_up+down")
        frac = roof["gate_up+down"] / ms
        print(f"{name} layer {tag} {ms * 1e3:6.1f} us roof {frac:4.2f} {cfg}")
        rows.append({"stages": "gate_up+down", "tiles": repr(cfg), "ms": ms,
                     "roofline_fraction": frac, "best_of_family": tag != "default"})  # fmt: skip
        timed.append((ms, frac, cfg))
    return rows, min(timed, key=lambda t: t[0])


def write_winner(path: Path, device: str, quant: str, model: str, winner, source: str) -> None:
    """Set the (device, decode, quant, shape) row of a tiles.json copy at `path` (the shipped
    file's rows when it does not exist yet) to the winner's fields."""
    D, I = MODELS[model][:2]
    ms, frac, cfg = winner
    row = {f.name: getattr(cfg, f.name) for f in fields(DecodeConfig)}
    row["note"] = (f"tune_gpu_decode.py at {source}: {ms * 1e3:.1f} us per {model} layer at T=1, "
                   f"{frac:.2f} of the roofline")  # fmt: skip
    data = json.loads((path if path.exists() else tuned.CONFIG_FILE).read_text())
    data = tuned.with_row(data, device, "decode", quant, tuned.shape_key(D, I), row)
    path.write_text(tuned.dumps(data))
    print(f"wrote {device} decode {quant} {tuned.shape_key(D, I)} to {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--quant", nargs="+", default=["int4", "int8", "bf16"])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--commit", default=None)
    ap.add_argument("--write", nargs="?", type=Path, const=tuned.CONFIG_FILE, default=None,
                    help="set each (model shape, quant) winner as this GPU's row of a tiles.json "
                    "(default: the package's moestream/kernels/triton/configs/tiles.json)")  # fmt: skip
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    bw = copy_bandwidth()
    src = source(args.commit)
    commit = src["commit"] + ("-dirty" if src["dirty"] else "")  # for the written rows' notes
    for model in args.models:
        for quant in args.quant:
            rows, winner = tune(model, quant, args.layers, bw, gen)
            torch.cuda.empty_cache()
            D, I, E, K = MODELS[model]
            config = dict(model=model, D=D, I=I, E=E, K=K, quant=quant, layers=args.layers)
            # written per model and format: a cut-short run keeps what it did
            write_rows(args.out, [bench_row("tune_gpu_decode", config,
                                            {**r, "copy_bw_gbps": bw / 1e9}, args.commit)
                                  for r in rows])  # fmt: skip
            if args.write:
                write_winner(args.write, torch.cuda.get_device_name(), quant, model, winner, commit)


if __name__ == "__main__":
    main()
