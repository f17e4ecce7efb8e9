"""Peak memory while streaming: experts >= 8x the budget, RSS <= dense + budget + 15%.

Runs in a subprocess so the RSS is its own. The baseline is the RSS after importing torch and
running a tiny store once (interpreter and kernel code pages, ~370 MB, not the model); dense
weights are counted as loaded (fp32)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from moestream.convert.synthetic import qwen3_moe_config, write_random_qwen3_moe
from moestream.convert.writer import convert
from moestream.kernels.cpu import int4_kernel_ok
from moestream.quant import make_scheme

CHILD = r"""
import gc, json, resource, sys, torch
torch.set_num_threads(1)
from moestream.engine.kv_cache import KVCache
from moestream.loader import load_model
from moestream.experts.config import StreamConfig


def run(folder, budget, n):
    loaded = load_model(folder, StreamConfig(memory_budget=budget))
    cache = KVCache(loaded.args, 64, torch.float32)
    ids = list(range(3, 35))
    with torch.no_grad():
        logits = loaded.model(torch.tensor(ids), cache, 0, last_only=True)[-1]
        for pos in range(len(ids), len(ids) + n):
            tok = torch.tensor([int(logits.argmax())])
            logits = loaded.model(tok, cache, pos, last_only=True)[-1]
    dense = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    provider = loaded.provider
    provider.close()
    return dense, provider.stats()


def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


run(sys.argv[1], 1 << 20, 2)  # warm-up on a tiny store: loads the kernels' code pages
gc.collect()
base = rss()
dense, stats = run(sys.argv[2], int(sys.argv[3]), 16)
# VmHWM, not ru_maxrss: ru_maxrss survives exec and would report the parent pytest's peak.
with open("/proc/self/status") as f:
    peak = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM"))
print(json.dumps({"base": base, "peak": peak, "dense": dense, **stats}))
"""


def _fallback_only() -> bool:
    """Neither the native kernels nor torch's int4 kernel: the dequantizing reference runs, whose
    transient fp32 weights exceed the 15% bound (measured +5.4 MB at e7ee0e4 on an AVX2 EPYC)."""
    from moestream.kernels import native

    return not native.available() and not int4_kernel_ok()


@pytest.mark.skipif(_fallback_only(), reason="only the dequantizing reference kernel runs here")
def test_peak_rss_follows_the_budget(tmp_path):
    cfg = qwen3_moe_config(hidden=256, inter=512, experts=64, top_k=8, layers=4, vocab=512)
    write_random_qwen3_moe(tmp_path / "hf", cfg, dtype=torch.float32)
    store = convert(tmp_path / "hf", tmp_path / "store", make_scheme("int4"), False)
    small = qwen3_moe_config(hidden=64, inter=64, experts=8, top_k=8, layers=1, vocab=512)
    write_random_qwen3_moe(tmp_path / "hf-small", small, dtype=torch.float32)
    warm = convert(tmp_path / "hf-small", tmp_path / "warm", make_scheme("int4"), False)
    expert_bytes = sum(p.stat().st_size for p in store.glob("experts-*.bin"))
    budget = expert_bytes // 8
    r = subprocess.run(
        [sys.executable, "-c", CHILD, str(warm), str(store), str(budget)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout.strip().splitlines()[-1])
    assert s["bytes_read"] > 2 * budget  # the run really streamed through the budget
    assert s["evictions"] > 0
    grown = s["peak"] - s["base"]
    assert grown <= 1.15 * (s["dense"] + budget), (grown, s["dense"], budget)
