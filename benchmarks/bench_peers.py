"""moestream vs llama.cpp on the same Hugging Face checkpoint, same threads, same prompt and decode
lengths, interleaved repeats in one run (the yardstick of the speed issues).

Each engine converts the checkpoint with its own converter (moestream `convert --quant Q`,
llama.cpp `convert_hf_to_gguf.py --outtype q8_0` then `llama-quantize` for Q4_0) once into
`--work`. Per repeat and pair (moestream int4 vs Q4_0, int8 vs Q8_0), each engine runs in its own
process: llama.cpp as `llama-bench -p P -n N -d 0,P` (random tokens; the prompt's rate from an
empty cache, the decode's after P cached tokens, as moestream's decode follows its prompt; rows
before 2026-12-03 took llama.cpp's decode from an empty cache), moestream as a child of this script
that prefills P random token ids and decodes N greedy tokens through the Generator (every expert
resident, `--resident`), after an untimed 8-token warm-up on another random prompt of P ids (so
a streamed pool starts warm, but not on the measured prompt's own experts). Reported per engine and format (medians): prefill and decode tok/s, peak
RSS of the process, bytes read per decoded token (dense weights + the top-k experts of every layer
+ one embedding row, from the files' tensor sizes), the implied GB/s against the DRAM read
bandwidth measured in this run (a 1 GiB fp32 sum at the same threads), and the ratio
moestream / llama.cpp.

    python benchmarks/bench_peers.py --hf HF_DIR --llama .cache/peers/llama [--threads 2]
        [--pairs int4:Q4_0,int8:Q8_0] [-p 64] [-n 64] [--reps 3] [--out rows.jsonl]

`--gguf FILE` instead of `--hf`: both engines run that very file (no conversion difference left):
llama.cpp reads it as it is, moestream runs the store `moestream convert FILE` makes of it (its
default scheme: Q8_0 / Q4_0 experts and dense weights kept exactly, other types requantized, as
convert prints; `--gguf-quant q8_0` keeps a Q8_0 file in its own 8.5-bit blocks instead of
int8). On the CPU, `--shares 1,0.5` adds moestream streaming its experts through a slot
cache of that fraction of the expert bytes (`--memory-budget 50%`); llama.cpp has no such cap and
runs once per repeat with everything mapped (its row is the ratios' base).

On the GPU machine (`--device cuda`, llama.cpp built with CUDA): each `--shares` value is the
fraction of expert bytes in VRAM. 1 = every layer on the GPU (llama-bench `-ngl 99`; moestream
`GpuConfig(resident=True)`, CUDA-graph decode, kernel `triton` as captured and `compiled` with the
step torch.compile'd); s < 1 = llama.cpp computes the experts of
round(L * (1 - s)) layers on the CPU (`--n-cpu-moe`), moestream streams them into a VRAM slot pool
of s of the expert bytes from a pinned host mirror: `triton` and `compiled` with a step's misses
staged into VRAM by one launch per layer (captured step), `prefetch` staged as `triton` plus the
stale gate's prefetch of the next layer's predicted misses (`--predictor stale-gate`), `direct`
with the decode kernels reading them from pinned RAM themselves, `host-misses` with the
per-layer host round trip; a
`-step` suffix (`triton-step`) is the ablation that issues each greedy step only after the host
read the one before (as the device-miss pool did before it decoded ahead), and a `-tprefill`
suffix (`triton-tprefill`) runs the prompt on the grouped Triton kernels instead of the grouped
GEMMs (`GpuConfig.prefill`), an `-admitall` suffix (`triton-admitall`) admits every device-side miss
into the pool instead of the scored ones (`GpuConfig.admit`), a `-pause` suffix (`triton-pause`)
makes admissions wait while a step stages its misses (`GpuConfig.admit_pause`, True: the
default's behaviour wherever misses stage, asked for), `-nopause` turns that off, a `-hitsfirst`
suffix computes a layer's hits while its misses are staged (`GpuConfig.hits_first`), a `-split`
suffix stages the misses' down sections beside the gate/up kernel (`GpuConfig.split_staging`;
suffixes combine: `triton-hitsfirst-pause`). The ceiling is then
the HBM read bandwidth (a 4 GiB fp32 sum on the device), float dense weights count at bf16 and quantized ones as their
sections (the GPU's GEMV reads them in place), and the PCIe H2D rate (a pinned 1 GiB copy) is
reported beside it.

Build llama.cpp first (../shared/peers/README.md: build_llamacpp.sh); nothing of it is committed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_row, write_rows  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def dram_gbps(threads: int, reps: int = 5, device: str = "cpu") -> float:
    """Read bandwidth of a 1 GiB (CPU) / 4 GiB (GPU) fp32 sum, warm: the ceiling for weight
    streaming."""
    import torch

    torch.set_num_threads(threads)
    t = torch.ones(1 << (28 if device == "cpu" else 30), device=device)
    t.sum()
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        t.sum()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return t.numel() * 4 / statistics.median(times) / 1e9


def _sync(device: str) -> None:
    if device != "cpu":
        import torch

        torch.cuda.synchronize()


def h2d_gbps(reps: int = 5) -> float:
    """Pinned host -> device copy rate of 1 GiB: the ceiling for experts streamed over PCIe."""
    import torch

    src = torch.ones(1 << 28).pin_memory()
    dst = torch.empty(1 << 28, device="cuda")
    dst.copy_(src)
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return src.numel() * 4 / statistics.median(times) / 1e9


def child_rss(cmd: list[str]) -> tuple[str, int]:
    """Run cmd, return (stdout, its own peak RSS) via wait4 on a fork-exec."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: stdout into the pipe, stderr discarded
        os.dup2(w, 1)
        os.close(r)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.execvp(cmd[0], cmd)
    os.close(w)
    chunks = []
    with os.fdopen(r) as f:
        chunks.append(f.read())
    _, status, usage = os.wait4(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} ... failed with {status}")
    return "".join(chunks), usage.ru_maxrss * 1024


