"""Decode speed of predicted routing with and without the recovery adapter, in one process.

Opens the model as `moestream generate -m MODEL --quant int4 --memory-budget 25% --predictor
prerouter --routing predicted -t 1` does (the slot cache streams experts; the adapter found
beside the model), then decodes --tokens greedy tokens from one prompt per arm (or, with --text, feeds the same
text's tokens to every arm), the arms
interleaved for --rounds rounds in a rotating order (a slow spell of the shared box hits every
arm). Arms: `none` (adapter removed), `stacked` (the adapter as it runs: models/lowrank.py, q/k/v
as two GEMMs, each other delta one addmm) and `per-delta` (each delta its own module, added one
by one: the inference path before the stacking, kept here as the ablation). Prints medians, the
ratio of each arm's median to `none`'s, the median of the per-round ratios, the main thread's
CPU time per token (a speed ratio of it: none's / the arm's), and the attention
modules' time per token in each arm (where the arms differ; best of several timings, less
moved by the shared box than whole decodes); appends JSON rows with --out.

    .venv/bin/python benchmarks/bench_lora.py -m models/pystd-moe-29m --rounds 12 \
        --out benchmarks/results/lora.jsonl
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import bench_row, write_rows  # noqa: E402

ARMS = ("none", "stacked", "per-delta")


@contextmanager
def per_delta():
    """The inference path before the stacking: every delta `y + lora(x)`, q/k/v split and cat."""
    from moestream.models.lowrank import LoraStack, LowRank

    saved = LowRank.add_to, LoraStack.add_to
    LowRank.add_to = lambda self, y, x: y + self(x)
    LoraStack.add_to = lambda self, lora, y, x: None
    try:
        yield
    finally:
        LowRank.add_to, LoraStack.add_to = saved


def decode(rt, ids: list[int], n: int) -> dict:
    from moestream.config import SamplingConfig

    t0 = time.thread_time()
    res = rt.generator.generate(ids, SamplingConfig(max_new_tokens=n, ignore_eos=True))
    # this thread's CPU time (the decode loop and, at -t 1, its torch ops; not the IO pool's):
    # what the adapter adds, unmoved by the box's other jobs taking the CPU away
    cpu_ms = 1e3 * (time.thread_time() - t0) / len(res.ids)
    return {**res.stats(), "thread_cpu_ms_per_token": cpu_ms}


@torch.inference_mode()
def decode_forced(rt, ids: list[int], n: int) -> dict:
    """generate's steps with every input token taken from `ids` (the last n of them decoded one
    at a time): the arms then see the same tokens, and differ only where the adapter changes
    the predicted experts (what the free-running arms' diverging texts add on top)."""
    from moestream.engine.kv_cache import KVCache
    from moestream.experts.base import stats_delta

    p, P = rt.provider, len(ids) - n
    cache = KVCache(rt.args, len(ids), rt.model.dtype)
    p.reset()
    rt.model(torch.tensor(ids[:P]), cache, 0, last_only=True)
    before, t0, c0 = p.stats(), time.perf_counter(), time.thread_time()
    for pos in range(P, len(ids)):
        p.decode_read()
        rt.model(torch.tensor([ids[pos]]), cache, pos, last_only=True)
        p.decode_issued()
    dt, cpu = time.perf_counter() - t0, time.thread_time() - c0
    d = stats_delta(before, p.stats())
    return {**d, "decode_tok_s": n / dt, "thread_cpu_ms_per_token": 1e3 * cpu / n}


def run_arm(rt, arm: str, path: Path, ids: list[int], n: int, forced: bool = False) -> dict:
    from moestream.recovery.adapter import load_adapter, remove_adapter

    run = decode_forced if forced else decode
    remove_adapter(rt.model)
    if arm == "none":
        return run(rt, ids, n)
    load_adapter(rt.model, path)
    if arm == "stacked":
        return run(rt, ids, n)
    with per_delta():
        return run(rt, ids, n)


def attention_us(rt, arm: str, path: Path, loops: int = 300, repeats: int = 7) -> float:
    """Microseconds per token of every layer's attention module at one decode step (position
    64; the one place the arms differ), best of `repeats` timings of `loops` steps (the best is
    the one least disturbed by the box's other jobs)."""
    from moestream.engine.kv_cache import KVCache
    from moestream.recovery.adapter import load_adapter, remove_adapter

    model, pos = rt.model, 64
    remove_adapter(model)
    if arm != "none":
        load_adapter(model, path)
    cache = KVCache(rt.args, pos + 1, model.dtype)
    x = torch.randn(1, rt.args.hidden_size, generator=torch.Generator().manual_seed(0))
    cos, sin = model.rope(pos, pos + 1, x.dtype)
    attns = [layer.self_attn for layer in model.model.layers]
    best = float("inf")
    with torch.inference_mode(), per_delta() if arm == "per-delta" else nullcontext():
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(loops):
                for attn in attns:
                    attn(x, cos, sin, cache, pos)
            best = min(best, (time.perf_counter() - t0) / loops)
    return best * 1e6


def main() -> None:
    from moestream.config import parse_budget
    from moestream.experts.config import PredictConfig, StreamConfig
    from moestream.runtime import open_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--budget", default="25%", help="expert memory budget (as --memory-budget)")
    ap.add_argument("--prompt", default="def fibonacci(n):")
    ap.add_argument(
        "--text",
        default=None,
        help="teacher-force this file's first 16 + --tokens tokens instead of generating",
    )
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="append JSON rows here")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    pred = PredictConfig(predictor="prerouter", routing="predicted")
    experts = StreamConfig(memory_budget=parse_budget(a.budget, "--budget"))
    with open_model(a.model, quant="int4", experts=experts, predict=pred, threads=a.threads) as rt:
        if rt.adapter is None:
            raise SystemExit(f"no recovery adapter beside {a.model}: nothing to compare")
        path = rt.adapter.path
        ids = rt.encode_prompt(a.prompt)
        forced = a.text is not None
        if forced:
            ids = rt.tokenizer.encode(Path(a.text).read_text(encoding="utf-8"))[: 16 + a.tokens]
        decode(rt, ids, 16)  # warm-up: kernels built, slots filled
        samples: dict[str, list[float]] = {arm: [] for arm in ARMS}
        cpu: dict[str, list[float]] = {arm: [] for arm in ARMS}
        rows = []
        config = {"model": a.model, "budget": a.budget, "quant": "int4", "tokens": a.tokens,
                  "threads": a.threads, "lora": rt.adapter.describe(), "text": a.text,
                  "prompt": None if forced else a.prompt}  # fmt: skip
        for r in range(a.rounds):
            order = ARMS[r % 3 :] + ARMS[: r % 3]
            for arm in order:
                s = run_arm(rt, arm, path, ids, a.tokens, forced)
                samples[arm].append(s["decode_tok_s"])
                cpu[arm].append(s["thread_cpu_ms_per_token"])
                rows.append(bench_row("lora", config, {"arm": arm, "round": r, **s}))
            print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in samples.items()))
        attn = {arm: attention_us(rt, arm, path) for arm in ARMS}
        print("attention modules, us per token (best of 7 x 300 steps): "
              + ", ".join(f"{k} {v:.0f}" for k, v in attn.items()))  # fmt: skip
        base = statistics.median(samples["none"])
        for arm in ARMS:
            med = statistics.median(samples[arm])
            paired = statistics.median(x / y for x, y in zip(samples[arm], samples["none"]))
            ms = statistics.median(cpu[arm])
            print(f"{arm:10} median {med:7.1f} tok/s  x none {med / base:.3f}  "
                  f"paired median {paired:.3f}  thread CPU {ms:.3f} ms/token "
                  f"(x none {statistics.median(cpu['none']) / ms:.3f})")  # fmt: skip
            rows.append(bench_row("lora", config, {"arm": arm, "round": "median",
                        "decode_tok_s": med, "ratio_to_none": med / base,
                        "paired_ratio": paired, "samples": samples[arm],
                        "attention_us_per_token": attn[arm],
                        "thread_cpu_ms_per_token": ms, "thread_cpu_samples": cpu[arm]}))  # fmt: skip
    write_rows(a.out, rows)


if __name__ == "__main__":
    main()
