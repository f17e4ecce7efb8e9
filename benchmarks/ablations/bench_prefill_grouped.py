"""Prefill MoE on one layer of int4 rows (the GPU pool's layout), two paths side by side: the
grouped Triton kernels (`prefill.moe_prefill`) and the grouped GEMMs of
kernels/triton/grouped.py (the routed experts dequantized to bf16, two `torch._grouped_mm`),
"grouped_all" (prefill_grouped.py: every expert dequantized), with the
candidate's two parts timed alone ("dequant": every expert; "gemms": the rest of its path, sort,
gathers, two GEMMs and the combine, on weights already dequantized), and
the Triton kernels on that bf16 layer (a third design: dequant, then the bf16 kernels).
Tokens routed uniformly at random, interleaved rounds (the variants' order rotated each round),
medians of CUDA-event times with the L2 flushed, the HBM copy rate measured in the same run, and
the candidate's output against the product's (relative norm of the difference). One row per
(shape, tokens, variant).

    PYTHONPATH=. python benchmarks/ablations/bench_prefill_grouped.py --tokens 64 512 \
        --out rows.jsonl --commit abc1234
    python benchmarks/ablations/bench_prefill_grouped.py --dry-run   # CPU, interpreter, tiny
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

FLUSH = 256 << 20  # bytes zeroed before each timed call: the L2 flushed
SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8), "qwen3.5-35b-a3b": (2048, 512, 256, 8)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help="names of " + ", ".join(SHAPES))
    ap.add_argument("--tokens", nargs="+", type=int, default=[16, 64, 128, 512])
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds of 3 calls each")
    ap.add_argument("--dry-run", action="store_true", help="CPU, interpreter, tiny layer")
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default=None)
    a = ap.parse_args(argv)
    if a.dry_run:  # before triton is imported: it reads the variable when kernels are decorated
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    if not a.dry_run and not torch.cuda.is_available():
        print("bench_prefill_grouped.py: no CUDA device; --dry-run checks it on the CPU",
              file=sys.stderr)  # fmt: skip
        return 2
    from common import bench_row, median_seconds, write_rows
    from prefill_grouped import layer_weights, moe_prefill_grouped

    from moestream.kernels.triton.grouped import moe_grouped
    from moestream.kernels.triton.layout import StackedExperts, quantize_stacked
    from moestream.kernels.triton.prefill import moe_prefill
    from moestream.quant import make_scheme

    cuda = not a.dry_run
    device = "cuda" if cuda else "cpu"
    # the interpreter's tl.dot is checked in fp32 (test_prefill_interpreter); the GPU's in bf16
    dtype = torch.bfloat16 if cuda else torch.float32
    shapes = {"tiny": (128, 64, 8, 2)} if a.dry_run else {n: SHAPES[n] for n in a.shapes.split(",")}
    tokens = [5] if a.dry_run else a.tokens
    reps = 1 if a.dry_run else 3
    copy_gbps = None
    if cuda:
        src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        copy_gbps = 2 * src.numel() / median_seconds(lambda: dst.copy_(src), 5, cuda) / 1e9
        del src, dst
        print(f"HBM copy {copy_gbps:.0f} GB/s (read + write)")
    for name, (D, I, E, K) in shapes.items():
        g = torch.Generator(device=device).manual_seed(0)
        w13 = torch.randn(E, 2 * I, D, device=device, generator=g) / D**0.5
        w2 = torch.randn(E, D, I, device=device, generator=g) / I**0.5
        ex = quantize_stacked(make_scheme("int4"), w13, w2).to_rows()
        del w13, w2
        ex_bytes = sum(t.numel() * t.element_size() for t in ex.sections.values())
        scratch = E * 3 * D * I * torch.finfo(dtype).bits // 8
        w = layer_weights(ex, dtype)
        ex16 = StackedExperts(make_scheme("bf16"), {"w13.q": w[0], "w2.q": w[1]})
        for T in tokens:
            gen = torch.Generator().manual_seed(T)
            ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).to(device)
            wt = torch.rand(T, K, generator=gen).to(device)
            x = torch.randn(T, D, generator=gen).to(device=device, dtype=dtype)
            variants = {
                "triton": lambda: moe_prefill(x, ids, wt, ex),
                "grouped_mm": lambda: moe_grouped(x, ids, wt, ex),  # the product: routed only
                "grouped_all": lambda: moe_prefill_grouped(x, ids, wt, ex),  # every expert
                "dequant": lambda: layer_weights(ex, dtype),
                "gemms": lambda: moe_prefill_grouped(x, ids, wt, ex, w=w),
                # the product's kernels on the same layer already in bf16: with "dequant" the
                # third design (it keeps the Triton path's bits per pair in any chunk)
                "triton_bf16": lambda: moe_prefill(x, ids, wt, ex16),
            }
            want = moe_prefill(x, ids, wt, ex).float()
            got = moe_grouped(x, ids, wt, ex).float()
            rel = ((got - want).norm() / want.norm()).item()
            assert rel < 1e-2, f"{name} T={T}: grouped_mm differs from moe_prefill by {rel:.2e}"
            b16 = moe_prefill(x, ids, wt, ex16).float()
            rel16 = ((b16 - want).norm() / want.norm()).item()
            assert rel16 < 1e-2, f"{name} T={T}: the bf16 layer's kernels differ by {rel16:.2e}"
            times: dict[str, list[float]] = {v: [] for v in variants}
            names = list(variants)
            for r in range(a.rounds if cuda else 1):
                for v in names[r % len(names) :] + names[: r % len(names)]:
                    times[v].append(median_seconds(variants[v], reps, cuda, FLUSH))
            base = statistics.median(times["triton"])
            touched = int(torch.unique(ids).numel())
            rows = []
            for v, ts in times.items():
                s = statistics.median(ts)
                res = {"shape": name, "tokens": T, "variant": v, "us_per_layer": s * 1e6,
                       "vs_triton": base / s, "rel_diff_vs_triton": rel, "experts_touched": touched,
                       "layer_bytes": ex_bytes, "scratch_bytes": scratch,
                       "hbm_copy_gbps": copy_gbps}  # fmt: skip
                rows.append(res)
                print(f"{name} T={T:4d} {v:<11} {s * 1e6:9.1f} us  {base / s:5.2f}x triton"
                      + (f"  (outputs differ by {rel:.1e})" if v == "grouped_mm" else ""))  # fmt: skip
            config = {"shape": [D, I, E, K], "dtype": str(dtype), "rounds": a.rounds,
                      "dry_run": a.dry_run}  # fmt: skip
            write_rows(a.out, [bench_row("prefill_grouped", config, r, a.commit) for r in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