POOL_ONLY = ("host-misses", "direct", "prefetch")  # variants of a streamed pool (shares < 1)
# A GPU variant's suffix -> the GpuConfig fields it sets (they combine: "triton-hitsfirst-pause")
SUFFIXES = {
    "-tprefill": {"prefill": "triton"},  # a prompt on the Triton kernels, not the grouped GEMMs
    "-admitall": {"admit": "all"},  # every device-side miss admitted, not only the scored ones
    "-pause": {"admit_pause": True},  # admissions wait while a step stages its misses (the
    "-nopause": {"admit_pause": False},  # default wherever misses stage); -nopause: they do not
    "-hitsfirst": {"hits_first": True},  # a layer's hits computed while its misses are staged
    "-split": {"split_staging": True},  # misses' down sections staged beside the gate/up kernel
}


def child_experts(kernel: str, device: str, share: float):
    """The experts config a benchmark child runs: CPU resident, or VRAM resident / slot pool;
    a SUFFIXES suffix (ablations) sets GpuConfig fields on the variant before it."""
    from moestream.config import Budget
    from moestream.experts.config import GpuConfig, StreamConfig

    for suffix, fields in SUFFIXES.items():
        if kernel.endswith(suffix):
            cfg = child_experts(kernel.removesuffix(suffix), device, share)
            return dataclasses.replace(cfg, **fields)

    if device == "cpu" and share >= 1:
        return StreamConfig(resident=True, kernel=kernel)
    if device == "cpu":  # a slot cache of that fraction of the expert bytes
        return StreamConfig(memory_budget=Budget(fraction=share), kernel=kernel)
    if share >= 1:  # kernel "compiled": the captured step torch.compile'd (GpuConfig.compile_step)
        return GpuConfig(resident=True, device=device, compile_step=kernel == "compiled")
    # kernel "host-misses": the per-layer host round trip (GpuConfig.device_misses=False);
    # "direct": the decode kernels read misses from the mirror (GpuConfig.miss_reads)
    return GpuConfig(gpu_budget=Budget(fraction=share), pinned_mirror=True, device=device,
                     device_misses=False if kernel == "host-misses" else None,
                     miss_reads="direct" if kernel == "direct" else "stage",
                     compile_step=kernel == "compiled")  # fmt: skip


