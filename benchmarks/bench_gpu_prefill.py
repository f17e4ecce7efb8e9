"""The grouped prefill MoE kernels (kernels/triton/prefill.py) on one layer, timed alone: a prompt
of T tokens routed uniformly at random over E experts at Qwen3-30B-A3B's shapes, every expert in
VRAM. Per (quant, T, tile config): median us per layer of CUDA-event timed calls (L2 flushed
before each), the TFLOP/s of the routed products, and the GB/s of the experts the prompt touches
read once, against the bf16 dense-GEMM and HBM-copy ceilings measured in the same run. A row is
appended to --out as soon as it is measured.

    PYTHONPATH=. python benchmarks/bench_gpu_prefill.py --quant int4r int8 --tokens 64 512 \
        --configs "block_m=64;half=64,bk=128" --out rows.jsonl

`--path experts` times the layer as a prompt runs it (kernels/triton.moe_experts: on sm_90 the
routed experts dequantized, then the grouped GEMMs; K-quant layers, "q4_k+q6_k" included, take
this path only), with `--profile` each kernel's share (the dequant launches among them).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_row, cuda_median_seconds, write_rows  # noqa: E402


def parse_configs(text: str | None) -> list[dict]:
    """'a=1,b=2;c=3' -> [{}, {a: 1, b: 2}, {c: 3}] (the default first)."""
    out = [{}]
    for part in (text or "").split(";"):
        if part.strip():
            out.append({k: int(v) for k, v in (kv.split("=") for kv in part.split(","))})
    return out


def layer(quant: str, E: int, D: int, I: int):
    from moestream.kernels.triton.layout import KQUANTS, quantize_stacked
    from moestream.quant import make_scheme

    if quant.split("+")[0] in KQUANTS:  # random block bytes (no quantizer: GGUF files' blocks)
        from bench_gpu_moe import random_layer

        return random_layer(quant, D, I, E)

    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(E, 2 * I, D, device="cuda", generator=g) / D**0.5
    w2 = torch.randn(E, D, I, device="cuda", generator=g) / I**0.5
    if quant == "int4r":
        return quantize_stacked(make_scheme("int4"), w13, w2).to_rows()
    return quantize_stacked(make_scheme(quant), w13, w2)


def timed(fn, reps: int) -> float:
    """Median seconds of fn(), the L2 flushed before each call."""
    return cuda_median_seconds(fn, reps, flush_bytes=256 << 20)


def kernel_times(fn, reps: int = 5) -> dict[str, float]:
    """GPU us per call of each kernel fn launches (torch.profiler / CUPTI), by kernel name."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for ev in prof.key_averages():
        if ev.device_type.name == "CUDA" and ev.count:
            out[ev.key[:60]] = out.get(ev.key[:60], 0.0) + ev.device_time_total / reps
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def compiled_kernels() -> list[dict]:
    """Registers, spills, shared memory and the matrix instructions of every compiled prefill
    kernel (Triton 3.x's JIT cache; cuobjdump from Triton's package)."""
    import re
    import subprocess
    import tempfile

    import triton

    from moestream.kernels.triton import prefill as pf

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    rows: list[dict] = []
    for name in ("_gate_up_wm", "_down_wm", "_gate_up_grouped", "_down_grouped"):
        for cache in getattr(getattr(pf, name), "device_caches", {}).values():
            for k in cache[0].values():
                r = {"kernel": name, "regs": k.n_regs, "spills": k.n_spills,
                     "shared": k.metadata.shared, "warps": k.metadata.num_warps}  # fmt: skip
                with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                    f.write(k.asm["cubin"])
                    f.flush()
                    sass = subprocess.run([str(tool), "--dump-sass", f.name], capture_output=True,
                                          text=True).stdout  # fmt: skip
                for op in ("HGMMA", "HMMA", "LDL", "STL", "LDGSTS", "LDS", "FFMA"):
                    r[op] = len(re.findall(rf"\b{op}\b", sass))
                rows.append(r)
    return rows


