"""The capturable decode step (engine/graph.py): the position as a device tensor, attention over
the whole static cache with later positions masked. On the CPU it runs eagerly and must give the
eager decode's tokens and logits (within a masked reduction's rounding) for every architecture
whose layers are all attention; on CUDA the replayed graph must give the same logits as its
eager first step."""

from __future__ import annotations

import pytest
import torch
from tiny_models import ARCHS

from moestream.engine.graph import bucket
from moestream.engine.kv_cache import KVCache, StaticKVCache
from moestream.loader import load_model

PROMPT = [3, 17, 5, 9, 12, 40, 7]


def _decode(model, cache, static: bool, n: int):
    out, rows = [], []
    with torch.no_grad():
        logits = model(torch.tensor(PROMPT), cache, 0, last_only=True)[-1]
        for pos in range(len(PROMPT), len(PROMPT) + n):
            rows.append(logits)
            out.append(int(logits.argmax()))
            tok = torch.tensor([out[-1]])
            if static:
                cache.pos.fill_(pos)
                logits = model(tok, cache, cache.pos, last_only=True)[-1]
            else:
                logits = model(tok, cache, pos, last_only=True)[-1]
    return out, torch.stack(rows)


@pytest.mark.parametrize("arch", ARCHS)
def test_static_decode_equals_eager(tiny_dir, arch):
    loaded = load_model(tiny_dir(arch))
    args = loaded.args
    if not all(args.attention_layers):
        pytest.skip("recurrent layers are not captured (engine.graph.graphable)")
    n = 12
    want, want_logits = _decode(loaded.model, KVCache(args, 64, torch.float32), False, n)
    # A reused cache: stale rows past the prompt must not leak through the mask.
    static = StaticKVCache(args, 64, torch.float32)
    for t in static.k + static.v:
        if t is not None:
            t.normal_()
    got, got_logits = _decode(loaded.model, static, True, n)
    assert got == want, arch
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-5)


def test_buckets():
    assert bucket(10, 4096) == 256 and bucket(257, 4096) == 512 and bucket(5000, 4096) == 4096
