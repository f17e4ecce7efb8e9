"""The decode ablations of benchmarks/ablations/triton_decode.py (one persistent launch per layer,
the L2 prefetch of w2, per-step int4 row sums, the chain sums) against the product kernels and the float64 spec,
with the helpers and tolerances of test_triton_kernels.py. The fused-vs-two-launch check is not
marked cuda: it runs in the interpreter without a GPU (equal bits) and compiled on one.
conftest.py puts benchmarks/ on the path."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_triton_kernels import CASES, CUDA, TOL, _check, _layer, _routing, needs_triton

from moestream.kernels.triton.layout import ROW_QUANTS, moe_stacked_ref, quantize_stacked
from moestream.quant import make_scheme

QUANTS = ["bf16", "int8", "int4"]  # the ablations run the store layouts (not the pool's int4 rows)


@needs_triton
@pytest.mark.skipif(CUDA, reason="compiled kernels are tested by the cuda tests")
@pytest.mark.parametrize("quant", QUANTS)
def test_row_sums_per_step_interpreter(quant):
    """elem=False (int4: rows summed per K step; bf16/int8 ignore it) with a D split."""
    from ablations.triton_decode import AblationConfig, moe_decode

    bn = 64 if quant == "int4" else 8
    cfg = AblationConfig(bn=bn, bk=32, split=2, bn_d=bn, bk_d=32, elem=False)
    _check(moe_decode, quant, 4, 64, 64, 2, 2, torch.float32, "cpu", seed=2, cfg=cfg)


@needs_triton
@pytest.mark.skipif(CUDA, reason="compiled kernels are tested by the cuda tests")
def test_chain_interpreter():
    """chain=True (a 32-block's products summed by one chain of fused multiply-adds) with and
    without half, on q4_0 (CI time: the row layouts share the chain); refused for the other
    layouts and with the tensor cores."""
    from ablations.triton_decode import AblationConfig, check_shapes, moe_decode

    for half in (True, False):
        cfg = AblationConfig(bn=8, bk=64, bn_d=8, bk_d=32, half=half, chain=True)
        _check(moe_decode, "q4_0", 4, 64, 64, 2, 2, torch.float32, "cpu", seed=7, cfg=cfg)
    # the hook runs: the chain's sums round in another order than the tree's
    gen = torch.Generator().manual_seed(8)
    ex = _layer("q4_0", 4, 64, 64, "cpu", gen)
    x = torch.randn(2, 64, generator=gen)
    ids, w = _routing(2, 4, 2, "cpu", gen)
    tree = moe_decode(x, ids, w, ex, replace(cfg, chain=False)).clone()
    assert not torch.equal(moe_decode(x, ids, w, ex, cfg), tree)
    assert "chain" in check_shapes("int8", 64, 64, 32, AblationConfig(chain=True))
    assert (
        check_shapes("q4_0", 64, 64, 32, AblationConfig(bk=64, bn_d=8, bk_d=32, chain=True)) is None
    )
    with pytest.raises(AssertionError, match="chain"):
        AblationConfig(chain=True, mma=True)


# fp32 with chain=True: a chain adds a block's 32 products in sequence (error ~ n eps, a tree's
# ~ log n eps), on top of half's offset cancellation (256 sum f x - 136 sum x): 1.007e-5 measured
# on q4_0 at T=3 (H200, d2c6d4e), 1.07e-5 one launch at T=1 (H100, 6110eb2), so twice the tree
# kernels' bound
CHAIN_TOL = {torch.float32: 2e-5, torch.bfloat16: TOL[torch.bfloat16]}


@pytest.mark.cuda
@pytest.mark.parametrize("quant", ROW_QUANTS)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("T", [1, 3])
def test_decode_chain_cuda(quant, case, T):
    """The row layouts with chain=True against the float64 spec, the default tiles otherwise."""
    from ablations.triton_decode import default, moe_decode

    from moestream.kernels.triton.decode import fit_config

    (E, D, I, K), dtype = case
    cfg = replace(fit_config(quant, D, I, 32, default(quant, D, I, "NVIDIA H200")), chain=True)
    _check(moe_decode, quant, E, D, I, T, K, dtype, "cuda", seed=500 + T, cfg=cfg, tol=CHAIN_TOL)


@needs_triton
@pytest.mark.parametrize("quant", [*QUANTS, "int4r", "q4_0"])
@pytest.mark.parametrize("mma", [False, True])
def test_fused_layer_gives_the_two_launch_bits(quant, mma):
    """One persistent launch per layer (fused=True: work items taken from a counter, down items
    waiting on their pair's gate/up items) computes the two-launch path's items: combined (T=3)
    and as pair rows (T=1, combine=False), with a D split; a second call reuses the reset
    counters. Interpreter (one program): equal bits. CUDA (as many programs as the GPU holds, a
    Qwen3-30B-A3B layer's D and I): within the tolerance of the two-launch result, not bit for
    bit: on the H200 the int8 and int4-mma bits differed (int8's down items run with the gate/up
    warps, so their sums reduce in another order), so a run must not mix the paths."""
    from ablations.triton_decode import MMA_CONFIGS, default, moe_decode

    from moestream.kernels.triton.decode import fit_config

    if quant in ROW_QUANTS and mma:
        pytest.skip("the row layouts run on CUDA cores only")
    device, dtype = ("cuda", torch.bfloat16) if CUDA else ("cpu", torch.float32)
    E, D, I, K = (16, 2048, 768, 8) if CUDA else (5, 64, 64, 2)
    base = MMA_CONFIGS[quant] if mma else default(quant, D, I)
    bk = min(base.bk, 512 if CUDA else 32)
    # the row layouts with chain (the tiles' half as they set it; on the CPU 16
    # rows a program: the interpreter runs programs one by one)
    rows = {} if CUDA or quant not in ROW_QUANTS else dict(bn=16, bn_d=16)
    cfg = replace(base, split=2, bk=bk, chain=quant in ROW_QUANTS, **rows)
    cfg = fit_config(quant, D, I, 32, cfg)
    gen = torch.Generator().manual_seed(40 + mma)
    ex = _layer(quant, E, D, I, device, gen)
    # the third call reuses the reset counters (one token on the CPU: CI time)
    for T, combine in ((3, True), (1, False), (3 if CUDA else 1, True)):
        x = torch.randn(T, D, generator=gen).to(device=device, dtype=dtype)
        ids, w = _routing(T, E, K, device, gen)
        want = moe_decode(x, ids, w, ex, cfg, combine=combine).clone().double()
        got = moe_decode(x, ids, w, ex, replace(cfg, fused=True), combine=combine).clone().double()
        if CUDA:
            err = ((got - want).norm() / want.norm()).item()
            assert err <= TOL[dtype], f"T={T} combine={combine}: {err:.2e}"
        else:
            assert torch.equal(got, want), f"T={T} combine={combine}"
        if combine:
            ref = moe_stacked_ref(x.double(), ids, w.double(), ex)
            err = ((got - ref).norm() / ref.norm()).item()
            assert err <= TOL[dtype], err


@pytest.mark.cuda
@pytest.mark.parametrize("quant", [*QUANTS, "int4r", "q4_0"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("T", [1, 3, 8])
def test_fused_decode_cuda(quant, case, T):
    """The default tiles as one persistent launch (work counter), each case twice, so the second
    call reuses the counters the first one reset (the row layouts with chain)."""
    from ablations.triton_decode import default, moe_decode

    from moestream.kernels.triton.decode import fit_config

    (E, D, I, K), dtype = case
    cfg = replace(fit_config(quant, D, I, 32, default(quant, D, I)), fused=True)
    cfg = replace(cfg, chain=quant in ROW_QUANTS)  # the row layouts: with chain
    tol = CHAIN_TOL if cfg.chain else TOL
    for seed in range(2):
        _check(moe_decode, quant, E, D, I, T, K, dtype, "cuda", seed=100 * seed + T, cfg=cfg,
               tol=tol)  # fmt: skip


@pytest.mark.cuda
@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("elem", [False, True])
@pytest.mark.parametrize("split", [1, 2, 4])
def test_decode_variants_cuda(quant, elem, split):
    """Accumulation orders, D splits, no prefetch / no PDL (the benchmark's sweep) at the
    Qwen3-30B D, I; each config twice, so the counters reset by the last programs are reused."""
    from ablations.triton_decode import AblationConfig, moe_decode

    bn = 64 if quant == "int4" else 8
    for prefetch in (False, True):
        cfg = AblationConfig(bn=bn, bk=64 if quant == "int4" else 256, split=split,
                             bn_d=64 if quant == "int4" else 16,
                             bk_d=64 if quant == "int4" else 128, elem=elem, prefetch=prefetch,
                             pdl=prefetch)  # fmt: skip
        for T in (1, 2):
            _check(moe_decode, quant, 16, 2048, 768, T, 8, torch.bfloat16, "cuda", seed=5 + T,
                   cfg=cfg)  # fmt: skip


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequant_rows_equals_the_spec(dtype):
    """benchmarks/ablations/prefill_grouped.py: the int4 rows dequantized by the Triton launch
    equal kernels/ref.py's dequantize of every expert bit for bit (a partial row block: N = 24 of
    BN = 16; two groups a K block), both weights."""
    from ablations.prefill_grouped import dequant_rows, dequant_rows_ref

    device = "cuda" if CUDA else "cpu"
    ex = _layer("int4r", 3, 128, 64, device, torch.Generator().manual_seed(5))
    for name in ("w13", "w2"):
        got = dequant_rows(ex, name, dtype, bk=64)
        want = dequant_rows_ref(ex, name, dtype)
        assert got.shape == want.shape and torch.equal(got.cpu(), want.cpu()), name
        # src: out[c] is expert src[c]; -1 entries are neither read nor written
        src = torch.tensor([2, 0, -1], dtype=torch.int32, device=device)
        part = dequant_rows(ex, name, dtype, bk=64, src=src)
        assert torch.equal(part[:2].cpu(), want[[2, 0]].cpu()), name


@needs_triton
@pytest.mark.parametrize("quant", ["int4r", "bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemm_prefill_matches_the_spec(quant, dtype):
    """The dequantize-then-grouped-GEMM prefill against the float64 spec (the tolerance of the
    product kernels), experts that no token routes to included (E = 16 > T * K / 2), and its
    result within rounding of prefill.moe_prefill's on the same layer (CPU: torch's grouped-GEMM
    loop, the Triton kernels in fp32, as test_prefill_interpreter; CUDA: CUTLASS, bf16 only)."""
    from ablations.prefill_grouped import moe_prefill_grouped

    from moestream.kernels.triton.prefill import moe_prefill

    if CUDA and dtype == torch.float32:
        pytest.skip("torch._grouped_mm takes bf16 on CUDA")
    device = "cuda" if CUDA else "cpu"
    from moestream.kernels.triton.grouped import moe_grouped

    _check(moe_prefill_grouped, quant, 16, 128, 64, 5, 2, dtype, device, seed=7)  # asserts
    if quant == "int4r":  # the product's: the routed experts only
        _check(moe_grouped, quant, 16, 128, 64, 5, 2, dtype, device, seed=7)
    if not CUDA and dtype != torch.float32:
        return
    gen = torch.Generator().manual_seed(8)
    ex = _layer(quant, 16, 128, 64, device, gen)
    x = torch.randn(5, 128, generator=gen).to(device=device, dtype=dtype)
    ids, weights = _routing(5, 16, 2, device, gen)
    a, b = moe_prefill_grouped(x, ids, weights, ex), moe_prefill(x, ids, weights, ex)
    torch.testing.assert_close(a.float(), b.float(), rtol=TOL[dtype], atol=TOL[dtype])


@needs_triton
def test_the_grouped_prefill_benchmark_dry_run(tmp_path):
    """benchmarks/ablations/bench_prefill_grouped.py --dry-run: a tiny int4 rows layer through
    both prefill paths on the CPU (the script asserts they agree), one row per variant."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parents[1]
    out = tmp_path / "rows.jsonl"
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    r = subprocess.run([sys.executable, str(root / "benchmarks/ablations/bench_prefill_grouped.py"),
                        "--dry-run", "--out", str(out)], env={**os.environ, "PYTHONPATH": path},
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [x["variant"] for x in rows] == ["triton", "grouped_mm", "grouped_all", "dequant",
                                            "gemms", "triton_bf16"]  # fmt: skip
    assert all(x["bench"] == "prefill_grouped" and x["config"]["dry_run"] for x in rows)
    assert all(x["us_per_layer"] > 0 and x["rel_diff_vs_triton"] < 1e-5 for x in rows)


@pytest.mark.cuda
def test_grouped_mm_rows_do_not_depend_on_the_call_cuda():
    """torch._grouped_mm (CUTLASS on sm_90) picks its tile config per call from the average group
    size (rows / groups <= 128: 64x128x128 ping-pong, else 128x256x64 cooperative). A prompt's
    pool path runs chunks of a layer's experts, so a group's rows must come out with the same
    bits whatever else is in the call: fewer groups, other groups empty, rows past the last
    group, and the average on either side of 128. This records which calls differ."""
    torch.manual_seed(0)
    D, N, E = 2048, 1536, 16
    b = (torch.randn(E, N, D, device="cuda") / D**0.5).to(torch.bfloat16)
    sizes = torch.tensor([40, 0, 200, 7, 300, 1, 64, 129, 0, 33, 250, 16, 5, 90, 400, 12])
    a = torch.randn(int(sizes.sum()), D, device="cuda").to(torch.bfloat16)
    ends = torch.cumsum(sizes, 0)
    starts = ends - sizes
    full = torch._grouped_mm(a, b.transpose(1, 2), offs=ends.to(torch.int32).cuda())
    differ = {}
    for case in ("alone", "alone_padded_large", "subset_other_empty", "first_groups_only"):
        for g in range(E):
            n = int(sizes[g])
            if n == 0:
                continue
            rows = a[starts[g] : ends[g]]
            if case == "alone":  # one group, few rows: the small config
                got = torch._grouped_mm(rows, b[g : g + 1].transpose(1, 2),
                                        offs=torch.tensor([n], dtype=torch.int32, device="cuda"))  # fmt: skip
            elif case == "alone_padded_large":  # rows past the group: an average above 128
                pad = torch.zeros(n + 1024, D, device="cuda", dtype=a.dtype)
                pad[:n] = rows
                got = torch._grouped_mm(pad, b[g : g + 1].transpose(1, 2),
                                        offs=torch.tensor([n], dtype=torch.int32, device="cuda"))[:n]  # fmt: skip
            elif case == "subset_other_empty":  # all E groups given, only g has rows
                offs = torch.where(torch.arange(E) >= g, n, 0).to(torch.int32).cuda()
                got = torch._grouped_mm(rows, b.transpose(1, 2), offs=offs)
            else:  # "first_groups_only": the groups up to g, in a call of g + 1 groups
                m = int(ends[g])
                got = torch._grouped_mm(a[:m], b[: g + 1].transpose(1, 2),
                                        offs=ends[: g + 1].to(torch.int32).cuda())[int(starts[g]) :]  # fmt: skip
            want = full[starts[g] : ends[g]]
            if not torch.equal(got, want):
                differ.setdefault(case, []).append(
                    (g, n, (got.float() - want.float()).abs().max().item()))  # fmt: skip
    assert not differ, f"rows differ by call: {differ}"


# ---- int8 activations (ablations/decode_q8.py: int4 rows, dp4a) -------------------------------
def _q8_case(G, E, D, I, T, K, device, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * I, D, generator=gen) / D**0.5
    w2 = torch.randn(E, D, I, generator=gen) / I**0.5
    ex = quantize_stacked(make_scheme("int4", G), w13.to(device), w2.to(device)).to_rows()
    x = torch.randn(T, D, generator=gen).to(device=device, dtype=dtype)
    ids, w = _routing(T, E, K, device, gen)
    return ex, x, ids, w


def _q8_errors(ex, x, ids, w, G, cfg):
    """(error against the q8 spec, against the exact float64 spec) of one decode_q8 call."""
    from ablations.decode_q8 import moe_decode, moe_int4_q8_ref

    if x.is_cuda:
        torch.full((64 << 20,), float("nan"), device=x.device)  # freed: the next buffers hold NaN
    out = torch.full(x.shape, float("nan"), device=x.device, dtype=x.dtype)
    got = moe_decode(x, ids, w, ex, cfg, out=out).double().cpu()
    assert torch.isfinite(got).all(), "output not fully written"
    secs = [[{k: v.cpu() for k, v in ex.expert(int(e)).items()} for e in row] for row in ids.cpu()]
    spec = moe_int4_q8_ref(x.cpu(), secs, w.cpu(), G).double()
    exact = moe_stacked_ref(x.double(), ids, w.double(), ex).cpu()
    return (
        ((got - spec).norm() / spec.norm()).item(),
        ((got - exact).norm() / exact.norm()).item(),
    )


@needs_triton
def test_q8_activation_blocks_are_the_spec_bits():
    """decode_q8's quantization of a row gives ref.quantize_act's q and d bit for bit (and the
    blocks' sums of q), zero blocks included."""
    from ablations.decode_q8 import quantize_rows

    from moestream.kernels.ref import quantize_act

    device = "cuda" if CUDA else "cpu"
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(3, 96, generator=gen) * 3
    x[1, 32:64] = 0.0
    x[2, :4] = torch.tensor([127.5, -0.5, 1.5, 2.5]) / 127.5 * 3  # ties at d = amax / 127
    q, d, s = quantize_rows(x.to(device))
    want_q, want_d = quantize_act(x, 32, 127)
    assert torch.equal(q.view(3, 3, 32).float().cpu(), want_q)
    assert torch.equal(d.view(3, 3).cpu(), want_d)
    assert torch.equal(s.view(3, 3).float().cpu(), want_q.sum(-1))


@needs_triton
@pytest.mark.skipif(CUDA, reason="compiled kernels are tested by the cuda tests")
@pytest.mark.parametrize("G", [32, 64])
def test_decode_q8_interpreter(G):
    """int8 activations: the kernels equal their spec to fp32 rounding (D split at G = 32),
    and stay within the activations' quantization error of the exact result."""
    from moestream.kernels.triton.decode import DecodeConfig

    ex, x, ids, w = _q8_case(G, 3, 128, 64 if G == 32 else 128, 2 if G == 32 else 1, 2, "cpu",
                             torch.float32, 7)  # fmt: skip
    for split in (2,) if G == 32 else (1,):  # CI time: each case once
        cfg = DecodeConfig(bn=8, bk=64, split=split, bn_d=8, bk_d=G)
        to_spec, to_exact = _q8_errors(ex, x, ids, w, G, cfg)
        assert to_spec <= 1e-6, to_spec
        assert to_exact <= 3e-2, to_exact


def test_q8_needs_int4_rows():
    from ablations.decode_q8 import unsupported

    from moestream.kernels.triton.decode import DecodeConfig

    cfg = DecodeConfig(bn=8, bk=64, bn_d=8, bk_d=64)
    assert "int4 rows" in unsupported("int8", cfg)
    assert unsupported("int4r", cfg) is None


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("G", [32, 64])
@pytest.mark.parametrize("T", [1, 3])
def test_decode_q8_cuda(G, T):
    """Compiled (dp4a, PDL between the four launches): the q8 spec to fp32 rounding before
    the bf16 output, at the default tiles and a split of D; and graph replays give the same bits."""
    from ablations.decode_q8 import moe_decode

    from moestream.kernels.triton.decode import DecodeConfig, default_config

    ex, x, ids, w = _q8_case(G, 16, 2048, 768, T, 8, "cuda", torch.bfloat16, 9 + T)
    base = default_config("int4r", 2048, 768, G, torch.cuda.get_device_name())
    for cfg in (base, DecodeConfig(bn=8, bk=512, split=2, bn_d=8, bk_d=256)):
        to_spec, to_exact = _q8_errors(ex, x, ids, w, G, cfg)
        assert to_spec <= TOL[torch.bfloat16], (cfg, to_spec)
        assert to_exact <= 3e-2, (cfg, to_exact)
    cfg = base
    out = torch.empty_like(x)
    moe_decode(x, ids, w, ex, cfg, out=out)
    torch.cuda.synchronize()
    eager = out.clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        moe_decode(x, ids, w, ex, cfg, out=out)
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
