"""Native CPU expert kernels (kernels/native.py) against their pure-torch spec (kernels/ref.py).

Tolerances:
- one projection: the native variants (scalar, AVX2) equal `qlinear_q8` bit for bit (exact
  integer block dots, fp32 block sums in the same order and roundings);
- a layer (gate|up, SiLU*up, down, weighted sum): within 1e-3 * max|ref| of `moe_q8_ref`; the only
  difference is SiLU's exp (libm vs torch's), which can flip one intermediate activation's int8
  rounding (one step of its block's scale); the ISA variants equal each other bit for bit;
- against the fp32 dequantized reference (`expert_ffn_q` + `qlinear_ref`): the int8 activation
  quantization error: relative RMS <= 2% (~0.5% per projection on gaussian data, ~1.2% for
  the two of a layer).
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from gguf_models import kquant_blocks

from moestream.experts.config import StreamConfig
from moestream.kernels import native
from moestream.kernels.ref import expert_ffn_q, group_by_expert, moe_q8_ref, qlinear_q8
from moestream.quant import KQUANT_BYTES, RecordLayout, make_scheme, quantize_expert

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernels did not build here")
ISAS = native.isas() or ["scalar"]
SHAPES = [(160, 96), (2048, 768)]  # (D, I): 160 ends in a partial int4 block of 32 rows
K_SHAPES = [(256, 256), (2048, 768)]  # K-quants: K a multiple of 256
KQUANTS = tuple(KQUANT_BYTES)


def records(scheme: str, D: int, I: int, n: int, seed: int = 0) -> list[dict]:
    if scheme in KQUANT_BYTES:  # GGUF blocks (no quantizer): random ones, weights ~ 1/sqrt(K)
        return [
            {
                name: torch.from_numpy(
                    kquant_blocks(scheme, N, K, seed + 2 * e + i, 0.005 / K**0.5, centred=True)
                )
                for i, (name, N, K) in enumerate((("w13.q", 2 * I, D), ("w2.q", D, I)))
            }
            for e in range(n)
        ]
    layout = RecordLayout.build(make_scheme(scheme), D, I)
    g = torch.Generator().manual_seed(seed)
    return [
        quantize_expert(
            layout,
            torch.randn(2 * I, D, generator=g) / D**0.5,
            torch.randn(D, I, generator=g) / I**0.5,
        )
        for _ in range(n)
    ]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


# schemes with a quantizer (and int4)
ROW_MAJOR = ("int4", "int8", "q4_0", "q4_1", "q5_0", "q8_0", "mxfp4")
CASES = [(s, D, I) for s in ROW_MAJOR for D, I in SHAPES]
CASES += [(s, D, I) for s in KQUANTS for D, I in K_SHAPES]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 3, 6])  # 6: a full token tile of 4, then 2
@pytest.mark.parametrize("scheme,D,I", CASES)
def test_projection_equals_reference_bits(scheme, D, I, T, dtype, isa):
    sec = records(scheme, D, I, 1)[0]
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(1)).to(dtype)
    for name, xin in (("w13", x), ("w2", x[:, :I])):
        assert torch.equal(native.linear(xin, sec, name, isa), qlinear_q8(xin, sec, name))
    if scheme in ("int8", "q8_0"):  # int16 activations (the int8 schemes' down projection)
        xin = x[:, :I]  # int16 x int8 block dots pass 2**24: their fp32 rounding counts too
        got = native.linear(xin, sec, "w2", isa, wide=True)
        assert torch.equal(got, qlinear_q8(xin, sec, "w2", wide=True))


def test_row_tails_equal_the_reference_bits():
    """Rows whose blocks past the last full eight (1-7 of them; a 1408-wide projection has 4)
    take the vector rows' tails (q5_0's and mxfp4's AVX-512 row: the same integer dots from
    zero-padded vectors), with one and with three activation rows: the spec's bits on every ISA."""
    for scheme in ("q5_0", "mxfp4", "q4_0", "int8"):
        for tail in range(1, 8):
            D = 32 * (8 + tail)
            sec = records(scheme, D, 96, 1, seed=tail)[0]
            for T in (1, 3):
                x = torch.randn(T, D, generator=torch.Generator().manual_seed(tail))
                want = qlinear_q8(x, sec, "w13")
                for isa in ISAS:
                    got = native.linear(x, sec, "w13", isa)
                    assert torch.equal(got, want), (scheme, tail, T, isa)


