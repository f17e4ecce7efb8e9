"""Issue 21's quality gate beside llama.cpp's perplexity: the reference model, its held-out text,
moestream's quantized stores and llama.cpp's Q8_0 / Q4_0 files scored on the same tokens.

One run (conversions cached under --work, never committed):

1. The text: the first --bytes (9,000) bytes of the corpus' held-out split, `data/corpus/valid.txt`
   as `python scripts/build_corpus.py --out data/corpus` rebuilds it from Debian and PyPI (the model
   card's corpus, file for file: 9,803 train / 214 validation files; issue 21's text, on which its
   "today" figures were measured; sha256 of its first 9,000 bytes 5e8cab43...). Without that
   folder: the installed `libpython3.11-minimal` .py files that `scripts/build_corpus.py` puts in the
   validation split (`is_valid`, 2 %), sorted by path, cleaned (`read_text`) and joined with
   `<|endoftext|>` lines as that script joins documents (not issue 21's text). `--text` names any
   file. Its sha256 is in every row.
2. moestream, gate layout (`moestream eval`'s own, as issue 21's thresholds are stated): windows
   of --ctx 256 over the first --max-tokens 2048 tokens, fresh KV cache per window, every next
   token scored (8 x 255 = 2,040), `quality.eval.evaluate` against the fp32 oracle (the Hugging
   Face folder in fp32): PPL (stderr), margin flips, KL mean. Stores (`convert`, resident, native
   kernels unless said): experts int8 / int4 / q4_0 with the dense weights float (`--dense
   float`); whole-model `--dense auto` (the model's attention is under the size floor, so auto
   quantizes only the tied 8192 x 256 table) and "all" (`DenseQuant(..., min_params=0)`, what
   `--dense` would do without the floor); the torch kernels (`cpu`) for the experts-only int8 /
   int4 stores; and stores moestream converts from llama.cpp's own Q8_0 / Q4_0 files (their
   blocks kept exactly; a Q6_K tensor dequantized to float).
3. llama.cpp: `convert_hf_to_gguf.py --outtype f32` of the same folder (its fp32 oracle), then
   `llama-quantize` F32 -> Q8_0, Q4_0 (its default mix: the tied token_embd at Q6_K) and Q4_0
   `--pure` (every 2-D weight Q4_0); `llama-perplexity -f TEXT -c N --kl-divergence-base F` per
   file (its PPL +/- stderr, and every scored position's log-probabilities into F), then
   `--kl-divergence` of each file against the F32 one (its mean KLD, same top token), under two
   settings: "exact" (`-fa off -ctk f32 -ctv f32`: fp32 attention and KV cache as moestream's
   eval runs; its F32 file then gives moestream's fp32 oracle to the file's uint16 steps) and
   "default" (llama-perplexity's own: flash attention auto = on here, f16 KV cache), both against
   the exact F32 base, so a default row's KL is everything its run adds to the exact model's;
   --threads threads.
4. Both engines on llama-perplexity's layout: it tokenizes the whole file (BOS first: the GGUF's
   add_bos_token is true, from tokenizer.json's post-processor), cuts len // N chunks of N tokens
   (a partial last chunk dropped), sets each chunk's first token to BOS, clears the KV cache per
   chunk and scores only the logits of positions N/2 .. N-2 (the tokens N/2+1 .. N-1).
   `quality.eval.llama_chunks` builds those chunks from moestream's tokenization and
   `evaluate_windows(..., first=N/2)` scores the same positions with the same context (N = --ctx:
   11 chunks, 1,397 positions of the 9,000-byte text). The token ids are checked: llama.cpp's are
   in its log-prob file's header, and must equal moestream's (tokenizer.json) and those of the
   tokenizer moestream rebuilds from the GGUF vocabulary; the script stops if they differ.
   llama.cpp rows: PPL +/- stderr as llama-perplexity prints it, KL = its mean KLD against its
   F32 file (its rule: base log-probs below -16 dropped; `kl_llama_rule` applies the same rule to
   moestream's logits, beside the exact KL), flips = the margin rule on the log-probs in its files
   (stored as uint16 over 16 nats: steps of 2.4e-4, far under the 0.1 margin). The two oracles are
   compared position by position (NLL, KL, flips): they are one model in two engines.
5. Activation ablation (--ablation, experts-only stores, gate layout): the torch spec
   (`kernel="ref"`, the provider's linear replaced by `kernels.ref.qlinear_q8`) with int8
   activations everywhere, with int16 activations into the down projection (what the native int8
   scheme does), int16 into every projection, and with no activation quantization (dequantized
   weights, fp32 activations: the weights' quantization alone). No kernel is changed: this
   measures what int16 down-projection activations would buy int4 / q4_0 before anyone writes
   them.

    python benchmarks/quality_peers.py --llama ../main/.cache/peers/llama \\
        --llama-bin .cache/peers/llama-build/bin --threads 2 --ablation \\
        --out benchmarks/results/quality_peers.jsonl
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_row, write_rows  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LLAMA_QUANTS = {"Q8_0": ["Q8_0"], "Q4_0": ["Q4_0"], "Q4_0-pure": ["--pure", "Q4_0"]}
LLAMA_FLOOR = -16.0  # llama-perplexity's KLD drops base log-probs at or below this


# ---- the text -------------------------------------------------------------------------------
def held_out_text(nbytes: int, pkg: str = "libpython3.11-minimal") -> str:
    """The first nbytes of the held-out split rebuilt from `pkg`'s installed .py files."""
    spec = importlib.util.spec_from_file_location("build_corpus", ROOT / "scripts/build_corpus.py")
    bc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bc)
    listed = subprocess.run(["dpkg", "-L", pkg], capture_output=True, text=True, check=True)
    docs = []
    for f in sorted(listed.stdout.split("\n")):
        p = Path(f)
        if f.endswith(".py") and p.is_file() and not p.is_symlink():
            rel = f.lstrip("/")
            if bc.is_valid(pkg, rel, 2.0) and (text := bc.read_text(f)) is not None:
                docs.append(text + bc.EOT + "\n")
    data = "".join(docs).encode()[:nbytes]
    return data.decode("utf-8")