def moestream_child(store: str, kernel: str, threads: int, P: int, N: int, device: str = "cpu",
                    share: float = 1.0) -> None:  # fmt: skip
    """In a child process: prefill P random ids, decode N greedy tokens; print one JSON line."""
    import torch

    from moestream.config import SamplingConfig
    from moestream.experts.config import PredictConfig
    from moestream.runtime import open_model

    torch.set_num_threads(threads)
    # "-step" (ablation): each decode step issued after the host read the one before
    kernel, step = kernel.removesuffix("-step"), kernel.endswith("-step")
    experts = child_experts(kernel, device, share)
    # "prefetch": the staged pool plus the stale gate's prefetch inside the step
    prefetch = kernel.split("-")[0] == "prefetch"
    predict = PredictConfig(predictor="stale-gate") if prefetch else None
    dtype = "float32" if device == "cpu" else "bfloat16"
    t0 = time.perf_counter()
    with open_model(store, dtype=dtype, experts=experts, threads=threads, predict=predict) as rt:
        if step:
            rt.provider.decodes_ahead = lambda: False
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, rt.args.vocab_size, (P,), generator=g).tolist()
        # The warm-up (compiles, captures graphs, fills a slot pool) runs another prompt of the
        # same length: the measured one's own routing would leave a streamed pool holding
        # exactly the experts its prompt and first tokens route to.
        other = torch.randint(0, rt.args.vocab_size, (P,), generator=g).tolist()
        cfg = SamplingConfig(max_new_tokens=N, ignore_eos=True)
        warm = SamplingConfig(max_new_tokens=8, ignore_eos=True)
        rt.generator.generate(other, warm)
        ready_s = time.perf_counter() - t0
        res = rt.generator.generate(ids, cfg)
        s = res.stats()
        row = {
            "prefill_tok_s": s["prefill_tok_s"],
            "decode_tok_s": s["decode_tok_s"],
            "mode": rt.provider.describe(),
            "load_and_warm_s": ready_s,
            "decode_depth": P,  # decoded after the P-token prompt (llama_run: -d P)
        }
        if device != "cpu":
            row["peak_vram_bytes"] = torch.cuda.max_memory_allocated()
            lookups = s.get("hits", 0) + s.get("misses", 0)
            row["hit_rate"] = s["hits"] / lookups if lookups else 1.0
            row["h2d_bytes_per_token"] = s.get("h2d_bytes", 0) / max(len(res.ids), 1)
            # the decode's bytes over PCIe: admissions copied + misses the kernels read from
            # pinned RAM (device misses); the host path's h2d_bytes also hold the prompt's copies
            moved = s.get("admit_bytes", s.get("h2d_bytes", 0)) + s.get("host_read_bytes", 0)
            row["pcie_bytes_per_token"] = moved / max(len(res.ids) - 1, 1)
            if "host_ms_per_token" in s:  # decode wall time not blocked on the GPU
                row["host_ms_per_token"] = s["host_ms_per_token"]
            if "decode_hits" in s:  # device misses: the decode steps' own lookups (no prompt)
                looked = s["decode_hits"] + s["host_reads"]
                row["decode_hit_rate"] = s["decode_hits"] / looked if looked else 1.0
                steps = max(len(res.ids) - 1, 1)  # misses left in pinned RAM / layer steps
                row["declined_per_token"] = s["admissions_declined"] / steps  # not admitted
                row["skipped_steps_per_token"] = (
                    s["admissions_skipped"] / steps
                )  # layers: victims busy
                row["hurried_per_token"] = s["admissions_hurried"] / steps  # pause let go
            if s.get("predict_routed"):  # prefetch: recall, and the copies a routed pair read
                row["prediction_recall"] = s["predict_correct"] / s["predict_routed"]
                row["prefetch_precision"] = s["prefetch_used"] / max(s["prefetch_reads"], 1)
            if "bookkeeping_seconds" in s:  # device misses: slot-table work between steps
                steps = max(len(res.ids) - 1, 1)
                row["bookkeeping_ms_per_token"] = s["bookkeeping_seconds"] * 1e3 / steps
                row["table_ms_per_token"] = s["decode_table_seconds"] * 1e3 / steps
    print(json.dumps(row))


def store_name(quant: str) -> str:
    """A store's folder name, by what convert's defaults write now (the dense rule too: a store
    reused by an older name would be measured silently; one of an older version is refused)."""
    from moestream.quant import make_dense, make_scheme
    from moestream.store.format import NEWEST

    return f"moestream-{quant}-{make_dense('auto', make_scheme(quant)).tag}-v{NEWEST}"


