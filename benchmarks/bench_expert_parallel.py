"""Expert parallelism (experts/parallel.py): decode tok/s of N ranks against one process on the
same store, and what a MoE layer's all_gather costs (per layer and as a share of the step),
next to the backend's floor measured in the same run (an all_gather of one float), so a loaded
machine shows as a higher floor rather than as slower code. CPU ranks over gloo here; the same
script is the one to run for NCCL once the GPU provider takes a shard.

    python benchmarks/bench_expert_parallel.py [--store S | -m HF] [--ranks 2] \
        [--memory-budget 0.5] [--out benchmarks/results/expert_parallel.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the CLI does

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_row, write_rows  # noqa: E402

from moestream.config import parse_budget  # noqa: E402
from moestream.distributed import Devices, launch  # noqa: E402
from moestream.engine.kv_cache import KVCache  # noqa: E402
from moestream.experts.config import Shard, StreamConfig  # noqa: E402
from moestream.loader import load_model  # noqa: E402

PROMPT = 32  # prompt tokens before the timed decode steps


def decode(folder: str, cfg: StreamConfig, steps: int) -> dict:
    """Prefill, 4 warm-up steps, then `steps` timed one-token steps; the provider's counters of
    the timed steps only."""
    loaded = load_model(folder, cfg)
    model, provider = loaded.model, loaded.provider
    cache = KVCache(loaded.args, PROMPT + steps + 8, torch.float32)
    tok = torch.tensor([1])
    with torch.inference_mode():
        model(torch.arange(PROMPT) % loaded.args.vocab_size, cache, 0, last_only=True)
        for pos in range(PROMPT, PROMPT + 4):
            model(tok, cache, pos, last_only=True)
        before = provider.stats()
        t0 = time.perf_counter()
        for pos in range(PROMPT + 4, PROMPT + 4 + steps):
            model(tok, cache, pos, last_only=True)
        seconds = time.perf_counter() - t0
    after = provider.stats()
    provider.close()
    out = {"decode_tok_s": steps / seconds, "step_ms": seconds / steps * 1e3}
    if "comm_calls" in after:
        calls = after["comm_calls"] - before["comm_calls"]
        comm = after["comm_seconds"] - before["comm_seconds"]
        out.update(
            comm_ms_per_layer=comm / calls * 1e3,
            comm_share=comm / seconds,
            comm_bytes_per_layer=(after["comm_bytes"] - before["comm_bytes"]) / calls,
        )
    return out


def _floor_ms(repeats: int = 200) -> float:
    """The backend's all_gather latency for one float (median)."""
    import torch.distributed as dist

    one = torch.zeros(1)
    outs = [torch.empty(1) for _ in range(dist.get_world_size())]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dist.all_gather(outs, one)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3


def _rank(rank: int, world: int, folder: str, cfg: StreamConfig, steps: int, out: str) -> int:
    floor = _floor_ms()
    res = decode(folder, replace(cfg, shard=Shard(rank, world)), steps)
    res["gloo_floor_ms"] = floor
    res["torch_threads"] = torch.get_num_threads()
    if rank == 0:
        Path(out).write_text(json.dumps(res))
    return 0


def _store(a) -> str:
    if a.store:
        return a.store
    from moestream.convert.writer import convert
    from moestream.quant import make_scheme

    dst = Path(tempfile.mkdtemp(prefix="bench-ep-")) / "store"
    return str(convert(a.model, dst, make_scheme(a.quant), False))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("-m", "--model", default="models/pystd-moe-29m", help="HF folder to convert")
    p.add_argument("--store", default=None, help="an existing store (skips the conversion)")
    p.add_argument("--quant", default="int8")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--memory-budget", default=None, help="per rank (streams); default resident")
    p.add_argument("--out", default=None, help="append JSON rows here")
    a = p.parse_args()
    folder = _store(a)
    budget = None if a.memory_budget is None else parse_budget(a.memory_budget, "--memory-budget")
    cfg = StreamConfig(resident=budget is None, memory_budget=budget)
    one = decode(folder, cfg, a.steps)
    one["torch_threads"] = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        launch(Devices("cpu", a.ranks), _rank, folder, cfg, a.steps, f"{tmp}/r.json")
        many = json.loads(Path(f"{tmp}/r.json").read_text())
    config = {"model": a.store or a.model, "quant": a.quant, "memory_budget": a.memory_budget,
              "steps": a.steps, "ranks": a.ranks, "backend": "gloo"}  # fmt: skip
    results = {"one_process": one, "expert_parallel": many,
               "speedup": many["decode_tok_s"] / one["decode_tok_s"]}  # fmt: skip
    print(
        f"one process: {one['decode_tok_s']:.1f} tok/s ({one['torch_threads']} threads) | "
        f"{a.ranks} ranks: {many['decode_tok_s']:.1f} tok/s ({many['torch_threads']} threads "
        f"each), {results['speedup']:.2f}x | all_gather {many['comm_ms_per_layer']:.3f} ms/layer "
        f"({many['comm_bytes_per_layer'] / 1024:.1f} KiB), {100 * many['comm_share']:.0f}% of "
        f"the step; gloo floor {many['gloo_floor_ms']:.3f} ms"
    )
    write_rows(a.out, [bench_row("expert_parallel", config, results)])


if __name__ == "__main__":
    main()
