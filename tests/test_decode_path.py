"""The one-token decode path's shortcuts against the plain math they replace."""

from __future__ import annotations

import pytest
import torch

from moestream.engine.kv_cache import KVCache
from moestream.experts.resident import ResidentExperts
from moestream.kernels.ref import moe_ref
from moestream.loader import load_model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 2, 8])
@pytest.mark.parametrize("weight_dtype", ["act", "fp32"])  # Qwen casts the weights; Mixtral not
def test_resident_decode_matches_reference(dtype, k, weight_dtype):
    g = torch.Generator().manual_seed(k)
    E, D, I = 16, 64, 32
    w13 = torch.randn(E, 2 * I, D, generator=g).to(dtype)
    w2 = torch.randn(E, D, I, generator=g).to(dtype)
    provider = ResidentExperts({3: w13}, {3: w2})
    wdt = dtype if weight_dtype == "act" else torch.float32
    for _ in range(10):  # the slot buffers are reused between calls
        x = torch.randn(1, D, generator=g).to(dtype)
        ids = torch.randperm(E, generator=g)[:k][None]
        w = torch.rand(1, k, generator=g).to(wdt)
        got = provider.experts(3, x, ids, w)
        want = moe_ref(x, ids, w, lambda e: (w13[e], w2[e]))
        assert got.dtype == dtype and got.shape == (1, D)
        if dtype == torch.float32:  # one [1,K]@[K,D] GEMM sums in another order
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
        else:  # transformers' rounding steps kept: bit-identical
            assert torch.equal(got, want)


def test_fused_qkv_shares_memory_and_follows_a_cast(tiny_dir):
    folder = tiny_dir("qwen2_moe", "fused")  # q/k/v biases fused too
    ours = load_model(folder)
    attn = ours.model.model.layers[0].self_attn
    # Fused by build_model before loading, not on first use: the weights were copied into the
    # views, so no unfused copy ever coexisted with them (peak memory, test_store_memory).
    fused = attn._fused[0]
    assert attn.q_proj.weight.untyped_storage().data_ptr() == fused.data_ptr()
    prompt = torch.arange(7)
    with torch.inference_mode():
        first = ours.model(prompt, KVCache(ours.args, 16, torch.float32), 0)
    assert attn._fused[0] is fused
    storages = {
        p.untyped_storage().data_ptr()
        for m in (attn.q_proj, attn.k_proj, attn.v_proj)
        for p in (m.weight, m.bias)
    }
    assert len(storages) == 2  # one fused weight, one fused bias: no second copy

    # A device move replaces every parameter (nn.Module._apply); clones do the same here.
    # The fusion must be remade from the new parameters, not keep serving the old tensor.
    old = attn._fused[0].data_ptr()
    with torch.no_grad():
        ours.model._apply(lambda t: t.clone())
        attn.q_proj.weight.mul_(0.5)  # and a changed weight must show in the output
    with torch.inference_mode():
        again = ours.model(prompt, KVCache(ours.args, 16, torch.float32), 0)
    assert attn._fused[0].data_ptr() != old
    assert attn.q_proj.weight.untyped_storage().data_ptr() == attn._fused[0].data_ptr()
    assert not torch.allclose(again, first)
    with torch.no_grad():
        attn.q_proj.weight.mul_(2.0)  # exact: back to the loaded weights
    with torch.inference_mode():
        restored = ours.model(prompt, KVCache(ours.args, 16, torch.float32), 0)
    assert torch.equal(restored, first)
