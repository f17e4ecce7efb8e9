"""Quantizers and CPU kernels against kernels/ref.py.

Tolerances: int8, bf16, q4_0, q4_1, q5_0 and mxfp4 CPU kernels are the reference math (exact). int4 uses torch's packed
kernel, which accumulates in another order: max abs error <= 1e-4 * sqrt(K) * max|y| relative."""

from __future__ import annotations

import pytest
import torch

from moestream.config import ConfigError
from moestream.kernels.cpu import int4_kernel_ok, qlinear_cpu
from moestream.kernels.ref import dequantize, qlinear_ref
from moestream.quant import QuantScheme, make_scheme, pack_int4, quantize, unpack_int4


def _sections(scheme, w):
    return {f"w.{k}": v for k, v in quantize(scheme, w).items()}


@pytest.mark.parametrize("n", [64, 96, 128, 1536])
def test_int4_pack_roundtrip(n):
    q = torch.randint(0, 16, (n, 64), dtype=torch.uint8)
    assert torch.equal(unpack_int4(pack_int4(q)), q)


def test_int4_layout_is_torchs_cpu_layout():
    # The store packs int4 as torch's AVX-512 kernel does; where torch dispatches another vector
    # width (seen: an AMD EPYC with AVX-512 reported as "AVX2") it packs differently and the
    # dequantizing reference runs instead (covered by the kernel-vs-reference tests below).
    cap = torch.backends.cpu.get_cpu_capability()
    if "AVX512" not in cap:
        pytest.skip(f"torch dispatches {cap} here, not the AVX-512 layout the store is written in")
    assert int4_kernel_ok(), "this torch packs int4 differently: the int4 kernel falls back to ref"


@pytest.mark.parametrize("quant", ["bf16", "int8", "int4", "q4_0", "q4_1", "q5_0", "q8_0", "mxfp4"])
@pytest.mark.parametrize("shape", [(64, 64), (128, 256), (1536, 2048)])
@pytest.mark.parametrize("T", [1, 5])
def test_cpu_kernel_matches_reference(quant, shape, T):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(*shape, generator=g) / shape[1] ** 0.5
    sec = _sections(make_scheme(quant), w)
    x = torch.randn(T, shape[1], generator=g)
    want, got = qlinear_ref(x, sec, "w", 32), qlinear_cpu(x, sec, "w", 32)
    if quant == "int4":
        # The int4 kernel multiplies bf16 activations (torch's fast path) and returns bf16-rounded
        # results: documented tolerance 1% of the output's magnitude (bf16 has 8 mantissa bits).
        tol = 1e-2 * want.abs().max().item()
        assert (got - want).abs().max().item() <= tol
        # ... and close to the reference on bf16-rounded activations (only output rounding differs).
        ref_b = qlinear_ref(x.bfloat16().float(), sec, "w", 32)
        assert (got - ref_b).abs().max().item() <= 4e-3 * want.abs().max().item()
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize(
    "quant,bound",
    [("bf16", 0.005), ("int8", 0.008), ("int4", 0.09), ("q4_0", 0.095), ("q4_1", 0.09)]
    + [("q5_0", 0.05), ("q8_0", 0.008), ("mxfp4", 0.12)],
)
def test_quantization_error_is_bounded(quant, bound):
    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(1))
    d = dequantize(_sections(make_scheme(quant), w), "w", 32, torch.float32)
    assert ((d - w).norm() / w.norm()).item() < bound


def test_int4_asymmetric_is_better():
    """The measurement behind quant.INT4_CHOICE (sym ~0.097, asym ~0.078 relative RMS error)."""
    w = torch.randn(1536, 2048, generator=torch.Generator().manual_seed(0))
    err = {}
    for sym in (True, False):
        d = dequantize(_sections(QuantScheme("int4", 32, sym), w), "w", 32, torch.float32)
        err[sym] = ((d - w).norm() / w.norm()).item()
    assert err[False] < 0.85 * err[True]
    assert make_scheme("int4").symmetric is False


def test_int8_is_symmetric_per_block_of_32():
    w = torch.zeros(2, 64)
    w[0, :32] = torch.linspace(-1, 1, 32)
    w[0, 32:] = 100.0  # a large block must not coarsen the other block's scale
    t = quantize(make_scheme("int8"), w)
    assert t["s"].shape == (2, 2) and t["q"].dtype == torch.int8
    assert abs(t["s"][0, 0].item() - 1 / 127) < 1e-7


