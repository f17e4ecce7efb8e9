"""moestream vs llama.cpp on the same Hugging Face checkpoint, same threads, same prompt and decode
lengths, interleaved repeats in one run (the yardstick of the speed issues).

Each engine converts the checkpoint with its own converter (moestream `convert --quant Q`,
llama.cpp `convert_hf_to_gguf.py --outtype q8_0` then `llama-quantize` for Q4_0) once into
`--work`. Per repeat and pair (moestream int4 vs Q4_0, int8 vs Q8_0), each engine runs in its own
process: llama.cpp as `llama-bench -p P -n N` (random tokens), moestream as a child of this script
that prefills P random token ids and decodes N greedy tokens through the Generator (every expert
resident, `--resident`). Reported per engine and format (medians): prefill and decode tok/s, peak
RSS of the process, bytes read per decoded token (dense weights + the top-k experts of every layer
+ one embedding row, from the files' tensor sizes), the implied GB/s against the DRAM read
bandwidth measured in this run (a 1 GiB fp32 sum at the same threads), and the ratio
moestream / llama.cpp.

    python benchmarks/bench_peers.py --hf HF_DIR --llama .cache/peers/llama [--threads 2]
        [--pairs int4:Q4_0,int8:Q8_0] [-p 64] [-n 64] [--reps 3] [--out rows.jsonl]

Build llama.cpp first (../shared/peers/README.md: build_llamacpp.sh); nothing of it is committed.
"""

from __future__ import annotations

import argparse
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


def dram_gbps(threads: int, reps: int = 5) -> float:
    """Read bandwidth of a 1 GiB fp32 sum (2 passes warm), the ceiling for weight streaming."""
    import torch

    torch.set_num_threads(threads)
    t = torch.ones(1 << 28)
    t.sum()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        t.sum()
        times.append(time.perf_counter() - t0)
    return t.numel() * 4 / statistics.median(times) / 1e9


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


def moestream_child(store: str, kernel: str, threads: int, P: int, N: int) -> None:
    """In a child process: prefill P random ids, decode N greedy tokens; print one JSON line."""
    import torch

    from moestream.config import SamplingConfig
    from moestream.experts.config import StreamConfig
    from moestream.runtime import open_model

    torch.set_num_threads(threads)
    experts = StreamConfig(resident=True, kernel=kernel)
    with open_model(store, experts=experts, threads=threads) as rt:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, rt.args.vocab_size, (P,), generator=g).tolist()
        cfg = SamplingConfig(max_new_tokens=N, ignore_eos=True)
        rt.generator.generate(ids[:8], SamplingConfig(max_new_tokens=4, ignore_eos=True))  # warm
        s = rt.generator.generate(ids, cfg).stats()
    print(json.dumps({"prefill_tok_s": s["prefill_tok_s"], "decode_tok_s": s["decode_tok_s"]}))


def ensure_store(hf: Path, work: Path, quant: str) -> Path:
    from moestream.store.format import VERSION

    dst = work / f"moestream-{quant}-v{VERSION}"  # a store of an older version would be refused
    if not (dst / "manifest.json").is_file():
        subprocess.run(
            [sys.executable, "-m", "moestream", "convert", str(hf), str(dst), "--quant", quant],
            check=True,
        )
    return dst


def ensure_gguf(hf: Path, work: Path, llama: Path, qtype: str) -> Path:
    q8 = work / "llama-Q8_0.gguf"
    if not q8.is_file():
        conv = [str(llama / "venv/bin/python"), str(llama / "src/convert_hf_to_gguf.py")]
        subprocess.run([*conv, str(hf), "--outtype", "q8_0", "--outfile", str(q8)], check=True)
    if qtype == "Q8_0":
        return q8
    out = work / f"llama-{qtype}.gguf"
    if not out.is_file():
        quantize = llama / "build/bin/llama-quantize"
        # From the Q8_0 file (speed is what is compared; the bf16 GGUF would double the disk).
        cmd = [str(quantize), "--allow-requantize", str(q8), str(out), qtype]
        subprocess.run(cmd, check=True)
    return out


def store_bytes_per_token(store: Path) -> int:
    """Dense weights read per token as the child holds them (float ones fp32, quantized ones as
    stored; the embedding: one row) +
    top-k records per MoE layer."""
    from moestream.store.format import Store

    s = Store(store)
    a = s.args
    dense = 0
    for name in s.dense_names:
        if s.dense_scheme(name) is None:
            n = s.tensor(name).numel() * 4
        else:  # quantized: its sections as stored
            n = sum(t.numel() * t.element_size() for t in s.dense_sections(name).values())
        dense += n // a.vocab_size if name.endswith("embed_tokens.weight") else n
    s.release_dense()
    return dense + len(s.crc) * a.num_experts_per_tok * s.layout.size


def gguf_bytes_per_token(gguf: Path, llama: Path, top_k: int, experts: int) -> int:
    """The same count from the GGUF's tensor sizes (read by llama.cpp's gguf-py)."""
    code = (
        "import gguf, json, sys; r = gguf.GGUFReader(sys.argv[1]); "
        "print(json.dumps({t.name: [int(t.n_bytes), [int(d) for d in t.shape]] for t in r.tensors}))"
    )
    py = str(llama / "venv/bin/python")
    out = subprocess.run([py, "-c", code, str(gguf)], capture_output=True, text=True, check=True)
    total = 0
    for name, (n, shape) in json.loads(out.stdout).items():
        if "_exps" in name:
            total += n * top_k // experts
        elif name == "token_embd.weight":
            total += n // shape[-1]  # one row of [vocab] rows
        else:
            total += n
    return total


