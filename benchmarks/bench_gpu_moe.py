"""MoE-layer decode time of the Triton routed-only kernels on a CUDA GPU, against (a) reading all
experts (the same kernel routed to every expert, plus a torch bmm over all experts for bf16),
(b) a per-expert torch loop (dequantize + F.linear, kernels/ref.py) and (c) the HBM roofline of
the routed bytes at the device-to-device copy bandwidth measured in the same run (1 GiB copies).
Two references for what one launch of a layer's size reaches: a Triton kernel that only reads the
routed bytes (`read_only_*`) and a device copy of as many bytes (`copy_same_bytes_*`).

Weights are random bytes in the store layout (timing does not depend on their values); each timed
call is a CUDA graph over `--layers` layers with different weights and routing, and
triton.testing.do_bench flushes the L2 cache before each replay, so weights come from HBM.
Writes JSON lines (one per model x quant x tokens) and prints a table.
  python benchmarks/bench_gpu_moe.py --out benchmarks/results/gpu_moe.jsonl
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).parent))
from ablations.triton_decode import MMA_CONFIGS, check_shapes, default, moe_decode  # noqa: E402
from common import bench_row, capture_graph, group_of, hardware, override, tiles_of, write_rows  # noqa: E402

from moestream.kernels.ref import dequantize, expert_ffn  # noqa: E402
from moestream.kernels.triton.layout import KQUANTS, ROW_QUANTS, StackedExperts  # noqa: E402
from moestream.quant import make_scheme, tensor_sections  # noqa: E402

MODELS = {"Qwen3-30B-A3B": (2048, 768, 128, 8), "Qwen3.5-35B-A3B": (2048, 512, 256, 8)}
# Tiles of the other family (CUDA cores) and the tile variants of the sweep, per quant.
_CUDA_CORES = {
    "bf16": dict(bn=4, bk=128, split=1, bn_d=16, bk_d=256, num_warps=4),
    "int8": dict(bn=4, bk=512, split=1, bn_d=8, bk_d=256, warps_d=2),
    "int4": dict(bn=64, bk=128, split=8, bn_d=64, bk_d=128),
}
# bk_d=512: at Qwen3.5 (I=512) all of down's weights are loaded before the wait
_TILES = {"bf16": [dict(bk_d=512)], "int8": [dict(bk_d=512)],
          "int4": [dict(bk=256), dict(stages=0), dict(stages=2), dict(bk_d=512)]}  # fmt: skip
_FUSED = {"bf16": [dict(bn=8), dict(bn_d=32)], "int8": [dict(bn_d=16), dict(bn=8, bn_d=16)],
          "int4": [dict(bk=64, bk_d=128), dict(mma=False, **_CUDA_CORES["int4"])]}  # fmt: skip


def sweep(quant: str, D: int, I: int) -> list:
    """Configs timed at T=1: the default (configs/tiles.json, tuned per kernel by
    tune_gpu_decode.py), the other family (tensor cores / CUDA cores), tiles, and the programmatic
    dependent launch and the one-launch ablation (benchmarks/ablations) switched one at a time."""
    d = default(tiles_of(quant), D, I)
    if tiles_of(quant) in (*ROW_QUANTS, *KQUANTS):  # CUDA cores only, no one-launch ablation
        return [d, replace(d, pdl=False), replace(d, bk=256), replace(d, bn=8, bn_d=16),
                replace(d, bn=8, bk=256, bn_d=16, warps_d=4), replace(d, chain=not d.chain)]  # fmt: skip
    return [d, MMA_CONFIGS[quant], replace(d, pdl=False),
            replace(d, mma=False, **_CUDA_CORES[quant]), *(replace(d, **t) for t in _TILES[quant]),
            replace(d, fused=True), *(replace(d, fused=True, **f) for f in _FUSED[quant])]  # fmt: skip


@triton.jit
def _read_section(ptr, e, c, acc, N: tl.constexpr, CH: tl.constexpr, BLOCK: tl.constexpr):
    if N > 0:
        lo = c * (N // CH)
        for i in range(0, N // CH, BLOCK):
            o = lo + i + tl.arange(0, BLOCK)
            acc ^= tl.load(ptr + e * N + o, mask=o < lo + N // CH, other=0)
    return acc


@triton.jit
def _read_kernel(a_ptr, b_ptr, c_ptr, d_ptr, ids_ptr, out_ptr, NA: tl.constexpr,
                 NB: tl.constexpr, NC: tl.constexpr, ND: tl.constexpr, CH: tl.constexpr,
                 BLOCK: tl.constexpr):  # fmt: skip
    """Read chunk c of each of the four int32 sections of expert ids[p] (the routed bytes) and
    store a checksum: the one-launch read ceiling for these bytes."""
    p = tl.program_id(0)
    c = tl.program_id(1)
    e = tl.load(ids_ptr + p).to(tl.int64)
    acc = tl.zeros([BLOCK], tl.int32)
    acc = _read_section(a_ptr, e, c, acc, NA, CH, BLOCK)
    acc = _read_section(b_ptr, e, c, acc, NB, CH, BLOCK)
    acc = _read_section(c_ptr, e, c, acc, NC, CH, BLOCK)
    acc = _read_section(d_ptr, e, c, acc, ND, CH, BLOCK)
    tl.store(out_ptr + p * CH + c, tl.sum(acc, 0))


@triton.jit
def _empty_kernel(PDL: tl.constexpr, WAIT: tl.constexpr):
    """Does nothing but the decode kernels' PDL handshake: the launch floor."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if WAIT:
        tl.extra.cuda.gdc_wait()