def test_q4_0_is_llama_cpps_q4_0():
    """quantize(q4_0) writes the bytes llama.cpp's Q4_0 quantizer writes (the gguf package's port
    of quantize_row_q4_0_ref), split into sections, and dequantizes to its values bit for bit."""
    import gguf
    import numpy as np

    T = gguf.GGMLQuantizationType.Q4_0
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(4))
    w[0, :32] = 0.0  # an all-zero block: d = 0, every q = 8
    sec = quantize(make_scheme("q4_0"), w)
    theirs = gguf.quants.quantize(w.numpy(), T).reshape(48, -1, 18)  # per block: fp16 d, 16 bytes
    assert np.array_equal(theirs[..., :2].copy().view(np.float16)[..., 0], sec["d"].numpy())
    assert np.array_equal(theirs[..., 2:].reshape(48, -1), sec["q"].numpy())
    want = torch.from_numpy(gguf.quants.dequantize(theirs.reshape(48, -1), T))
    assert torch.equal(dequantize(_sections(make_scheme("q4_0"), w), "w", 32, torch.float32), want)
    with pytest.raises(ConfigError, match="q4_0 is symmetric blocks of 32"):
        make_scheme("q4_0", 64)


def test_q4_1_is_llama_cpps_q4_1():
    """quantize(q4_1) writes the bytes llama.cpp's Q4_1 quantizer writes (the gguf package's port
    of quantize_row_q4_1_ref), split into the nibbles and the (d, m) pairs, and dequantizes to its
    values bit for bit."""
    import gguf
    import numpy as np

    T = gguf.GGMLQuantizationType.Q4_1
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(6))
    w[0, :32] = 0.25  # a constant block: d = 0, every q = 0, m the value
    w[1, 32:64] = torch.rand(32, generator=torch.Generator().manual_seed(7)) + 3.0  # all positive
    sec = quantize(make_scheme("q4_1"), w)
    theirs = gguf.quants.quantize(w.numpy(), T).reshape(48, -1, 20)  # fp16 d, fp16 m, 16 bytes
    assert np.array_equal(theirs[..., :4].copy().view(np.float16), sec["dm"].numpy())
    assert np.array_equal(theirs[..., 4:].reshape(48, -1), sec["q"].numpy())
    want = torch.from_numpy(gguf.quants.dequantize(theirs.reshape(48, -1), T))
    got = dequantize(_sections(make_scheme("q4_1"), w), "w", 32, torch.float32)
    assert torch.equal(got, want)
    assert got[0, :32].eq(0.25).all() and sec["dm"][0, 0, 0] == 0
    assert make_scheme("q4_1").symmetric is False
    with pytest.raises(ConfigError, match="q4_1 is blocks of 32"):
        make_scheme("q4_1", 64)


def _assert_gguf_blocks(name: str, w: torch.Tensor, nbytes: int) -> None:
    """quantize(name) of w [48, 256] writes the gguf package's blocks of that type byte for byte
    (its port of llama.cpp's quantizer), which dequantize to its values bit for bit; w's first
    block is all zero."""
    import gguf
    import numpy as np

    T = gguf.GGMLQuantizationType[name.upper()]
    sec = quantize(make_scheme(name), w)
    theirs = gguf.quants.quantize(w.numpy(), T)
    assert sec["q"].shape == (48, 8, nbytes)
    assert np.array_equal(theirs.reshape(48, 8, nbytes), sec["q"].numpy())
    want = torch.from_numpy(gguf.quants.dequantize(theirs, T))
    got = dequantize(_sections(make_scheme(name), w), "w", 32, torch.float32)
    assert torch.equal(got, want) and got[0, :32].eq(0).all()


def test_q5_0_is_llama_cpps_q5_0():
    """quantize(q5_0) writes the blocks llama.cpp's Q5_0 quantizer writes (the gguf package's port
    of quantize_row_q5_0_ref: d, the 5th bits in qh, the nibbles), kept whole, and they
    dequantize to its values bit for bit; every 5-bit value survives pack / unpack."""

    from moestream.quant import pack_q5_0, unpack_q5_0

    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(8))
    w[0, :32] = 0.0  # an all-zero block: d = 0, every q = 16
    w[1, 32:64] = torch.linspace(-3.0, 5.0, 32)  # every bit of qh in use, the max positive
    _assert_gguf_blocks("q5_0", w, 22)
    q = torch.randint(0, 32, (5, 4, 32), generator=torch.Generator().manual_seed(9))
    d = torch.randn(5, 4).half()
    back, d2 = unpack_q5_0(pack_q5_0(q.to(torch.uint8), d))
    assert torch.equal(back, (q - 16).view(5, 128).to(torch.int8)) and torch.equal(d2, d)
    with pytest.raises(ConfigError, match="q5_0 is symmetric blocks of 32"):
        make_scheme("q5_0", 64)


