"""Triton MoE kernels (moestream/kernels/triton) against the pure-torch spec (kernels/ref.py).

The reference is computed in float64 from the dequantized weights; errors are ||out - ref|| / ||ref||.
Documented tolerances:
  fp32 activations: <= 1e-5 (fp32 accumulation, summation order differs; prefill dots in "ieee").
  bf16 activations: <= 1e-2 (output rounded to bf16; prefill also rounds dequantized weight tiles
  and silu(gate) * up to bf16 for the tensor-core dot).
Every check draws fresh random inputs, poisons the caching allocator and the output with NaN first,
and needs every output element finite. `cuda` tests run compiled kernels on a GPU (CI skips them);
the interpreter tests run the same kernels through TRITON_INTERPRET=1 on CPU tensors (set by
conftest.py when there is no GPU; triton comes with the `test` extra; with the ablations of
test_triton_ablations.py about 95 s on 2 cores).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from moestream.kernels.ref import dequantize
from moestream.kernels.triton.layout import (
    KQUANTS,
    ROW_QUANTS,  # CUDA cores only
    StackedExperts,
    moe_stacked_ref,
    quantize_stacked,
    stack_records,
)
from moestream.quant import RecordLayout, make_scheme, quantize_expert

CUDA = torch.cuda.is_available()
try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed (gpu extra)")
# int4r: int4 in the GPU pool's row layout; q4_0 / q4_1: GGUF's blocks as stored (the same row
# bytes)
QUANTS = ["bf16", "int8", "int4", "int4r", "q4_0", "q4_1"]
# CI time: on the CPU, q4_0 runs the row layouts' kernels in the calls' bookkeeping tests (pair
# rows, picked calls, host reads); the others' scale and zero are checked by the spec tests
CPU_ROWS_SKIP = ("int4r", "q4_1")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
# a GGUF's K-quant layers as stored, "w13's+w2's" scheme where they differ (Q4_K_M: q6_k down
# below q4_k gate/up on some layers; Q4_K_S: q5_k on some)
KQUANT_LAYERS = [*KQUANTS, "q4_k+q6_k", "q4_k+q5_k"]
# a K-quant layer whose experts' width 256 does not divide (DeepSeek-V2-Lite's 1408): llama-
# quantize's Q4_K_M writes its down in Q5_0 (for Q4_K) or Q8_0 (for Q6_K, kept as int8)
FALLBACK_LAYERS = ["q4_k+q5_0", "q4_k+int8"]


def _kquant_layer(quant, E, D, I, device, seed):
    """Random K-quant super-blocks (any valid block; q4_k / q5_k centred like a model's weights);
    a fallback down (q5_0, int8: DOWN_FALLBACKS) from random floats by quant.py's quantizers."""
    from gguf_models import kquant_blocks

    q13, q2 = (quant.split("+") * 2)[:2]

    def blocks(kind, n, k, s):
        q6 = kind == "q6_k"  # (its scales are int8, up to 127)
        b = kquant_blocks(kind, E * n, k, s, scale=0.0005 if q6 else 0.002, centred=not q6)
        return torch.from_numpy(b).view(E, n, k // 256, -1).to(device)

    secs = {"w13.q": blocks(q13, 2 * I, D, seed)}
    if q2 in KQUANTS:
        secs["w2.q"] = blocks(q2, D, I, seed + 1)
    else:
        w2 = torch.randn(E, D, I, generator=torch.Generator().manual_seed(seed)) * 0.02
        ex = quantize_stacked(make_scheme(q2), w2.new_zeros(E, 2 * I, D), w2)
        secs.update({k: v.to(device) for k, v in ex.sections.items() if k.startswith("w2.")})
    return StackedExperts(make_scheme(q13), secs, down=None if q2 == q13 else make_scheme(q2))


def _padded(ex: StackedExperts, extra: int) -> StackedExperts:
    """ex with each K-quant section housed in slots `extra` bytes longer (layout.padded_view, as
    a pool of per-layer layouts holds a smaller layout), the padding NaN bytes."""
    from moestream.kernels.triton.layout import padded_view

    secs = {}
    for name, t in ex.sections.items():
        slots = torch.full((t.shape[0], t[0].numel() + extra), 255, dtype=t.dtype, device=t.device)
        secs[name] = padded_view(slots, t.shape[1:])
        secs[name].copy_(t)
        assert not secs[name].is_contiguous()
    return StackedExperts(ex.scheme, secs, ex.routed, ex.down)


def _layer(quant, E, D, I, device, gen):
    if quant.split("+")[0] in KQUANTS:
        return _kquant_layer(
            quant, E, D, I, device, int(torch.randint(1 << 30, (1,), generator=gen))
        )
    w13 = torch.randn(E, 2 * I, D, generator=gen).to(device) / D**0.5
    w2 = torch.randn(E, D, I, generator=gen).to(device) / I**0.5
    if quant == "int4r":
        return quantize_stacked(make_scheme("int4"), w13, w2).to_rows()
    return quantize_stacked(make_scheme(quant), w13, w2)


def _routing(T, E, K, device, gen):
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    weights = torch.rand(T, K, generator=gen)
    return ids.to(device), (weights / weights.sum(1, keepdim=True)).to(device)


def _check(fn, quant, E, D, I, T, K, dtype, device, seed, tol=TOL, **kw):
    gen = torch.Generator().manual_seed(seed)
    ex = _layer(quant, E, D, I, device, gen)
    x = torch.randn(T, D, generator=gen).to(device=device, dtype=dtype)
    ids, weights = _routing(T, E, K, device, gen)
    want = moe_stacked_ref(x.double(), ids, weights.double(), ex).cpu()  # float64 spec
    if device != "cpu":
        torch.full((64 << 20,), float("nan"), device=device)  # freed: the next buffers hold NaN
    out = torch.full((T, D), float("nan"), device=device, dtype=dtype)
    fn(x, ids, weights, ex, out=out, **kw)
    got = out.double().cpu()
    assert torch.isfinite(got).all(), "output not fully written"
    err = ((got - want).norm() / want.norm()).item()
    assert err <= tol[dtype], f"{quant} T={T} {dtype}: relative error {err:.2e}"


# ---- no triton needed ------------------------------------------------------------------------
@pytest.mark.parametrize("quant", ["bf16", "int8", "int4"])
def test_stacked_sections_are_store_records(quant):
    """StackedExperts.expert(e) holds the same sections as the store's record for expert e."""
    gen = torch.Generator().manual_seed(1)
    D, I = 64, 64
    layout = RecordLayout.build(make_scheme(quant), D, I)
    w13, w2 = torch.randn(3, 2 * I, D, generator=gen), torch.randn(3, D, I, generator=gen)
    recs = [quantize_expert(layout, a, b) for a, b in zip(w13, w2)]
    ex = stack_records(layout.scheme, recs)
    assert ex.expert_bytes() == sum(s.nbytes for s in layout.sections)
    for e in range(3):
        for name in ("w13", "w2"):
            a = dequantize(ex.expert(e), name, 32, torch.float32)
            assert torch.equal(a, dequantize(recs[e], name, 32, torch.float32))


def test_int4_rows_hold_the_store_numbers():
    """The pool's int4 row layout (layout.rows_sections) holds the store's numbers: each expert
    unpacked back equals its record byte for byte, whole-block and short-block row counts."""
    gen = torch.Generator().manual_seed(3)
    for D, I in ((64, 64), (96, 32)):  # w2 with D = 96 rows: a short last 64-row block
        w13, w2 = torch.randn(3, 2 * I, D, generator=gen), torch.randn(3, D, I, generator=gen)
        ex = quantize_stacked(make_scheme("int4"), w13, w2)
        rows = ex.to_rows()
        assert (
            rows.rows and rows.kernel_quant == "int4r" and rows.expert_bytes() == ex.expert_bytes()
        )
        assert rows.sections["w13.rz"].shape == (3, 2 * I, D // 32)
        for e in range(3):
            got, want = rows.expert(e), ex.expert(e)
            assert got.keys() == want.keys()
            assert all(torch.equal(got[k], want[k]) for k in want)


def test_biased_records_are_refused():
    """gpt_oss records (bias sections, clamped activation) must not run bias-less kernels."""
    layout = RecordLayout.build(make_scheme("int8"), 64, 32, bias=True)
    rec = quantize_expert(
        layout, torch.randn(64, 64), torch.randn(64, 32), torch.randn(64), torch.randn(64)
    )
    with pytest.raises(NotImplementedError, match="gpt_oss"):
        stack_records(layout.scheme, [rec, rec])


# ---- interpreter (CPU) -----------------------------------------------------------------------
@needs_triton
@pytest.mark.skipif(CUDA, reason="compiled kernels are tested by the cuda tests")
@pytest.mark.parametrize("quant", QUANTS)
def test_decode_interpreter(quant):
    from moestream.kernels.triton.decode import DecodeConfig, check_shapes, moe_decode

    bn = 64 if quant == "int4" else 8
    for split in (2, 1):
        cfg = DecodeConfig(bn=bn, bk=32, split=split, bn_d=bn, bk_d=32)
        _check(moe_decode, quant, 4, 64, 64, 2, 2, torch.float32, "cpu", seed=2, cfg=cfg)
    # the default tiles, fitted to a small shape
    _check(moe_decode, quant, 3, 128, 128, 1, 2, torch.float32, "cpu", seed=4)
    if quant in ROW_QUANTS:  # CUDA cores only (check_shapes refuses mma)
        cfg = DecodeConfig(bn=16, bk=64, bn_d=16, bk_d=32, mma=True)
        assert "CUDA-core" in check_shapes(quant, 128, 64, 32, cfg)
        # half: nibbles read as 0.5 + q / 256, the offset in the zero term (DecodeConfig.half;
        # q4_0's zero term is then -136 d sum(x))
        for split in (2, 1) if quant == "int4r" else (2,):  # (CI time: int4r's unsplit one)
            cfg = DecodeConfig(bn=8, bk=32, split=split, bn_d=8, bk_d=32, half=True)
            _check(moe_decode, quant, 4, 64, 64, 2, 2, torch.float32, "cpu", seed=2, cfg=cfg)
        if quant != "int4r":
            return
        # groups of 64: two 32-input blocks share a (scale, zero) word
        gen = torch.Generator().manual_seed(6)
        w13, w2 = torch.randn(3, 128, 128, generator=gen), torch.randn(3, 128, 64, generator=gen)
        ex = quantize_stacked(make_scheme("int4", 64), w13 / 11, w2 / 8).to_rows()
        x = torch.randn(2, 128, generator=gen)
        ids, w = _routing(2, 3, 2, "cpu", gen)
        want = moe_stacked_ref(x.double(), ids, w.double(), ex)
        for half in (False, True):
            cfg = DecodeConfig(bn=8, bk=64, bn_d=8, bk_d=64, half=half)
            got = moe_decode(x, ids, w, ex, cfg).double()
            assert ((got - want).norm() / want.norm()).item() <= TOL[torch.float32]
        return
    # tensor cores (fp32 "ieee" dots here): one K step, a D split, a pipelined K loop
    for split, bk, stages in ((1, 64, 0), (2, 32, 0), (1, 32, 2)):
        cfg = DecodeConfig(bn=64 if quant == "int4" else 16, bk=bk, split=split,
                           bn_d=64 if quant == "int4" else 16, bk_d=32, mma=True,
                           stages=stages)  # fmt: skip
        _check(moe_decode, quant, 4, 128, 64, 2, 2, torch.float32, "cpu", seed=5, cfg=cfg)


@needs_triton
@pytest.mark.skipif(CUDA, reason="compiled kernels are tested by the cuda tests")
@pytest.mark.parametrize("quant", KQUANT_LAYERS)
def test_decode_kquant_interpreter(quant):
    """A GGUF's K-quant super-blocks as stored, against the float64 spec (the blocks dequantized
    as llama.cpp does): one D split and two, q4_k's nibbles with and without half, a mixed
    layer's down launch in its own step."""
    from moestream.kernels.triton.decode import DecodeConfig, check_shapes, moe_decode

    q13 = quant.split("+")[0]
    cfg = DecodeConfig(bn=64, bk=256, bn_d=64, bk_d=256)  # (CI time: few programs)
    _check(moe_decode, quant, 3, 256, 256, 2, 2, torch.float32, "cpu", seed=2, cfg=cfg)
    if quant == "q4_k":  # (CI time: the other cases' steps take no split or half)
        _check(moe_decode, quant, 3, 512, 256, 2, 2, torch.float32, "cpu", seed=3,
               cfg=replace(cfg, split=2, half=True))  # fmt: skip
    if quant == "q4_k+q5_k":  # each section in slots of a larger record (per-layer layouts)
        gen = torch.Generator().manual_seed(5)
        ex = _padded(_layer(quant, 3, 256, 256, "cpu", gen), 256 * 256)
        x, (ids, w) = torch.randn(2, 256, generator=gen), _routing(2, 3, 2, "cpu", gen)
        want = moe_stacked_ref(x.double(), ids, w.double(), ex)
        got = moe_decode(x, ids, w, ex, cfg).double()
        assert ((got - want).norm() / want.norm()).item() <= TOL[torch.float32]
    some = DecodeConfig(bk=256, bk_d=256)
    assert "CUDA-core" in check_shapes(q13, 512, 256, 256, replace(some, mma=True))
    assert "D=512" in check_shapes(q13, 512, 256, 256, replace(some, bk=128))  # super-blocks
    if q13 != "q4_k":
        assert "half" in check_shapes(q13, 512, 256, 256, replace(some, half=True))


@needs_triton
@pytest.mark.skipif(CUDA, reason="compiled kernels are tested by the cuda tests")
@pytest.mark.parametrize("quant", FALLBACK_LAYERS)
def test_decode_fallback_down_interpreter(quant):
    """A K-quant layer whose I (160) 256 does not divide, its down in llama-quantize's fallback
    (q5_0 blocks as stored, or int8): gate/up's super-block step, the down launch in the
    fallback's own step and group, against the float64 spec; the tiles fit bk_d to I; a q5_0
    down in slots of a larger record (per-layer layouts: uint8 blocks in an int8 down's slots)."""
    from moestream.kernels.triton.decode import DecodeConfig, check_shapes, fit_config, moe_decode

    down = (quant.split("+")[1], 32)
    tiles = DecodeConfig(bn=32, bk=256, bn_d=64, bk_d=256)
    assert "I=160 must be a multiple of bk_d=256 (itself of G=32)" in check_shapes(
        "q4_k", 256, 160, 256, tiles, down
    )
    cfg = fit_config("q4_k", 256, 160, 256, tiles, down)
    assert cfg.bk_d == 32 and cfg.bk == 256  # (bk_d halved to a divisor of I, bk kept)
    assert fit_config("q4_k", 256, 160, 256, tiles) is None  # (a K-quant down: no tile fits)
    _check(moe_decode, quant, 3, 256, 160, 2, 2, torch.float32, "cpu", seed=2, cfg=cfg)
    if quant == "q4_k+q5_0":
        gen = torch.Generator().manual_seed(5)
        ex = _padded(_layer(quant, 3, 256, 160, "cpu", gen), 4096)
        x, (ids, w) = torch.randn(2, 256, generator=gen), _routing(2, 3, 2, "cpu", gen)
        want = moe_stacked_ref(x.double(), ids, w.double(), ex)
        got = moe_decode(x, ids, w, ex, cfg).double()
        assert ((got - want).norm() / want.norm()).item() <= TOL[torch.float32]


@needs_triton
@pytest.mark.parametrize("quant", FALLBACK_LAYERS)
def test_fallback_downs_dequantize_to_the_spec_bits(quant):
    """A prompt's routed fallback downs (q5_0 blocks, also in padded slots; int8 and its fp32
    scales) dequantized by one launch (dequant_blocks32): the spec's values bit for bit in fp32
    and bf16; only the matrices src names are written, and a prompt on the layer (grouped GEMMs
    and the float Triton prefill) is the float64 spec's."""
    from moestream.kernels.triton import moe_experts
    from moestream.kernels.triton.dequant import dequant_blocks32

    device = "cuda" if CUDA else "cpu"
    gen = torch.Generator().manual_seed(8)
    ex = _layer(quant, 3, 256, 160, device, gen)
    if quant == "q4_k+q5_0":
        ex = _padded(ex, 4096)
    src = torch.tensor([2, -1, 0], dtype=torch.int32, device=device)
    want = torch.stack([dequantize(ex.expert(e), "w2", 32, torch.float32) for e in range(3)])
    for dtype in (torch.float32, torch.bfloat16):
        got = dequant_blocks32(ex.down.name, ex.sections["w2.q"], ex.sections.get("w2.s"), dtype,
                               src=src)  # fmt: skip
        assert torch.equal(got[0], want[2].to(dtype)) and torch.equal(got[2], want[0].to(dtype))
    dtype = torch.bfloat16 if CUDA else torch.float32  # (_grouped_mm: bf16 on CUDA)
    x = torch.randn(10, 256, generator=gen).to(device=device, dtype=dtype)
    ids, w = _routing(10, 3, 2, device, gen)
    spec = moe_stacked_ref(x.double(), ids, w.double(), ex).cpu()
    for prefill in ("grouped", "triton"):
        got = moe_experts(x, ids, w, ex, prefill=prefill).double().cpu()
        assert ((got - spec).norm() / spec.norm()).item() <= TOL[dtype], prefill


@needs_triton
@pytest.mark.parametrize("quant", [*KQUANTS, "q4_k+q6_k"])
def test_kquant_blocks_dequantize_to_the_spec_bits(quant):
    """A prompt's routed K-quant experts dequantized by one launch each projection
    (dequant_kquant_blocks): the spec's values (ggml's dequantize_row_q*_K) bit for bit, in
    fp32 and rounded to bf16; only the matrices src names are written. Rows of two super-blocks
    (w13, 512 inputs) and of one (w2)."""
    from moestream.kernels.triton.dequant import dequant_kquant_blocks

    device = "cuda" if CUDA else "cpu"
    ex = _layer(quant, 3, 512, 256, device, torch.Generator().manual_seed(8))
    if quant == "q4_k+q6_k":  # sections in longer slots (a pool of per-layer layouts)
        ex = _padded(ex, 4096)
    src = torch.tensor([2, -1, 0], dtype=torch.int32, device=device)
    for n, dtype in (("w13", torch.float32), ("w2", torch.bfloat16)):  # (CI time: each once)
        want = torch.stack([dequantize(ex.expert(e), n, 256, torch.float32) for e in range(3)])
        got = dequant_kquant_blocks(ex.sections[f"{n}.q"], dtype, src=src)
        assert torch.equal(got[0], want[2].to(dtype)) and torch.equal(got[2], want[0].to(dtype))


@needs_triton
@pytest.mark.parametrize("quant", ["q4_k+q6_k"])  # (CI time: q5_k's blocks: the dequant test)
def test_kquant_prompts_dequantize_the_routed_experts(quant):
    """A prompt on K-quant experts dequantizes its routed experts, then runs the grouped GEMMs
    (prefill "grouped") or the float Triton prefill ("triton", any GPU): both against the float64
    spec; the Triton family's pair rows in chunks of tokens give the call's bits (each chunk
    dequantizes its own experts; the grouped GEMMs' chunks of experts: the test below)."""
    from moestream.kernels.triton import combine_pairs, moe_experts, moe_pairs

    device = "cuda" if CUDA else "cpu"
    dtype = torch.bfloat16 if CUDA else torch.float32  # (_grouped_mm: bf16 on CUDA)
    gen = torch.Generator().manual_seed(9)
    ex = _layer(quant, 4, 256, 256, device, gen)
    x = torch.randn(10, 256, generator=gen).to(device=device, dtype=dtype)
    ids, w = _routing(10, 4, 2, device, gen)
    want = moe_stacked_ref(x.double(), ids, w.double(), ex).cpu()
    for prefill in ("grouped", "triton"):
        got = moe_experts(x, ids, w, ex, prefill=prefill)
        err = ((got.double().cpu() - want).norm() / want.norm()).item()
        assert err <= TOL[dtype], f"{quant} {prefill}: relative error {err:.2e}"
    rows = [moe_pairs(x[a:b], ids[a:b], w[a:b], ex, 10, prefill="triton").clone()
            for a, b in ((0, 4), (4, 10))]  # fmt: skip
    assert torch.equal(combine_pairs(torch.cat(rows), 2, dtype), got)


@needs_triton
@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("T", [3, 10, 150])
def test_pair_rows_in_chunks_give_the_call_bits(quant, T):
    """The GPU provider's chunked prefill: pair rows computed in chunks of experts (as K=1 calls
    over their tokens), then combine_pairs, equal the one call bit for bit (decode path at T=3,
    grouped prefill at T=10; at T=150 int4 rows' chunks of ~100 pairs take the tiles of the
    150-token call, not of a short prompt); and a call is deterministic."""
    from moestream.kernels.triton import combine_pairs, moe_experts, moe_pairs

    if quant in CPU_ROWS_SKIP and not CUDA:  # CI time: the layout-free pair/combine path
        pytest.skip("interpreter coverage in test_decode_interpreter / prefill (and q4_0's case)")
    if T > 100 and not CUDA:
        pytest.skip("CI time: the interpreter takes minutes at 150 tokens")
    device, dtype = ("cuda", torch.bfloat16) if CUDA else ("cpu", torch.float32)
    E, D, I, K = 6, 64, 64, 2
    gen = torch.Generator().manual_seed(20 + T)
    ex = _layer(quant, E, D, I, device, gen)
    x = torch.randn(T, D, generator=gen).to(device=device, dtype=dtype)
    ids, w = _routing(T, E, K, device, gen)
    want = moe_experts(x, ids, w, ex)
    flat = ids.reshape(-1)
    rows = torch.full((T * K, D), float("nan"), device=device)
    for lo in range(0, E, 2):
        sel = torch.nonzero((flat >= lo) & (flat < lo + 2)).reshape(-1)
        if len(sel):
            sub = (x[sel // K], flat[sel].reshape(-1, 1), w.reshape(-1)[sel].reshape(-1, 1))
            rows[sel] = moe_pairs(*sub, ex, tokens=T)
    assert torch.equal(combine_pairs(rows, K, dtype), want)
    assert torch.equal(moe_experts(x, ids, w, ex), want)


@needs_triton
def test_routed_groups_name_the_routed_experts_in_order():
    """kernels/triton/grouped.py's one-launch bookkeeping: the routed matrices in ascending order
    (-1 past them) and each group's row end (the pairs past the last group: none), for ids of
    more pairs than one block, a pool larger than its layer, and every matrix routed."""
    from moestream.kernels.triton.grouped import routed_groups

    device = "cuda" if CUDA else "cpu"
    gen = torch.Generator().manual_seed(3)
    for n, P, groups, pick in ((40, 2500, 12, 12), (1000, 37, 37, 9), (16, 64, 16, 16)):
        chosen = torch.randperm(n, generator=gen)[:pick]
        flat = chosen[torch.randint(pick, (P,), generator=gen)]
        src, offs = routed_groups(flat.to(device), n, groups)
        used = torch.unique(flat)  # ascending
        counts = torch.stack([(flat == e).sum() for e in used])
        want_src = torch.full((groups,), -1, dtype=torch.int32)
        want_src[: len(used)] = used.to(torch.int32)
        want_offs = torch.full((groups,), P, dtype=torch.int32)
        want_offs[: len(used)] = torch.cumsum(counts, 0).to(torch.int32)
        assert torch.equal(src.cpu(), want_src) and torch.equal(offs.cpu(), want_offs), (n, P)


@needs_triton
@pytest.mark.parametrize("quant", [*ROW_QUANTS, "q4_k+q6_k"])
@pytest.mark.parametrize("T", [10, 150])
def test_grouped_prompt_pairs_in_chunks_give_the_call_bits(quant, T):
    """The grouped-GEMM prompt path (int4 rows, q4_0; kernels/triton/grouped.py), as the GPU provider's
    chunked prefill runs it: pair rows of chunks of experts (K=1 calls over their tokens, the
    experts in a pool of more slots than the layer has experts, `routed` bounding the scratch),
    then combine_pairs, equal the resident call bit for bit; the call is deterministic and
    `moe_experts` takes this path for a prompt (prefill="grouped"; `prompt_path`), not for
    decode."""
    from moestream.kernels.triton import combine_pairs, moe_experts, moe_pairs, prompt_path
    from moestream.kernels.triton.grouped import moe_grouped
    from moestream.kernels.triton.layout import StackedExperts

    if T > 100 and not CUDA:  # CI time: the interpreter's chunks at 10 tokens cover the path
        pytest.skip("150 tokens: the library's tile configs at real shapes, on CUDA")
    if "_k" in quant and not CUDA:  # CI time: K-quants' dequant is tested alone, the GEMMs here
        pytest.skip("K-quant layers: on CUDA (the interpreter's row layouts cover the GEMMs)")
    device, dtype = ("cuda", torch.bfloat16) if CUDA else ("cpu", torch.float32)
    E, D, I, K = 8, 64, 64, 2
    if "_k" in quant:  # super-blocks of 256 (a Q4_K_M layer: q4_k gate/up, q6_k down)
        D = I = 256
    if CUDA:  # the library's tile configs at a real layer's shapes
        E, D, I, K = 128, 2048, 768, 8
    gen = torch.Generator().manual_seed(40 + T)
    ex = _layer(quant, E, D, I, device, gen)
    x = torch.randn(T, D, generator=gen).to(device=device, dtype=dtype)
    ids, w = _routing(T, E, K, device, gen)
    want = moe_experts(x, ids, w, ex)
    assert torch.equal(want, moe_grouped(x, ids, w, ex))  # the dispatch's choice, deterministic
    pool = StackedExperts(ex.scheme, {k: torch.cat([v, v]) for k, v in ex.sections.items()}, E)
    flat = ids.reshape(-1)
    rows = torch.full((T * K, D), float("nan"), device=device)
    step = E // 4 if CUDA else E // 2
    for lo in range(0, E, step):  # chunks of experts, read from the pool's second copy
        sel = torch.nonzero((flat >= lo) & (flat < lo + step)).reshape(-1)
        if len(sel):
            slots = (flat[sel] + E).reshape(-1, 1)
            rows[sel] = moe_pairs(x[sel // K], slots, w.reshape(-1)[sel].reshape(-1, 1), pool,
                                  tokens=T)  # fmt: skip
    assert torch.equal(combine_pairs(rows, K, dtype), want)
    # the rule: a call of more than DECODE_MAX_TOKENS tokens, asked for; decode never
    assert prompt_path(ex, x, T, "grouped") and not prompt_path(ex, x, T, "triton")
    assert not prompt_path(ex, x[:1], 1, "grouped")
    if CUDA:  # (the interpreter's Triton prefill against the spec: test_prefill_interpreter)
        tri = moe_experts(x, ids, w, ex, prefill="triton")
        assert not torch.equal(tri, want)  # another path (the library's products)
        # relative to the output's norm: random K-quant blocks give outputs of ~1e4, where two
        # bf16 roundings of one value differ by ~100 (the bf16 spec's own max error is 124 there)
        err = ((tri.double() - want.double()).norm() / want.double().norm()).item()
        assert err <= TOL[dtype], f"{quant} T={T}: relative error {err:.2e}"


@needs_triton
@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("mma", [False, True])
def test_host_reads_give_the_pool_bits(quant, mma):
    """Ids < 0 read record -1 - id of a second set of sections (on CUDA: pinned host memory read
    through unified addressing, the GPU provider's misses) with the pool's arithmetic: any mix of
    pool slots and host records gives the bits of every expert in the pool."""
    from moestream.kernels.triton.decode import DecodeConfig, fit_config, moe_decode
    from moestream.kernels.triton.layout import StackedExperts, kernel_sections

    if quant in ROW_QUANTS and mma:
        pytest.skip("the row layouts run on CUDA cores only")
    if quant in CPU_ROWS_SKIP and not CUDA:  # CI time: q4_0 runs the row layout's kernels here
        pytest.skip("on the CPU q4_0's case and test_cpu_device_misses cover the row layouts")
    device, dtype = ("cuda", torch.bfloat16) if CUDA else ("cpu", torch.float32)
    E, D, I, K = 6, 128, 64, 3
    gen = torch.Generator().manual_seed(40 + mma)
    ex = _layer(quant, E, D, I, device, gen)
    # the host mirror: the same sections in host memory (pinned on CUDA), every expert, in the
    # kernels' order as the provider's mirror holds them (int4's sz reordered once: the kernels
    # would otherwise reorder a copy per call, in pageable memory the GPU cannot read)
    host = StackedExperts(ex.scheme, {k: v.cpu().pin_memory() if CUDA else v.clone()
                                      for k, v in kernel_sections(ex).items()})  # fmt: skip
    # a pool of 3 slots holding experts 4, 1, 2 (slot order is not expert order)
    held = [4, 1, 2]
    pool = StackedExperts(ex.scheme, {k: v[held].contiguous() for k, v in ex.sections.items()})
    slot_of = {e: i for i, e in enumerate(held)}
    cfg = None
    if mma or not CUDA:  # the interpreter takes small tiles; mma: the tensor-core family
        bn = 64 if quant == "int4" else 16
        cfg = fit_config(quant, D, I, 32, DecodeConfig(bn=bn, bk=32, bn_d=bn, bk_d=32, mma=mma))
    for T in (1, 3) if CUDA else (3,):  # the interpreter is slow: one call per case
        x = torch.randn(T, D, generator=gen).to(device=device, dtype=dtype)
        ids, w = _routing(T, E, K, device, gen)
        want = moe_decode(x, ids, w, ex, cfg).clone()
        codes = torch.tensor([[slot_of.get(e, -1 - e) for e in row] for row in ids.tolist()],
                             device=device)  # fmt: skip
        assert (codes < 0).any() and (codes >= 0).any(), "the draw must mix pool and host"
        got = moe_decode(x, codes, w, pool, cfg, host=host)
        assert torch.equal(got, want), f"{quant} T={T}: host reads changed the bits"


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("mma", [False, True])
def test_picked_calls_give_the_one_call_bits(quant, mma):
    """A layer in two picked calls on one output (the GPU pool's hits while its misses are
    staged, then the misses: moe_decode's `pick`) gives the one call's bits, with the pairs split
    any way, every pair in the first call or every pair in the second; the pair rows too."""
    from moestream.kernels.triton.decode import DecodeConfig, fit_config, moe_decode

    if quant in ROW_QUANTS and mma:
        pytest.skip("the row layouts run on CUDA cores only")
    if quant in CPU_ROWS_SKIP and not CUDA:  # CI time: q4_0 runs the row layout's kernels here
        pytest.skip("on the CPU q4_0's case and the provider's test cover the row layouts")
    device, dtype = ("cuda", torch.bfloat16) if CUDA else ("cpu", torch.float32)
    E, D, I, K = 6, 64, 64, 3
    gen = torch.Generator().manual_seed(50 + mma)
    ex = _layer(quant, E, D, I, device, gen)
    cfg = None
    if mma or not CUDA:  # the interpreter takes small tiles; mma: the tensor-core family
        bn = 64 if quant == "int4" else 16
        cfg = fit_config(quant, D, I, 32, DecodeConfig(bn=bn, bk=32, bn_d=bn, bk_d=32, mma=mma))
    T = 3
    x = torch.randn(T, D, generator=gen).to(device=device, dtype=dtype)
    ids, w = _routing(T, E, K, device, gen)
    want = moe_decode(x, ids, w, ex, cfg).clone()
    rows = moe_decode(x, ids, w, ex, cfg, combine=False).clone()
    mixed = torch.tensor([0, -1, 2, -3, -5, 1, 4, -2, 3], device=device)  # the sign picks
    other = torch.randn(T, D, generator=gen).to(device=device, dtype=dtype)
    for codes in (mixed, mixed.abs(), -1 - mixed.abs()):
        # another input first: a pair a picked call skipped would leave its stale h in the
        # shared workspace, which would differ from this input's
        moe_decode(other, ids, w, ex, cfg)
        out = torch.full((T, D), float("nan"), device=device, dtype=dtype)
        moe_decode(x, ids, w, ex, cfg, out=out, pick=(codes, 1))
        if codes is mixed:  # every token has a pair still to run: none combined yet
            assert out.isnan().all()
        moe_decode(x, ids, w, ex, cfg, out=out, pick=(codes, 2))
        assert torch.equal(out, want), f"{quant} mma={mma}: picked calls changed the bits"
        if codes is not mixed and not CUDA:  # CI time: the pair rows of a split of both calls
            continue
        moe_decode(other, ids, w, ex, cfg, combine=False)
        pair_rows = moe_decode(x, ids, w, ex, cfg, combine=False)  # the workspace's rows
        pair_rows.fill_(float("nan"))
        moe_decode(x, ids, w, ex, cfg, combine=False, pick=(codes, 1))
        hit = (codes >= 0).cpu()
        assert torch.equal(pair_rows[hit].cpu(), rows[hit].cpu())  # the picked pairs only
        assert pair_rows[~hit].isnan().all()
        got = moe_decode(x, ids, w, ex, cfg, combine=False, pick=(codes, 2))
        assert torch.equal(got, rows)


@needs_triton
@pytest.mark.skipif(CUDA, reason="compiled kernels are tested by the cuda tests")
@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("block_n", [0, 32])
def test_prefill_interpreter(quant, block_n):
    """fp32 only: the interpreter's bf16 tl.dot is wrong (triton 3.6), the GPU test covers bf16.
    block_n 0: tokens on the dot's M side; 32: weight rows on M (the store's int4 always 0)."""
    from moestream.kernels.triton.prefill import PrefillConfig, moe_prefill

    if quant == "bf16" and not block_n:
        pytest.skip("bf16 tokens-on-M: the GPU test covers it")
    cfg = PrefillConfig(block_m=16, half=32, bk=32, block_n=block_n)
    _check(moe_prefill, quant, 4, 64, 64, 5, 2, torch.float32, "cpu", seed=3, cfg=cfg)


# ---- CUDA ------------------------------------------------------------------------------------
# (E, D, I, K): the Qwen3-30B-A3B and Qwen3.5-35B-A3B D and I with fewer experts (the kernels
# index experts by id; E=256 is checked at a small D, I), in bf16, plus fp32 on the small shape.
CASES = [
    ((16, 2048, 768, 8), torch.bfloat16),
    ((16, 2048, 512, 8), torch.bfloat16),
    ((256, 256, 128, 8), torch.bfloat16),
    ((256, 256, 128, 8), torch.float32),
]


@pytest.mark.cuda
@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("T", [1, 3, 8])
def test_decode_cuda(quant, case, T):
    """The default tiles, each case twice, so the second call reuses the counters the first one
    reset (the one-launch ablation: test_triton_ablations.py)."""
    from moestream.kernels.triton.decode import moe_decode

    (E, D, I, K), dtype = case
    for seed in range(2):
        _check(moe_decode, quant, E, D, I, T, K, dtype, "cuda", seed=100 * seed + T)


@pytest.mark.cuda
@pytest.mark.parametrize("quant", KQUANT_LAYERS)
@pytest.mark.parametrize("case", [c for c in CASES if c[0][2] % 256 == 0])  # super-blocks
@pytest.mark.parametrize("T", [1, 3, 8])
def test_decode_kquant_cuda(quant, case, T):
    """A GGUF's K-quant layers as stored (mixed: w2's own step in the down launch) through the
    default tiles and, for q4_k's nibbles, the other half setting, against the float64 spec."""
    from moestream.kernels.triton.decode import default_config, moe_decode

    (E, D, I, K), dtype = case
    q13 = quant.split("+")[0]
    tiles = default_config(q13, D, I, 256, "NVIDIA H200")
    for cfg in (tiles, replace(tiles, half=not tiles.half)) if q13 == "q4_k" else (tiles,):
        for seed in range(2):
            _check(moe_decode, quant, E, D, I, T, K, dtype, "cuda", seed=100 * seed + T, cfg=cfg)


@pytest.mark.cuda
@pytest.mark.parametrize("quant", FALLBACK_LAYERS)
@pytest.mark.parametrize("I", [1408, 160])
@pytest.mark.parametrize("T", [1, 3, 8])
def test_decode_fallback_cuda(quant, I, T):
    """A K-quant layer 256 does not divide (DeepSeek-V2-Lite's I = 1408), its down in q5_0 or
    int8: the H200's tiles fitted to it (and for q4_k's nibbles the other half setting) against
    the float64 spec, bf16."""
    from moestream.kernels.triton.decode import default_config, moe_decode

    tiles = default_config("q4_k", 2048, I, 256, "NVIDIA H200", (quant.split("+")[1], 32))
    for cfg in (tiles, replace(tiles, half=not tiles.half)):
        for seed in range(2):
            _check(moe_decode, quant, 16, 2048, I, T, 6, torch.bfloat16, "cuda",
                   seed=100 * seed + T, cfg=cfg)  # fmt: skip


@pytest.mark.cuda
@pytest.mark.parametrize("quant", ROW_QUANTS)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("T", [1, 3, 8])
def test_decode_half_cuda(quant, case, T):
    """int4 rows (q4_0) with DecodeConfig.half as the tiles do not set it (the H200's set it:
    each nibble 0.5 + q / 256 by one PTX permute, the offset folded into the zero term, and
    test_decode_cuda runs that) against the float64 spec, the default tiles otherwise."""
    from moestream.kernels.triton.decode import default_config, moe_decode

    (E, D, I, K), dtype = case
    tiles = default_config(quant, D, I, 32, "NVIDIA H200")
    cfg = replace(tiles, half=not tiles.half)
    for seed in range(2):
        _check(moe_decode, quant, E, D, I, T, K, dtype, "cuda", seed=100 * seed + T, cfg=cfg)


# tensor-core tiles for every quant (int4's default family; the benchmarks' MMA_CONFIGS)
MMA_TILES = {
    "bf16": dict(bn=32, bk=256, split=2, bn_d=32, bk_d=256),
    "int8": dict(bn=32, bk=512, split=2, bn_d=32, bk_d=256),
    "int4": dict(bn=64, bk=256, split=4, bn_d=64, bk_d=256),
}


@pytest.mark.cuda
@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("T", [1, 3, 8])
def test_decode_mma_cuda(quant, case, T):
    """The tensor-core kernels (exact integer weights in the dot, scales per group) and their
    byte-to-bf16 conversions, tiles fitted to each shape."""
    from moestream.kernels.triton.decode import DecodeConfig, fit_config, moe_decode

    if quant in ROW_QUANTS:
        pytest.skip("the row layouts run on CUDA cores only")
    (E, D, I, K), dtype = case
    cfg = fit_config(quant, D, I, 32, DecodeConfig(**MMA_TILES[quant], mma=True))
    for seed, stages in ((0, 0), (1, 3)):  # the K loop unrolled, then software-pipelined
        _check(moe_decode, quant, E, D, I, T, K, dtype, "cuda", seed=300 + 100 * seed + T,
               cfg=replace(cfg, stages=stages))  # fmt: skip


@pytest.mark.cuda
@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("T", [9, 100])
def test_prefill_cuda(quant, case, T):
    from moestream.kernels.triton.prefill import moe_prefill

    (E, D, I, K), dtype = case
    _check(moe_prefill, quant, E, D, I, T, K, dtype, "cuda", seed=7 + T)


# (block_m=64, half=64, bk=128 needs more shared memory than an H200 has: 233-410 KB)
PREFILL_TILES = [
    dict(block_m=16, block_n=0),
    dict(bk=64, block_n=0),
    dict(block_m=64, half=64, block_n=0),
    dict(block_m=32, bk=64, block_n=0),
    dict(block_m=32, block_n=64),
    dict(block_m=64, block_n=128, num_warps=8),
    dict(block_n=128, bk=256, num_warps=8),
    dict(block_m=16, block_n=32, bk=64),
]
# (block_n 0: tokens on the dot's M side, the tiles before weight rows on M)


@pytest.mark.cuda
@pytest.mark.parametrize("tiles", PREFILL_TILES)
@pytest.mark.parametrize("quant", ["int8", *ROW_QUANTS])
def test_prefill_tiles_cuda(quant, tiles):
    """The tile candidates bench_gpu_prefill.py times, at Qwen3-30B-A3B's D and I."""
    from moestream.kernels.triton.prefill import PrefillConfig, moe_prefill

    if quant == "int8" and tiles == PREFILL_TILES[6]:  # H200, 28fa220: OutOfResources
        pytest.skip("int8 at block_n 128, bk 256 needs 704 KB of shared memory (H200: 227 KB)")
    _check(moe_prefill, quant, 16, 2048, 768, 40, 8, torch.bfloat16, "cuda", seed=5,
           cfg=PrefillConfig(**tiles))  # fmt: skip


@pytest.mark.cuda
@pytest.mark.parametrize("quant", QUANTS)
def test_dispatcher_cuda(quant):
    """moe_kernel('triton') picks decode or prefill by token count and agrees with 'ref'."""
    from moestream.kernels.dispatch import moe_kernel

    gen = torch.Generator().manual_seed(11)
    ex = _layer(quant, 32, 512, 256, "cuda", gen)
    for T in (1, 8, 9, 40):
        x = torch.randn(T, 512, generator=gen).cuda().bfloat16()
        ids, w = _routing(T, 32, 4, "cuda", gen)
        got = moe_kernel("triton")(x, ids, w, ex).double()
        want = moe_kernel("ref")(x.double(), ids, w.double(), ex)
        err = ((got - want).norm() / want.norm()).item()
        assert err <= TOL[torch.bfloat16], f"T={T}: {err:.2e}"