def test_mxfp4_rows_take_every_code_and_exponent():
    """mxfp4 rows of random blocks (every code; exponents 0 and 1, whose scales are subnormal, up
    to 140), 11 blocks a row (eight whole, then a tail of 3): the spec's bits on every ISA, for one
    and for three activation rows."""
    g = torch.Generator().manual_seed(6)
    q = torch.randint(0, 256, (70, 11, 17), dtype=torch.uint8, generator=g)
    q[..., 0] = torch.randint(0, 141, (70, 11), dtype=torch.uint8, generator=g)
    q[:4, :, 0] = torch.tensor([0, 1, 2, 3], dtype=torch.uint8)[:, None]
    sec = {"w.q": q}
    for T in (1, 3):
        x = torch.randn(T, 352, generator=g) * 1e30  # the subnormal scales' products stay normal
        want = qlinear_q8(x, sec, "w")
        for isa in ISAS:
            assert torch.equal(native.linear(x, sec, "w", isa), want), (T, isa)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("scheme,D,I", CASES)
def test_layer_matches_reference(scheme, D, I, T, dtype):
    secs = records(scheme, D, I, 4)
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(T, D, generator=g).to(dtype), torch.rand(T, 4, generator=g)
    want = moe_q8_ref(x, secs, w)
    got = {isa: native.moe(x, secs, w, isa) for isa in ISAS}
    assert all(torch.equal(y, got["scalar"]) for y in got.values()), "ISA variants disagree"
    assert rel(got["scalar"], want) <= 1e-3
    # vs the fp32 dequantized experts: the activation quantization error (~1.2% measured)
    fp = sum(w[:, e : e + 1] * expert_ffn_q(x.float(), sec, 32) for e, sec in enumerate(secs))
    err = ((got["scalar"] - fp).pow(2).mean() / fp.pow(2).mean()).sqrt().item()
    assert err <= 0.02  # K-quants (centred random blocks): 1.0-1.6% measured


@pytest.mark.parametrize("scheme", ["int8", "int4", "q4_0", "mxfp4"])
@pytest.mark.parametrize("T", [1, 3])
def test_gpt_oss_layer_matches_reference(scheme, T):
    """gpt-oss's experts (biases b13 / b2 and the clamped SwiGLU, ref.ExpertActivation) through
    the layer op: within moe_q8_ref's 1e-3, the ISA variants and moe_grouped (a prompt's call)
    bit for bit; the biases and the clamp reach the output (dropping either changes it), and
    against the fp32 dequantized experts only the activation quantization error remains."""
    from moestream.kernels.ref import ExpertActivation

    D, I = 160, 96
    g = torch.Generator().manual_seed(4)
    secs = records(scheme, D, I, 3)
    for sec in secs:  # gate / up pre-activations well past the clamp at 7 (as gpt-oss's)
        sec["b13"], sec["b2"] = torch.randn(2 * I, generator=g) * 8, torch.randn(D, generator=g)
    act = ExpertActivation(1.702, 7.0)
    x, w = torch.randn(T, D, generator=g), torch.rand(T, 3, generator=g)
    want = moe_q8_ref(x, secs, w, act)
    got = {isa: native.moe(x, secs, w, isa, act=act) for isa in ISAS}
    assert all(torch.equal(y, got["scalar"]) for y in got.values()), "ISA variants disagree"
    assert rel(got["scalar"], want) <= 1e-3
    bare = [{k: v for k, v in sec.items() if k[0] != "b"} for sec in secs]
    assert rel(native.moe(x, bare, w, act=act), want) > 0.05  # the biases count
    assert rel(native.moe(x, secs, w), want) > 0.05  # the clamped SwiGLU counts
    flat = [t for sec in secs for t in native.record_tensors(sec)]
    bias = [t for sec in secs for t in native.bias_tensors(sec)]
    tok = torch.arange(T).repeat(3)  # every expert over every token: pairs (e, t)
    grouped = native.moe_grouped(x, flat, tok, [0, T, 2 * T, 3 * T], w.t().reshape(-1),
                                 biases=bias, act=act)  # fmt: skip
    one = sum(w[:, e : e + 1] * native.moe(x, [sec], torch.ones(T, 1), act=act)
              for e, sec in enumerate(secs))  # fmt: skip
    assert torch.equal(grouped, one)
    fp = sum(w[:, e : e + 1] * expert_ffn_q(x, sec, 32, act=act) for e, sec in enumerate(secs))
    err = ((got["scalar"] - fp).pow(2).mean() / fp.pow(2).mean()).sqrt().item()
    assert err <= 0.03


@contextmanager
def token_tile(n: int):
    """Activation rows per pass over the weights (1: one row at a time, the one-row kernels)."""
    native.module()._set_token_tile(n)
    try:
        yield
    finally:
        native.module()._set_token_tile(0)