def llama_run(llama: Path, gguf: Path, threads: int, P: int, N: int) -> tuple[dict, int]:
    bench = str(llama / "build/bin/llama-bench")
    cmd = [bench, "-m", str(gguf), "-t", str(threads), "-p", str(P), "-n", str(N), "-r", "1",
           "-o", "json"]  # fmt: skip
    out, rss = child_rss(cmd)
    rows = json.loads(out)
    pp = next(r["avg_ts"] for r in rows if r["n_prompt"] > 0)
    tg = next(r["avg_ts"] for r in rows if r["n_gen"] > 0)
    return {"prefill_tok_s": pp, "decode_tok_s": tg}, rss


def ours_run(store: Path, kernel: str, threads: int, P: int, N: int) -> tuple[dict, int]:
    cmd = [sys.executable, __file__, "--child", str(store), "--kernel", kernel,
           "--threads", str(threads), "-p", str(P), "-n", str(N)]  # fmt: skip
    out, rss = child_rss(cmd)
    return json.loads(out.strip().splitlines()[-1]), rss


def measure(pairs, kernels: list[str], files: dict, llama: Path, a) -> dict:
    """Interleaved repeats: per repeat and pair, llama.cpp and each moestream kernel, the order
    reversed every other repeat. Keys: the llama.cpp format, or (moestream format, kernel)."""
    P, N = a.prompt_tokens, a.tokens
    runs: dict = {}
    for rep in range(a.reps):
        for ours, theirs in pairs:
            order = [theirs] + [(ours, k) for k in kernels]
            for key in order if rep % 2 == 0 else order[::-1]:
                if isinstance(key, tuple):
                    r = ours_run(files[key[0]], key[1], a.threads, P, N)
                else:
                    r = llama_run(llama, files[key], a.threads, P, N)
                runs.setdefault(key, []).append(r)
                print(f"rep {rep} {key}: decode {r[0]['decode_tok_s']:.2f} tok/s", file=sys.stderr)
    return runs


def summarize(runs: list[tuple[dict, int]], bpt: int, ceiling: float) -> dict:
    dec = statistics.median(r["decode_tok_s"] for r, _ in runs)
    return {
        "decode_tok_s": dec,
        "prefill_tok_s": statistics.median(r["prefill_tok_s"] for r, _ in runs),
        "decode_tok_s_all": [r["decode_tok_s"] for r, _ in runs],
        "peak_rss_bytes": max(rss for _, rss in runs),
        "bytes_per_token": bpt,
        "decode_gbps": dec * bpt / 1e9,
        "dram_fraction": dec * bpt / 1e9 / ceiling,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hf", help="Hugging Face checkpoint folder (gen_model_b.py)")
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
    ap.add_argument("--kernel", default="cpu", help=argparse.SUPPRESS)  # the child's
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        moestream_child(a.child, a.kernel, a.threads, a.prompt_tokens, a.tokens)
        return 0
    hf, work, llama = Path(a.hf), Path(a.work), Path(a.llama)
    work.mkdir(parents=True, exist_ok=True)
    pairs = [p.split(":") for p in a.pairs.split(",")]
    from moestream.models import load_model_args

    args = load_model_args(hf)
    files = {}
    for ours, theirs in pairs:
        files[ours] = ensure_store(hf, work, ours)
        files[theirs] = ensure_gguf(hf, work, llama, theirs)
    bpt = {q: store_bytes_per_token(files[q]) for q, _ in pairs}
    K, E = args.num_experts_per_tok, args.num_experts
    bpt.update({t: gguf_bytes_per_token(files[t], llama, K, E) for _, t in pairs})
    ceiling = dram_gbps(a.threads)
    kernels = a.kernels.split(",")
    runs = measure(pairs, kernels, files, llama, a)
    rows = []
    for ours, theirs in pairs:
        base = summarize(runs[theirs], bpt[theirs], ceiling)
        variants = [("llama.cpp", theirs, base)] + [
            ("moestream", f"{ours}/{k}", summarize(runs[(ours, k)], bpt[ours], ceiling))
            for k in kernels
        ]
        for engine, fmt, s in variants:
            rows.append({"engine": engine, "format": fmt, "dram_gbps": ceiling, **s,
                         "decode_ratio_vs_llama": s["decode_tok_s"] / base["decode_tok_s"],
                         "prefill_ratio_vs_llama": s["prefill_tok_s"] / base["prefill_tok_s"]})  # fmt: skip
    print(f"DRAM read ceiling {ceiling:.1f} GB/s ({a.threads} threads)")
    print(f"{'engine':<10} {'format':<12} {'decode':>8} {'prefill':>8} {'GB/tok':>7} {'GB/s':>6} "
          f"{'of DRAM':>7} {'RSS GB':>7} {'ratio':>6}")  # fmt: skip
    for r in rows:
        print(
            f"{r['engine']:<10} {r['format']:<12} {r['decode_tok_s']:8.2f} {r['prefill_tok_s']:8.1f} "
            f"{r['bytes_per_token'] / 1e9:7.3f} {r['decode_gbps']:6.1f} {r['dram_fraction']:7.2f} "
            f"{r['peak_rss_bytes'] / 1e9:7.2f} {r['decode_ratio_vs_llama']:6.2f}"
        )
    if a.out:
        config = {"hf": str(hf), "layers": args.num_hidden_layers, "threads": a.threads,
                  "kernels": kernels,
                  "prompt_tokens": a.prompt_tokens, "tokens": a.tokens, "reps": a.reps}  # fmt: skip
        write_rows(a.out, [bench_row("peers", config, r) for r in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
