"""benchmarks/ablations/mma_int4_cuda.py: the tensor-core gate/up ablation's layout and spec on the
CPU (each nibble where the kernel's extraction reads it, for the fragment each lane feeds the
tensor cores), its kernel against the float64 spec on CUDA (with CuPy, as on the GPU machine)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks" / "ablations"))
import mma_int4_cuda as abl  # noqa: E402

from moestream.kernels.ref import dequantize  # noqa: E402
from moestream.quant import int4_to_rows, make_scheme, quantize  # noqa: E402


def _experts(E: int, N: int, D: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    s = make_scheme("int4")
    qs = [quantize(s, torch.randn(N, D, generator=g) / D**0.5) for _ in range(E)]
    pairs = [int4_to_rows(q["q"], q["sz"], 32) for q in qs]
    return qs, torch.stack([r for r, _ in pairs]), torch.stack([w for _, w in pairs])


def test_mma_layout_puts_each_nibble_in_its_lanes_fragment():
    """For every tile, group and lane: the words the kernel takes (group 2j: words 0, 1; 2j + 1:
    words 2, 3) give, through (w >> s) & 0x000F000F for s = 0, 4, 8, 12, the nibbles of the A
    fragment rows g, g + 8 and inputs 2c, 2c + 1 (+ 8, + 16, + 24) of the group: the tile's
    weights, each once."""
    E, N, D = 2, 48, 128
    _, rows, _ = _experts(E, N, D, 1)
    lay = abl.mma_layout(rows).to(torch.int64) & 0xFFFFFFFF
    b = rows.view(E, N, D // 32, 16).to(torch.int64)
    want = torch.cat([b & 15, b >> 4], -1)  # [E, N, K/32, 32]
    got = torch.full_like(want, -1)
    for lane in range(32):
        g, c = lane // 4, lane % 4
        for j in range(D // 32):
            w = lay[:, :, j // 2, lane, 2 * (j % 2) : 2 * (j % 2) + 2]  # [E, N/16, 2]: rows g, g+8
            for half in range(2):
                for sh, base in ((0, 0), (4, 8), (8, 16), (12, 24)):
                    v = (w[..., half] >> sh) & 0x000F000F
                    r = torch.arange(N // 16) * 16 + g + 8 * half
                    got[:, r, j, base + 2 * c] = v & 0xF
                    got[:, r, j, base + 2 * c + 1] = v >> 16
    assert torch.equal(got, want)


def test_h_spec_is_silu_of_gate_times_up_of_the_dequantized_weights():
    E, I, D = 3, 32, 128
    qs, rows, words = _experts(E, 2 * I, D, 2)
    x = torch.randn(D).bfloat16()
    ids = torch.tensor([2, 0, 1])
    W = torch.stack(
        [dequantize({"w.q": q["q"], "w.sz": q["sz"]}, "w", 32, torch.float64) for q in qs]
    )
    gu = W[ids] @ x.double()
    want = torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]
    assert torch.allclose(abl.h_spec(x, ids, rows, words, I), want, rtol=1e-12, atol=1e-12)
    assert abl.within_spec(want.bfloat16(), want) and not abl.within_spec(
        (want * 1.02).bfloat16(), want
    )


@pytest.mark.cuda
@pytest.mark.parametrize("kw", [2, 4])
def test_cuda_mma_gate_up_matches_the_float64_spec(kw):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pytest.importorskip("cupy")
    E, I, D = 8, 64, 256
    _, rows, words = _experts(E, 2 * I, D, 3)
    rows, words = rows.cuda(), words.cuda()
    x = torch.randn(1, D).cuda().bfloat16()
    ids = torch.tensor([5, 0, 7, 7, 2], device="cuda")
    h = torch.full((ids.numel(), I), float("nan"), device="cuda", dtype=torch.bfloat16)
    fn, *_ = abl.compile_kernels(D, I, kw)
    abl.gate_up(fn, abl.mma_layout(rows), words, x, ids, h, I, kw)
    torch.cuda.synchronize()
    assert abl.within_spec(h.cpu(), abl.h_spec(x[0].cpu(), ids.cpu(), rows.cpu(), words.cpu(), I))
