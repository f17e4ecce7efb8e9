"""Per-token Python/dispatch overhead of the decode loop.

A model with tiny matrices (D=64) spends almost nothing in arithmetic, so its decode time per token
is the engine's overhead: Python, op dispatch, KV-cache writes, routing bookkeeping. Reported per
layer and for a 48-layer, K=8 model (Qwen3-30B-A3B's depth and top-k), next to a count of torch ops
per token and the dispatch floor measured in the same run (a trivial op from Python), so a loaded
machine shows up as a higher floor rather than as a slower engine. The GEMMs here are 64-wide, so
the whole step is overhead, the dispatch of the GEMM calls included.

    python benchmarks/bench_overhead.py [--out benchmarks/results/overhead.jsonl]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the CLI does

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_row, write_rows  # noqa: E402

from moestream.engine.kv_cache import KVCache  # noqa: E402
from moestream.loader import load_model  # noqa: E402


def build(folder: Path, layers: int, experts: int, k: int) -> None:
    import transformers as T

    cfg = T.Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        moe_intermediate_size=32,
        num_experts=experts,
        num_experts_per_tok=k,
        norm_topk_prob=True,
        max_position_embeddings=4096,
    )
    T.Qwen3MoeForCausalLM(cfg).save_pretrained(folder)
    # A store needs a tokenizer: a byte-level BPE of the model's 256 tokens.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator([], trainers.BpeTrainer(vocab_size=256, initial_alphabet=alphabet,
                                                    show_progress=False))  # fmt: skip
    tok.save(str(folder / "tokenizer.json"))


def decode_ms(model, args, steps: int, repeats: int = 3) -> float:
    """Best of `repeats` mean decode times (ms/token) over `steps` steps after a warm-up."""
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            cache = KVCache(args, steps + 16, torch.float32)
            model(torch.arange(8), cache, 0, last_only=True)
            tok = torch.tensor([1])
            for pos in range(8, 16):  # warm-up
                model(tok, cache, pos, last_only=True)
            t0 = time.perf_counter()
            for pos in range(16, 16 + steps):
                model(tok, cache, pos, last_only=True)
            best = min(best, (time.perf_counter() - t0) / steps * 1e3)
    return best


def profile_step(model, args) -> dict:
    """One profiled decode step: top-level aten ops (children of composite ops are not extra
    dispatches from Python) and all aten ops (each nested one is a dispatch from C++)."""
    from torch.profiler import ProfilerActivity, profile

    cache = KVCache(args, 32, torch.float32)
    with torch.inference_mode():
        model(torch.arange(8), cache, 0, last_only=True)
        for pos in range(8, 12):
            model(torch.tensor([1]), cache, pos, last_only=True)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model(torch.tensor([1]), cache, 12, last_only=True)
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    top = [e for e in events if e.cpu_parent is None]
    return {"aten_ops_per_token": len(top), "aten_ops_incl_nested": len(events)}


def gemm_calls_ms(args, k: int, positions: int, repeats: int = 5) -> float:
    """The decode step's GEMM calls alone, same shapes and same calls as the engine issues them
    (per layer: fused qkv, scores and values bmm, o_proj, router, 2 per routed expert into slot
    rows, the fp32 combine; then lm_head), timed back to back: the "inside the matmuls" part."""
    D, H, Hkv, hd = (
        args.hidden_size,
        args.num_attention_heads,
        args.num_key_value_heads,
        args.head_dim,
    )
    I, E, G = args.moe_intermediate_size, args.num_experts, H // Hkv
    x = torch.randn(1, D)
    wqkv, wo = torch.randn((H + 2 * Hkv) * hd, D), torch.randn(D, H * hd)
    gate, head = torch.randn(E, D), torch.randn(args.vocab_size, D)
    w13 = torch.randn(E, 2 * I, D).transpose(1, 2).unbind(0)
    w2 = torch.randn(E, D, I).transpose(1, 2).unbind(0)
    q, kc, vc = (
        torch.randn(Hkv, G, hd),
        torch.randn(Hkv, positions, hd),
        torch.randn(Hkv, positions, hd),
    )
    p = torch.randn(Hkv, G, positions)
    h, a, y = torch.empty(k, 1, 2 * I), torch.randn(k, 1, I), torch.empty(k, 1, D)
    hs, as_, ys, w = h.unbind(0), a.unbind(0), y.unbind(0), torch.rand(1, k)
    ids = list(range(0, E, E // k))[:k]

    def step():
        for _ in range(args.num_hidden_layers):
            F.linear(x, wqkv)
            torch.bmm(q, kc.transpose(1, 2))
            torch.bmm(p, vc)
            F.linear(x, wo)
            F.linear(x, gate)
            for s, e in enumerate(ids):
                torch.mm(x, w13[e], out=hs[s])
            for s, e in enumerate(ids):
                torch.mm(as_[s], w2[e], out=ys[s])
            torch.mm(w, y.view(k, D))
        F.linear(x, head)

    best = float("inf")
    with torch.inference_mode():
        step()
        for _ in range(repeats):
            t0 = time.perf_counter()
            step()
            best = min(best, (time.perf_counter() - t0) * 1e3)
    return best


def dispatch_floor_us(n: int = 20000) -> dict:
    """Cost of a trivial op from Python right now (a view; an out-of-place add)."""
    x = torch.randn(1, 64)
    out = {}
    with torch.inference_mode():
        for name, fn in (("view", lambda: x.view(64)), ("add", lambda: torch.add(x, x))):
            for _ in range(200):
                fn()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            out[f"floor_us_{name}"] = round((time.perf_counter() - t0) / n * 1e6, 2)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None, help="append JSON rows here")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--big", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--paths", default="hf,native,step",
                   help="hf (torch kernels), native (int8 store, per-module fused ops), step (int8 "
                        "store with int8 dense: the native decode step)")  # fmt: skip
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        shapes = ((4, 8, 2), (48, 128, 8)) if a.big else ((4, 8, 2),)
        for layers, experts, k in shapes:
            folder = Path(tmp) / f"m{layers}"
            build(folder, layers, experts, k)
            for path in a.paths.split(","):
                rows.append(measure(path, folder, layers, experts, k, a))
    write_rows(a.out, rows)


@contextlib.contextmanager
def native_timer():
    """Seconds spent inside the native kernels' expert and dense calls while the block runs."""
    from moestream.kernels import native

    real, acc = native.module(), {"s": 0.0}

    class Timed:
        def __getattr__(self, name):
            f = getattr(real, name)
            if name not in ("moe", "linear"):
                return f

            def timed(*args, **kw):
                t0 = time.perf_counter()
                try:
                    return f(*args, **kw)
                finally:
                    acc["s"] += time.perf_counter() - t0

            return timed

    orig = native.module
    native.module = lambda: Timed()
    try:
        yield acc
    finally:
        native.module = orig


