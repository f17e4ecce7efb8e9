"""The engine's real cache hit count in a streamed run equals the simulator's replay of that run's
trace, for the same policy and budget."""

from __future__ import annotations

import pytest

from moestream.config import SamplingConfig
from moestream.convert.writer import convert
from moestream.experts.config import StreamConfig
from moestream.obs.simulate import simulate
from moestream.obs.trace import load_trace, record_trace
from moestream.quant import make_scheme
from moestream.runtime import open_model
from moestream.store.format import Store
from moestream.store.io import IOConfig

PROMPTS = ["def fibonacci(n):", "return n if n < 2 else", "fibonacci(n - 1)"]


@pytest.fixture(scope="module")
def store(tiny_dir, tmp_path_factory):
    return convert(
        tiny_dir("qwen3_moe"), tmp_path_factory.mktemp("store") / "s", make_scheme("int8"), False
    )


ONE_TOKEN = ["def", "if", " n"]


# sticky gives each layer n_slots / layers slots: a multi-token prefill is then served in
# chunks of that size, and the simulator must chunk the same way.
@pytest.mark.parametrize(
    ("policy", "slots", "prompts"),
    [
        ("lru", 5, PROMPTS),
        ("lru", 9, PROMPTS),
        ("lfu", 6, PROMPTS),
        ("lrfu", 6, PROMPTS),
        ("sticky", 6, PROMPTS),
        ("sticky", 6, ONE_TOKEN),
    ],
)
def test_engine_hits_equal_simulated_hits(store, tmp_path, policy, slots, prompts):
    io = IOConfig(mode="pagecache", threads=1)
    budget = slots * Store(store).layout.size
    rt = open_model(store, experts=StreamConfig(memory_budget=budget, io=io, policy=policy))
    provider = rt.generator.provider
    assert provider.n_slots == slots
    cfg = SamplingConfig(max_new_tokens=12, ignore_eos=True)
    t = load_trace(record_trace(rt, prompts, cfg, tmp_path / "tr"))
    engine = provider.stats()
    assert t.model.expert_bytes == provider.store.layout.size
    sim = simulate(t, policy, slots, t.model.expert_bytes)
    assert (sim.hits, sim.misses) == (engine["hits"], engine["misses"])
    assert sim.bytes_read == engine["bytes_read"]
    assert engine["misses"] > 2 * slots  # the budget forced evictions: the test compares something
