"""Ablation: a MoE layer's residual add, post-attention norm and router in one launch, against the
product's two (kernels/triton/norm.py `add_rms_norm_rows`, then kernels/triton/router.py
`route_decode`). Off the product path until it is measured.

Why: a resident decode token runs 31.5 norm launches of ~1.7 us each on the H200 (aa2dad0
profile), 16 of them the add + norm right before a router, whose own launch reads the norm's
output. Here every router program (one router row, one warp, as `route_decode`) computes the
residual sum and the norm itself, from the same inputs (12 KB more loads a program, the same for all),
and program 0 stores the sum and the norm for the residual stream and the experts; the last
program to finish routes, as `route_decode`. Expected: one launch and its drain fewer a layer,
~1-2 us (~2-4% of a resident token, ~1% of a 50% one); the PDL chain's result (no shorter
step, docs/gpu.md) says gaps between captured kernels are small, so the measurement decides.

Numerics: the sum is torch's x + y rounded to the activation dtype, as the product's; the norm
takes `_norm_row`'s roundings but sums the squares in BK chunks on one warp where the product's
norm sums one block on 4 warps, so a row may differ in the last bit (the product's norm already
differs from torch's that way); the logits are the router's arithmetic over that norm. The test
(tests/test_ablation_norm_router.py) and every run check: the sum bit for bit, the norm within
one unit in the last place, the same experts, the weights within the router's tolerance.

    python benchmarks/ablations/norm_router.py --out rows.jsonl --commit C
    python benchmarks/ablations/norm_router.py --dry-run   # CPU: a tiny shape, the interpreter
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (experts, hidden, top-k, renormalised)
SHAPES = {"Qwen3-30B-A3B": (128, 2048, 8, True), "Qwen3.5-35B-A3B": (256, 2048, 8, True)}
DRY_SHAPES = {"tiny": (16, 64, 2, True)}
# a graph replays this many layers' chains, each reading the last one's sum; their router
# weights (8-16 MB) stay in L2 across replays, for both variants alike (a step reads them from
# HBM: the same bytes either way, so the difference is the launch and the norm's own work)
LAYERS = 16
EPS = 1e-6


def _kernel():
    """The fused kernel, defined on first use (the dry run sets TRITON_INTERPRET first); the
    names its body reads are this module's globals, where Triton looks them up."""
    global tl, triton, _route_row
    import triton
    import triton.language as tl

    from moestream.kernels.triton.router import _route_row

    @triton.jit
    def _add_norm_route_kernel(x_ptr, y_ptr, nw_ptr, g_ptr, sum_ptr, h_ptr, logit_ptr, cnt_ptr,
                               w_ptr, ids_ptr, E, eps, T: tl.constexpr, D: tl.constexpr,
                               BK: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                               EP: tl.constexpr, RENORM: tl.constexpr, XDT: tl.constexpr,
                               DT: tl.constexpr):  # fmt: skip
        r = tl.program_id(0)  # this program's router row
        kk = tl.arange(0, BK)
        for t in tl.static_range(T):
            sq = tl.zeros([BK], tl.float32)
            for k0 in tl.range(0, D, BK):  # the sum's squares, chunk by chunk
                x = tl.load(x_ptr + t * D + k0 + kk).to(tl.float32)
                s = (x + tl.load(y_ptr + t * D + k0 + kk).to(tl.float32)).to(XDT).to(tl.float32)
                sq += s * s
            rinv = tl.rsqrt(tl.sum(sq, 0) / D + eps)
            acc = tl.zeros([BK], tl.float32)
            for k0 in tl.range(0, D, BK):  # the norm (_norm_row's roundings) and the logit
                x = tl.load(x_ptr + t * D + k0 + kk).to(tl.float32)
                s = (x + tl.load(y_ptr + t * D + k0 + kk).to(tl.float32)).to(XDT)
                h = (s.to(tl.float32) * rinv).to(XDT).to(tl.float32)
                h = (tl.load(nw_ptr + k0 + kk).to(tl.float32) * h).to(XDT)
                if r == 0:
                    tl.store(sum_ptr + t * D + k0 + kk, s)
                    tl.store(h_ptr + t * D + k0 + kk, h)
                acc += tl.load(g_ptr + r * D + k0 + kk).to(tl.float32) * h.to(tl.float32)
            tl.store(logit_ptr + t * E + r, tl.sum(acc, 0).to(XDT).to(tl.float32))
        tl.debug_barrier()  # every thread's logits are stored before the release below
        if tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
            for t in tl.static_range(T):
                _route_row(logit_ptr, w_ptr, ids_ptr, t, E, K, KP, EP, RENORM, DT, False)
            tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")  # ready for the next call

    return _add_norm_route_kernel


_KERNEL = []