def measure(path: str, folder: Path, layers: int, experts: int, k: int, a) -> dict:
    """One path's row: "hf" = the Hugging Face folder loaded directly (torch expert kernels);
    "native" = its int8 store, resident, the native kernels and the fused one-token ops called
    layer by layer from Python; "step" = an int8 store with the dense weights int8 too (the tiny
    attention is under the size floor: quantized anyway), whose one-token steps run every layer
    in one native call (models/native_step.py; the engine's CPU default for a quantized model)."""
    if path == "hf":
        loaded = load_model(folder)
    elif path in ("native", "step"):
        import dataclasses

        from moestream.convert.writer import convert
        from moestream.experts.config import StreamConfig
        from moestream.quant import make_dense, make_scheme

        scheme = make_scheme("int8")
        dense = dataclasses.replace(make_dense("auto", scheme), min_params=0)
        store = folder.parent / f"{folder.name}-int8{'-dense' if path == 'step' else ''}"
        if not store.exists():
            convert(folder, store, scheme, False, dense if path == "step" else None)
        loaded = load_model(store, StreamConfig(resident=True, kernel="native"))
        from moestream.models.native_step import why_not

        why = why_not(loaded.model, loaded.provider)
        if path == "step" and why:
            raise SystemExit(f"the native step does not run here: {why}")
        if path == "native":
            loaded.model._decode_step = False  # the per-module path (the step's reference)
    else:
        raise SystemExit(f"unknown path {path!r}: use hf, native or step")
    floor = dispatch_floor_us()
    if path == "step":  # all of it is native: the whole step is overhead at these sizes
        gemm = 0.0
    elif path == "native":  # the time inside the native expert and dense kernels, per token
        with native_timer() as inside:
            decode_ms(loaded.model, loaded.args, a.steps, repeats=1)
        gemm = inside["s"] * 1e3 / (a.steps + 8)  # the 8 warm-up steps ran inside too
    else:  # the same GEMM calls back to back
        gemm = gemm_calls_ms(loaded.args, k, 8 + a.steps // 2)  # mid-run KV length
    ms = decode_ms(loaded.model, loaded.args, a.steps)
    prof = profile_step(loaded.model, loaded.args)
    ops = prof["aten_ops_per_token"]
    config = {"threads": a.threads, "layers": layers, "experts": experts, "top_k": k,
              "steps": a.steps, "path": path}  # fmt: skip
    results = {
        "ms_per_token": round(ms, 3),
        "us_per_layer": round(ms * 1e3 / layers, 1),
        "aten_ops_per_token": ops,
        "aten_ops_incl_nested": prof["aten_ops_incl_nested"],
        "us_per_op": round(ms * 1e3 / ops, 2),
        "gemm_calls_ms": round(gemm, 3),
        "outside_gemm_ms_per_token": round(ms - gemm, 3),
        **floor,
        "floor_ms_for_these_ops": round(ops * floor["floor_us_add"] / 1e3, 2),
        "load_avg_1m": os.getloadavg()[0],
    }
    row = bench_row("decode_overhead", config, results)
    print(row)
    return row


if __name__ == "__main__":
    main()
