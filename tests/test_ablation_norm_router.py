"""benchmarks/ablations/norm_router.py: the residual add, post-attention norm and router in one
launch give the product's two launches' sum bit for bit, its norm within one unit in the last
place, its experts and its weights (the interpreter on CPU, compiled on CUDA)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks" / "ablations"))
import norm_router as abl  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DT = torch.bfloat16 if DEVICE == "cuda" else torch.float16  # the product's norm: 16-bit rows


@pytest.mark.parametrize("T,D,E", [(1, 1024, 16), (2, 256, 24)])
def test_fused_add_norm_route_gives_the_two_launches_results(T, D, E):
    """Rows in two K chunks (D 1024) or one, one and two tokens, experts not a power of two."""
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(T * D)
    x, y = (torch.randn(T, D, generator=g).to(DEVICE, DT) for _ in range(2))
    nw = (1 + 0.1 * torch.randn(D, generator=g)).to(DEVICE, DT)
    gate = (torch.randn(E, D, generator=g) / D**0.5).to(DEVICE, DT)
    fused = abl.add_norm_route(x, y, nw, gate, 4, True, torch.float32)
    check = abl.agreement(fused, abl.two_launches(x, y, nw, gate, 4, True, torch.float32))
    assert all(check[k] for k in ("sum_equal", "norm_within_ulp", "ids_equal", "weights_close"))
    s, h, w, ids = fused
    assert torch.equal(s, x + y)  # torch's add, one rounding
    ref = (s.float() * torch.rsqrt(s.float().pow(2).mean(-1, keepdim=True) + abl.EPS)).to(DT)
    torch.testing.assert_close(h, nw * ref, rtol=2**-7, atol=0)  # RMSNorm.forward's rule
    p = torch.softmax((h.float() @ gate.float().t()), -1)
    top = p.topk(4, -1)
    assert torch.equal(ids.sort(-1).values, top.indices.sort(-1).values)
    assert torch.allclose(w.sum(-1), torch.ones(T, device=DEVICE))  # renormalised
