"""End-to-end decode on a CUDA GPU: moestream (`--device cuda`) vs Hugging Face transformers, and
streaming experts into a VRAM slot pool at several budgets vs the PCIe-bound limit.

Rows (JSON lines, `--out`):
- `hf`: transformers, same model and dtype, greedy with its DynamicCache (one host read per token).
- `resident`: every expert in VRAM; the routing never leaves the GPU (no sync in the MoE layers).
- `stream`: a VRAM pool of `budget_fraction` of the expert bytes (`policy`, the default LRFU);
  `tokens_equal_resident_prefix` counts the greedy tokens equal to the resident run's (all of
  them: streaming keeps the resident arithmetic, prefill chunks included). `host` = `pinned` (every
  record in pinned host RAM; a miss is one host->device copy) or `store` (misses pread from the
  store by the IO pool into pinned staging, then copied). The ids come to the host once per MoE
  layer: `sync_ms_per_layer` is the host time blocked there (it includes waiting for the GPU work
  queued before the router), `sync_cost_ms_per_token` the decode time per token over `resident`
  at a budget that holds everything (all hits: the sync alone).
  `pcie_bound_tok_s` = H2D bandwidth / host->device bytes per decoded token, with the H2D
  bandwidth assumed (55 GB/s pinned, BACKGROUND.md) and measured in this run (`h2d_gbps_measured`).
Each measured run follows a warm-up run of the same prompt (Triton compiled, pool in steady state).

    PYTHONPATH=. python benchmarks/bench_gpu_e2e.py --out results.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import bench_row, write_rows  # noqa: E402

from moestream.engine.kv_cache import KVCache  # noqa: E402

REF = Path(__file__).resolve().parent.parent / "models" / "pystd-moe-29m"
H2D_ASSUMED = 55e9


DEV = "cuda"  # --device cpu: a dry run of this script (reference kernel, no timings worth keeping)


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


@torch.inference_mode()
def ours(model, args, ids: list[int], n: int, provider=None) -> dict:
    dev = model.device
    cache = KVCache(args, len(ids) + n, model.dtype, dev)
    sync()
    t0 = time.perf_counter()
    logits = model(torch.tensor(ids, device=dev), cache, 0, last_only=True)[-1]
    toks = [int(logits.argmax())]
    t1 = time.perf_counter()
    s0 = provider.stats() if provider is not None else None
    t1b = time.perf_counter()
    for i in range(n - 1):
        logits = model(torch.tensor([toks[-1]], device=dev), cache, len(ids) + i, last_only=True)
        toks.append(int(logits[-1].argmax()))
    t2 = time.perf_counter()
    row = {
        "tokens": toks,
        "prefill_seconds": t1 - t0,
        "decode_seconds": t2 - t1b,
        "decode_tok_s": (n - 1) / (t2 - t1b),
    }
    if provider is not None:
        s1 = provider.stats()
        row["stats"] = {k: s1[k] - s0[k] for k in s1}
    return row


@torch.inference_mode()
def hf_loop(model, ids: list[int], n: int) -> dict:
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    sync()
    t0 = time.perf_counter()
    x = torch.tensor([ids], device=DEV)
    logits = model(x, past_key_values=cache, use_cache=True).logits[0, -1]
    toks = [int(logits.argmax())]
    t1 = time.perf_counter()
    for _ in range(n - 1):
        x = torch.tensor([[toks[-1]]], device=DEV)
        logits = model(x, past_key_values=cache, use_cache=True).logits[0, -1]
        toks.append(int(logits.argmax()))
    t2 = time.perf_counter()
    return {"tokens": toks, "prefill_seconds": t1 - t0, "decode_tok_s": (n - 1) / (t2 - t1)}


def empty():
    if DEV == "cuda":
        torch.cuda.empty_cache()


def h2d_bandwidth() -> float:
    src = torch.empty(256 * 2**20, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(src, device="cuda")
    dst.copy_(src, non_blocking=True)
    sync()
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(src, non_blocking=True)
    sync()
    return 10 * src.numel() / (time.perf_counter() - t0)


def sync_latency_us() -> float:
    """Round trip of a [1, 8] int64 device->host read on an idle stream (the floor of one sync)."""
    t = torch.zeros(1, 8, dtype=torch.int64, device="cuda")
    for _ in range(100):
        t.cpu()
    t0 = time.perf_counter()
    for _ in range(2000):
        t.cpu()
    return (time.perf_counter() - t0) / 2000 * 1e6


def run_hf(a, dtype, ids: list[int], emit) -> list[int]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype).to(DEV).eval()
    hf_loop(hf, ids, a.tokens)
    r = hf_loop(hf, ids, a.tokens)
    hf_tokens = r["tokens"]
    impl = {
        "attn": getattr(hf.config, "_attn_implementation", None),
        "experts": getattr(hf.config, "_experts_implementation", None),
    }
    emit({"run": "hf", "impl": f"transformers {impl}, python loop, DynamicCache", **r})
    del hf
    empty()
    return hf_tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default=str(REF))
    ap.add_argument("-p", "--prompt", default="def fibonacci(n):")
    ap.add_argument("-n", "--tokens", type=int, default=128)
    ap.add_argument("--quant", default="bf16")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--budgets", default="0.1,0.25,0.5,1.0")
    ap.add_argument("--out", default=None, help="append JSON rows here")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers row")
    ap.add_argument("--commit", default=None, help="source commit when the tree has no .git")
    ap.add_argument("--hosts", default="pinned,store", help="host tiers of the stream rows")
    ap.add_argument(
        "--synthetic",
        default=None,
        help="D,I,E,K,L: a random qwen3_moe checkpoint of these shapes instead of -m (big records)",
    )
    a = ap.parse_args()
    if a.synthetic:
        from moestream.convert.synthetic import qwen3_moe_config, write_random_qwen3_moe

        D, I, E, K, L = (int(v) for v in a.synthetic.split(","))
        folder = Path("/tmp") / f"synthetic-{D}-{I}-{E}-{K}-{L}"
        if not (folder / "config.json").is_file():
            write_random_qwen3_moe(folder, qwen3_moe_config(D, I, E, K, L))
        a.model = str(folder)
    global DEV
    DEV = a.device
    kernel = "triton" if DEV == "cuda" else "ref"

    from moestream.convert.cache import cached_store
    from moestream.engine.tokenizer import Tokenizer
    from moestream.experts.config import GpuConfig
    from moestream.loader import load_model, resolve_dtype
    from moestream.quant import make_scheme
    from moestream.store.format import Store
    from moestream.store.io import IOConfig

    dtype = resolve_dtype(a.dtype)
    store = cached_store(a.model, make_scheme(a.quant), False)
    st = Store(store)
    ids = Tokenizer(store).encode(a.prompt)
    total = st.expert_bytes
    config = {
        "model": Path(a.model).name,
        "device": DEV,  # cpu: a dry run
        "dtype": a.dtype,
        "quant": a.quant,
        "prompt_tokens": len(ids),
        "new_tokens": a.tokens,
        "budgets": a.budgets,
        "hosts": a.hosts,
    }
    base = {"expert_bytes": total, "record_bytes": st.layout.size}
    if DEV == "cuda":
        h2d = h2d_bandwidth()
        base["h2d_gbps_measured"] = h2d / 1e9
        base["sync_floor_us"] = sync_latency_us()
    else:
        h2d = H2D_ASSUMED
    rows = []

    def emit(row):
        row = bench_row("gpu_e2e", config, {**base, **row}, a.commit)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "tokens"}), flush=True)
        write_rows(a.out, [row])

    hf_tokens: list[int] = []

    def same(toks, ref=None):
        ref = hf_tokens if ref is None else ref
        n = 0
        for x, y in zip(toks, ref):
            if x != y:
                break
            n += 1
        return n if ref else None

    if not a.no_hf:
        hf_tokens = run_hf(a, dtype, ids, emit)

    # resident
    loaded = load_model(store, GpuConfig(resident=True, kernel=kernel, device=DEV), dtype=dtype)
    prov = loaded.provider
    ours(loaded.model, loaded.args, ids, a.tokens)
    r = ours(loaded.model, loaded.args, ids, a.tokens, prov)
    resident_s = r["decode_seconds"] / (a.tokens - 1)
    resident_tokens = r["tokens"]
    emit({"run": "resident", "tokens_equal_hf_prefix": same(r["tokens"]), **r})
    del loaded, prov
    empty()
    # The same through the engine's Generator (what `moestream generate --device cuda` runs:
    # logits copied to the host each token, log-probabilities kept).
    from moestream.config import SamplingConfig
    from moestream.runtime import open_model

    rt = open_model(
        store, dtype=a.dtype, experts=GpuConfig(resident=True, kernel=kernel, device=DEV)
    )
    scfg = SamplingConfig(max_new_tokens=a.tokens, ignore_eos=True)
    rt.generator.generate(ids, scfg)
    res = rt.generator.generate(ids, scfg)
    st_ = res.stats()
    emit(
        {
            "run": "resident_generator",
            "tokens": res.ids,
            "tokens_equal_hf_prefix": same(res.ids),
            "decode_tok_s": st_["decode_tok_s"],
            "prefill_seconds": st_["prefill_seconds"],
        }
    )
    del rt
    empty()

    for host in a.hosts.split(","):
        for f in [float(x) for x in a.budgets.split(",")]:
            cfg = GpuConfig(
                gpu_budget=max(int(f * total), 1),
                pinned_mirror=host == "pinned",
                io=IOConfig(mode="pagecache", threads=8),
                kernel=kernel,
                device=DEV,
            )
            loaded = load_model(store, cfg, dtype=dtype)
            prov = loaded.provider
            ours(loaded.model, loaded.args, ids, a.tokens, prov)  # warm-up: compile, fill the pool
            r = ours(loaded.model, loaded.args, ids, a.tokens, prov)
            s, dec = r["stats"], a.tokens - 1
            per_tok = s["h2d_bytes"] / dec if s["h2d_bytes"] else 0.0
            row = {
                "run": "stream",
                "host": host,
                "budget_fraction": f,
                "n_slots": prov.n_slots,
                "policy": cfg.policy,
                "tokens_equal_hf_prefix": same(r["tokens"]),
                "tokens_equal_resident_prefix": same(r["tokens"], resident_tokens),
                **r,
                "misses_per_token": s["misses"] / dec,
                "hit_rate": s["hits"] / max(s["hits"] + s["misses"], 1),
                "h2d_bytes_per_token": per_tok,
                "h2d_gbps_achieved": s["h2d_bytes"] / s["h2d_gpu_seconds"]
                if s["h2d_gpu_seconds"]
                else None,
                "pcie_bound_tok_s": H2D_ASSUMED / per_tok if per_tok else None,
                "pcie_bound_tok_s_measured_bw": h2d / per_tok if per_tok else None,
                "fraction_of_pcie_bound": r["decode_tok_s"] * per_tok / H2D_ASSUMED
                if per_tok
                else None,
                "syncs_per_token": s["syncs"] / dec,
                "sync_ms_per_layer": 1e3 * s["sync_seconds"] / max(s["syncs"], 1),
                "copy_ms_per_token": 1e3 * s["copy_seconds"] / dec,
                "table_ms_per_layer": 1e3 * s["table_seconds"] / max(s["syncs"], 1),
                "sync_cost_ms_per_token": 1e3 * (r["decode_seconds"] / dec - resident_s),
            }
            emit(row)
            prov.close()
            del loaded, prov
            empty()


if __name__ == "__main__":
    main()