def ensure_store(hf: Path, work: Path, quant: str) -> Path:
    dst = work / store_name(quant)
    if not (dst / "manifest.json").is_file():
        subprocess.run(
            [sys.executable, "-m", "moestream", "convert", str(hf), str(dst), "--quant", quant],
            check=True,
        )
    return dst


def ensure_gguf_store(gguf: Path, work: Path, quant: str | None = None) -> Path:
    """The store moestream's own convert makes of `gguf` (its default scheme, or `quant`: e.g.
    q8_0 keeps a Q8_0 file's fp16 scales), once per file version."""
    from moestream.convert.gguf import gguf_fingerprint
    from moestream.store.format import NEWEST

    tag = f"-{quant}" if quant else ""
    dst = work / f"moestream-{gguf.stem}-{gguf_fingerprint(gguf)[:12]}{tag}-v{NEWEST}"
    if not (dst / "manifest.json").is_file():
        cmd = [sys.executable, "-m", "moestream", "convert", str(gguf), str(dst)]
        subprocess.run(cmd + (["--quant", quant] if quant else []), check=True)
    return dst


def ensure_gguf(hf: Path, work: Path, llama: Path, qtype: str) -> Path:
    q8, out = work / "llama-Q8_0.gguf", work / f"llama-{qtype}.gguf"
    if out.is_file():  # made before (its Q8_0 source may be gone: disk)
        return out
    if not q8.is_file():
        conv = [str(llama / "venv/bin/python"), str(llama / "src/convert_hf_to_gguf.py")]
        subprocess.run([*conv, str(hf), "--outtype", "q8_0", "--outfile", str(q8)], check=True)
    if qtype != "Q8_0":
        # From the Q8_0 file (speed is what is compared; the bf16 GGUF would double the disk).
        quantize = llama / "build/bin/llama-quantize"
        cmd = [str(quantize), "--allow-requantize", str(q8), str(out), qtype]
        subprocess.run(cmd, check=True)
    return out


def store_bytes_per_token(store: Path, gpu: bool = False) -> int:
    """Dense weights read per token as the child holds them (float ones fp32 on the CPU, bf16 on
    the GPU; quantized ones as their stored sections on both, except the GPU's q6_k as the int8 of
    group 16 its GEMV reads, kernels/dense.py: triton_form; the embedding one row, or, tied, the
    whole table lm_head reads) + top-k records per MoE layer."""
    elem = 2 if gpu else 4
    from moestream.kernels.dense import QuantWeight, triton_form
    from moestream.store.format import Store

    s = Store(store)
    a = s.args
    dense = 0
    for name in s.dense_names:
        scheme = s.dense_scheme(name)
        if scheme is None:
            n = s.tensor(name).numel() * elem
        else:  # (the GPU's int4 row repack holds the same bytes)
            secs = s.dense_sections(name)
            if gpu:
                w = triton_form(QuantWeight(scheme, s.dense_formats[name][1], secs))
                secs = w.sections()
            n = sum(t.numel() * t.element_size() for t in secs.values())
        # the embedding: one row, unless tied: then lm_head reads the whole table every token
        embed = name.endswith("embed_tokens.weight") and not a.tie_word_embeddings
        dense += n // a.vocab_size if embed else n
    s.release_dense()
    return dense + a.num_experts_per_tok * sum(s.layouts[layer].size for layer in s.crc)


def gguf_bytes_per_token(gguf: Path, llama: Path, top_k: int, experts: int) -> int:
    """The same count from the GGUF's tensor sizes (read by llama.cpp's gguf-py)."""
    code = (
        "import gguf, json, sys; r = gguf.GGUFReader(sys.argv[1]); "
        "print(json.dumps({t.name: [int(t.n_bytes), [int(d) for d in t.shape]] for t in r.tensors}))"
    )
    venv = llama / "venv/bin/python"  # the converter's venv (CPU build); else ours + gguf-py
    py = str(venv) if (llama / "venv/pyvenv.cfg").is_file() else sys.executable
    out = subprocess.run([py, "-c", code, str(gguf)], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"reading {gguf}'s tensor index failed: {out.stderr[-400:]}")
    total = 0
    for name, (n, shape) in json.loads(out.stdout).items():
        if "_exps" in name:
            total += n * top_k // experts
        elif name == "token_embd.weight":
            total += n // shape[-1]  # one row of [vocab] rows
        else:
            total += n
    return total


