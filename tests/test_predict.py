"""Routing predictors and the prefetching pipeline: exact routing with any predictor is
bit-identical to resident; predictors agree with their definitions; prerouter training helps."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moestream.convert.writer import convert
from moestream.engine.kv_cache import KVCache
from moestream.experts.config import StreamConfig, min_budget
from moestream.experts.predicting import attach
from moestream.loader import load_model
from moestream.obs.trace import Trace, TraceRecorder
from moestream.predict.base import PREDICTORS, Prediction
from moestream.predict.oracle import OraclePredictor
from moestream.predict.pipeline import make_predictor
from moestream.predict.prerouter import PrerouterHeads, PrerouterPredictor
from moestream.predict.recall import overall, replay_recall
from moestream.predict.temporal import TemporalPredictor
from moestream.predict.train import TrainConfig, train_heads
from moestream.quant import make_scheme
from moestream.store.format import Store
from moestream.store.io import IOConfig

ARCHS4 = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")
PROMPT = torch.randint(0, 320, (10,), generator=torch.Generator().manual_seed(3)).tolist()


@pytest.fixture(scope="module")
def stores(tiny_dir, tmp_path_factory):
    root, cache = tmp_path_factory.mktemp("pstores"), {}

    def get(arch: str):
        if arch not in cache:
            cache[arch] = convert(tiny_dir(arch), root / arch, make_scheme("int8"), False)
        return cache[arch]

    return get


def record(model, prompt: list[int], n: int, hidden: bool = False) -> tuple[list[int], Trace]:
    """Greedy tokens of a resident run and its routing as an in-memory trace."""
    blocks = model.moe_blocks
    rows, hid = [], []

    def sink(ids, w, h):
        rows.append(ids.copy())  # the recorder reuses its buffers
        if h is not None:
            hid.append(h.copy())

    model.set_observer(
        TraceRecorder([b.layer for b in blocks], blocks[0].k, model.args.hidden_size, hidden, sink)
    )
    toks = greedy(model, prompt, n)[0]
    model.set_observer(None)
    ids = np.concatenate(rows)
    t = Trace.from_ids(ids, model.args.num_experts, prompt_tokens=[len(prompt)])
    t.hidden = np.concatenate(hid) if hidden else None
    return toks, t


def greedy(model, prompt: list[int], n: int):
    model.moe_blocks[0].provider.reset()
    cache = KVCache(model.args, len(prompt) + n, torch.float32)
    out, seen = [], []
    with torch.no_grad():
        logits = model(torch.tensor(prompt), cache, 0, last_only=True)[-1]
        for pos in range(len(prompt), len(prompt) + n):
            seen.append(logits)
            out.append(int(logits.argmax()))
            logits = model(torch.tensor([out[-1]]), cache, pos, last_only=True)[-1]
    return out, torch.stack(seen)


def untrained_heads(model, next_state: bool = False) -> PrerouterHeads:
    torch.manual_seed(0)
    a = model.args
    heads = PrerouterHeads(
        len(model.moe_blocks), a.hidden_size, a.num_experts, a.num_experts_per_tok, 16, next_state
    )
    heads.warm_start([b.gate.weight for b in model.moe_blocks])
    return heads


@pytest.mark.parametrize("arch", ARCHS4)
def test_exact_routing_with_every_predictor_is_bit_identical(stores, arch):
    folder = stores(arch)
    store = Store(folder)
    ref = load_model(folder, StreamConfig(resident=True)).model
    want, want_logits = greedy(ref, PROMPT, 12)
    _, trace = record(ref, PROMPT, 12)
    total = len(store.crc) * store.args.num_experts * store.layout.size
    io = IOConfig(mode="pagecache", threads=2)
    for budget in (min_budget(store), total // 2):
        for name in PREDICTORS:
            model = load_model(folder, StreamConfig(memory_budget=budget, io=io)).model
            heads = untrained_heads(model)
            p = attach(
                model,
                model.moe_blocks[0].provider,
                make_predictor(name, model, heads=heads, trace=trace),
            )
            got, logits = greedy(model, PROMPT, 12)
            s = p.stats()
            p.close()
            assert got == want, (name, budget)
            assert torch.equal(logits, want_logits), (name, budget)
            if name == "oracle":  # the trace is this run: every prediction is right
                assert s["predict_correct"] == s["predict_predicted"] > 0
            # (temporal names last token's experts, which an LRU cache of this size still holds)
            if name not in ("none", "temporal") and budget == total // 2:
                assert s["prefetch_reads"] > 0, name
            assert (
                s["prefetch_used"] + s["prefetch_wasted_bytes"] // store.layout.size
                <= s["prefetch_reads"]
            )
        # Two layers ahead, reads filtered by confidence: still only prefetching.
        model = load_model(folder, StreamConfig(memory_budget=budget, io=io)).model
        p = attach(
            model,
            model.moe_blocks[0].provider,
            make_predictor("stale-gate", model, ahead=2),
            min_score=0.2,
        )
        got, logits = greedy(model, PROMPT, 12)
        p.close()
        assert got == want and torch.equal(logits, want_logits), budget


def test_predicted_routing_with_the_oracle_matches_exact(stores):
    folder = stores("qwen2_moe")  # no renormalisation: weights are the router's probabilities
    ref = load_model(folder, StreamConfig(resident=True)).model
    want, want_logits = greedy(ref, PROMPT, 10)
    _, trace = record(ref, PROMPT, 10)
    model = load_model(folder, StreamConfig(resident=True)).model
    p = attach(
        model,
        model.moe_blocks[0].provider,
        make_predictor("oracle", model, trace=trace),
        routing="predicted",
    )
    got, logits = greedy(model, PROMPT, 10)
    assert got == want
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
    assert p.stats()["predict_forced_layers"] > 0


def test_predicted_routing_uses_the_prediction(stores):
    """A predictor that always names experts {0, 1}: those run, weighted by the router."""
    folder = stores("olmoe")
    model = load_model(folder, StreamConfig(resident=True)).model

    class Fixed(TemporalPredictor):
        def observe(self, col, pos, x, ids):
            nxt, npos = (col + 1, pos) if col + 1 < self.L else (0, pos + 1)
            return [Prediction(nxt, npos, (0, 1))]

    p = attach(
        model, model.moe_blocks[0].provider, Fixed(len(model.moe_blocks)), routing="predicted"
    )
    used = []
    inner_experts = p.inner.experts
    p.inner.experts = lambda layer, x, ids, w: (
        used.append((layer, x, ids.tolist(), w)) or inner_experts(layer, x, ids, w)
    )
    greedy(model, PROMPT, 3)
    decode = [u for u in used if len(u[2]) == 1]
    assert decode and all(sorted(u[2][0]) == [0, 1] for u in decode)
    blocks = {b.layer: b for b in model.moe_blocks}
    for layer, x, ids, w in decode:
        b = blocks[layer]
        want = torch.softmax(b.gate(x), -1, dtype=torch.float32)[:, ids[0]]
        want = want / want.sum() if b.renorm else want
        torch.testing.assert_close(w, want.to(w.dtype))


def test_temporal_and_oracle_on_a_hand_made_trace():
    # 1 sequence, 4 tokens (prompt 1), 2 layers, top-2 of 4 experts.
    ids = [
        [[0, 1], [2, 3]],
        [[0, 1], [2, 0]],
        [[1, 2], [2, 0]],
        [[1, 2], [3, 1]],
    ]
    t = Trace.from_ids(ids, 4, prompt_tokens=[1])
    rows = replay_recall(TemporalPredictor(2), t)
    # layer 0 at t=1..3 predicted from t-1: {0,1}->{0,1}: 2, {0,1}->{1,2}: 1, {1,2}->{1,2}: 2
    assert rows[0]["correct"] == 5 and rows[0]["routed"] == 6
    # layer 1: {2,3}->{0,2}: 1, {0,2}->{0,2}: 2, {0,2}->{1,3}: 0
    assert rows[1]["correct"] == 3 and rows[1]["routed"] == 6
    assert overall(rows) == pytest.approx(8 / 12)
    oracle = OraclePredictor(t)
    rows = replay_recall(oracle, t, decode_only=False)
    assert all(r["recall"] == 1.0 for r in rows)
    assert rows[0]["positions"] == 3 and rows[1]["positions"] == 4  # layer 0 of token 0: nobody
    p = OraclePredictor(t)
    p.reset()
    assert p.observe(0, 2, torch.empty(0), [1, 2]) == [Prediction(1, 2, (0, 2))]
    assert p.observe(1, 2, torch.empty(0), [0, 2]) == [Prediction(0, 3, (1, 2))]
    assert p.observe(1, 3, torch.empty(0), [1, 3]) == []  # past the end


def test_stale_gate_is_next_router_on_this_hidden(stores):
    model = load_model(stores("mixtral"), StreamConfig(resident=True)).model
    _, t = record(model, PROMPT, 6, hidden=True)
    pred = make_predictor("stale-gate", model)
    blocks = model.moe_blocks
    for row in (3, 12):
        for col in range(len(blocks) - 1):
            x = torch.from_numpy(t.hidden[row, col]).float()
            (p,) = pred.observe(col, row, x, t.ids[row, col].tolist())
            logits = blocks[col + 1].gate.weight @ x
            want = torch.topk(torch.softmax(logits[None], -1), blocks[0].k).indices
            assert p.layer == col + 1 and p.pos == row
            assert p.experts == tuple(sorted(want[0].tolist()))
        assert pred.observe(len(blocks) - 1, row, x, [0, 1]) == []


def test_stale_gate_scores_and_two_layers_ahead(stores):
    model = load_model(stores("qwen3_moe"), StreamConfig(resident=True)).model
    _, t = record(model, PROMPT, 4, hidden=True)
    blocks = model.moe_blocks
    pred = make_predictor("stale-gate", model, ahead=2)
    x = torch.from_numpy(t.hidden[5, 0]).float()
    ps = pred.observe(0, 5, x, t.ids[5, 0].tolist())
    assert [(p.layer, p.pos) for p in ps] == [(1, 5), (2, 5)][: len(blocks) - 1]
    for p in ps:
        probs = torch.softmax(blocks[p.layer].gate(x[None]).float(), -1)[0]
        assert p.experts == tuple(sorted(torch.topk(probs, blocks[0].k).indices.tolist()))
        torch.testing.assert_close(torch.tensor(p.scores), probs[list(p.experts)])


def test_ranked_prediction_orders_by_confidence():
    p = Prediction(1, 0, (3, 5, 9), (0.1, 0.5, 0.01))
    assert p.ranked() == [5, 3, 9]
    assert p.ranked(min_score=0.05) == [5, 3]
    assert Prediction(1, 0, (3, 5)).ranked(min_score=0.9) == [3, 5]  # no scores: all, as given


def test_prerouter_input_and_warm_start(stores):
    model = load_model(stores("olmoe"), StreamConfig(resident=True)).model
    heads = untrained_heads(model)
    E = model.args.num_experts
    h = torch.randn(2, model.args.hidden_size)
    f = heads.features(h, torch.tensor([[1, 4], [0, 2]]), torch.tensor([[-1, -1], [5, 7]]))
    assert torch.equal(f[:, : h.shape[1]], h)
    assert f[0, h.shape[1] :].nonzero()[:, 0].tolist() == [1, 4]  # no previous token
    assert f[1, h.shape[1] :].nonzero()[:, 0].tolist() == [0, 2, E + 5, E + 7]
    # Warm start: fc2 = 0, so a head's logits are router N+1 applied to the hidden part.
    torch.testing.assert_close(heads.heads[0](f), h @ model.moe_blocks[1].gate.weight.t())
    pred = PrerouterPredictor(heads)
    (p,) = pred.observe(0, 5, h[0], [1, 4])
    assert (p.layer, p.pos) == (1, 6)  # next layer, next token


def test_next_state_heads_run_at_the_next_tokens_layer_0(stores, tmp_path):
    model = load_model(stores("olmoe"), StreamConfig(resident=True)).model
    heads = untrained_heads(model, next_state=True)
    with torch.no_grad():
        for h in heads.heads:
            h.fc1.weight.normal_(0, 0.5)
            h.fc2.weight.normal_(0, 0.5)
    L, D, K = len(model.moe_blocks), model.args.hidden_size, model.args.num_experts_per_tok
    x = torch.randn(2, L, D)
    ids = [[[(3 * c + t + j) % model.args.num_experts for j in range(K)] for c in range(L)]
           for t in range(2)]  # fmt: skip
    pred = PrerouterPredictor(PrerouterHeads.load(heads.save(tmp_path / "h.heads")))
    assert pred.heads.next_state
    # Token 4: states are kept, nothing is predicted (token 3 left none).
    assert all(pred.observe(c, 4, x[0, c], ids[0][c]) == [] for c in range(L))
    # Token 5's layer 0: every head runs on token 4's states and token 5's column-0 input.
    preds = pred.observe(0, 5, x[1, 0], ids[1][0])
    assert [(p.layer, p.pos) for p in preds] == [(c + 1, 5) for c in range(L - 1)]
    for c, p in enumerate(preds):
        probs = heads.probs(c, x[0, c : c + 1], torch.tensor([ids[0][c]]),
                            torch.tensor([[-1] * K]), x[1, 0:1])[0]  # fmt: skip
        assert p.experts == tuple(sorted(probs.topk(K).indices.tolist()))
    assert all(pred.observe(c, 5, x[1, c], ids[1][c]) == [] for c in range(1, L))


@pytest.mark.parametrize("next_state", [False, True])
def test_prerouter_training_reduces_loss_and_raises_recall(stores, tmp_path, next_state):
    model = load_model(stores("olmoe"), StreamConfig(resident=True)).model
    g = torch.Generator().manual_seed(1)
    traces = [
        record(model, torch.randint(0, 320, (6,), generator=g).tolist(), 40, hidden=True)[1]
        for _ in range(6)
    ]
    from moestream.predict.train import merge_traces

    t = merge_traces(traces)
    routers = [b.gate.weight.detach() for b in model.moe_blocks]
    cfg = TrainConfig(
        hidden=64, epochs=60, lr=3e-3, batch=64, val_fraction=0.0, next_state=next_state
    )
    heads, report = train_heads(t, routers, cfg)
    assert heads.next_state == next_state
    for r in report.values():
        assert r["loss_after"] < 0.8 * r["loss_before"]
        assert r["recall_after"] > r["recall_before"] + 0.05
    untrained = untrained_heads(model, next_state)
    before = overall(replay_recall(PrerouterPredictor(untrained), t))
    path = heads.save(tmp_path / "prerouter.heads")
    after = overall(replay_recall(PrerouterPredictor(PrerouterHeads.load(path)), t))
    assert after > before + 0.05


def test_open_model_passes_prefetch_options_and_rejects_bad_ones(stores):
    from moestream.config import ConfigError
    from moestream.experts.config import PredictConfig
    from moestream.runtime import open_model

    folder = stores("qwen3_moe")
    store = Store(folder)
    stream = StreamConfig(memory_budget=min_budget(store), io=IOConfig(mode="pagecache"))
    want, _ = greedy(load_model(folder, StreamConfig(resident=True)).model, PROMPT, 6)
    predict = PredictConfig(predictor="stale-gate", min_score=0.2, ahead=2)
    with open_model(folder, experts=stream, predict=predict) as rt:
        wrapper = rt.provider
        assert rt.generator.provider is wrapper and rt.model.moe_blocks[0].provider is wrapper
        assert wrapper.min_score == 0.2 and wrapper.predictor.ahead == 2
        got, _ = greedy(rt.model, PROMPT, 6)
    assert got == want
    bad = [
        ({"predictor": "stale-gate", "min_score": 1.5}, "--min-score"),
        ({"predictor": "temporal", "ahead": 2}, "--predict-ahead"),
        ({"predictor": "stale-gate", "ahead": 3}, "--predict-ahead"),
        ({"routing": "predicted"}, "--predictor"),
    ]
    for kwargs, flag in bad:
        with pytest.raises(ConfigError, match=flag):
            PredictConfig(**kwargs)


def test_prerouter_heads_are_found_from_the_stores_source(tiny_dir, tmp_path):
    """Heads trained beside the Hugging Face folder serve a store converted from it; without
    heads the error lists every folder looked in."""
    import shutil

    from moestream.config import ConfigError
    from moestream.experts.config import PredictConfig
    from moestream.runtime import open_model

    src = tmp_path / "hf"
    shutil.copytree(tiny_dir("qwen3_moe"), src)
    store = convert(src, tmp_path / "store", make_scheme("int8"), False)
    predict = PredictConfig(predictor="prerouter")
    with pytest.raises(ConfigError, match="looked in") as e:
        open_model(store, predict=predict)
    assert str(store) in str(e.value) and str(src.resolve()) in str(e.value)
    model = load_model(store).model
    untrained_heads(model).save(src / "prerouter.heads")
    with open_model(store, predict=predict) as rt:
        assert rt.mode["predictor"] == "prerouter"