def ceilings() -> tuple[float, float]:
    """(bf16 dense GEMM TFLOP/s at 8192^3, HBM copy GB/s of 1 GiB read + written)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = timed(lambda: a @ a, 5)
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    c = timed(lambda: dst.copy_(src), 5)
    return 2 * 8192**3 / t / 1e12, 2 * src.numel() / c / 1e9


def main(argv=None) -> int:
    from moestream.kernels.triton import moe_experts
    from moestream.kernels.triton.prefill import PrefillConfig, default_config, moe_prefill

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quant", nargs="+", default=["int4r"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[64, 512])
    ap.add_argument("--shape", default="2048,768,128,8", help="D,I,E,K")
    ap.add_argument("--configs", default=None, help="PrefillConfig overrides, ';' between")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--path", choices=["tiles", "experts"], default="tiles",
                    help="tiles: prefill.py's kernels (--configs); experts: moe_experts' dispatch")  # fmt: skip
    ap.add_argument("--profile", action="store_true", help="also each kernel's GPU time, and "
                    "the compiled kernels' registers and matrix instructions")  # fmt: skip
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default=None)
    a = ap.parse_args(argv)
    D, I, E, K = (int(v) for v in a.shape.split(","))
    if a.path == "tiles" and any("_k" in q for q in a.quant):
        ap.error(
            "K-quant layers run a prompt through --path experts (prefill.py has no K-quant tiles)"
        )
    if a.path == "experts" and a.configs:
        ap.error("--configs are prefill.py's tiles: --path tiles")
    tflops, gbps = ceilings()
    print(f"ceilings: bf16 GEMM {tflops:.0f} TFLOP/s, HBM copy {gbps:.0f} GB/s")
    known = {f.name for f in fields(PrefillConfig)}
    for quant in a.quant:
        ex = layer(quant, E, D, I)
        rec = sum(t.numel() * t.element_size() for t in ex.sections.values()) // E
        for T in a.tokens:
            if a.path == "tiles":  # T picks tiles
                base = default_config(quant, D, I, torch.cuda.get_device_name(), T)
            g = torch.Generator().manual_seed(T)
            ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).cuda()
            w = torch.rand(T, K, generator=g).cuda()
            x = torch.randn(T, D, generator=g).cuda().bfloat16()
            touched = int(torch.unique(ids).numel())
            for over in parse_configs(a.configs):
                assert set(over) <= known, f"unknown PrefillConfig field in {over}"
                cfg = None if a.path == "experts" else replace(base, **over)

                def run(cfg=cfg):
                    if cfg is None:
                        return moe_experts(x, ids, w, ex)
                    return moe_prefill(x, ids, w, ex, cfg=cfg)

                try:
                    s = timed(run, a.reps)
                except Exception as err:  # a tile the compiler refuses (shared memory, shapes)
                    print(f"{quant} T={T} {over}: failed: {str(err).splitlines()[0][:120]}")
                    continue
                flop = 2 * T * K * 3 * D * I
                r = {"quant": quant, "tokens": T, "path": a.path,
                     "tiles": {f.name: getattr(cfg, f.name) for f in fields(cfg)} if cfg else None,
                     "us_per_layer": s * 1e6, "tflops": flop / s / 1e12,
                     "tflops_fraction": flop / s / 1e12 / tflops,
                     "experts_touched": touched, "gbps": touched * rec / s / 1e9,
                     "hbm_fraction": touched * rec / s / 1e9 / gbps,
                     "ceiling_tflops": tflops, "ceiling_gbps": gbps}  # fmt: skip
                if a.profile:
                    r["kernel_us"] = kernel_times(run)
                    print("   " + ", ".join(f"{k} {v:.0f}" for k, v in r["kernel_us"].items()))
                print(f"{quant} T={T} {over or 'default'}: {r['us_per_layer']:.1f} us/layer, "
                      f"{r['tflops']:.1f} TFLOP/s ({r['tflops_fraction']:.3f}), "
                      f"{r['gbps']:.0f} GB/s of touched experts ({r['hbm_fraction']:.2f})")  # fmt: skip
                if a.out:
                    config = {"shape": [D, I, E, K], "reps": a.reps, "device": "cuda"}
                    write_rows(a.out, [bench_row("gpu_prefill", config, r, a.commit)])
    if a.profile:
        for r in compiled_kernels():
            print("compiled:", r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
