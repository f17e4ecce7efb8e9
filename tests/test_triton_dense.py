"""The quantized dense GEMV (kernels/triton/dense.py) and QuantLinear's "triton" kernel.

The GEMV's outputs are checked against a float64 spec: the stored numbers (q, scales, zeros)
dequantized exactly in float64 times the activations. Bounds: fp32 summation, |err| <= 1e-5 *
sum|w x| (fp32 activations also round each product); bf16 / fp16 outputs add one rounding to the
output dtype. A prompt (more than 8 rows) runs the reference's bits: dequantize + F.linear.
Runs through TRITON_INTERPRET=1 on CPU tensors without a GPU (conftest.py), compiled on CUDA;
`cuda` tests add a CUDA graph capture and the inductor-compiled module.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

try:
    from moestream.kernels.triton import dense as tdense
except ImportError:
    pytest.skip("triton not installed (gpu extra)", allow_module_level=True)

from moestream.kernels.dense import QuantLinear, QuantWeight
from moestream.kernels.ref import dequantize
from moestream.quant import (
    int4_sz_kn,
    int4_to_rows,
    make_scheme,
    quantize,
    unpack_int4,
    unpack_q4_0,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
QUANTS = ["int8", "int4", "q4_0", "int4_rows"]
# (N, K): N off the 64-row block (int4: a short last block of 8, then of 2 rows), K split in two
SHAPES = [(200, 256), (130, 128), (96, 512)]
# The interpreter's bf16 tl.dot is wrong (triton 3.6-3.9; test_triton_kernels.py says so too):
# fp16 stands in for a 16-bit activation there, and bf16 runs on CUDA.
ACT = torch.bfloat16 if DEVICE == "cuda" else torch.float16
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.cuda)]
OUT_ROUND = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def _weight(quant: str, n: int, k: int, seed: int, group: int = 32) -> QuantWeight:
    g = torch.Generator().manual_seed(seed)
    s = make_scheme("int4" if quant == "int4_rows" else quant, group)
    return QuantWeight(s, (n, k), quantize(s, torch.randn(n, k, generator=g) / k**0.5))


def _operands(w: QuantWeight, quant: str):
    """(q, scales) the GEMV of `quant` reads: the sections, or int4's row-major GPU repack."""
    if quant == "int4_rows":
        return int4_to_rows(w.q, w.sz, w.scheme.group_size)
    if w.scheme.name == "int4":  # the store-layout GEMV reads sz in [K/G, N, 2] order
        return w.q, int4_sz_kn(w.sz, w.shape[0])
    return w.q, getattr(w, w.scale_suffix)


def _exact(w: QuantWeight) -> torch.Tensor:
    """The stored weight dequantized in float64 (no rounding; K-quants: ggml's values, whose one
    rounding is part of the format): [N, K]."""
    n, k = w.shape
    if w.scheme.name in ("q4_k", "q5_k", "q6_k"):
        return dequantize(w.sections(), "w", 256, torch.float32).double()
    if w.scheme.name == "int8":
        return (w.q.double().view(n, -1, 32) * w.s.double()[..., None]).view(n, k)
    if w.scheme.name == "q4_0":
        q = unpack_q4_0(w.q).double() - 8
        return (q.view(n, -1, 32) * w.d.double()[..., None]).view(n, k)
    sz = int4_sz_kn(w.sz, n)
    s, z = sz[..., 0].t().double(), sz[..., 1].t().double()  # [N, K/G]
    q = unpack_int4(w.q).double() - 8
    return (q.view(n, s.shape[1], -1) * s[..., None] + z[..., None]).view(n, k)


