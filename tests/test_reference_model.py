"""The bundled reference model: transformers loads it and moestream generates the same tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moestream.config import SamplingConfig
from moestream.runtime import open_model

REF = Path(__file__).resolve().parent.parent / "models" / "pystd-moe-29m"
PROMPTS = ["def fibonacci(n):", "class BinarySearchTree:", "import os\n"]
N = 32


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        REF, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    ).eval()


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """Greedy decode with transformers' own KV cache, not stopping at EOS."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    x = torch.tensor([ids])
    out = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(x, cache=cache, use_cache=True).logits[0, -1]
            out.append(int(logits.argmax()))
            x = torch.tensor([[out[-1]]])
    return out


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_equal_transformers(hf, prompt):
    rt = open_model(REF)
    ids = rt.encode_prompt(prompt)
    from transformers import AutoTokenizer

    assert ids == AutoTokenizer.from_pretrained(REF)(prompt)["input_ids"]
    ours = rt.generator.generate(ids, SamplingConfig(max_new_tokens=N, ignore_eos=True))
    assert ours.ids == hf_greedy(hf, ids, N)
    assert "\n" in ours.text  # it writes lines of code, not noise


def test_streaming_store_equals_resident(tmp_path):
    from moestream.convert.writer import convert
    from moestream.experts.config import StreamConfig
    from moestream.quant import make_scheme
    from moestream.store.io import IOConfig

    store = convert(REF, tmp_path / "store", make_scheme("int8"), False)
    cfg = SamplingConfig(max_new_tokens=24, ignore_eos=True)
    resident = open_model(store, experts=StreamConfig(resident=True))
    ids = resident.encode_prompt(PROMPTS[0])
    want = resident.generator.generate(ids, cfg)
    io = IOConfig(mode="pagecache", threads=2)
    streamed = open_model(store, experts=StreamConfig(memory_budget=2 * 2**20, io=io))
    got = streamed.generator.generate(ids, cfg)
    assert got.ids == want.ids
    stats = got.stats()
    assert stats["misses"] > 0 and stats["evictions"] > 0 and stats["bytes_read"] > 0