# ---- llama.cpp ------------------------------------------------------------------------------
def llama_ggufs(hf: Path, work: Path, llama: Path, bin_dir: Path, threads: int) -> dict:
    """name -> GGUF path: F32 (llama.cpp's converter), and llama-quantize's files from it."""
    out = {"F32": work / "llama-F32.gguf"}
    if not out["F32"].is_file():
        conv = [str(llama / "venv/bin/python"), str(llama / "src/convert_hf_to_gguf.py")]
        cmd = [*conv, str(hf), "--outtype", "f32", "--outfile", str(out["F32"])]
        subprocess.run(cmd, check=True, capture_output=True)
    for name, args in LLAMA_QUANTS.items():
        out[name] = work / f"llama-{name}.gguf"
        if not out[name].is_file():
            q = [str(bin_dir / "llama-quantize"), *args[:-1], str(out["F32"]), str(out[name])]
            subprocess.run([*q, args[-1], str(threads)], check=True, capture_output=True)
    return out


def gguf_types(path: Path) -> dict:
    """Tensor type -> count, and the type of token_embd (the tied output layer)."""
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    counts: dict[str, int] = {}
    for t in r.tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    embd = next(t.tensor_type.name for t in r.tensors if t.name == "token_embd.weight")
    return {"types": counts, "token_embd": embd}


def _llama(bin_dir: Path, args: list[str]) -> str:
    cmd = [str(bin_dir / "llama-perplexity"), *args]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    return r.stdout + r.stderr