def launch_floor(layers: int, grids: tuple) -> dict:
    """µs per layer of empty launches in a graph of `layers` layers, as the decode layer issues
    them: one launch (grid 1), two (grid 1, the second PDL-launched as down is), and two with
    the layer's own grids (gate/up, down): the fixed cost no kernel of that shape can beat."""

    def one():
        for _ in range(layers):
            _empty_kernel[(1,)](PDL=True, WAIT=False, num_warps=4)

    def two(g1=(1,), g2=(1,)):
        for _ in range(layers):
            _empty_kernel[g1](PDL=True, WAIT=False, num_warps=4)
            _empty_kernel[g2](PDL=False, WAIT=True, num_warps=4, launch_pdl=True)

    return {
        "one_launch_us": graph_ms(one, layers) * 1e3,
        "two_launches_us": graph_ms(two, layers) * 1e3,
        "two_launches_layer_grids_us": graph_ms(lambda: two(*grids), layers) * 1e3,
    }


def read_routed(ex: StackedExperts, ids, out):
    secs = [t.view(torch.int32) for t in ex.sections.values()]
    ns = [t[0].numel() for t in secs] + [0] * (4 - len(secs))
    secs = secs + [secs[0]] * (4 - len(secs))
    CH = 64
    assert all(n % CH == 0 for n in ns), ns
    _read_kernel[(ids.numel(), CH)](*secs, ids, out, *ns, CH=CH, BLOCK=1024, num_warps=4)


def random_layer(quant: str, D: int, I: int, E: int) -> StackedExperts:
    """Random sections of E experts in the store layout, on the GPU ("int4r": int4 repacked into
    the GPU pool's row layout, as the provider holds it; K-quants: random block bytes, whose
    fp16 fields may be inf or NaN: the kernels' time, not their values)."""
    if quant == "int4r":
        return random_layer("int4", D, I, E).to_rows()
    if "+" in quant:  # "q4_k+q6_k": K-quant gate/up, w2 in its own K-quant (a Q4_K_M layer's)
        up, down = (random_layer(q, D, I, E) for q in quant.split("+"))
        secs = {"w13.q": up.sections["w13.q"], "w2.q": down.sections["w2.q"]}
        return StackedExperts(up.scheme, secs, down=down.scheme)
    scheme, secs = make_scheme(quant), {}
    for name, n, k in (("w13", 2 * I, D), ("w2", D, I)):
        for sname, dtype, shape in tensor_sections(scheme, name, n, k):
            shape = (E, *shape)
            if dtype == torch.int8:
                t = torch.randint(-127, 128, shape, dtype=dtype, device="cuda")
            elif dtype == torch.uint8:
                t = torch.randint(0, 256, shape, dtype=dtype, device="cuda")
            elif sname.endswith(".q"):  # bf16 weights
                t = (torch.randn(shape, device="cuda") / k**0.5).to(dtype)
            else:  # scales (and int4 zero points)
                t = (torch.rand(shape, device="cuda") * 1e-2).to(dtype)
            secs[sname] = t
    return StackedExperts(scheme, secs)


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (the HBM ceiling)."""
    a = torch.empty(1 << 28, device="cuda")  # 1 GiB
    b = torch.empty_like(a)
    ms = do_bench(lambda: b.copy_(a), warmup=50, rep=300, return_mode="median")
    return 2 * a.numel() * 4 / (ms * 1e-3)


def graph_ms(fn, n_calls: int) -> float:
    """Median ms of one call, from a CUDA graph of n_calls calls (L2 flushed per replay)."""
    g = capture_graph(fn)
    return do_bench(g.replay, warmup=25, rep=200, return_mode="median") / n_calls


def routing(T: int, E: int, K: int, gen):
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).cuda()
    w = torch.softmax(torch.randn(T, K, generator=gen), -1).cuda()
    return ids, w


def dense_bf16(x, w_all, ex: StackedExperts):
    """Read-all-experts in torch: every expert's FFN for the token, weighted by a dense [E] gate."""
    w13, w2 = ex.sections["w13.q"], ex.sections["w2.q"]  # [E, 2I, D], [E, D, I]
    gu = torch.matmul(w13, x[0])  # [E, 2I]
    g, u = gu.chunk(2, -1)
    y = torch.matmul(w2, (F.silu(g) * u)[..., None])[..., 0]  # [E, D]
    return (w_all[:, None] * y).sum(0, keepdim=True)