# (D, I): D 352 has 11 blocks of 32 (8 in lanes, then a tail of 3), I 96 has 3 (a tail only);
# K-quants take multiples of 256 and have tiles on AVX-512 only (below it, one row per pass: the
# same path either way, nothing to compare)
TILE_CASES = [
    (s, D, I, isa) for s in ROW_MAJOR for D, I in ((352, 96), (2048, 768)) for isa in ISAS
]
TILE_CASES += [(s, D, I, "avx512") for s in KQUANTS for D, I in K_SHAPES if "avx512" in ISAS]


@pytest.mark.parametrize("scheme,D,I,isa", TILE_CASES)
def test_token_tiles_give_the_one_row_bits(scheme, D, I, isa):
    """Every tile width (4, 3, 2 rows and the last single one of T = 10) against one row per pass."""
    sec = records(scheme, D, I, 1)[0]
    x = torch.randn(10, D, generator=torch.Generator().manual_seed(3))
    calls = [("w13", x, False), ("w2", x[:, :I], False)]
    calls += [("w2", x[:, :I], True)] if scheme in ("int8", "q8_0") else []
    for name, xin, wide in calls:
        with token_tile(1):
            one = native.linear(xin, sec, name, isa, wide=wide)
        assert torch.equal(native.linear(xin, sec, name, isa, wide=wide), one), (name, wide)
    secs, w = records(scheme, D, I, 3, seed=4), torch.rand(10, 3)
    with token_tile(1):
        one = native.moe(x, secs, w, isa)
    assert torch.equal(native.moe(x, secs, w, isa), one)