def llama_run(llama: Path, gguf: Path, threads: int, P: int, N: int, cpu_moe: int | None = None
              ) -> tuple[dict, int]:  # fmt: skip
    """llama-bench once; cpu_moe None = CPU build, else `-ngl 99 --n-cpu-moe cpu_moe`. The prompt
    is timed from an empty cache and the decode after P cached tokens (`-d 0,P`), as moestream's
    child decodes after its prompt: llama-bench's tg alone starts from an empty cache, which at a
    long prompt skips the attention's cost of the context."""
    bench = str(llama / "build/bin/llama-bench")
    cmd = [bench, "-m", str(gguf), "-t", str(threads), "-p", str(P), "-n", str(N),
           "-d", f"0,{P}", "-r", "1", "-o", "json"]  # fmt: skip
    if cpu_moe is not None:
        cmd += ["-ngl", "99", "--n-cpu-moe", str(cpu_moe)]
    out, rss = child_rss(cmd)
    rows = json.loads(out)
    pp = next(r["avg_ts"] for r in rows if r["n_prompt"] > 0 and r["n_depth"] == 0)
    tg = next(r["avg_ts"] for r in rows if r["n_gen"] > 0 and r["n_depth"] == P)
    return {"prefill_tok_s": pp, "decode_tok_s": tg, "decode_depth": P}, rss


def ours_run(store: Path, kernel: str, a, share: float) -> tuple[dict, int]:
    cmd = [sys.executable, __file__, "--child", str(store), "--kernel", kernel,
           "--threads", str(a.threads), "-p", str(a.prompt_tokens), "-n", str(a.tokens),
           "--device", a.device, "--shares", str(share)]  # fmt: skip
    out, rss = child_rss(cmd)
    return json.loads(out.strip().splitlines()[-1]), rss


def cpu_moe_layers(layers: int, share: float) -> int:
    """llama.cpp's --n-cpu-moe for a share of the expert bytes in VRAM."""
    return round(layers * (1 - share))


def share_kernels(kernels: list[str], pool_kernels: list[str] | None, share: float) -> list[str]:
    """The moestream variants run at a share: --kernels, at shares < 1 --pool-kernels if given;
    the pool's own variants (POOL_ONLY) only where there is a pool."""
    ks = pool_kernels if pool_kernels is not None and share < 1 else kernels
    return [k for k in ks if share < 1 or k not in POOL_ONLY]


def measure(pairs, kernels: list[str], shares: list[float], files: dict, llama: Path, a,
            layers: int, pool_kernels: list[str] | None = None) -> dict:  # fmt: skip
    """Interleaved repeats: per repeat, pair and share, llama.cpp and each moestream kernel, the
    order reversed every other repeat. Keys: (llama.cpp format, share) or (moestream format,
    kernel, share)."""
    P, N = a.prompt_tokens, a.tokens
    gpu = a.device != "cpu"
    runs: dict = {}
    for rep in range(a.reps):
        for ours, theirs in pairs:
            for sh in shares:
                ks = share_kernels(kernels, pool_kernels, sh)
                # On the CPU llama.cpp has no memory cap: it runs once, at share 1.
                base = [(theirs, sh)] if gpu or sh == 1 else []
                order = base + [(ours, k, sh) for k in ks]
                for key in order if rep % 2 == 0 else order[::-1]:
                    if len(key) == 3:
                        r = ours_run(files[key[0]], key[1], a, sh)
                    else:
                        ncm = cpu_moe_layers(layers, sh) if gpu else None
                        r = llama_run(llama, files[key[0]], a.threads, P, N, ncm)
                    runs.setdefault(key, []).append(r)
                    tps = r[0]["decode_tok_s"]
                    print(f"rep {rep} {key}: decode {tps:.2f} tok/s", file=sys.stderr)
    return runs


