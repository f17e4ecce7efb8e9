"""The one-token Triton attention (kernels/triton/attention.py) against its reference, the model's
torch code (models/layers.Attention: head norm, RoPE, cache write, gqa_attention), on twin caches:
every step's output and every cache row within rounding. The kernel sums in another order than
torch's GEMMs: fp32 within 1e-5 of the output's max, bf16 within a few bf16 steps. Both position
forms: an int with a KVCache (eager) and a device tensor with a StaticKVCache (a captured step,
whose bucket holds positions the kernel must not read). The interpreter case is small (CI time);
the CUDA cases take Qwen3-30B-A3B's heads, longer caches and a sliding window."""

from __future__ import annotations

import pytest
import torch

from moestream.config import ModelArgs
from moestream.engine.kv_cache import KVCache, StaticKVCache
from moestream.models.layers import Attention, Rope

try:
    import moestream.kernels.triton.attention  # noqa: F401
except ImportError:
    pytest.skip("triton not installed (gpu extra)", allow_module_level=True)

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def args(**over) -> ModelArgs:
    import transformers as T

    from moestream.models import model_args_from_dict

    base = dict(vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=8,
                num_key_value_heads=2, head_dim=32, moe_intermediate_size=32, num_experts=16,
                num_experts_per_tok=4, max_position_embeddings=4096)  # fmt: skip
    return model_args_from_dict(T.Qwen3MoeConfig(**{**base, **over}).to_dict())


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def run(a: ModelArgs, qk_norm, window, dtype, device, prompt: int, steps: int, static: bool,
        capacity: int) -> None:  # fmt: skip
    torch.manual_seed(7)
    m = Attention(a, 0, qkv_bias=False, o_bias=False, qk_norm=qk_norm)
    # Scores of a few units: without the head norm, weights of std 0.2 at D = 2048 give scores
    # near 80, where one bf16 step of a score (0.5) moves its probability by e^0.5
    scale = 0.2 * (64 / a.hidden_size) ** 0.5
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * (scale if p.dim() > 1 else 1.0) + (p.dim() == 1))
    m = m.to(device, dtype)
    m.window = window
    rope = Rope(a.rope, a.rotary_dim, a.max_position_embeddings)
    kind = StaticKVCache if static else KVCache
    ref_cache, cache = (kind(a, capacity, dtype, device) for _ in range(2))
    g = torch.Generator().manual_seed(8)
    tol = TOL[dtype]
    with torch.inference_mode():
        x = torch.randn(prompt, a.hidden_size, generator=g).to(device, dtype)
        cos, sin = (t.to(device) for t in rope(0, prompt, dtype))
        m(x, cos, sin, ref_cache, 0)
        m(x, cos, sin, cache, 0)
        for pos in range(prompt, prompt + steps):
            x = torch.randn(1, a.hidden_size, generator=g).to(device, dtype)
            cos, sin = (t.to(device) for t in rope(pos, pos + 1, dtype))
            start = torch.tensor([pos], device=device) if static else pos
            want = m(x, cos, sin, ref_cache, start)  # the torch code (gpu_decode off)
            got = m.o_proj(m._attend_gpu(m._qkv_proj(x), cos, sin, cache, start))
            assert rel(got, want) <= tol, (pos, rel(got, want))
        end = prompt + steps
        for c0, c1 in ((ref_cache.k[0], cache.k[0]), (ref_cache.v[0], cache.v[0])):
            assert rel(c1[:, :end], c0[:, :end]) <= tol


@pytest.mark.parametrize("static", [False, True])
def test_decode_attend_matches_the_torch_attention_interpreter(static, monkeypatch):
    """Short blocks, so the steps cover the first block alone and the loops past it."""
    from moestream.kernels.triton import attention

    if torch.cuda.is_available():
        pytest.skip("the CUDA cases below cover it")
    monkeypatch.setattr(attention, "FIRST", 8)
    monkeypatch.setattr(attention, "BLOCK_S", 4)
    run(args(), "head", None, torch.float32, "cpu", prompt=6, steps=9, static=static, capacity=40)


@pytest.mark.parametrize("static,window", [(False, None), (True, 11)])
def test_split_attend_matches_the_torch_attention_interpreter(static, window, monkeypatch):
    """A cache past SPLIT_CAP split over the positions: 3 chunks of 8 positions in blocks of 4, so
    the steps cover one chunk, several, empty chunks past the position and (window) chunks that
    start past the window's first position. 4 heads (CI time)."""
    from moestream.kernels.triton import attention

    if torch.cuda.is_available():
        pytest.skip("the CUDA cases below cover it")
    calls = []
    monkeypatch.setattr(attention, "SPLIT_CAP", 24)
    monkeypatch.setattr(attention, "CHUNK", 8)
    monkeypatch.setattr(attention, "BLOCK_S", 4)
    monkeypatch.setattr(attention, "SUM_BLOCK", 2)  # the partials in two loads, one masked
    split = attention._split_sum_kernel
    monkeypatch.setattr(attention, "_split_sum_kernel", _Counting(split, calls))
    a = args(num_attention_heads=4, num_key_value_heads=2)
    run(a, "head", window, torch.float32, "cpu", prompt=5, steps=13, static=static, capacity=24)
    assert calls == [(4,)] * 13  # every step took the split


