"""Seed 000's warm-up experiment: does pre-running the hottest experts (from a router trace) before
generation help? Arms, compared in one process on a store-backed model:

  none    plain generation, no pre-warm
  hot     pre-warm the top-N most used experts of every MoE layer (from a trace)
  random  pre-warm N random experts per layer (control: warming anything vs the right ones)

each with the store's expert files in the OS page cache ("warm") and evicted from it ("evicted",
posix_fadvise DONTNEED). Every trial starts from a fresh expert provider (empty slot cache, no
mappings); the pre-warm runs each chosen expert once through `provider.experts` on a zero token,
like seed 000's gather_qmm pre-run, and its time is reported apart from TTFT and decode tok/s.
Arm order alternates between repetitions. Record a trace of the same model first with
`moestream trace`; the store flags are moestream's (`--io` defaults to mmap here).

    python benchmarks/bench_warmup.py -m MODEL --trace TRACE [--reps 5] [--top-n 20] [--io mmap]
        [--out benchmarks/results/warmup.jsonl]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: spinning threads crawl

import numpy as np  # noqa: E402
import torch  # noqa: E402
from common import bench_row, write_rows  # noqa: E402

from moestream.cli import _add_store_args, _setup_threads, _store_kwargs  # noqa: E402
from moestream.config import ConfigError, SamplingConfig  # noqa: E402
from moestream.obs.stats import expert_counts  # noqa: E402
from moestream.obs.trace import Trace, load_trace  # noqa: E402

ARMS = ("none", "hot", "random")
PAGE_CACHE = ("warm", "evicted")


@dataclass(frozen=True, slots=True)
class WarmupConfig:
    top_n: int = 20
    reps: int = 3
    max_new_tokens: int = 32
    arms: tuple[str, ...] = ARMS
    page_cache: tuple[str, ...] = PAGE_CACHE
    seed: int = 0

    def __post_init__(self):
        if self.top_n < 1 or self.reps < 1 or self.max_new_tokens < 2:
            raise ConfigError("warm-up bench needs top_n >= 1, reps >= 1 and max tokens >= 2")
        for a in self.arms:
            if a not in ARMS:
                raise ConfigError(f"unknown arm {a!r}; use {', '.join(ARMS)}")
        for c in self.page_cache:
            if c not in PAGE_CACHE:
                raise ConfigError(f"unknown page-cache state {c!r}; use {', '.join(PAGE_CACHE)}")


def hot_experts(t: Trace, n: int) -> dict[int, list[int]]:
    """Per MoE layer (model index): its n most used experts in the trace."""
    counts = expert_counts(t)
    return {
        layer: np.argsort(-counts[col], kind="stable")[:n].tolist()
        for col, layer in enumerate(t.model.moe_layers)
    }


def random_experts(layers: list[int], num_experts: int, n: int, seed: int) -> dict[int, list[int]]:
    rng = np.random.default_rng(seed)
    return {layer: sorted(rng.permutation(num_experts)[:n].tolist()) for layer in layers}


def prewarm(model, experts: dict[int, list[int]]) -> float:
    """Run every listed expert once on a zero token through its layer's provider; seconds."""
    t0 = time.perf_counter()
    D = model.args.hidden_size
    dtype = model.dtype
    x = torch.zeros(1, D, dtype=dtype)
    w = torch.ones(1, 1, dtype=torch.float32)
    with torch.inference_mode():
        for block in model.moe_blocks:
            for e in experts.get(block.layer, ()):
                block.provider.experts(block.layer, x, torch.tensor([[e]]), w)
    return time.perf_counter() - t0


def expert_files(store) -> list:
    return [store.path(layer) for layer in sorted(store.crc)]


def evict_page_cache(paths) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def fill_page_cache(paths, chunk: int = 8 << 20) -> None:
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.read(chunk):
                pass


def fresh_provider(rt, store, stream_cfg):
    """Replace the runtime's expert provider by a new one (empty slot cache, no mappings)."""
    from moestream.experts.mmap import MmapExperts
    from moestream.experts.streaming import StreamingExperts

    make = MmapExperts if stream_cfg.mmap else StreamingExperts
    rt.replace_provider(make(store, stream_cfg))
    gc.collect()  # drop the old mmaps so their pages can leave the page cache
    return rt.provider