def test_mxfp4_is_llama_cpps_mxfp4():
    """quantize(mxfp4) writes the blocks llama.cpp's MXFP4 quantizer writes (the gguf package's
    port of quantize_row_mxfp4_ref: the e8m0 exponent, the nearest doubled e2m1 code, a tie to
    the first), and they dequantize to its values bit for bit (the subnormal scales of e < 2
    included); every code survives unpack."""
    import gguf

    from moestream.quant import MXFP4_X2, unpack_mxfp4

    T = gguf.GGMLQuantizationType.MXFP4
    g = torch.Generator().manual_seed(8)
    w = torch.randn(48, 256, generator=g) * torch.logspace(-3, 3, 48)[:, None]
    w[0, :32] = 0.0  # an all-zero block: e = 0, every code 0
    w[1, 32:64] = torch.arange(-16, 16) * 0.25  # ties between neighbouring values
    _assert_gguf_blocks("mxfp4", w, 17)
    blocks = torch.randint(0, 256, (3, 2, 17), dtype=torch.uint8, generator=g)
    blocks[0, 0, 0], blocks[0, 1, 0] = 0, 1  # e8m0 0 and 1: subnormal half-scales
    q, s = unpack_mxfp4(blocks)
    want = gguf.quants.dequantize(blocks.numpy().reshape(-1), T).reshape(3, 64)
    assert torch.equal(
        q.float().view(3, 2, 32).mul(s[..., None]).view(3, 64), torch.from_numpy(want)
    )
    assert sorted(set(q.flatten().tolist())) == sorted(set(MXFP4_X2))
    with pytest.raises(ConfigError, match="mxfp4 is symmetric blocks of 32"):
        make_scheme("mxfp4", 64)


def test_mxfp4_keeps_mxfp4_values():
    """A hub checkpoint's MXFP4 experts, dequantized as convert reads them (convert.mxfp4), come
    back from quantize(mxfp4) as the same values: --quant mxfp4 keeps gpt-oss's weights exactly."""
    from moestream.convert.mxfp4 import dequantize_mxfp4

    g = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (64, 8, 16), dtype=torch.uint8, generator=g)  # hub layout
    scales = torch.randint(110, 135, (64, 8), dtype=torch.uint8, generator=g)
    w = dequantize_mxfp4(blocks, scales).float()
    got = dequantize(_sections(make_scheme("mxfp4"), w), "w", 32, torch.float32)
    assert torch.equal(got, w)


def test_q8_0_is_llama_cpps_q8_0():
    """quantize(q8_0) writes llama.cpp's Q8_0 bytes (the gguf package's port of
    quantize_row_q8_0_ref: round half away from zero), split into q and the fp16 d, and
    dequantizes to its values bit for bit."""
    import gguf
    import numpy as np

    T = gguf.GGMLQuantizationType.Q8_0
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(5))
    w[0, :32] = 0.0  # an all-zero block: d = 0, every q = 0
    w[1, :32] = torch.arange(32) - 15.5  # halves: rounded away from zero, not to even
    sec = quantize(make_scheme("q8_0"), w)
    theirs = gguf.quants.quantize(w.numpy(), T).reshape(48, -1, 34)  # per block: fp16 d, 32 int8
    assert np.array_equal(theirs[..., :2].copy().view(np.float16)[..., 0], sec["d"].numpy())
    assert np.array_equal(theirs[..., 2:].reshape(48, -1).view(np.int8), sec["q"].numpy())
    want = torch.from_numpy(gguf.quants.dequantize(theirs.reshape(48, -1), T))
    assert torch.equal(dequantize(_sections(make_scheme("q8_0"), w), "w", 32, torch.float32), want)
    with pytest.raises(ConfigError, match="q8_0 is symmetric blocks of 32"):
        make_scheme("q8_0", 64)