class _Counting:
    """A kernel launcher that records its launches."""

    def __init__(self, kernel, calls):
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        self.calls.append(grid)
        return self.kernel[grid]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("qk_norm,window", [("head", None), (None, None), ("head", 37)])
@pytest.mark.parametrize("static", [False, True])
def test_decode_attend_matches_the_torch_attention_cuda(dtype, qk_norm, window, static):
    from moestream.kernels.triton import attention

    a = args(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128)
    assert attention.SPLIT_CAP > 256  # the one launch, its first block and its loops
    run(a, qk_norm, window, dtype, "cuda", prompt=130, steps=6, static=static, capacity=256)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("qk_norm,window", [("head", None), ("head", 300)])
@pytest.mark.parametrize("static", [False, True])
def test_split_attend_matches_the_torch_attention_cuda(dtype, qk_norm, window, static):
    """A long context's cache (2048 positions: past SPLIT_CAP, 8 chunks) at Qwen3-30B-A3B's heads."""
    from moestream.kernels.triton import attention

    assert attention.SPLIT_CAP <= 2048
    a = args(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128)
    run(a, qk_norm, window, dtype, "cuda", prompt=1100, steps=4, static=static, capacity=2048)


@pytest.mark.cuda
@pytest.mark.parametrize("static", [False, True])
def test_split_attend_long_chunks_cuda(static):
    """8192 positions: 256-position chunks (split_chunk keeps 32 per head), several loop steps."""
    from moestream.kernels.triton import attention

    assert attention.split_chunk(8192) == 256
    a = args(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
             max_position_embeddings=8192)  # fmt: skip
    run(a, "head", None, torch.bfloat16, "cuda", prompt=4200, steps=3, static=static,
        capacity=8192)  # fmt: skip


def test_split_chunk_rule():
    """One loop step a chunk while a head has at most MAX_CHUNKS of them; longer chunks past."""
    from moestream.kernels.triton import attention

    c, m = attention.CHUNK, attention.MAX_CHUNKS
    assert attention.split_chunk(attention.SPLIT_CAP) == c
    assert attention.split_chunk(c * m) == c
    for cap in (2 * c * m, 8 * c * m):
        assert cap // attention.split_chunk(cap) == m


@pytest.mark.cuda
def test_decode_attend_in_a_compiled_captured_step_cuda():
    """The custom op inside torch.compile + a CUDA graph writes the cache in place and gives the
    eager kernel's bits."""
    a = args(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=128)
    torch.manual_seed(3)
    m = Attention(a, 0, qkv_bias=False, o_bias=False, qk_norm="head").cuda().bfloat16()
    m.gpu_decode = True
    rope = Rope(a.rope, a.rotary_dim, a.max_position_embeddings)
    caches = [StaticKVCache(a, 256, torch.bfloat16, "cuda") for _ in range(2)]
    x = torch.randn(9, 256, device="cuda", dtype=torch.bfloat16)
    cos, sin = (t.cuda() for t in rope(0, 256, torch.bfloat16))
    with torch.inference_mode():
        for c in caches:
            m(x[:8], cos[:8], sin[:8], c, 0)
        want = m(x[8:], cos[8:9], sin[8:9], caches[0], caches[0].pos.fill_(8))
        c = caches[1]
        c.pos.fill_(8)
        step = torch.compile(
            lambda: m(x[8:], cos.index_select(0, c.pos), sin.index_select(0, c.pos), c, c.pos)
        )
        step()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        c.k[0][:, 8].zero_()
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(out, want)
    assert torch.equal(c.k[0][:, :9], caches[0].k[0][:, :9])
    assert torch.equal(c.v[0][:, :9], caches[0].v[0][:, :9])


def test_the_attention_benchmark_dry_run(tmp_path):
    """benchmarks/bench_gpu_attention.py --dry-run: both variants of a context split into chunks
    (interpreter, tiny heads), one row each, the split within fp32 rounding of the one launch."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parents[1]
    out = tmp_path / "rows.jsonl"
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    r = subprocess.run([sys.executable, str(root / "benchmarks/bench_gpu_attention.py"),
                        "--dry-run", "--contexts", "100", "--reps", "1", "--out", str(out)],
                       env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True,
                       timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(x["variant"], x["chunk"], x["chunks"], x["bucket"]) for x in rows] == [
        ("one_launch", None, 1, 256), ("split", 64, 4, 256), ("split_rule", 64, 4, 256)]  # fmt: skip
    assert all(x["bench"] == "gpu_attention" and x["config"]["dry_run"] for x in rows)
    assert all(x["us"] > 0 and x["max_rel_diff_vs_one_launch"] < 1e-5 for x in rows)