def summarize(runs: list[tuple[dict, int]], bpt: int, ceiling: float) -> dict:
    dec = statistics.median(r["decode_tok_s"] for r, _ in runs)
    out = {
        "decode_tok_s": dec,
        "prefill_tok_s": statistics.median(r["prefill_tok_s"] for r, _ in runs),
        "decode_tok_s_all": [r["decode_tok_s"] for r, _ in runs],
        "peak_rss_bytes": max(rss for _, rss in runs),
        "bytes_per_token": bpt,
        "decode_gbps": dec * bpt / 1e9,
        "ceiling_fraction": dec * bpt / 1e9 / ceiling,
    }
    first = runs[0][0]
    for k in ("mode", "peak_vram_bytes", "hit_rate", "h2d_bytes_per_token", "pcie_bytes_per_token",
              "host_ms_per_token", "bookkeeping_ms_per_token", "table_ms_per_token",
              "load_and_warm_s", "prediction_recall", "prefetch_precision",
              "decode_hit_rate", "declined_per_token", "skipped_steps_per_token",
              "hurried_per_token", "decode_depth"):  # fmt: skip
        if k in first:
            out[k] = first[k] if k == "mode" else statistics.median(r[k] for r, _ in runs)
    return out


def prepare(a, work: Path, llama: Path):
    """(HF folder or None, label -> file each engine runs, [(moestream label, llama.cpp label)],
    the model's args): from `--hf` each engine converts with its own tools; from `--gguf` both run
    that file (moestream through the store its convert makes of it)."""
    from moestream.store.format import Store

    if a.gguf:
        gguf = Path(a.gguf)
        store = ensure_gguf_store(gguf, work, a.gguf_quant)
        ours = f"{Store(store).quant_name}<-gguf"  # e.g. q4_k+q6_k: the kept blocks
        return None, {ours: store, gguf.name: gguf}, [(ours, gguf.name)], Store(store).args
    from moestream.models import load_model_args

    hf = Path(a.hf)
    pairs = [p.split(":") for p in a.pairs.split(",")]
    files = {}
    for ours, theirs in pairs:
        files[ours] = ensure_store(hf, work, ours)
        files[theirs] = ensure_gguf(hf, work, llama, theirs)
    return hf, files, pairs, load_model_args(hf)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--hf", help="Hugging Face checkpoint folder (gen_model_b.py)")
    src.add_argument("--gguf", help="a GGUF file both engines run (moestream converts it)")
    ap.add_argument("--gguf-quant", default=None,
                    help="moestream's --quant for the --gguf file (default: convert's own)")  # fmt: skip
    ap.add_argument("--llama", default=str(ROOT / ".cache/peers/llama"))
    ap.add_argument("--work", default=str(ROOT / ".cache/peers/work"))
    ap.add_argument("--pairs", default="int4:Q4_0,int8:Q8_0")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-p", "--prompt-tokens", type=int, default=64)
    ap.add_argument("-n", "--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None, help="append JSON rows here")
    ap.add_argument(
        "--kernels", default="cpu", help="moestream expert kernels to run, e.g. native,cpu"
    )
    ap.add_argument("--pool-kernels", default=None,
                    help="the variants at shares < 1 (default: --kernels), e.g. triton,direct")  # fmt: skip
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (llama.cpp built with CUDA)")
    ap.add_argument(
        "--shares",
        default="1",
        help="fractions of expert bytes in VRAM (GPU) or in moestream's slot cache (CPU), "
        "e.g. 1,0.5",
    )
    ap.add_argument("--commit", default=None, help="source commit when the tree has no .git")
    ap.add_argument("--kernel", default="cpu", help=argparse.SUPPRESS)  # the child's
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    shares = [float(x) for x in a.shares.split(",")]
    if a.child:
        moestream_child(a.child, a.kernel, a.threads, a.prompt_tokens, a.tokens, a.device,
                        shares[0])  # fmt: skip
        return 0
    if not (a.hf or a.gguf):
        ap.error("give --hf HF_DIR or --gguf FILE")
    gpu = a.device != "cpu"
    if gpu and a.kernels == "cpu":
        a.kernels = "triton,compiled,host-misses"
    if not gpu and 1.0 not in shares:
        ap.error("on the CPU --shares must include 1 (llama.cpp's run, the ratios' base)")
    for suffix in SUFFIXES:
        if not gpu and suffix in f"{a.kernels},{a.pool_kernels}":
            ap.error(f"'{suffix}' is a GPU provider's variant: run it with --device cuda")
    work, llama = Path(a.work), Path(a.llama)
    work.mkdir(parents=True, exist_ok=True)
    hf, files, pairs, args = prepare(a, work, llama)
    bpt = {q: store_bytes_per_token(files[q], gpu) for q, _ in pairs}
    K, E = args.num_experts_per_tok, args.num_experts
    bpt.update({t: gguf_bytes_per_token(files[t], llama, K, E) for _, t in pairs})
    ceiling = dram_gbps(a.threads, device=a.device)
    pcie = h2d_gbps() if gpu else None
    kernels = a.kernels.split(",")
    pool_kernels = a.pool_kernels.split(",") if a.pool_kernels else None
    runs = measure(pairs, kernels, shares, files, llama, a, args.num_hidden_layers, pool_kernels)
    rows = []
    for ours, theirs in pairs:
        for sh in shares:
            base = summarize(runs[(theirs, sh if gpu else 1.0)], bpt[theirs], ceiling)
            mine = [("llama.cpp", theirs, base)] if gpu or sh == 1 else []
            variants = mine + [
                ("moestream", f"{ours}/{k}", summarize(runs[(ours, k, sh)], bpt[ours], ceiling))
                for k in share_kernels(kernels, pool_kernels, sh)
                if (ours, k, sh) in runs
            ]
            for engine, fmt, s in variants:
                if pcie and s.get("pcie_bytes_per_token"):  # of the PCIe-bound rate for those bytes
                    s["pcie_fraction"] = s["pcie_bytes_per_token"] * s["decode_tok_s"] / 1e9 / pcie
                rows.append({"engine": engine, "format": fmt, "device": a.device,
                             "vram_share": sh if gpu else None,
                             "memory_share": None if gpu else sh,
                             "llama_n_cpu_moe": cpu_moe_layers(args.num_hidden_layers, sh) if gpu else None,
                             "ceiling_gbps": ceiling, "h2d_gbps": pcie, **s,
                             "decode_ratio_vs_llama": s["decode_tok_s"] / base["decode_tok_s"],
                             "prefill_ratio_vs_llama": s["prefill_tok_s"] / base["prefill_tok_s"]})  # fmt: skip
    what = "HBM" if gpu else "DRAM"
    print(f"{what} read ceiling {ceiling:.1f} GB/s" + (f", H2D {pcie:.1f} GB/s" if gpu else
          f" ({a.threads} threads)"))  # fmt: skip
    print(f"{'engine':<10} {'format':<12} {'share':>5} {'decode':>8} {'prefill':>8} {'GB/tok':>7} "
          f"{'GB/s':>6} {'of ' + what:>7} {'RSS GB':>7} {'ratio':>6}")  # fmt: skip
    for r in rows:
        print(
            f"{r['engine']:<10} {r['format']:<12} {r['vram_share'] or r['memory_share']:5.2f} "
            f"{r['decode_tok_s']:8.2f} {r['prefill_tok_s']:8.1f} "
            f"{r['bytes_per_token'] / 1e9:7.3f} {r['decode_gbps']:6.1f} {r['ceiling_fraction']:7.2f} "
            f"{r['peak_rss_bytes'] / 1e9:7.2f} {r['decode_ratio_vs_llama']:6.2f}"
            + (f"  host {r['host_ms_per_token']:.3f} ms/token" if "host_ms_per_token" in r else "")
            + (
                f" (slot table {r['table_ms_per_token']:.3f}, bookkeeping "
                f"{r['bookkeeping_ms_per_token']:.3f})"
                if "bookkeeping_ms_per_token" in r
                else ""
            )
            + (
                f"  hit {r['hit_rate']:.2f}, PCIe {r['pcie_bytes_per_token'] / 1e6:.0f} MB/token"
                f" = {r.get('pcie_fraction', 0):.2f} of its rate"
                if r.get("pcie_bytes_per_token")
                else ""
            )  # fmt: skip
        )
    if a.out:
        config = {"hf": str(hf) if hf else None, "gguf": a.gguf,
                  "layers": args.num_hidden_layers, "threads": a.threads,
                  "kernels": kernels, "pool_kernels": pool_kernels, "device": a.device,
                  "shares": shares,
                  "prompt_tokens": a.prompt_tokens, "tokens": a.tokens, "reps": a.reps}  # fmt: skip
        write_rows(a.out, [bench_row("peers", config, r, a.commit) for r in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