def _check(got: torch.Tensor, x: torch.Tensor, w: QuantWeight, bias) -> None:
    W = _exact(w).cpu()
    want = x.cpu().double() @ W.t() + (0 if bias is None else bias.cpu().double())
    scale = x.cpu().double().abs() @ W.abs().t() + (0 if bias is None else bias.cpu().abs())
    got = got.cpu().double()
    assert got.shape == want.shape and torch.isfinite(got).all()
    bound = 1e-5 * scale + OUT_ROUND[x.dtype] * want.abs() + 1e-30
    worst = ((got - want).abs() / bound).max().item()
    assert worst <= 1.0, f"error {worst:.2f}x the bound"


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("T", [1, 3, 8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_matches_the_float64_spec(quant, T, dtype):
    for i, (n, k) in enumerate(SHAPES):
        w = _weight(quant, n, k, seed=n + T).to(DEVICE)
        g = torch.Generator().manual_seed(k + T)
        x = torch.randn(T, k, generator=g).to(DEVICE, dtype)
        bias = torch.randn(n, generator=g).to(DEVICE, dtype) if i % 2 == 0 else None
        got = tdense.gemv(x, *_operands(w, quant), bias, quant, n, 32)
        assert got.dtype == dtype
        _check(got, x, w, bias)


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_int4_rows_half_matches_the_float64_spec(T, dtype):
    """GemvConfig.half: the int4 rows' nibbles read as 0.5 + q / 256 (one permute on a GPU, the
    same exact values in the interpreter), the offset folded into the zero term; groups of 32 and
    64, a split K and a folded one."""
    from dataclasses import replace

    if DEVICE == "cpu" and (T == 3) == (dtype == DTYPES[0]):  # CI time: a dtype at one T each
        pytest.skip("the interpreter runs the first dtype at one token, the second at three")
    for i, (n, k) in enumerate(SHAPES):
        for group in (32, 64):
            w = _weight("int4_rows", n, k, seed=n + T + group, group=group).to(DEVICE)
            g = torch.Generator().manual_seed(k + T)
            x = torch.randn(T, k, generator=g).to(DEVICE, dtype)
            bias = torch.randn(n, generator=g).to(DEVICE, dtype) if i % 2 == 0 else None
            rule = tdense.gemv_config("int4_rows", n, k, group, T)
            for cfg in (rule, replace(rule, split=2, fold=True), replace(rule, split=2)):
                cfg = replace(cfg, half=True, bk=min(cfg.bk, k // cfg.split))
                got = tdense.gemv_impl(x, *_operands(w, "int4_rows"), bias, "int4_rows", n, group,
                                       cfg)  # fmt: skip
                _check(got, x, w, bias)


@pytest.mark.parametrize("group", [64, 128])
def test_int4_rows_take_groups_over_32(group):
    """The repack keeps one (scale, zero) word per group: groups of 64 and 128 (two and four
    32-input blocks each) give the spec; under 32 the repack says it cannot."""
    n, k = 96, 512
    w = _weight("int4_rows", n, k, seed=group, group=group).to(DEVICE)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(5)).to(DEVICE, ACT)
    _check(tdense.gemv(x, *_operands(w, "int4_rows"), None, "int4_rows", n, group), x, w, None)
    assert "multiple of 32" in tdense.unsupported("int4_rows", n, k, 16, 1)
    assert not tdense.rows_layout("int4", n, 16) and tdense.rows_layout("int4", n, group)


def test_the_rule_takes_fma_for_one_token_and_splits_k_for_a_small_n_only():
    """One token: the fma kernel, a 2048-row projection on fewer rows per program and split K,
    an output layer on the most rows and unsplit; every split holds whole K steps. More tokens:
    the tensor-core kernel. The sweep's candidates start with the rule's pick."""
    o = tdense.gemv_config("int8", 2048, 4096, 32)
    head = tdense.gemv_config("int4", 151936, 2048, 32)
    assert o.fma and head.fma and o.split > 1 and head.split == 1
    assert o.bn < tdense.gemv_config("int8", 151936, 2048, 32).bn
    for cfg, k in ((o, 4096), (head, 2048)):
        assert (k // cfg.split) % cfg.bk == 0
    assert not tdense.gemv_config("int8", 2048, 4096, 32, 8).fma
    cands = tdense.gemv_candidates("q4_0", 4096, 2048, 32, 1)
    assert cands[0] == tdense.gemv_config("q4_0", 4096, 2048, 32) and len(set(cands)) == len(cands)
    assert {c.fma for c in cands} == {True, False}
    # int4 rows: nibbles read as 0.5 + q / 256 at 4 rows a program (attention), not at 16 (a
    # 32000-row output layer, where it measured slower); the candidates flip it
    assert tdense.gemv_config("int4_rows", 4096, 2048, 32).half
    big = tdense.gemv_config("int4_rows", 32000, 2048, 32)
    assert big.bn == 16 and not big.half and not tdense.gemv_config("int8", 4096, 2048, 32).half
    cands = tdense.gemv_candidates("int4_rows", 4096, 2048, 32, 1)
    assert {c.half for c in cands} == {True, False} and not any(c.half and c.elem for c in cands)


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("T", [1, 3, 8])
def test_every_candidate_config_matches_the_spec(quant, T):
    """The sweep's configs (both kernels, fma at any token count, split K) and fma tiles the rule
    takes only at device shapes (16 rows, 128-input steps split 2), on an N off the row blocks."""
    n, k = 200, 256
    w = _weight(quant, n, k, seed=11 + T).to(DEVICE)
    x = torch.randn(T, k, generator=torch.Generator().manual_seed(T)).to(DEVICE, ACT)
    bias = torch.randn(n).to(DEVICE, ACT)
    q, scales = _operands(w, quant)
    bn = 64 if quant == "int4" else 16
    forced = tdense.GemvConfig(bn=bn, split=2, fma=True, bk=64 if quant == "int4" else 128)
    for cfg in [*tdense.gemv_candidates(quant, n, k, 32, T), forced]:
        _check(tdense.gemv_impl(x, q, scales, bias, quant, n, 32, cfg), x, w, bias)
    if quant != "int4":  # the last split program adds the partials: the sum kernel's bits
        want = tdense.gemv_impl(x, q, scales, bias, quant, n, 32, forced)
        folded = dataclasses.replace(forced, fold=True)
        for _ in range(2):  # the counters are reset by the call that used them
            assert torch.equal(tdense.gemv_impl(x, q, scales, bias, quant, n, 32, folded), want)


def test_the_gemv_says_what_it_does_not_take():
    assert "at most 8" in tdense.unsupported("int8", 64, 64, 32, 9)
    assert "bf16" in tdense.unsupported("bf16", 64, 64, 32, 1)
    assert "group size" in tdense.unsupported("int8", 64, 96, 48, 1)
    assert tdense.unsupported("int4", 64, 64, 32, 8) is None


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quant_linear_runs_the_gemv_for_decode_and_the_reference_for_a_prompt(quant):
    """kernel "triton": <= 8 rows the GEMV's bits (int4: from its row-major repack), more rows
    dequantize + F.linear's (int4: the repack dequantized by one launch, the reference's
    values bit for bit); the module holds the sections (and the bias; int4 the repack, of the
    same size), no dequantized copy."""
    n, k = 160, 128
    w = _weight(quant, n, k, seed=3).to(DEVICE)
    bias = torch.randn(n).to(DEVICE, ACT)
    lin = QuantLinear(w, bias, "triton")
    assert lin.rows_layout == (quant == "int4")
    gq = "int4_rows" if quant == "int4" else quant
    q, scales = _operands(w, gq)
    for T, kind in ((1, "triton"), (8, "triton"), (9, "ref")):
        x = torch.randn(1, T, k).to(DEVICE, ACT)  # [B, T, K]
        assert lin.resolved_kernel(x.device, T) == kind
        got = lin(x)
        assert got.shape == (1, T, n) and got.dtype == ACT
        if kind == "triton":
            want = tdense.gemv_impl(x[0], q, scales, bias, gq, n, 32)
        else:
            want = F.linear(x[0], dequantize(w.sections(), "w", 32, ACT), bias)
        assert torch.equal(got[0], want)
    held = {name for name, _ in lin.named_buffers()}
    rows = {"rows_q", "rows_sz"} if quant == "int4" else set()
    assert held == {"bias", "qweight.q", f"qweight.{w.suffixes[1]}"} | rows
    assert sum(lin.get_buffer(b).nbytes for b in rows) == sum(t.nbytes for t in w.buffers()) * (
        quant == "int4"
    )  # the repack: the sections' size


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_int4_rows_dequantize_to_the_reference_values(group, dtype):
    """kernels/triton/dequant.py: int4 rows -> dtype equal kernels/ref.py's dequantize bit for bit
    (rounded to nearest even), one weight with N off the 16-row block and K of one or more
    launch blocks, and three stacked weights in one launch."""
    from moestream.kernels.triton.dequant import dequant_int4_rows

    for n, k, seed in ((200, 256, 1), (24, 512, 2)):
        w = _weight("int4", n, k, seed, group).to(DEVICE)
        rows, words = int4_to_rows(w.q, w.sz, group)
        want = dequantize(w.sections(), "w", group, dtype)
        assert torch.equal(dequant_int4_rows(rows, words, group, dtype, bk=128), want)
    ws = [_weight("int4", 64, 256, s, group).to(DEVICE) for s in (3, 4, 5)]
    rows, words = int4_to_rows(
        torch.stack([w.q for w in ws]), torch.stack([w.sz for w in ws]), group
    )
    got = dequant_int4_rows(rows, words, group, dtype)
    assert torch.equal(got, torch.stack([dequantize(w.sections(), "w", group, dtype) for w in ws]))


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q4_rows_dequantize_to_the_reference_values(fmt, dtype):
    """The same launch on q4_0's / q4_1's sections (the row bytes as stored, fp16 d, q4_1's fp16
    m: a GPU prompt's grouped GEMMs) equals kernels/ref.py's dequantize bit for bit, stacked and
    routed by `src` (-1: that output left as it was)."""
    from moestream.kernels.triton.dequant import dequant_int4_rows

    ws = [_weight(fmt, 48, 256, s, 32).to(DEVICE) for s in (6, 7, 8)]
    scale = "d" if fmt == "q4_0" else "dm"
    q, d = torch.stack([w.q for w in ws]), torch.stack([getattr(w, scale) for w in ws])
    want = torch.stack([dequantize(w.sections(), "w", 32, dtype) for w in ws])
    assert torch.equal(dequant_int4_rows(q, d, 32, dtype, bk=128, fmt=fmt), want)
    out = torch.full((2, 48, 256), 7.0, dtype=dtype, device=DEVICE)
    src = torch.tensor([2, -1], dtype=torch.int32, device=DEVICE)
    got = dequant_int4_rows(q, d, 32, dtype, out=out, src=src, fmt=fmt)
    assert torch.equal(got[0], want[2]) and (got[1] == 7.0).all()


def _lookups_in_one_launch(monkeypatch, emb, kernel: str, ids, want) -> None:
    """emb(ids) gives `want` by one call of kernels/triton/dequant.py's `kernel`, the reference's
    gather never called; a [T, 1] batch of the ids gives the same rows."""
    from moestream.kernels import dense as kdense
    from moestream.kernels.triton import dequant

    launches = []
    real = getattr(dequant, kernel)
    monkeypatch.setattr(dequant, kernel, lambda *a, **kw: launches.append(1) or real(*a, **kw))
    monkeypatch.setattr(kdense, "dequantize_rows", None)  # called: a TypeError
    assert torch.equal(emb(ids), want) and len(launches) == 1
    assert torch.equal(emb(ids.view(-1, 1)), want.view(-1, 1, want.shape[-1]))
    monkeypatch.undo()


@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_embedding_gathers_int4_rows_in_one_launch(group, dtype, monkeypatch):
    """QuantEmbedding with kernel "triton": an int4 table's rows by one launch from the store's
    64-row blocks (rows in the last, shorter block, repeated ids), the reference's bits; no copy
    of the table is held beside its sections (a row repack was, until 2026-12: ~195 MB at
    Qwen3's vocabulary); launch blocks smaller than a group."""
    from moestream.kernels.dense import QuantEmbedding
    from moestream.kernels.triton.dequant import dequant_table_rows

    w = _weight("int4", 130, 256, 8, group).to(DEVICE)
    ids = torch.tensor([0, 129, 64, 65, 127, 128, 3, 3], device=DEVICE)
    want = dequantize(w.sections(), "w", group, dtype)[ids]
    emb = QuantEmbedding(w, dtype, "triton")
    assert {n for n, _ in emb.named_buffers()} == {"qweight.q", "qweight.sz"}
    _lookups_in_one_launch(monkeypatch, emb, "dequant_table_rows", ids, want)
    assert torch.equal(dequant_table_rows("int4", w.q, w.sz, ids, group, dtype, bk=16), want)
    assert torch.equal(QuantEmbedding(w, dtype, "ref")(ids), want)


def _table(fmt: str, n: int, k: int, seed: int) -> QuantWeight:
    """A [n, k] table in `fmt`: quantized from random floats, or (GGUF's K-quants) random valid
    blocks."""
    if fmt not in ("q4_k", "q5_k", "q6_k"):
        return _weight(fmt, n, k, seed)
    from gguf_models import kquant_blocks

    from moestream.quant import make_scheme

    q = torch.from_numpy(kquant_blocks(fmt, n, k, seed, scale=0.05, centred=fmt != "q6_k"))
    return QuantWeight(make_scheme(fmt), (n, k), {"q": q})


@pytest.mark.parametrize("fmt", ["int4", "int8", "q8_0", "q4_0", "q4_1", "q5_0", "q4_k", "q5_k",
                                 "q6_k"])  # fmt: skip
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_embedding_reads_other_tables_in_one_launch(fmt, dtype, monkeypatch):
    """QuantEmbedding with kernel "triton" and a table in any format it stores but bf16: the
    looked-up rows by one dequant_table_rows launch over the sections as stored (no repack), the
    reference's bits; the reference's gather (9-48 small kernels a row) is not called. K of 768 /
    288: a launch block runs past the row's end (masked), and blocks of 128 split a row in many
    programs."""
    from moestream.kernels.dense import QuantEmbedding
    from moestream.kernels.triton.dequant import dequant_table_rows

    k = 768 if fmt in ("q4_k", "q5_k", "q6_k") else 288
    w = _table(fmt, 70, k, 11).to(DEVICE)
    g = w.scheme.group_size
    ids = torch.tensor([0, 69, 33, 33, 7], device=DEVICE)
    want = dequantize(w.sections(), "w", g, dtype)[ids]
    assert want.isfinite().all() and want.abs().amax() > 0
    emb = QuantEmbedding(w, dtype, "triton")
    assert {n for n, _ in emb.named_buffers()} == {f"qweight.{n}" for n in w.suffixes}
    _lookups_in_one_launch(monkeypatch, emb, "dequant_table_rows", ids, want)
    scales = w.scale_suffix and getattr(w, w.scale_suffix)
    assert torch.equal(dequant_table_rows(fmt, w.q, scales, ids, g, dtype, bk=128), want)
    assert dequant_table_rows(fmt, w.q, scales, ids[:0], g, dtype).shape == (0, k)


def test_q6_k_output_layer_runs_the_int8_gemv_over_its_exact_values():
    """A q6_k weight (the 4-bit rules' output layer) in kernel triton's form (`triton_form`, as
    the loader places it): int8 of group 16 holding its values and steps exactly, the blocks not
    kept; the GEMV within its fp32 bound of the float64 product of the stored values; a prompt
    and a lookup the blocks' own bits (ref); the blocks themselves have no GEMV."""
    from moestream.kernels.dense import QuantEmbedding, triton_form
    from moestream.quant import make_scheme, quantize_q6_k

    n, k = 96, 512
    g = torch.Generator().manual_seed(6)
    blocks = quantize_q6_k(torch.randn(n, k, generator=g) * 0.05)
    w6 = QuantWeight(make_scheme("q6_k"), (n, k), {"q": blocks}).to(DEVICE)
    assert "q6_k weights have no GEMV" in QuantLinear(w6, None, "triton").gemv_unsupported(1)
    w = triton_form(w6)
    assert (w.scheme.name, w.scheme.group_size, w.suffixes) == ("int8", 16, ("q", "s"))
    assert triton_form(w) is w and triton_form(_weight("int4", 64, 64, 1)).scheme.name == "int4"
    bias = torch.randn(n).to(DEVICE, ACT)
    lin = QuantLinear(w, bias, "triton")
    assert lin.gemv_unsupported(1) is None and lin.resolved_kernel(torch.device(DEVICE), 9) == "ref"
    exact = dequantize({"w.q": blocks}, "w", 256, torch.float64)
    assert torch.equal(w.q.cpu().double().view(n, -1, 16) * w.s.cpu().double()[..., None],
                       exact.view(n, -1, 16))  # fmt: skip
    x = torch.randn(1, 3, k).to(DEVICE, ACT)
    got = lin(x)[0].cpu().double()
    want = x[0].cpu().double() @ exact.t() + bias.cpu().double()
    scale = x[0].cpu().double().abs() @ exact.abs().t() + bias.cpu().double().abs()
    assert ((got - want).abs() <= 1e-5 * scale + OUT_ROUND[ACT] * want.abs() + 1e-30).all()
    xp = torch.randn(1, 9, k).to(DEVICE, ACT)
    assert torch.equal(lin(xp)[0], F.linear(xp[0], dequantize(w6.sections(), "w", 256, ACT), bias))
    ids = torch.tensor([95, 0, 7], device=DEVICE)
    rows = dequantize(w6.sections(), "w", 256, ACT)[ids]
    assert torch.equal(QuantEmbedding(w, ACT, "triton")(ids), rows)


@pytest.mark.parametrize("fmt", ["q4_k", "q5_k"])
@pytest.mark.parametrize("T", [3])  # (a program per token: one count covers the grid)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kquant_gemv_matches_the_float64_spec(fmt, T, dtype):
    """A GGUF's Q4_K / Q5_K dense weights (a Q4_K_M file's attention) as stored: QuantLinear's
    kernel "triton" runs the MoE decode kernels' super-block steps as a GEMV for decode (a prompt
    dequantizes), against the float64 spec, with and without a bias, rows in blocks of 4 and of
    2."""
    for i, (n, k) in enumerate(((96, 512), (6, 256))):
        w = _table(fmt, n, k, seed=n + T).to(DEVICE)
        g = torch.Generator().manual_seed(k + T)
        x = torch.randn(T, k, generator=g).to(DEVICE, dtype) / 8
        bias = torch.randn(n, generator=g).to(DEVICE, dtype) if i == 0 else None
        lin = QuantLinear(w, bias, "triton")
        assert lin.resolved_kernel(x.device, T) == "triton"  # the GEMV, as stored
        assert lin.resolved_kernel(x.device, 9) == "ref"
        got = lin(x)
        assert got.dtype == dtype
        _check(got, x, w, bias)
    # a prompt: the blocks dequantized by one launch, the reference's bits (F.linear over them)
    x9 = torch.randn(9, k, generator=g).to(DEVICE, dtype)
    want = F.linear(x9, dequantize(w.sections(), "w", 256, dtype))
    assert torch.equal(lin(x9), want)
    assert "super-blocks" in tdense.unsupported(fmt, 96, 384, 256, 1)


def test_q4_1_dense_weights_run_the_reference_under_triton():
    """The GEMV does not read q4_1 (a GGUF's Q4_1 dense weights kept exactly): kernel "triton"
    says so and runs dequantize + F.linear, the bits of a float layer holding those values."""
    n, k = 96, 128
    w = _weight("q4_1", n, k, seed=4).to(DEVICE)
    lin = QuantLinear(w, None, "triton")
    assert "q4_1 weights have no GEMV" in lin.gemv_unsupported(1)
    x = torch.randn(1, 2, k).to(DEVICE, ACT)
    assert lin.resolved_kernel(x.device, 2) == "ref"
    assert torch.equal(lin(x)[0], F.linear(x[0], dequantize(w.sections(), "w", 32, ACT)))


def test_released_sections_leave_every_path_its_bits():
    """An int4 weight read from its row repack drops its store-layout sections (release_sections,
    as the loader does once q/k/v are fused): the GEMV, a prompt's dequant and a compiled trace
    give the bits they gave with the sections held, the module holds the weight once, and a
    weight without a repack keeps its sections."""
    w = _weight("int4", 96, 256, seed=12).to(DEVICE)
    lin = QuantLinear(w, None, "triton")
    assert lin.rows_layout
    x1, x9 = torch.randn(1, 256).to(DEVICE, ACT), torch.randn(9, 256).to(DEVICE, ACT)
    want1, want9 = lin(x1), lin(x9)
    assert torch.equal(want9, F.linear(x9, dequantize(w.sections(), "w", 32, ACT)))
    held = sum(t.nbytes for t in lin.buffers())
    lin.release_sections()
    assert not list(lin.qweight.buffers()) and sum(t.nbytes for t in lin.buffers()) * 2 == held
    assert torch.equal(lin(x1), want1) and torch.equal(lin(x9), want9)
    torch._dynamo.reset()
    compiled = torch.compile(lin, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x9), want9)
    i8 = QuantLinear(_weight("int8", 96, 256, seed=12), None, "triton")
    i8.release_sections()
    assert len(list(i8.qweight.buffers())) == 2


def test_kernels_other_than_triton_never_take_the_gemv():
    w = _weight("int8", 64, 64, seed=1)
    for kernel in ("native", "cpu", "ref"):
        lin = QuantLinear(w, None, kernel)
        assert lin.resolved_kernel(torch.device("cuda"), 1) == "ref"
        assert "no GEMV" in lin.gemv_unsupported(1)


def test_the_op_traces_as_one_node_under_torch_compile():
    """The custom op's fake gives dynamo the output's shape and dtype: the compiled module has no
    graph break (fullgraph) and returns the eager bits."""
    torch._dynamo.reset()
    w = _weight("int4", 128, 64, seed=2).to(DEVICE)
    lin = QuantLinear(w, None, "triton")
    x = torch.randn(2, 64).to(DEVICE, ACT)
    compiled = torch.compile(lin, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), lin(x))
    torch.library.opcheck(
        tdense.dense_gemv,
        (x, w.q, int4_sz_kn(w.sz, 128), None, "int4", 128, 32),
        test_utils=("test_schema",),
    )


@pytest.mark.cuda
@pytest.mark.parametrize("quant", QUANTS)
def test_cuda_graph_replays_the_gemv(quant):
    """Captured once, replayed on new inputs: the eager call's bits (no host sync, no allocation
    outside the graph's pool)."""
    n, k = 4096, 2048
    w = _weight(quant, n, k, seed=7).cuda()
    q, scales = _operands(w, quant)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    tdense.gemv(x, q, scales, None, quant, n, 32)  # compiles outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = tdense.gemv(x, q, scales, None, quant, n, 32)
    x.copy_(torch.randn(1, k, device="cuda"))
    g.replay()
    assert torch.equal(y, tdense.gemv(x, q, scales, None, quant, n, 32))
    _check(y, x, w, None)


@pytest.mark.cuda
def test_cuda_graph_replays_the_embedding_rows():
    """A captured step's embedding (the token id a device input; an int4 table's blocks, a q6_k
    table's): replayed with other ids, the reference's rows."""
    from moestream.kernels.dense import QuantEmbedding

    for fmt in ("int4", "q6_k"):
        w = _table(fmt, 1000, 2048, 9).cuda()
        emb = QuantEmbedding(w, torch.bfloat16, "triton")
        ids = torch.tensor([5], device="cuda")
        emb(ids)  # compiles outside the capture
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            rows = emb(ids)
        full = dequantize(w.sections(), "w", w.scheme.group_size, torch.bfloat16)
        for i in (999, 64, 0):
            ids.fill_(i)
            g.replay()
            assert torch.equal(rows, full[[i]])


@pytest.mark.cuda
def test_cuda_inductor_compiled_module_equals_eager():
    torch._dynamo.reset()
    w = _weight("int8", 5120, 2048, seed=8).cuda()
    lin = QuantLinear(w, torch.randn(5120, device="cuda", dtype=torch.bfloat16), "triton")
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(lambda t: lin(t) * 2, fullgraph=True)
    assert torch.equal(compiled(x), lin(x) * 2)


def test_the_benchmark_dry_run_writes_its_rows(tmp_path):
    """benchmarks/bench_gpu_dense.py --dry-run: the script end to end on the CPU (one tiny shape
    through the interpreter), rows of the schema, the GEMV within fp32 rounding of the ref."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parents[1]
    out = tmp_path / "rows.jsonl"
    cmd = [sys.executable, str(root / "benchmarks/bench_gpu_dense.py"), "--dry-run"]
    env = {**os.environ, "PYTHONPATH": str(root)}
    r = subprocess.run([*cmd, "--quant", "int4", "--out", str(out)], env=env, capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["variant"] for row in rows] == ["bf16_linear", "triton_int4"]
    assert all(row["config"]["dry_run"] and row["us"] > 0 for row in rows)
    assert rows[1]["max_rel_err_vs_ref"] < 1e-5


@pytest.mark.cuda
@pytest.mark.parametrize("quant", ["int8", "q4_0", "int4_rows"])
def test_cuda_folded_split_gives_the_sum_kernels_bits(quant):
    """GemvConfig.fold (the last split program adds the partials) captured and replayed gives the
    two-launch split's bits, call after call (its counters reset themselves)."""
    n, k = 2048, 4096
    w = _weight(quant, n, k, seed=9).cuda()
    q, scales = _operands(w, quant)
    folded = tdense.gemv_config(quant, n, k, 32)
    assert folded.split > 1 and folded.fold  # the rule folds a split K
    cfg = dataclasses.replace(folded, fold=False)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    tdense.gemv_impl(x, q, scales, None, quant, n, 32, folded)  # compiles outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = tdense.gemv_impl(x, q, scales, None, quant, n, 32, folded)
    for seed in range(3):
        x.copy_(torch.randn(1, k, generator=torch.Generator().manual_seed(seed)))
        g.replay()
        assert torch.equal(y, tdense.gemv_impl(x, q, scales, None, quant, n, 32, cfg))
