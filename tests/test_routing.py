"""Each MoE block owns its whole routing rule: the weights it gives an expert set chosen elsewhere
(predicted routing) are the weights its own routing gives the same set, for every architecture."""

from __future__ import annotations

import pytest
import torch
from tiny_models import ARCHS

from moestream.experts.predicting import PredictingExperts
from moestream.loader import load_model
from moestream.predict.base import Prediction, Predictor


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ARCHS)
@torch.no_grad()
def test_weights_for_own_topk_equal_route(tiny_dir, arch, dtype):
    model = load_model(tiny_dir(arch), dtype=dtype).model
    g = torch.Generator().manual_seed(5)
    for block in model.moe_blocks:
        x = torch.randn(7, model.args.hidden_size, generator=g).to(model.lm_head.weight.dtype)
        w, ids = block.route(x)
        want = w.to(x.dtype) if block.weights_in_act_dtype else w
        got = block.weights_for(x, ids)
        assert got.dtype == want.dtype, arch
        assert torch.equal(got, want), (arch, block.layer, (got - want).abs().max())
        # Another order of the same set: the same weights, permuted with it (up to the order
        # of the renormalising sum).
        perm = torch.flip(ids, dims=[1])
        torch.testing.assert_close(block.weights_for(x, perm), torch.flip(want, dims=[1]))


class _Repeat(Predictor):
    """Predicts that each next (layer, token) routes to the set this one routed to."""

    def __init__(self, L: int):
        self.L = L

    def observe(self, col, pos, x, ids):
        nxt, npos = (col + 1, pos) if col + 1 < self.L else (0, pos + 1)
        return [Prediction(nxt, npos, tuple(sorted(ids)))]


@pytest.mark.parametrize("arch", ARCHS)
def test_predicted_routing_weighs_by_the_block(tiny_dir, arch):
    """Under predicted routing the forced set's weights are block.weights_for, whatever the rule."""
    loaded = load_model(tiny_dir(arch))
    model, inner = loaded.model, loaded.provider
    wrapper = PredictingExperts(
        inner, _Repeat(len(model.moe_blocks)), model.moe_blocks, "predicted"
    )
    model.set_provider(wrapper)
    seen = []
    real = inner.experts
    inner.experts = lambda layer, x, ids, w: (
        seen.append((layer, x, ids, w)) or real(layer, x, ids, w)
    )
    wrapper.reset()
    from moestream.engine.kv_cache import KVCache

    cache = KVCache(model.args, 8, torch.float32)
    with torch.no_grad():
        model(torch.tensor([1, 2, 3]), cache, 0)
        model(torch.tensor([4]), cache, 3)
    blocks = {b.layer: b for b in model.moe_blocks}
    forced = [s for s in seen if s[1].shape[0] == 1]
    assert forced and wrapper.stats()["predict_forced_layers"] > 0
    for layer, x, ids, w in forced:
        assert torch.equal(w, blocks[layer].weights_for(x, ids)), (arch, layer)
