"""What convert's requantization of GGUF expert types without a store scheme (IQ*, Q2_K / Q3_K,
Q5_1) costs, beside types whose blocks a store keeps (Q4_0, Q4_K, Q5_0, Q8_0): the reference
model through llama.cpp's converter (F32) and `llama-quantize --pure` into each type (the tensors
whose rows its blocks do not divide fall back to a type llama.cpp picks: the 64-wide down
projections), then, on the held-out text in `moestream eval`'s gate layout (windows of --ctx,
every next token scored) against the original model in fp32:

- file: the GGUF's own values (dequantized, fp32, as an HF folder): the type's cost itself, what
  llama.cpp runs up to its arithmetic;
- store: the store `convert` makes of the file by default (requantized experts into int4, or
  int8 for >= 8-bit sources; blocks of kept types copied; other dense types dequantized), native
  kernels: what moestream runs; with its KL against the file's values (what convert added:
  the second rounding plus the native kernels' int8 activations);
- store ref: the same store on the torch spec kernels (`ref`, fp32 activations): the second
  rounding alone, against the file's values;
- int8: the file's experts requantized into int8 instead (`--quant int8`), native.

    python benchmarks/gguf_requant_cost.py --llama .cache/peers/llama --threads 2 \\
        --imatrix IMATRIX.dat --out benchmarks/results/gguf_requant_cost.jsonl

The IQ2 / IQ3_XXS types need an importance matrix (`--imatrix`; llama-imatrix on the training
text); without one they are skipped."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_row, write_rows  # noqa: E402
from quality_peers import held_out_text, open_store  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
KEPT = ("Q8_0", "Q4_K", "Q4_0", "Q5_0")
REQUANTIZED = ("Q5_1", "IQ4_NL", "IQ4_XS", "Q3_K", "IQ3_S", "IQ3_XXS", "Q2_K")
NEEDS_IMATRIX = ("IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M")


def llama_file(f32: Path, work: Path, bin_dir: Path, qtype: str, imatrix: Path | None) -> Path:
    out = work / f"pure-{qtype}.gguf"
    if not out.is_file():
        extra = ["--imatrix", str(imatrix)] if imatrix and qtype in NEEDS_IMATRIX else []
        cmd = [str(bin_dir / "llama-quantize"), "--pure", *extra, str(f32), str(out), qtype, "2"]
        subprocess.run(cmd, check=True, capture_output=True)
    return out


def expert_types(path: Path) -> dict[str, str]:
    """Projection -> its GGUF type (layer 0's, as --pure gives every layer the same)."""
    import gguf

    r = gguf.GGUFReader(str(path))
    return {t.name.split(".")[2]: t.tensor_type.name for t in r.tensors
            if t.name.startswith("blk.0.ffn_") and "_exps" in t.name}  # fmt: skip


def values_folder(path: Path, hf: Path, dst: Path) -> Path:
    """An HF folder (per-expert layout) holding the GGUF's values as moestream's reader gives
    them, in fp32, beside the original's config and tokenizer."""
    from safetensors.torch import save_file

    from moestream.convert.gguf import GGUFCheckpoint

    if (dst / "model.safetensors").is_file():
        return dst
    ckpt = GGUFCheckpoint(path)
    state = {n: ckpt.tensor(n).float().contiguous() for n in ckpt.dense_names}
    for layer in ckpt.args.moe_layer_ids:
        for e in range(ckpt.args.num_experts):
            for role, w in zip(("gate", "up", "down"), ckpt.expert(layer, e)):
                key = f"model.layers.{layer}.mlp.experts.{e}.{role}_proj.weight"
                state[key] = w.float().contiguous()
    dst.mkdir(parents=True, exist_ok=True)
    for f in hf.iterdir():
        if f.suffix in (".json",) and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def gguf_store(path: Path, work: Path, quant: str | None) -> tuple[Path, list[str]]:
    """The store convert makes of the file (`quant`: --quant), and what it said."""
    import contextlib
    import io

    from moestream.convert.writer import convert, source_scheme

    dst = work / "stores" / f"{path.stem}-{quant or 'default'}"
    # converted every run: a store kept from an earlier run would be measured silently (its name
    # says nothing of the code that wrote it) and convert's note would be empty
    shutil.rmtree(dst, ignore_errors=True)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        store = convert(path, dst, source_scheme(path, quant), False, reuse=False)
    return store, [ln for ln in err.getvalue().splitlines() if "expert tensor" in ln]


def logits(rt, wins: list[list[int]]) -> list[torch.Tensor]:
    """Every window's logits [T, V] (fp32): computed once per model, compared many times."""
    from moestream.quality.eval import window_logits

    return [window_logits(rt, w, False)[:-1] for w in wins]


def metrics(cand: list, ref: list | None, wins: list[list[int]]) -> dict:
    """`quality.eval.evaluate_windows`' figures from logits already computed."""
    from moestream.quality.metrics import flips, kl_div, perplexity, token_nll

    tgt = [torch.tensor(w[1:]) for w in wins]
    out = perplexity(torch.cat([token_nll(c, t) for c, t in zip(cand, tgt)]))
    out = {k: out[k] for k in ("perplexity", "stderr")}
    if ref is not None:
        kl = torch.cat([kl_div(c, r) for c, r in zip(cand, ref)])
        f = [flips(c, r) for c, r in zip(cand, ref)]
        out.update(kl_mean=float(kl.mean()), kl_max=float(kl.max()))
        out.update({k: sum(x[k] for x in f) for k in ("flips", "ties", "positions")})
    return out


def run(a, hf: Path, work: Path, f32: Path, bin_dir: Path, wins: list[list[int]]) -> list[dict]:
    from moestream.runtime import open_model

    with open_model(hf, dtype="float32", threads=a.threads) as rt:
        oracle = logits(rt, wins)
    rows = [{"part": "oracle", **metrics(oracle, None, wins)}]
    print(format_row(rows[0]), file=sys.stderr)
    for qtype in a.types.split(","):
        if qtype in NEEDS_IMATRIX and a.imatrix is None:
            print(f"{qtype}: skipped (needs --imatrix)", file=sys.stderr)
            continue
        path = llama_file(f32, work, bin_dir, qtype, a.imatrix)
        base = {"type": qtype, "experts": expert_types(path), "bytes": path.stat().st_size}
        folder = values_folder(path, hf, work / f"values-{qtype}")
        with open_model(folder, dtype="float32", threads=a.threads) as rt:
            values = logits(rt, wins)
        rows.append({**base, "part": "file", **metrics(values, oracle, wins)})
        print(format_row(rows[-1]), file=sys.stderr)
        for quant, kernels in ((None, ("native", "ref")), ("int8", ("native",))):
            store, said = gguf_store(path, work, quant)
            for kernel in kernels:
                with open_store(store, kernel, a.threads) as rt:
                    got = logits(rt, wins)
                row = {**base, "part": "store", "quant": quant or "default", "kernel": kernel}
                row.update(convert_said=said, **metrics(got, oracle, wins))
                row["vs_file"] = metrics(got, values, wins)
                rows.append(row)
                print(format_row(row), file=sys.stderr)
    return rows


def format_row(r: dict) -> str:
    if r["part"] == "oracle":
        return f"oracle: PPL {r['perplexity']:.3f} +/- {r['stderr']:.3f}"
    head = f"{r['type']:8} {r['part']:5}"
    if r["part"] == "store":
        head += f" {r['quant']:7} {r['kernel']:6}"
    else:
        head += " " * 15
    line = f"{head} PPL {r['perplexity']:7.3f} KL {r['kl_mean']:.5f} flips {r['flips']:4d}"
    if "vs_file" in r:
        v = r["vs_file"]
        line += f" | vs file: KL {v['kl_mean']:.5f} flips {v['flips']:4d}"
    return line


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / "models/pystd-moe-29m"))
    ap.add_argument("--f32", default=None, help="llama.cpp's F32 GGUF of --model (else converted)")
    ap.add_argument("--llama", default=str(ROOT / ".cache/peers/llama"), help="src/, venv/, build/")
    ap.add_argument("--imatrix", default=None, help="llama-imatrix file for IQ2 / IQ3_XXS")
    ap.add_argument("--types", default=",".join(KEPT + REQUANTIZED))
    ap.add_argument("--text", default=None, help="text file (default: the held-out text)")
    ap.add_argument("--bytes", type=int, default=9000, help="bytes of the held-out text")
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", default=str(ROOT / ".cache/peers/requant"))
    ap.add_argument("--out", default=None, help="append JSON rows here")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    hf, work, llama = Path(a.model).resolve(), Path(a.work).resolve(), Path(a.llama).resolve()
    work.mkdir(parents=True, exist_ok=True)
    a.imatrix = Path(a.imatrix).resolve() if a.imatrix else None
    f32 = Path(a.f32) if a.f32 else work / "F32.gguf"
    if not f32.is_file():
        conv = [str(llama / "venv/bin/python"), str(llama / "src/convert_hf_to_gguf.py")]
        subprocess.run([*conv, str(hf), "--outtype", "f32", "--outfile", str(f32)], check=True)
    corpus = ROOT / "data/corpus/valid.txt"
    if a.text:
        text = Path(a.text).read_text(encoding="utf-8")
    else:  # issue 21's text when data/corpus is there (scripts/build_corpus.py)
        raw = corpus.read_bytes()[: a.bytes] if corpus.is_file() else None
        text = raw.decode("utf-8") if raw else held_out_text(a.bytes)
    from moestream.engine.tokenizer import Tokenizer
    from moestream.quality.eval import windows

    ids = Tokenizer(hf).encode(text)[: a.max_tokens]
    t0 = time.perf_counter()
    rows = run(a, hf, work, f32, llama / "build/bin", windows(ids, a.ctx))
    import hashlib

    config = {"model": str(hf.relative_to(ROOT)) if hf.is_relative_to(ROOT) else str(hf),
              "text_sha256": hashlib.sha256(text.encode()).hexdigest(), "tokens": len(ids),
              "ctx": a.ctx, "threads": a.threads, "imatrix": a.imatrix is not None,
              "wall_s": round(time.perf_counter() - t0, 1)}  # fmt: skip
    write_rows(a.out, [bench_row("gguf_requant_cost", config, r) for r in rows])
    print("\n".join(format_row(r) for r in rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