def run_warmup(rt, prompt_ids: list[int], t: Trace, cfg: WarmupConfig, log=None) -> list[dict]:
    """All trials; one dict per trial (arm, page cache, rep, TTFT, decode tok/s, pre-warm time)."""
    model = rt.model
    from moestream.experts.streaming import StoreExperts

    store = rt.store
    if not isinstance(rt.provider, StoreExperts):
        raise ConfigError("the warm-up bench needs a store-backed model (a store folder or --io)")
    if t.model.moe_layers != rt.args.moe_layer_ids or t.num_experts != rt.args.num_experts:
        raise ConfigError("the trace was recorded on another model (MoE layers or experts differ)")
    stream_cfg = rt.provider.cfg
    sets = {
        "none": {},
        "hot": hot_experts(t, cfg.top_n),
        "random": random_experts(rt.args.moe_layer_ids, rt.args.num_experts, cfg.top_n, cfg.seed),
    }
    files = expert_files(store)
    sampling = SamplingConfig(max_new_tokens=cfg.max_new_tokens, ignore_eos=True)
    rt.generator.generate(prompt_ids, sampling)  # process warm-up: allocator, kernels, threads
    rows = []
    for rep in range(cfg.reps):
        for cache in cfg.page_cache:
            arms = cfg.arms if rep % 2 == 0 else tuple(reversed(cfg.arms))
            for arm in arms:
                fresh_provider(rt, store, stream_cfg)
                if cache == "evicted":
                    evict_page_cache(files)
                else:
                    fill_page_cache(files)
                warm_s = prewarm(model, sets[arm])
                res = rt.generator.generate(prompt_ids, sampling)
                s = res.stats()
                row = {
                    "rep": rep,
                    "page_cache": cache,
                    "arm": arm,
                    "top_n": cfg.top_n if arm != "none" else 0,
                    "prewarm_s": warm_s,
                    "ttft_s": res.prefill_seconds,
                    "decode_tok_s": s["decode_tok_s"],
                    "prompt_tokens": len(prompt_ids),
                    "generated_tokens": len(res.ids),
                    **{k: s[k] for k in ("hits", "misses", "bytes_read") if k in s},
                }
                rows.append(row)
                if log is not None:
                    log(row)
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Median TTFT and decode tok/s per (page cache, arm), with the ratio to 'none'."""
    out = []
    for cache in dict.fromkeys(r["page_cache"] for r in rows):
        base = None
        for arm in dict.fromkeys(r["arm"] for r in rows):
            rs = [r for r in rows if r["page_cache"] == cache and r["arm"] == arm]
            if not rs:
                continue
            m = {
                "page_cache": cache,
                "arm": arm,
                "n": len(rs),
                "ttft_s": statistics.median(r["ttft_s"] for r in rs),
                "decode_tok_s": statistics.median(r["decode_tok_s"] for r in rs),
                "decode_tok_s_min": min(r["decode_tok_s"] for r in rs),
                "decode_tok_s_max": max(r["decode_tok_s"] for r in rs),
                "prewarm_s": statistics.median(r["prewarm_s"] for r in rs),
            }
            if arm == "none":
                base = m
            if base is not None:
                m["tok_s_vs_none"] = m["decode_tok_s"] / base["decode_tok_s"] - 1
                m["ttft_vs_none"] = m["ttft_s"] / base["ttft_s"] - 1
            out.append(m)
    return out


def format_summary(summary: list[dict]) -> str:
    lines = [
        f"{'page cache':<10} {'arm':<7} {'n':>2} {'TTFT ms':>8} {'vs none':>8} {'tok/s':>8} "
        f"{'(min-max)':>15} {'vs none':>8} {'pre-warm ms':>11}"
    ]
    for m in summary:
        lines.append(
            f"{m['page_cache']:<10} {m['arm']:<7} {m['n']:>2} {m['ttft_s'] * 1e3:>8.1f} "
            f"{_pct(m.get('ttft_vs_none')):>8} {m['decode_tok_s']:>8.2f} "
            f"{m['decode_tok_s_min']:>7.2f}-{m['decode_tok_s_max']:<7.2f} "
            f"{_pct(m.get('tok_s_vs_none')):>8} {m['prewarm_s'] * 1e3:>11.1f}"
        )
    return "\n".join(lines)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-m", "--model", required=True, help="store or checkpoint folder")
    p.add_argument("--trace", required=True, help="trace of this model (hot experts)")
    p.add_argument("-p", "--prompt", default="def fibonacci(n):", help="prompt text")
    p.add_argument("-n", "--max-tokens", type=int, default=32, help="tokens per trial")
    p.add_argument("--top-n", type=int, default=20, help="experts pre-warmed per layer")
    p.add_argument("--reps", type=int, default=3, help="repetitions (arm order alternates)")
    p.add_argument("--arms", default="none,hot,random", help="comma list of none,hot,random")
    p.add_argument("--page-cache", default="warm,evicted", help="comma list of warm,evicted")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--out", default=None, help="append JSON lines (trials + summary) here")
    _add_store_args(p)
    return p.parse_args(argv)


def _log(row: dict) -> None:
    print(
        f"rep {row['rep']} {row['page_cache']:<7} {row['arm']:<6} TTFT "
        f"{row['ttft_s'] * 1e3:7.1f} ms  {row['decode_tok_s']:7.2f} tok/s",
        file=sys.stderr,
    )


def main(argv=None) -> int:
    from moestream.runtime import open_model

    a = parse_args(argv)
    _setup_threads(a.threads)
    cfg = WarmupConfig(
        top_n=a.top_n,
        reps=a.reps,
        max_new_tokens=a.max_tokens,
        arms=tuple(a.arms.split(",")),
        page_cache=tuple(a.page_cache.split(",")),
    )
    if a.io is None and not a.resident and a.memory_budget is None:
        a.io = "mmap"  # seed 000's setting: experts through the OS page cache
    t = load_trace(a.trace)
    rt = open_model(a.model, dtype=a.dtype, progress=True, **_store_kwargs(a))
    rows = run_warmup(rt, rt.encode_prompt(a.prompt), t, cfg, _log)
    summary = summarize(rows)
    print(format_summary(summary))
    if a.out:
        config = {"model": str(a.model), "trace": str(a.trace), "io": a.io, "prompt": a.prompt,
                  "dtype": a.dtype, "threads": a.threads, **asdict(cfg)}  # fmt: skip
        out = [bench_row("warmup", config, row) for row in rows]
        write_rows(a.out, out + [bench_row("warmup", config, {"summary": summary})])
    return 0


if __name__ == "__main__":
    sys.exit(main())