def grouped_case(scheme: str, E: int = 6, T: int = 9, K: int = 3, seed: int = 5):
    """A prompt's routing over E records: x [T, D], ids/weights [T, K] (distinct ids per row)."""
    g = torch.Generator().manual_seed(seed)
    D, I = (256, 256) if scheme in KQUANTS else (352, 96)  # K-quants: K a multiple of 256
    secs = records(scheme, D, I, E, seed=seed)
    x = torch.randn(T, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    return secs, x, ids, torch.rand(T, K, generator=g)


def grouped_native(x, secs, ids, w, isa=None):
    groups = group_by_expert(ids)
    flat = [t for e, _, _ in groups for t in native.record_tensors(secs[e])]
    off = [0]
    for _, t, _ in groups:
        off.append(off[-1] + t.numel())
    tok = torch.cat([t for _, t, _ in groups])
    pw = torch.cat([w[t, s] for _, t, s in groups])
    return native.moe_grouped(x, flat, tok, off, pw, isa)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("scheme", [*ROW_MAJOR, "q4_k"])
def test_grouped_prefill_is_the_per_expert_calls(scheme, isa):
    """One call for a prompt's experts gives the bits of one call per expert over its rows,
    weighted and index_add_-ed in ascending expert id (StoreExperts._grouped without `_flat`)."""
    secs, x, ids, w = grouped_case(scheme)
    want = torch.zeros_like(x)
    for e, t, s in group_by_expert(ids):
        y = native.moe(x[t], [secs[e]], torch.ones(t.numel(), 1), isa)
        want.index_add_(0, t, y * w[t, s, None])
    assert torch.equal(grouped_native(x, secs, ids, w, isa), want)


def test_grouped_prefill_bits_do_not_depend_on_threads_or_tiles():
    secs, x, ids, w = grouped_case("int4", E=16, T=20, K=4)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with token_tile(1):
            one = grouped_native(x, secs, ids, w)
        torch.set_num_threads(2)
        assert torch.equal(grouped_native(x, secs, ids, w), one)
    finally:
        torch.set_num_threads(n)


def test_grouped_prefill_refuses_bad_offsets():
    secs, x, ids, w = grouped_case("int8", E=2, T=2, K=1)
    flat = [t for sec in secs for t in native.record_tensors(sec)]
    with pytest.raises(RuntimeError, match="offsets must cover"):
        native.moe_grouped(x, flat, torch.tensor([0, 1]), [0, 1, 3], torch.ones(2))
    with pytest.raises(RuntimeError, match="token index out of range"):
        native.moe_grouped(x, flat, torch.tensor([0, 2]), [0, 1, 2], torch.ones(2))


def test_one_expert_is_the_layer_term():
    """Prefill and overlapped decode call one expert at a time, weight 1: the layer op's term."""
    secs = records("int4", 160, 96, 3)
    x, w = torch.randn(1, 160), torch.rand(1, 3)
    acc = torch.zeros(1, 160)
    for e, sec in enumerate(secs):
        acc = acc + w[:, e : e + 1] * native.moe(x, [sec], torch.ones(1, 1))
    assert torch.equal(acc, native.moe(x, secs, w))


@pytest.mark.parametrize("scheme", ["int8", "q4_1"])
def test_threads_do_not_change_bits(scheme):
    secs = records(scheme, 2048, 768, 2)
    x, w = torch.randn(5, 2048), torch.rand(5, 2)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [native.moe(x[:1], secs, w[:1]), native.moe(x, secs, w)]  # decode and prompt
        torch.set_num_threads(2)
        assert torch.equal(native.moe(x[:1], secs, w[:1]), one[0])
        assert torch.equal(native.moe(x, secs, w), one[1])
    finally:
        torch.set_num_threads(n)


def test_bad_sections_are_refused():
    sec = records("int8", 160, 96, 1)[0]
    with pytest.raises(RuntimeError, match="wrong size"):
        native.linear(torch.randn(1, 160), {"w13.q": sec["w13.q"], "w13.s": sec["w2.s"]}, "w13")
    sec = records("q4_1", 160, 96, 1)[0]
    with pytest.raises(RuntimeError, match="wrong size"):
        native.linear(torch.randn(1, 160), {"w13.q": sec["w13.q"], "w13.dm": sec["w2.dm"]}, "w13")


def test_store_providers_default_to_native(tiny_dir, tmp_path):
    from moestream.convert.writer import convert
    from moestream.loader import load_model

    folder = convert(tiny_dir("olmoe", "fused"), tmp_path / "s", make_scheme("int8"), False)
    assert load_model(folder, StreamConfig(resident=True)).provider.native
    assert not load_model(folder, StreamConfig(resident=True, kernel="cpu")).provider.native


def test_a_failed_build_falls_back_and_says_so_once(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(native, "HASHED", (tmp_path / "missing.cpp",))
    monkeypatch.setenv("MOESTREAM_EXT_CACHE", str(tmp_path / "ext"))
    native.module.cache_clear()
    try:
        assert native.module() is None and not native.available()
        assert capsys.readouterr().err.count("native CPU kernels unavailable") == 1
    finally:
        native.module.cache_clear()


def test_the_first_build_says_so_once_and_a_cached_one_says_nothing(monkeypatch, tmp_path, capsys):
    builds = []
    monkeypatch.setattr(native, "_build", lambda name, build: builds.append(build) or "built")
    monkeypatch.setenv("MOESTREAM_EXT_CACHE", str(tmp_path / "ext"))
    native.module.cache_clear()
    try:
        assert native.module() == "built" and native.module() == "built"
        err = capsys.readouterr().err
        assert (
            len(builds) == 1 and err.count("building native CPU kernels (first use, ~1 min)") == 1
        )
        assert f"into {builds[0]}" in err and builds[0].parent == tmp_path / "ext"
        monkeypatch.setattr(native, "_import_built", lambda name, so: "cached")
        native.module.cache_clear()
        assert native.module() == "cached" and capsys.readouterr().err == ""
    finally:
        native.module.cache_clear()


@pytest.mark.parametrize("isa", ISAS)
def test_q4_1_under_the_isa_variable_equals_the_spec(isa, tmp_path):
    """MOESTREAM_NATIVE_ISA (read once per process) caps the variant: a q4_1 record's layer op
    and projections in a fresh process under each value give the spec's projection bits and
    the layer bits the explicit-ISA call gives here."""
    import os
    import subprocess
    import sys

    secs = records("q4_1", 352, 96, 2, seed=6)
    x, w = torch.randn(5, 352, generator=torch.Generator().manual_seed(7)), torch.rand(5, 2)
    torch.save({"secs": secs, "x": x, "w": w}, tmp_path / "case.pt")
    code = (
        "import sys, torch; from moestream.kernels import native; "
        "c = torch.load(sys.argv[1]); s = c['secs']; "
        "y = [native.linear(c['x'], s[0], 'w13'), native.moe(c['x'], s, c['w'])]; "
        "torch.save(y, sys.argv[2]); print(native._isa(None))"
    )
    env = {**os.environ, "MOESTREAM_NATIVE_ISA": isa}
    out = tmp_path / "out.pt"
    run = subprocess.run(
        [sys.executable, "-c", code, tmp_path / "case.pt", out],
        check=True, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert run.stdout.split() == [str(native.ISAS[isa])]  # the variable was read
    lin, layer = torch.load(out)
    assert torch.equal(lin, qlinear_q8(x, secs[0], "w13"))
    assert torch.equal(layer, native.moe(x, secs, w, isa))