def bench_one(model, quant, D, I, E, K, layers, bw, gen, tokens) -> list[dict]:
    exs = [random_layer(quant, D, I, E) for _ in range(layers)]
    eb = exs[0].expert_bytes()
    rows = []
    for T in tokens:
        x = torch.randn(T, D, generator=gen).cuda().bfloat16()
        y = torch.empty_like(x)
        routes = [routing(T, E, K, gen) for _ in range(layers)]
        unique = sum(len(set(r[0].flatten().tolist())) for r in routes) / layers
        routed_bytes = unique * eb
        roof_ms = routed_bytes / bw * 1e3
        times = {}
        d = default(tiles_of(quant), D, I)
        more = [] if tiles_of(quant) in (*ROW_QUANTS, *KQUANTS) else [replace(d, fused=True)]
        for cfg in sweep(quant, D, I) if T == 1 else [d, *more]:
            if check_shapes(tiles_of(quant), D, I, group_of(quant), cfg):
                continue

            def step(cfg=cfg):
                for ex, (ids, w) in zip(exs, routes):
                    moe_decode(x, ids, w, ex, cfg, out=y)

            times[cfg] = graph_ms(step, layers)
        chk = torch.empty(T * K * 64, device="cuda", dtype=torch.int32)

        def read_all_layers():
            for ex, (ids, _) in zip(exs, routes):
                read_routed(ex, ids, chk)

        read_ms = graph_ms(read_all_layers, layers)
        # A device copy of the routed bytes (each layer its own buffers): what one launch of
        # this size reaches, reading and writing, against the 1 GiB copy that sets the roofline.
        n = int(routed_bytes) // 16 * 16
        bufs = [(torch.empty(n, dtype=torch.uint8, device="cuda"),
                 torch.empty(n, dtype=torch.uint8, device="cuda")) for _ in range(layers)]  # fmt: skip

        def copy_layers():
            for src, dst in bufs:
                dst.copy_(src)

        copy_ms = graph_ms(copy_layers, layers)
        bufs.clear()
        best = min(times, key=times.get)
        ms = times[d] if d in times else times[best]
        ids0, w0 = routes[0]
        eager = do_bench(lambda: moe_decode(x, ids0, w0, exs[0]), warmup=25, rep=100,
                         return_mode="median")  # fmt: skip
        row = {
            "bench": "gpu_moe", "model": model, "quant": quant, "tokens": T,
            "config": {"D": D, "I": I, "E": E, "K": K, "layers_in_graph": layers},
            "expert_bytes": eb, "routed_bytes": routed_bytes,
            "copy_bw_gbps": bw / 1e9, "roofline_ms": roof_ms,
            "triton_ms": ms, "triton_best_ms": times[best], "best_config": best.__repr__(),
            "sweep_ms": {repr(c): t for c, t in times.items()},
            "triton_eager_ms": eager,
            "read_only_ms": read_ms, "read_only_roofline_fraction": roof_ms / read_ms,
            "copy_same_bytes_ms": copy_ms,
            "copy_same_bytes_fraction_of_copy_bw": 2 * n / bw * 1e3 / copy_ms,
            "roofline_fraction": roof_ms / ms, "roofline_fraction_best": roof_ms / times[best],
            "achieved_gbps": routed_bytes / ms / 1e6,
        }  # fmt: skip
        if T == 1:
            row.update(baselines(x, ids0, w0, exs[0], quant, E, ms))
        rows.append(row)
        print(row, flush=True)
    return rows


