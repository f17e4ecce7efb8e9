"""Streaming vs resident vs mmap on Qwen3-30B-A3B expert shapes (D=2048, I=768, E=128, K=8).

A random checkpoint with few layers is written and converted once (cached under --work). Each
mode runs in its own subprocess (own peak RSS) after the store is evicted from the page cache
with posix_fadvise(DONTNEED). Prints decode tok/s, GB read per token, achieved read GB/s against
a raw O_DIRECT sequential-read ceiling measured in the same run, hit rate and peak RSS; appends
JSON lines to benchmarks/results/stream.jsonl.

    .venv/bin/python benchmarks/bench_stream.py --layers 2 --tokens 12
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import bench_row, write_rows  # noqa: E402

CHILD = r"""
import os
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning OpenMP threads starve IO threads
import json, sys, time, torch
torch.set_num_threads(int(sys.argv[3]))
from moestream.engine.kv_cache import KVCache
from moestream.loader import load_model
from moestream.store.io import IOConfig
from moestream.experts.config import StreamConfig
mode, budget, n = json.loads(sys.argv[2]), None, int(sys.argv[4])
cfg = StreamConfig(
    memory_budget=mode.get("budget"), resident=mode.get("resident", False),
    io=IOConfig(mode=mode.get("io", "direct")),
)
t0 = time.perf_counter()
loaded = load_model(sys.argv[1], cfg)
load_s = time.perf_counter() - t0
p = loaded.provider
cache = KVCache(loaded.args, 16 + n, torch.float32)
ids = list(range(40, 56))
with torch.no_grad():
    logits = loaded.model(torch.tensor(ids), cache, 0, last_only=True)[-1]
    before, t1 = p.stats(), time.perf_counter()
    for pos in range(16, 16 + n):
        tok = torch.tensor([int(logits.argmax())])
        logits = loaded.model(tok, cache, pos, last_only=True)[-1]
    dt = time.perf_counter() - t1
after = p.stats()
d = {k: after[k] - before[k] for k in after}
with open("/proc/self/status") as f:
    hwm = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM"))
print(json.dumps({"load_s": load_s, "decode_s": dt, "tok_s": n / dt, "peak_rss": hwm, **d}))
"""


def evict(folder: Path) -> None:
    for p in folder.iterdir():
        fd = os.open(p, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def seq_read_ceiling(path: Path, chunk: int = 4 << 20, threads: int = 4) -> float:
    """GB/s of O_DIRECT reads of a whole cold file, `threads` x `chunk` outstanding."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    size = os.fstat(fd).st_size
    bufs = [mmap.mmap(-1, chunk) for _ in range(threads)]

    def read(i: int) -> int:
        return sum(os.preadv(fd, [bufs[i]], off) for off in range(i * chunk, size, threads * chunk))

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        total = sum(ex.map(read, range(threads)))
    dt = time.perf_counter() - t0
    os.close(fd)
    return total / dt / 1e9


def build_store(work: Path, layers: int) -> Path:
    from moestream.convert.synthetic import qwen3_moe_config, write_random_qwen3_moe
    from moestream.convert.writer import convert
    from moestream.quant import make_scheme

    store = work / f"store-L{layers}-int4"
    if not (store / "manifest.json").is_file():
        cfg = qwen3_moe_config(hidden=2048, inter=768, experts=128, top_k=8, layers=layers)
        hf = write_random_qwen3_moe(work / f"hf-L{layers}", cfg)
        convert(hf, store, make_scheme("int4"), progress=True)
    return store


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", default=".cache/bench_stream")
    ap.add_argument("--out", default=None, help="append JSON rows here")
    a = ap.parse_args()
    store = build_store(Path(a.work), a.layers)
    expert_bytes = sum(p.stat().st_size for p in store.glob("experts-*.bin"))
    evict(store)
    ceiling = seq_read_ceiling(next(store.glob("experts-*.bin")))
    modes = [("resident", {"resident": True, "io": "pagecache"}), ("mmap", {"io": "mmap"})]
    modes += [(f"stream {f}%", {"budget": expert_bytes * f // 100}) for f in (10, 25, 50)]
    config = {"D": 2048, "I": 768, "E": 128, "K": 8, "layers": a.layers, "quant": "int4",
              "tokens": a.tokens, "threads": a.threads}  # fmt: skip
    meta = {
        "loadavg": os.getloadavg()[0],
        "expert_bytes": expert_bytes,
        "seq_read_ceiling_gbps": ceiling,
    }
    print(
        f"store {expert_bytes / 1e9:.2f} GB experts; O_DIRECT sequential ceiling {ceiling:.2f} GB/s"
    )
    print(
        f"{'mode':12} {'tok/s':>7} {'GB/tok':>7} {'read GB/s':>9} {'vs ceil':>7} {'hit %':>6} {'peak RSS MB':>11}"
    )
    for name, mode in modes:
        evict(store)
        r = subprocess.run(
            [
                sys.executable,
                "-c",
                CHILD,
                str(store),
                json.dumps(mode),
                str(a.threads),
                str(a.tokens),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        s = json.loads(r.stdout.strip().splitlines()[-1])
        looks = s["hits"] + s["misses"]
        gbps = s["bytes_read"] / s["io_seconds"] / 1e9 if s["io_seconds"] else 0.0
        row = {
            **meta,
            "mode": name,
            **mode,
            **s,
            "stall_read_gbps": gbps,  # bytes over the time compute waited for them
            "gb_per_token": s["bytes_read"] / a.tokens / 1e9,
            "hit_rate": s["hits"] / looks if looks else 0.0,
        }
        write_rows(a.out, [bench_row("stream", config, row)])  # as each mode is done
        print(
            f"{name:12} {s['tok_s']:7.2f} {row['gb_per_token']:7.3f} {gbps:9.2f} "
            f"{gbps / ceiling:7.2f} {100 * row['hit_rate']:6.1f} {s['peak_rss'] / 2**20:11.0f}"
        )


if __name__ == "__main__":
    main()