def add_norm_route(x, y, norm_w, gate, k: int, renorm: bool, dtype):
    """x, y [T, D] (T <= 8), norm_w [D] and gate [E, D] in x's dtype -> (s = x + y, the norm of s,
    weights [T, k] in dtype, ids [T, k] int64): one launch of E programs."""
    import torch
    import triton

    from moestream.kernels.triton import kept
    from moestream.kernels.triton.router import _TL, router_block

    if not _KERNEL:
        _KERNEL.append(_kernel())
    T, D = x.shape
    E = gate.shape[0]
    assert T <= 8 and y.shape == x.shape and gate.dtype == norm_w.dtype == y.dtype == x.dtype
    logits, cnt = kept(("norm_router", str(x.device), E), lambda: (
        torch.empty(8, E, device=x.device), torch.zeros(1, device=x.device, dtype=torch.int32)))  # fmt: skip
    s, h = torch.empty_like(x), torch.empty_like(x)
    w = torch.empty(T, k, dtype=dtype, device=x.device)
    ids = torch.empty(T, k, dtype=torch.int64, device=x.device)
    _KERNEL[0][(E,)](x, y, norm_w, gate, s, h, logits, cnt, w, ids, E, EPS, T=T, D=D,
                     BK=router_block(D), K=k, KP=triton.next_power_of_2(k),
                     EP=triton.next_power_of_2(E), RENORM=renorm, XDT=_TL[x.dtype],
                     DT=_TL[dtype], num_warps=1)  # fmt: skip
    return s, h, w, ids


def two_launches(x, y, norm_w, gate, k: int, renorm: bool, dtype):
    """The product's: add_rms_norm_rows, then route_decode_impl on its norm."""
    from moestream.kernels.triton.norm import add_rms_norm_rows
    from moestream.kernels.triton.router import route_decode_impl

    s, h = add_rms_norm_rows(x, y, norm_w, EPS)
    return (s, h, *route_decode_impl(h, gate, k, renorm, dtype))


def agreement(fused, product) -> dict:
    """How the fused launch's outputs compare with the product's (the checks every run asserts:
    the sum bit for bit, the norm within one unit in the last place, the same experts, weights
    within 2^-7)."""
    import torch

    (s, h, w, ids), (s0, h0, w0, ids0) = fused, product
    ulp = (h.float() - h0.float()).abs() / h0.float().abs().clamp_min(1e-30)
    step = (
        2.0**-7 if h.dtype == torch.bfloat16 else 2.0**-10 if h.dtype == torch.float16 else 2.0**-23
    )
    out = {"sum_equal": torch.equal(s, s0), "norm_equal_fraction": (h == h0).float().mean().item(),
           "norm_max_rel": ulp.max().item(), "norm_within_ulp": bool((ulp <= step).all()),
           "ids_equal": torch.equal(ids.sort(-1).values, ids0.sort(-1).values),
           "weights_close": torch.allclose(w.float(), w0.float(), rtol=2**-7, atol=1e-6)}  # fmt: skip
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--reps", type=int, default=50, help="graph replays timed")
    ap.add_argument("--dry-run", action="store_true", help="CPU, interpreter, one tiny shape")
    a = ap.parse_args(argv)
    if a.dry_run:  # before triton is imported: it reads the variable when kernels are decorated
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from common import bench_row, capture_graph, graph_replay_us, write_rows

    cuda = not a.dry_run
    if cuda and not torch.cuda.is_available():
        print("norm_router.py: no CUDA device; --dry-run checks it on the CPU", file=sys.stderr)
        return 2
    # the product's norm takes 16-bit rows: fp16 stands in for bf16 in the interpreter
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float16)
    rows = []
    for name, (E, D, k, renorm) in (SHAPES if cuda else DRY_SHAPES).items():
        gen = torch.Generator().manual_seed(0)
        layers = [((torch.randn(E, D, generator=gen) / D**0.5).to(device, dtype),
                   (1 + 0.1 * torch.randn(D, generator=gen)).to(device, dtype),
                   torch.randn(1, D, generator=gen).to(device, dtype))
                  for _ in range(LAYERS if cuda else 2)]  # fmt: skip
        x0 = torch.randn(1, D, generator=gen).to(device, dtype)
        g, nw, y = layers[0]
        check = agreement(add_norm_route(x0, y, nw, g, k, renorm, dtype),
                          two_launches(x0, y, nw, g, k, renorm, dtype))  # fmt: skip
        assert check["sum_equal"] and check["norm_within_ulp"] and check["ids_equal"], check
        assert check["weights_close"], check
        row = {"shape": name, "experts": E, "hidden": D, "topk": k, "layers": len(layers), **check}
        for label, fn in (("two_launches", two_launches), ("fused", add_norm_route)):

            def chain(fn=fn):  # each layer adds onto the last one's sum, as a step does
                x = x0
                for g, nw, y in layers:
                    x = fn(x, y, nw, g, k, renorm, dtype)[0]

            if cuda:
                graph = capture_graph(chain)  # (runs it once first: Triton compiles outside)
                graph.replay()
                row[f"{label}_us_per_layer"] = graph_replay_us(graph, a.reps, len(layers))
            else:
                chain()
                row[f"{label}_us_per_layer"] = None  # a dry run measures nothing
        if cuda:
            row["fused_over_two"] = row["fused_us_per_layer"] / row["two_launches_us_per_layer"]
            print(f"{name:16} two launches {row['two_launches_us_per_layer']:.2f} us, fused "
                  f"{row['fused_us_per_layer']:.2f} us a layer ({row['fused_over_two']:.3f}x); "
                  f"norm bits equal {row['norm_equal_fraction']:.3f}", flush=True)  # fmt: skip
        else:
            print(f"{name}: dry run, checks passed {check}", flush=True)
        rows.append(row)
    keys = ("shape", "experts", "hidden", "topk", "layers")
    write_rows(a.out, [bench_row("norm_router", {"dry_run": a.dry_run} | {k: r.pop(k) for k in keys},
                                 r, a.commit) for r in rows])  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