def parse_configs(quant: str, D: int, I: int, spec: str) -> list:
    """'bn=4,bk=64;bn=8' -> the default config and one override of it per ';' item (ints; 0/1 for
    the flags)."""
    base = default(tiles_of(quant), D, I)
    return [base] + [override(base, item) for item in filter(None, spec.split(";"))]


def sweep_only(model, quant, D, I, E, K, layers, bw, gen, cfgs) -> dict:
    """One token: the layer time of each config (no references), printed as it is measured."""
    exs = [random_layer(quant, D, I, E) for _ in range(layers)]
    x = torch.randn(1, D, generator=gen).cuda().bfloat16()
    y = torch.empty_like(x)
    routes = [routing(1, E, K, gen) for _ in range(layers)]
    routed_bytes = K * exs[0].expert_bytes()
    roof_ms = routed_bytes / bw * 1e3
    d = cfgs[0]
    floor = launch_floor(layers, ((K, I // d.bn, d.split), (K, D // d.bn_d)))
    net_ms = roof_ms + floor["two_launches_layer_grids_us"] * 1e-3
    print(f"{model} launch floor (us per layer): {floor}; roofline {roof_ms * 1e3:.1f} us, "
          f"roofline + two empty launches {net_ms * 1e3:.1f} us", flush=True)  # fmt: skip
    runs: dict[str, list[float]] = {}  # a config given twice (an interleaved repeat): both times
    for cfg in cfgs:
        if check_shapes(tiles_of(quant), D, I, group_of(quant), cfg):
            continue

        def step(cfg=cfg):
            for ex, (ids, w) in zip(exs, routes):
                moe_decode(x, ids, w, ex, cfg, out=y)

        try:
            t = graph_ms(step, layers)
        except Exception as exc:  # a tile the compiler refuses: report it, time the rest
            print(f"{model} {quant} {cfg}: {type(exc).__name__}: {exc}", flush=True)
            continue
        runs.setdefault(repr(cfg), []).append(t)
        print(f"{model} {quant} {t * 1e3:6.1f} us {roof_ms / t:5.2f} of roofline, "
              f"{routed_bytes / (t - floor['two_launches_layer_grids_us'] * 1e-3) / 1e6:5.0f} GB/s "
              f"net of the launch floor {cfg}", flush=True)  # fmt: skip
    times = {c: statistics.median(ts) for c, ts in runs.items()}
    return {
        "bench": "gpu_moe_sweep", "model": model, "quant": quant, "tokens": 1,
        "config": {"D": D, "I": I, "E": E, "K": K, "layers_in_graph": layers},
        "routed_bytes": routed_bytes, "copy_bw_gbps": bw / 1e9, "roofline_ms": roof_ms,
        "sweep_ms": times, "sweep_ms_all": runs,  # medians, and every repeat's time
        "sweep_roofline_fraction": {c: roof_ms / t for c, t in times.items()},
        "launch_floor": floor,
        "sweep_gbps_net_of_launch_floor": {
            c: routed_bytes / (t - floor["two_launches_layer_grids_us"] * 1e-3) / 1e6
            for c, t in times.items()},
    }  # fmt: skip


def moe_loop_ref(x, ids, weights, ex: StackedExperts) -> torch.Tensor:
    """Per-expert torch loop for one token (baseline b): dequantize each routed expert, two
    F.linear, weighted sum. Reads the ids on the host (one sync)."""
    g = ex.scheme.group_size
    out = torch.zeros_like(x)
    for e, w in zip(ids[0].tolist(), weights[0]):
        sec = ex.expert(e)
        w13, w2 = dequantize(sec, "w13", g, x.dtype), dequantize(sec, "w2", g, x.dtype)
        out += expert_ffn(x, w13, w2) * w
    return out


def baselines(x, ids, w, ex, quant, E, ms) -> dict:
    """(a) all experts read (same kernel; torch bmm for bf16), (b) per-expert torch loop."""
    all_ids = torch.arange(E, device="cuda")[None]
    w_all = torch.zeros(1, E, device="cuda")
    w_all[0, ids[0]] = w[0]
    # every expert as a slot of the one token, same kernels and tiles
    cfg = default(tiles_of(quant), ex.hidden, ex.inter)
    dense_ms = graph_ms(lambda: moe_decode(x, all_ids, w_all, ex, cfg), 1)
    loop_ms = do_bench(lambda: moe_loop_ref(x, ids, w, ex), warmup=5, rep=50, return_mode="median")
    out = {
        "dense_same_kernel_ms": dense_ms, "speedup_vs_dense": dense_ms / ms,
        "loop_ms": loop_ms, "speedup_vs_loop": loop_ms / ms,
    }  # fmt: skip
    if quant == "bf16":
        t = do_bench(lambda: dense_bf16(x, w_all[0], ex), warmup=10, rep=50, return_mode="median")
        out.update(dense_torch_ms=t, speedup_vs_dense_torch=t / ms)
    return out


def to_row(r: dict, commit: str | None) -> dict:
    """A measurement -> the common row: its model, quant, tokens and shape are the config."""
    r = dict(r)
    config = {k: r.pop(k) for k in ("model", "quant", "tokens")} | r.pop("config")
    return bench_row(r.pop("bench"), config, r, commit)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="append JSON rows here")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--quant", nargs="+", default=["int8", "int4", "bf16"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 4, 8])
    ap.add_argument("--commit", default=None, help="source commit when the tree has no .git")
    ap.add_argument("--configs", default=None,
                    help="one token only, no references: the default config and these overrides "
                    "of it, e.g. 'bn=4,bk=64;bn_d=32,warps_d=2'")  # fmt: skip
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    bw = copy_bandwidth()
    hw = hardware()
    rows = []
    if args.configs is not None:
        for model, (D, I, E, K) in MODELS.items():
            for quant in args.quant:
                cfgs = parse_configs(quant, D, I, args.configs)
                rows.append(sweep_only(model, quant, D, I, E, K, args.layers, bw, gen, cfgs))
                torch.cuda.empty_cache()
                # written as each model is done: a time limit keeps them
                write_rows(args.out, [to_row(rows[-1], args.commit)])
        return
    for model, (D, I, E, K) in MODELS.items():
        for quant in args.quant:
            rows += bench_one(model, quant, D, I, E, K, args.layers, bw, gen, args.tokens)
            torch.cuda.empty_cache()
    write_rows(args.out, [to_row(r, args.commit) for r in rows])
    print(f"\ncopy bandwidth {bw / 1e9:.0f} GB/s ({hw.get('gpu')})")
    print(f"{'model':16} {'q':5} {'T':>2} {'MB':>6} {'us':>7} {'best':>7} {'roof':>5} "
          f"{'read':>6} {'copy':>5} {'eager':>7} {'dense':>7} {'xdense':>6} {'loop':>8} {'xloop':>6} {'GB/s':>5}")  # fmt: skip
    for r in rows:
        print(
            f"{r['model']:16} {r['quant']:5} {r['tokens']:>2} {r['routed_bytes'] / 1e6:6.1f} "
            f"{r['triton_ms'] * 1e3:7.1f} {r['triton_best_ms'] * 1e3:7.1f} "
            f"{r['roofline_fraction']:5.2f} {r['read_only_roofline_fraction']:6.2f} "
            f"{r['copy_same_bytes_fraction_of_copy_bw']:5.2f} "
            f"{r['triton_eager_ms'] * 1e3:7.1f} "
            f"{r.get('dense_same_kernel_ms', 0) * 1e3:7.1f} {r.get('speedup_vs_dense', 0):6.1f} "
            f"{r.get('loop_ms', 0) * 1e3:8.1f} {r.get('speedup_vs_loop', 0):6.1f} "
            f"{r['achieved_gbps']:5.0f}"
        )


if __name__ == "__main__":
    main()
