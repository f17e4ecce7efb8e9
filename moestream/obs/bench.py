"""`moestream bench`: prompt and decode speed at fixed lengths (llama-bench's pp/tg tests,
mlx_lm.benchmark), with the memory, bytes per token and expert-cache figures of the same runs.

A synthetic prompt of n_prompt token ids (fixed seed) is run `warmup` times untimed, then
`repeats` times, each decoding exactly n_gen tokens (EOS ignored). The expert cache is not
emptied between runs: the timed runs see the cache the warm-up left, the steady state."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from moestream.config import ConfigError, SamplingConfig


@dataclass(frozen=True)
class BenchConfig:
    n_prompt: int = 512
    n_gen: int = 128
    repeats: int = 3
    warmup: int = 1

    def __post_init__(self):
        for flag, value, low in (
            ("-p/--n-prompt", self.n_prompt, 1),
            ("-n/--n-gen", self.n_gen, 1),
            ("-r/--repetitions", self.repeats, 1),
            ("--warmup", self.warmup, 0),
        ):
            if value < low:
                raise ConfigError(f"{flag} {value}: give a whole number >= {low}")


def synthetic_prompt(n: int, vocab_size: int, seed: int = 0) -> list[int]:
    """n token ids drawn uniformly (fixed seed): the same prompt on every run and machine."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (n,), generator=g).tolist()


def spread(values: list[float]) -> dict:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "values": values,
    }


def dense_bytes_per_token(model) -> int:
    """Bytes of the non-expert weights one decode step reads: every weight once (quantized ones as
    their sections, or a GPU int4 weight's row-major repack, kernels/dense.py: rows_layout, the
    same size, in place of its sections), the input embedding one row, the output projection
    whole (also when tied to the embedding)."""
    embed, head = model.model.embed_tokens, model.lm_head
    head_ts = _read_tensors(head)
    embed_ts = [t for t in _read_tensors(embed) if t.data_ptr() not in _ptrs(head_ts)]  # tied
    seen = _ptrs(head_ts) | _ptrs(_read_tensors(embed))
    rest = [t for t in _read_tensors(model) if t.data_ptr() not in seen]
    rows = embed.num_embeddings
    return _nbytes(rest) + _nbytes(embed_ts) // rows + _nbytes(head_ts)


def _read_tensors(module) -> list:
    """The weights a decode step through module reads, each storage once (a loaded model holds
    each weight once, in the form its decode reads: loader.py's _place_quantized)."""
    unique = {}
    for t in [*module.parameters(), *module.buffers()]:  # (a released buffer, None, is not listed)
        unique.setdefault(t.data_ptr(), t)
    return list(unique.values())


def _ptrs(ts) -> set:
    return {t.data_ptr() for t in ts}


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def expert_bytes_per_token(rt) -> int | None:
    """The routed experts' record bytes one decode step computes with (top-k per MoE layer);
    None for a Hugging Face folder loaded directly (no records)."""
    s = rt.store
    if s is None:
        return None
    return rt.args.num_experts_per_tok * sum(s.layouts[layer].size for layer in s.crc)


def run_bench(rt, cfg: BenchConfig) -> dict:
    """The measurements of one runtime (an opened model, runtime.Runtime) under `cfg`."""
    gen = rt.generator
    if cfg.n_prompt + cfg.n_gen > gen.context:
        raise ConfigError(
            f"-p {cfg.n_prompt} + -n {cfg.n_gen} exceeds the context of {gen.context}; lower them"
        )
    ids = synthetic_prompt(cfg.n_prompt, rt.args.vocab_size)
    sampling = SamplingConfig(max_new_tokens=cfg.n_gen, ignore_eos=True)
    for _ in range(cfg.warmup):
        gen.generate(ids, sampling)
    cuda = gen.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(gen.device)
    runs = [gen.generate(ids, sampling).stats() for _ in range(cfg.repeats)]
    assert all(r["generated_tokens"] == cfg.n_gen for r in runs), "EOS is ignored"
    out = {
        "prompt_tok_s": spread([r["prefill_tok_s"] for r in runs]),
        "decode_tok_s": spread([r["decode_tok_s"] for r in runs]),
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in runs),
        "peak_vram_bytes": torch.cuda.max_memory_allocated(gen.device) if cuda else None,
        "mode": rt.mode,
        "threads": torch.get_num_threads(),
        "decode_threads": gen.decode_threads or torch.get_num_threads(),
        **_bytes(rt, runs),
    }
    return out


def _bytes(rt, runs: list[dict]) -> dict:
    """Bytes per decoded token (dense + routed experts) and the rate decode moved them at; the
    expert store's hit rate and disk reads per token (prompt and decode) where there is one."""
    dense, experts = dense_bytes_per_token(rt.model), expert_bytes_per_token(rt)
    per_tok = dense + (experts or 0)
    decode = statistics.median(r["decode_tok_s"] for r in runs)
    out = {
        "dense_bytes_per_tok": dense,
        "expert_bytes_per_tok": experts,
        "bytes_per_tok": per_tok,
        "decode_gbps": per_tok * decode / 1e9,
        "hit_rate": None,
        "disk_bytes_per_tok": None,
        "read_gbps": None,
    }
    if "bytes_read" in runs[0]:
        looked_up = sum(r["hits"] + r["misses"] for r in runs)
        tokens = sum(r["prompt_tokens"] + r["generated_tokens"] for r in runs)
        out.update(
            hit_rate=sum(r["hits"] for r in runs) / looked_up if looked_up else None,
            disk_bytes_per_tok=sum(r["bytes_read"] for r in runs) / tokens,
            read_gbps=statistics.median(r["read_gbps"] for r in runs),
        )
    return out


def _mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:.2f} MiB"


def format_bench(row: dict, mode_line: str) -> str:
    """The table `moestream bench` prints: one line per test (pp N, tg N), then the figures."""
    c = row["config"]
    lines = [
        mode_line,
        f"{c['model']} | threads {row['threads']} (decode {row['decode_threads']}) | "
        f"{row['mode']['quant']} | {c['repetitions']} runs after {c['warmup']} warm-up",
        f"{'test':>8} {'tok/s':>10} {'min':>10} {'max':>10}",
    ]
    for test, n, key in (("pp", c["n_prompt"], "prompt_tok_s"), ("tg", c["n_gen"], "decode_tok_s")):
        s = row[key]
        lines.append(f"{test + str(n):>8} {s['median']:10.1f} {s['min']:10.1f} {s['max']:10.1f}")
    mem = f"peak RSS {row['peak_rss_bytes'] / 2**20:.0f} MiB"
    if row["peak_vram_bytes"] is not None:
        mem += f", peak VRAM {row['peak_vram_bytes'] / 2**20:.0f} MiB"
    lines.append(
        f"{mem} | per decoded token: dense {_mib(row['dense_bytes_per_tok'])} + experts "
        f"{_mib(row['expert_bytes_per_tok'])}, {row['decode_gbps']:.2f} GB/s at tg"
    )
    if row["hit_rate"] is not None:
        lines.append(
            f"experts hit {100 * row['hit_rate']:.0f}%, {_mib(row['disk_bytes_per_tok'])} read "
            f"from disk per token, {row['read_gbps']:.2f} GB/s read"
        )
    return "\n".join(lines)