def _num(pattern: str, text: str) -> tuple[float, ...]:
    m = re.search(pattern, text)
    if m is None:
        raise RuntimeError(f"llama-perplexity output has no {pattern!r}")
    return tuple(float(g) for g in m.groups())


# "exact": fp32 attention and KV cache (CPU flash attention alone moved the F32 file's KL
# against moestream's fp32 oracle from ~0 to 1e-4 here); "default": the tool's own settings.
LLAMA_SETTINGS = {"exact": ["-fa", "off", "-ctk", "f32", "-ctv", "f32"], "default": []}


def llama_perplexity(bin_dir, gguf, text, n_ctx, threads, setting, kld_out) -> dict:
    args = ["-m", str(gguf), "-f", str(text), "-c", str(n_ctx), "-t", str(threads)]
    args += [*LLAMA_SETTINGS[setting], "--no-warmup", "--kl-divergence-base", str(kld_out)]
    log = _llama(bin_dir, args)
    ppl, se = _num(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", log)
    return {"perplexity": ppl, "stderr": se}


def llama_kld(bin_dir, gguf, base_kld, n_ctx, threads, setting) -> dict:
    args = ["-m", str(gguf), "-c", str(n_ctx), "-t", str(threads), *LLAMA_SETTINGS[setting]]
    log = _llama(bin_dir, [*args, "--kl-divergence", "--kl-divergence-base", str(base_kld)])
    pm = r"\s*:\s*([\d.]+) ± \s*([\d.]+)"
    ppl_q, ppl_q_se = _num(r"Mean PPL\(Q\)" + pm, log)
    kld, kld_se = _num(r"Mean    KLD:\s*([\d.]+) ± \s*([\d.]+)", log)
    same, same_se = _num(r"Same top p:\s*([\d.]+) ± \s*([\d.]+) %", log)
    return {"ppl_q": ppl_q, "ppl_q_stderr": ppl_q_se, "kld": kld, "kld_stderr": kld_se,
            "same_top": same / 100, "same_top_stderr": same_se / 100}  # fmt: skip


def read_kld(path: Path) -> tuple[int, torch.Tensor, torch.Tensor]:
    """llama-perplexity's --kl-divergence-base file -> (n_ctx, tokens [chunks, n_ctx], log-probs
    [positions, V]): per position 2 floats (scale, min log-prob) and V uint16 q, log p = scale * q
    + min (q = 0: at or under the top logit - 16)."""
    raw = path.read_bytes()
    assert raw[:8] == b"_logits_", f"{path} is not a llama-perplexity log-prob file"
    n_ctx, n_vocab, n_chunk = np.frombuffer(raw, np.int32, 3, 8)
    off = 20 + 4 * n_ctx * n_chunk
    tokens = np.frombuffer(raw, np.int32, n_ctx * n_chunk, 20).reshape(n_chunk, n_ctx)
    nv = 2 * ((n_vocab + 1) // 2) + 4
    rows = np.frombuffer(raw, np.uint16, offset=off).reshape(-1, nv)
    assert rows.shape[0] == n_chunk * (n_ctx - 1 - n_ctx // 2), f"{path}: truncated"
    head = rows[:, :4].copy().view(np.float32)  # [P, 2]: scale, min log-prob
    lp = rows[:, 4 : 4 + n_vocab].astype(np.float32) * head[:, :1] + head[:, 1:2]
    return int(n_ctx), torch.from_numpy(tokens.astype(np.int64)), torch.from_numpy(lp)


def kl_llama_rule(cand: torch.Tensor, base_lp: torch.Tensor) -> torch.Tensor:
    """KL(base || cand) [P] as llama-perplexity sums it: base log-probs <= -16 left out."""
    lc = torch.log_softmax(cand.float(), -1)
    keep = base_lp > LLAMA_FLOOR
    return torch.where(keep, base_lp.exp() * (base_lp - lc), torch.zeros_like(lc)).sum(-1)


# ---- moestream ------------------------------------------------------------------------------
def dense_rules():
    from moestream.quant import DenseQuant, make_dense, make_scheme

    i8, i4, q4, q6k = (make_scheme(n) for n in ("int8", "int4", "q4_0", "q6_k"))
    return [  # (row name, experts scheme, dense rule, kernels)
        ("experts int8, dense float", i8, DenseQuant(), ("native", "cpu")),
        ("experts int4, dense float", i4, DenseQuant(), ("native", "cpu")),
        ("experts q4_0, dense float", q4, DenseQuant(), ("native",)),
        ("int8, dense auto (tied table int8)", i8, make_dense("auto", i8), ("native",)),
        ("int8, dense all int8", i8, DenseQuant(i8, i8, min_params=0), ("native",)),
        ("int4, dense auto (tied table q6_k)", i4, make_dense("auto", i4), ("native",)),
        ("int4, dense all int4, output q6_k", i4, DenseQuant(i4, q6k, min_params=0), ("native",)),
        ("int4, dense all int4, output int8", i4, DenseQuant(i4, i8, min_params=0), ("native",)),
        ("int4, dense all int4, output int4", i4, DenseQuant(i4, i4, min_params=0), ("native",)),
        ("q4_0, dense all q4_0, output int8", q4, DenseQuant(q4, i8, min_params=0), ("native",)),
        ("q4_0, dense all q4_0, output q6_k", q4, DenseQuant(q4, q6k, min_params=0), ("native",)),
        ("q4_0, dense all q4_0, output q4_0", q4, DenseQuant(q4, q4, min_params=0), ("native",)),
    ]


def store_for(hf: Path, work: Path, scheme, dense) -> Path:
    from moestream.convert.writer import convert
    from moestream.store.format import NEWEST

    tag = f"{scheme.name}-{dense.tag}-min{dense.min_params}-v{NEWEST}"
    return convert(hf, work / "stores" / tag, scheme, False, dense=dense, reuse=True)


def gguf_store(gguf: Path, work: Path) -> Path:
    from moestream.convert.gguf import gguf_fingerprint
    from moestream.convert.writer import convert, source_scheme
    from moestream.quant import make_dense
    from moestream.store.format import NEWEST

    scheme = source_scheme(gguf, None)  # Q8_0 -> int8, Q4_0 -> q4_0: the blocks kept exactly
    dst = work / "stores" / f"{gguf.stem}-{gguf_fingerprint(gguf)[:12]}-v{NEWEST}"
    return convert(gguf, dst, scheme, False, dense=make_dense("auto", scheme.scheme), reuse=True)


def open_store(store: Path, kernel: str, threads: int):
    from moestream.experts.config import StreamConfig
    from moestream.runtime import open_model

    cfg = StreamConfig(resident=True, kernel=kernel)
    return open_model(store, dtype="float32", experts=cfg, threads=threads)


def layout_logits(rt, chunks: list[list[int]], first: int) -> torch.Tensor:
    """logits [positions, V] of the scored positions of every chunk, in order."""
    from moestream.quality.eval import window_logits

    return torch.cat([window_logits(rt, c, False)[first:-1] for c in chunks])


def spec_linear(wide: tuple[str, ...]):
    """The provider's linear as the native kernels' spec: activations quantized per block of 32,
    int8, or int16 into the projections named in `wide` ("w13", "w2")."""
    from moestream.kernels.ref import qlinear_q8

    return lambda x, sec, name, g: qlinear_q8(x.float(), sec, name, g, name in wide)


def set_linear(rt, linear) -> None:
    from moestream.experts.streaming import StoreExperts

    assert isinstance(rt.provider, StoreExperts), type(rt.provider)
    rt.provider.linear = linear  # benchmark only: the torch path's per-projection kernel


def _metrics(out: dict) -> dict:
    keep = ("perplexity", "stderr", "tokens", "flips", "ties", "positions", "kl_mean", "kl_max")
    return {k: out[k] for k in keep if k in out}


# ---- the run --------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / "models/pystd-moe-29m"))
    ap.add_argument("--text", default=None, help="text file (default: the rebuilt held-out text)")
    ap.add_argument("--bytes", type=int, default=9000, help="bytes of the rebuilt text")
    ap.add_argument("--max-tokens", type=int, default=2048, help="gate layout: tokens scored")
    ap.add_argument("--ctx", type=int, default=256, help="gate window and llama-perplexity -c")
    ap.add_argument("--llama", default=str(ROOT / ".cache/peers/llama"), help="src/ and venv/")
    ap.add_argument("--llama-bin", default=None, help="llama-perplexity, llama-quantize")
    ap.add_argument("--work", default=str(ROOT / ".cache/peers/quality"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ablation", action="store_true", help="the activation ablation rows")
    ap.add_argument("--out", default=None, help="append JSON rows here")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    hf, work, llama = Path(a.model).resolve(), Path(a.work).resolve(), Path(a.llama).resolve()
    bin_dir = Path(a.llama_bin).resolve() if a.llama_bin else llama / "build/bin"
    work.mkdir(parents=True, exist_ok=True)
    corpus = ROOT / "data/corpus/valid.txt"  # scripts/build_corpus.py: the model card's corpus
    text_path = Path(a.text) if a.text else work / f"heldout-{a.bytes}.txt"
    if not a.text:  # issue 21's text is `head -c 9000 data/corpus/valid.txt`
        text = (
            corpus.read_bytes()[: a.bytes] if corpus.is_file() else held_out_text(a.bytes).encode()
        )
        text_path.write_bytes(text)
    text = text_path.read_text(encoding="utf-8")
    t0 = time.perf_counter()
    rows, checks = run(a, hf, work, llama, bin_dir, text_path, text)
    version = _llama(bin_dir, ["--version"]).strip().splitlines()[0]
    sdist = sorted(p.name for p in (llama / "dl").glob("*.tar.gz"))  # build_llamacpp.sh's source
    sha = hashlib.sha256(text.encode()).hexdigest()
    config = {"model": str(hf.relative_to(ROOT)) if hf.is_relative_to(ROOT) else str(hf),
              "text_sha256": sha, "text_bytes": len(text.encode()),
              "gate_ctx": a.ctx, "gate_max_tokens": a.max_tokens, "llama_ctx": a.ctx,
              "threads": a.threads, "oracle": "fp32",
              "llama_cpp": version, "llama_cpp_sdist": sdist,
              "wall_s": round(time.perf_counter() - t0, 1)}  # fmt: skip
    out = [bench_row("quality_peers", config, r) for r in rows]
    out.append(bench_row("quality_peers", config, {"part": "checks", **checks}))
    write_rows(a.out, out)
    print(format_tables(rows, checks))
    return 0


def run(a, hf: Path, work: Path, llama: Path, bin_dir: Path, text_path: Path, text: str):
    from moestream.quality.eval import llama_chunks
    from moestream.runtime import open_model

    oracle = open_model(hf, dtype="float32", threads=a.threads)
    ids = oracle.tokenizer.encode(text)
    # llama.cpp first: its files give the token ids every layout is checked against.
    ggufs = llama_ggufs(hf, work, llama, bin_dir, a.threads)
    runs = {(n, st): llama_run(a, bin_dir, work, text_path, n, p, st)
            for st in LLAMA_SETTINGS for n, p in ggufs.items()}  # fmt: skip
    toks = runs["F32", "exact"]["tokens"]
    same = toks.flatten().tolist() == ids[: toks.numel()]
    checks = {"llama_tokens": toks.numel(), "llama_tokens_equal": same}
    assert checks["llama_tokens_equal"], "llama.cpp and moestream tokenize the text differently"
    chunks, first = llama_chunks(ids, a.ctx, oracle.tokenizer.token_id(oracle.tokenizer.bos_token))
    assert len(chunks) * a.ctx == toks.numel()
    tgt = torch.tensor([t for c in chunks for t in c[first + 1 :]])
    ref_logits = layout_logits(oracle, chunks, first)
    base = runs["F32", "exact"]["lp"]
    checks["oracles"] = compare_oracles(ref_logits, base, tgt, runs["F32", "exact"]["row"])
    rows = llama_rows(a, bin_dir, work, ggufs, runs, base)
    stores = [(n, store_for(hf, work, s, d), d, ks) for n, s, d, ks in dense_rules()]
    stores += [(f"llama.cpp's {n} file", gguf_store(ggufs[n], work), None, ("native",))
               for n in LLAMA_QUANTS]  # fmt: skip
    for name, store, dense, kernels in stores:
        for kernel in kernels:
            rows += moestream_rows(a, name, store, kernel, oracle, ids, (chunks, first), base,
                                   checks if dense is None else None, text)  # fmt: skip
    if a.ablation:
        rows += ablation(a, stores, oracle, ids[: a.max_tokens])
    oracle.close()
    return rows, checks


def llama_run(a, bin_dir, work, text_path, name, path, setting) -> dict:
    """llama-perplexity over the text: its row (PPL, the file's tensor types), the token ids and
    log-probs of its scored positions."""
    kld = work / f"llama-{name}-{setting}-c{a.ctx}.kld"
    ppl = llama_perplexity(bin_dir, path, text_path, a.ctx, a.threads, setting, kld)
    _, toks, lp = read_kld(kld)
    row = {"engine": "llama.cpp", "format": name, "llama_settings": setting,
           **gguf_types(path), **ppl}  # fmt: skip
    return {"row": row, "tokens": toks, "lp": lp, "kld_file": kld}


def compare_oracles(ref_logits, base, tgt, llama_row) -> dict:
    """moestream's fp32 oracle against llama.cpp's exact F32 run, position by position (targets
    under the file's floor excluded from the NLL difference: the file clamps them)."""
    from moestream.quality.metrics import flips, perplexity, token_nll

    mine, theirs = token_nll(ref_logits, tgt), -base.gather(1, tgt[:, None])[:, 0]
    seen = theirs < -LLAMA_FLOOR - 1
    f = flips(base, ref_logits)
    return {"moestream_ppl": perplexity(mine)["perplexity"], "llama_ppl": llama_row["perplexity"],
            "nll_max_abs_diff": float((mine - theirs)[seen].abs().max()),
            "targets_under_floor": int((~seen).sum()),
            "kl_llama_rule_mean": float(kl_llama_rule(ref_logits, base).mean()),
            "flips": f["flips"], "ties": f["ties"], "positions": f["positions"]}  # fmt: skip


def llama_rows(a, bin_dir, work, ggufs, runs, base) -> list[dict]:
    """llama.cpp's rows: its PPL, its mean KLD against the exact F32 run, flips from its files."""
    from moestream.quality.metrics import flips, kl_div

    rows = []
    base_file = runs["F32", "exact"]["kld_file"]
    for (name, setting), r in runs.items():
        row = {**r["row"], "layout": "llama", "positions": base.shape[0]}
        if (name, setting) != ("F32", "exact"):
            k = llama_kld(bin_dir, ggufs[name], base_file, a.ctx, a.threads, setting)
            f = flips(r["lp"], base)
            row.update(k, kl_mean=k["kld"], flips=f["flips"], ties=f["ties"],
                       kl_from_files=float(kl_div(r["lp"], base).mean()))  # fmt: skip
        rows.append(row)
    return rows


def moestream_rows(a, name, store, kernel, oracle, ids, layout, base, checks, text) -> list[dict]:
    """One store and kernel: the gate layout's row and llama-perplexity's layout's row."""
    from moestream.quality.eval import evaluate, evaluate_windows

    chunks, first = layout
    with open_store(store, kernel, a.threads) as rt:
        if checks is not None:  # a GGUF store: its own tokenizer, rebuilt from the vocabulary
            checks[f"tokens_equal {name}"] = rt.tokenizer.encode(text) == ids
            assert checks[f"tokens_equal {name}"], f"{name}: moestream's GGUF tokenizer differs"
        meta = {"engine": "moestream", "format": name, "kernel": kernel, "store": store.name,
                "mode": rt.provider.describe()}  # fmt: skip
        g = evaluate(rt, oracle, ids[: a.max_tokens], a.ctx)
        w = evaluate_windows(rt, oracle, chunks, first)
        cand = layout_logits(rt, chunks, first)
        extra = {"kl_llama_rule": float(kl_llama_rule(cand, base).mean())}
    print(f"  {name} [{kernel}]: gate {g['flips']} / {g['kl_mean']:.5f}, "
          f"llama layout {w['flips']} / {w['kl_mean']:.5f}", file=sys.stderr)  # fmt: skip
    return [{**meta, "layout": "gate", **_metrics(g)},
            {**meta, "layout": "llama", **_metrics(w), **extra}]  # fmt: skip


ABLATION = (  # (name, int16 projections of the spec; "native"; None: no activation rounding)
    ("native kernel", "native"),
    ("spec, int8 activations", ()),
    ("spec, int8 activations, int16 into down_proj", ("w2",)),
    ("spec, int16 activations everywhere", ("w13", "w2")),
    ("no activation quantization (dequantized weights, fp32)", None),
)


def ablation(a, stores, oracle, ids) -> list[dict]:
    from moestream.quality.eval import evaluate

    rows = []
    for name, store, _, _ in stores[:3]:  # the experts-only stores
        for variant, how in ABLATION:
            with open_store(store, "native" if how == "native" else "ref", a.threads) as rt:
                if how != "native" and how is not None:
                    set_linear(rt, spec_linear(how))
                g = evaluate(rt, oracle, ids, a.ctx)
            rows.append({"engine": "moestream", "part": "ablation", "format": name,
                         "variant": variant, "layout": "gate", **_metrics(g)})  # fmt: skip
            print(f"  ablation {name}: {variant}: {g['flips']} / {g['kl_mean']:.5f}",
                  file=sys.stderr)  # fmt: skip
    return rows


def format_tables(rows: list[dict], checks: dict) -> str:
    def line(r):
        ppl = f"{r['perplexity']:.3f} ({r['stderr']:.3f})"
        kl = f"{r['kl_mean']:.5f}" if "kl_mean" in r else ""
        fl = f"{r['flips']}" if "flips" in r else ""
        tag = r.get("kernel") or r.get("llama_settings")
        who = f"{r['engine']} {r['format']}" + (f" [{tag}]" if tag else "")
        return f"| {who} | {ppl} | {fl} | {kl} |"

    head = ["| engine, format | PPL (stderr) | margin flips | KL mean |", "|---|---|---|---|"]
    gate = [r for r in rows if r.get("layout") == "gate" and "part" not in r]
    lay = [r for r in rows if r.get("layout") == "llama"]
    abl = [r for r in rows if r.get("part") == "ablation"]
    out = [f"gate layout ({gate[0]['positions']} tokens)" if gate else "", *head]
    out += [line(r) for r in gate]
    out += ["", f"llama-perplexity layout ({lay[0]['positions']} tokens)", *head]
    out += [line(r) for r in lay]
    if abl:
        out += ["", "activation ablation (gate layout)", "| store | variant | flips | KL |",
                "|---|---|---|---|"]  # fmt: skip
        out += [f"| {r['format']} | {r['variant']} | {r['flips']} | {r['kl_mean']:.5f} |"
                for r in abl]  # fmt: skip
    out += ["", f"checks: {checks}"]
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
