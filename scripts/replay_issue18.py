"""Replay every input of issue 18 (silent conflicts, inputs that ended in a stack trace, the habits
users bring) against the bundled model and stores converted from it in a temporary folder.

Each case prints its command, its exit code against the expected one and the first lines of its
stderr; the run ends with a summary and exits 1 when a case exits with an unexpected code, lacks
the text it must print, or prints a Python stack trace.

    .venv/bin/python scripts/replay_issue18.py                # every case (~3 min on 2 cores)
    .venv/bin/python scripts/replay_issue18.py --list
    .venv/bin/python scripts/replay_issue18.py --cases mmap-budget,truncated-dense
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "pystd-moe-29m"
MS = [sys.executable, "-m", "moestream"]
STACK = "Trace" + "back"  # spelled apart: this script's own output never holds the word
TIMEOUT = 300


@dataclass
class Case:
    name: str
    what: str  # the words for the input
    argv: list[str] | str  # a list runs as is; a string runs in bash (pipes)
    rc: int = 2
    expect: tuple[str, ...] = ()  # texts stdout + stderr must hold
    needs: tuple[str, ...] = ()  # fixtures (FIXTURES) the command uses
    stdin: str | None = None


def ms(*args: str) -> list[str]:
    return [*MS, *args]


def gen(model: str, *flags: str) -> list[str]:
    return ms("generate", "-m", model, "-p", "def fibonacci(n):", "-n", "4", *flags)


CASES = [
    # ---- silent conflicts and wrong defaults -------------------------------------------------
    Case("mmap-budget", "--io mmap --memory-budget 1KB",
         gen("{store}", "--io", "mmap", "--memory-budget", "1KB"),
         expect=("--io mmap reads experts through the OS page",), needs=("store",)),
    Case("resident-budget", "--resident with --memory-budget",
         gen("{store}", "--resident", "--memory-budget", "1MiB"),
         expect=("--resident keeps every expert in RAM",), needs=("store",)),
    Case("gpu-budget-cpu", "--gpu-budget on the CPU", gen("{store}", "--gpu-budget", "1GiB"),
         expect=("add --device cuda",), needs=("store",)),
    Case("pin-experts-cpu", "--pin-experts on the CPU", gen("{store}", "--pin-experts"),
         expect=("--pin-experts is for the GPU expert pool",), needs=("store",)),
    Case("min-score-alone", "--min-score without a predictor", gen("{store}", "--min-score", "0.1"),
         expect=("--min-score 0.1 filters the prefetches of a --predictor",), needs=("store",)),
    Case("oracle-trace-alone", "--oracle-trace without a predictor",
         gen("{store}", "--oracle-trace", "{trace}"),
         expect=("--predictor oracle replays --oracle-trace",), needs=("store", "trace")),
    Case("predictor-resident", "a predictor on a resident model (runs, with a note)",
         gen("{store}", "--predictor", "temporal"), rc=0,
         expect=("note: --predictor temporal: every expert is resident",), needs=("store",)),
    Case("policy-resident", "--policy on a resident model", gen("{store}", "--policy", "lru"),
         expect=("but every expert is resident",), needs=("store",)),
    Case("threads-0", "--threads 0", gen(str(MODEL), "--threads", "0"),
         expect=("--threads 0: give a positive number",)),
    Case("eval-ctx-beyond", "eval --ctx beyond the model's context",
         ms("eval", "-m", "{store}", "--text", "{text}", "--ctx", "100000", "--no-reference"),
         expect=("exceeds the model's context",), needs=("store", "text")),
    Case("eval-store-oracle", "eval -m STORE: the oracle is the store's Hugging Face source",
         ms("eval", "-m", "{store}", "--text", "{text}", "--ctx", "64", "-q"), rc=0,
         expect=("(its manifest)", "flips"), needs=("store", "text")),
    Case("convert-default", "convert's default quantization is bf16 (said in --help)",
         ms("convert", "--help"), rc=0, expect=("default bf16",)),
    Case("auto-convert-says", "generate -m HF --memory-budget: the copy's path and size printed",
         gen(str(MODEL), "--memory-budget", "25%"), rc=0, expect=("{tmp}/cache",)),
    Case("budget-fraction", "--memory-budget 0.25", gen("{store}", "--memory-budget", "0.25"), rc=0,
         expect=("25% of experts",), needs=("store",)),
    Case("budget-percent", "--memory-budget 25%", gen("{store}", "--memory-budget", "25%"), rc=0,
         expect=("25% of experts",), needs=("store",)),
    Case("budget-bytes", "--memory-budget 4MiB", gen("{store}", "--memory-budget", "4MiB"), rc=0,
         expect=("slot cache 4.0 MiB",), needs=("store",)),
    Case("budget-decimal-bytes", "--memory-budget 4GB (more than the experts: every one fits)",
         gen("{store}", "--memory-budget", "4GB"), rc=0, expect=("[mode: ",), needs=("store",)),
    Case("simulate-fraction", "simulate --budget 0.25 / 25% / 512KiB",
         ms("simulate", "{trace}", "--budget", "0.25", "--budget", "25%", "--budget", "512KiB"),
         rc=0, needs=("trace",)),
    Case("mode-line", "the stats line names the mode",
         gen("{store}", "--memory-budget", "25%", "--policy", "lru", "--predictor", "temporal"),
         rc=0, expect=("[mode: slot cache", "lru", "predictor temporal, routing exact"),
         needs=("store",)),
    Case("mode-json", "--json names the mode and both read rates",
         [*gen("{store}", "--io", "mmap"), "--json"], rc=0,
         expect=('"mode": {', '"experts": "mmap"', '"read_gbps"', '"stall_read_gbps"'),
         needs=("store",)),
    Case("trace-existing", "trace -o EXISTING",
         ms("trace", "-m", "{store}", "--prompts", "{prompts}", "-n", "2", "-o", "{trace}"),
         expect=("exists",), needs=("store", "prompts", "trace")),
    Case("trace-force", "trace -o EXISTING --force replaces it",
         ms("trace", "-m", "{store}", "--prompts", "{prompts}", "-n", "2", "-o", "{tmp}/t2",
            "--force"),
         rc=0, needs=("store", "prompts")),
    Case("heads-from-source", "heads trained on the HF folder serve a store converted from it",
         gen("{hfstore}", "--predictor", "prerouter", "--memory-budget", "50%"), rc=0,
         expect=("predictor prerouter",), needs=("hfstore", "heads")),
    Case("heads-missing", "no heads: the message says where it looked",
         gen("{store}", "--predictor", "prerouter", "--memory-budget", "50%"),
         expect=("looked in",), needs=("store",)),
    Case("read-rates", "achieved read bandwidth beside the stalled one (stats line)",
         gen("{store}", "--memory-budget", "25%"), rc=0, expect=("GB/s read (", "while stalled"),
         needs=("store",)),
    # ---- stack traces that became named errors ----------------------------------------------
    Case("truncated-dense", "a store whose dense.safetensors is truncated", gen("{cut}"),
         expect=("dense.safetensors: cannot be read", "convert the model again"), needs=("cut",)),
    Case("truncated-dense-eval", "the same for eval",
         ms("eval", "-m", "{cut}", "--text", "{text}", "--no-reference"),
         expect=("convert the model again",), needs=("cut", "text")),
    Case("truncated-dense-serve", "the same for serve's startup", ms("serve", "{cut}"),
         expect=("convert the model again",), needs=("cut",)),
    Case("cuda-on-cpu", "--device cuda with CPU torch (or no GPU)", gen("{store}", "--device", "cuda"),
         expect=("sees no CUDA GPU",), needs=("store",)),
    Case("threads-neg", "--threads -2", gen(str(MODEL), "--threads", "-2"),
         expect=("--threads -2: give a positive number",)),
    Case("eval-empty", "eval with an empty text",
         ms("eval", "-m", "{store}", "--text", "{empty}", "--no-reference"),
         expect=("eval needs at least 2",), needs=("store", "empty")),
    Case("eval-ctx-0", "eval --ctx 0",
         ms("eval", "-m", "{store}", "--text", "{text}", "--ctx", "0", "--no-reference"),
         expect=("at least 2 tokens",), needs=("store", "text")),
    Case("eval-ctx-1", "eval --ctx 1",
         ms("eval", "-m", "{store}", "--text", "{text}", "--ctx", "1", "--no-reference"),
         expect=("at least 2 tokens",), needs=("store", "text")),
    Case("plot-existing", "plot -o an existing file", ms("plot", "{trace}", "-o", "{text}"),
         expect=("{text}",), needs=("trace", "text")),
    Case("simulate-2", "simulate --budget 2 (2 bytes: no expert fits)",
         ms("simulate", "{trace}", "--budget", "2"), expect=("--budget 2 holds no expert",),
         needs=("trace",)),
    Case("recall-no-hidden", "recall --predictor prerouter on a trace without hidden states",
         ms("recall", "-m", "{store}", "--trace", "{trace}", "--predictor", "prerouter"),
         expect=("moestream trace --hidden",), needs=("store", "trace")),
    Case("head-pipe", "generate | head -2 exits quietly",
         "set -o pipefail; " + shlex.join(ms("generate", "-m", "{store}", "-p", "def f(x):",
                                             "-n", "64", "--ignore-eos")) + " | head -2",
         rc=0, needs=("store",)),
    Case("convert-store", "convert of a store", ms("convert", "{store}", "{tmp}/again"),
         expect=("is already a moestream store",), needs=("store",)),
    Case("convert-no-tokenizer", "convert of an HF folder without tokenizer.json writes nothing",
         ms("convert", "{notok}", "{tmp}/notok-store"), expect=("tokenizer.json",),
         needs=("notok",)),
    Case("not-a-model", "a folder that is not a model", gen("{tmp}/docs"),
         expect=("is not a model folder",), needs=("docs",)),
    Case("oracle-hint", "the oracle hint names --oracle-trace", gen("{store}", "--predictor", "oracle"),
         expect=("--oracle-trace",), needs=("store",)),
    # ---- habits from llama.cpp, mlx-lm and vLLM ---------------------------------------------
    Case("version", "--version", ms("--version"), rc=0, expect=("moestream ",)),
    Case("ctx-size", "-c/--ctx-size on generate", [*gen("{store}", "-c", "8"), "-n", "30"],
         expect=("--ctx-size context of 8",), needs=("store",)),
    Case("ctx-size-chat", "-c on chat: a notice when the context cuts a reply",
         ms("chat", "-m", "{store}", "-c", "24", "-n", "100"), rc=0, stdin="tell me a story\n",
         expect=("reply cut: the context is full",), needs=("store",)),
    Case("short-threads", "-t for --threads", gen("{store}", "-t", "1"), rc=0, needs=("store",)),
    Case("prompt-file", "-f FILE", ms("generate", "-m", "{store}", "-f", "{text}", "-n", "4"), rc=0,
         needs=("store", "text")),
    Case("prompt-stdin", "-p -", ms("generate", "-m", "{store}", "-p", "-", "-n", "4"), rc=0,
         stdin="def fibonacci(n):", needs=("store",)),
    Case("repeat-penalty", "a repetition penalty", gen("{store}", "--repeat-penalty", "1.1"), rc=0,
         needs=("store",)),
    Case("bench", "moestream bench",
         ms("bench", "-m", "{store}", "-p", "32", "-n", "16", "-r", "2", "--memory-budget", "25%"),
         rc=0, expect=("pp32", "tg16", "peak RSS", "experts hit"), needs=("store",)),
    Case("bench-json", "moestream bench --json",
         ms("bench", "-m", "{store}", "-p", "8", "-n", "4", "-r", "1", "--json"), rc=0,
         expect=('"schema": 2', '"decode_tok_s"'), needs=("store",)),
    # uvicorn stops on SIGTERM, then re-raises it: -15 is the clean end of a served run
    Case("serve-positional", "serve MODEL (positional, as vllm serve): it serves", "serve",
         rc=-15, expect=("serving", '/health: {"status":"ok"'), needs=("store",)),
    Case("serve-two-models", "serve MODEL -m OTHER", ms("serve", "{store}", "-m", str(MODEL)),
         expect=("two models given",), needs=("store",)),
    Case("eval-quiet", "eval's progress bar off with -q",
         ms("eval", "-m", "{store}", "--text", "{text}", "--no-reference", "-q"), rc=0,
         expect=("perplexity",), needs=("store", "text")),
    Case("chat-help", "chat: /help handled by the CLI", ms("chat", "-m", "{store}"), rc=0,
         stdin="/help\n/exit\n", expect=("/reset clears the history",), needs=("store",)),
]  # fmt: skip


@dataclass
class Env:
    tmp: Path
    made: dict = field(default_factory=dict)

    def run(self, argv: list[str]) -> None:
        print(f"  (setup) $ {show(argv)}", flush=True)
        subprocess.run(argv, check=True, capture_output=True, env=env(self.tmp), timeout=TIMEOUT)

    def need(self, name: str) -> str:
        if name not in self.made:
            self.made[name] = str(FIXTURES[name](self))
        return self.made[name]


def _store(e: Env) -> Path:
    e.run(ms("convert", str(MODEL), str(e.tmp / "store"), "--quant", "int8", "-q"))
    return e.tmp / "store"


def _prompts(e: Env) -> Path:
    (e.tmp / "prompts.txt").write_text("def fibonacci(n):\nclass Stack:\n")
    return e.tmp / "prompts.txt"


def _trace(e: Env) -> Path:
    args = ["-m", e.need("store"), "--prompts", e.need("prompts"), "-n", "8"]
    e.run(ms("trace", *args, "-o", str(e.tmp / "trace")))
    return e.tmp / "trace"


def _hfstore(e: Env) -> Path:
    hf = shutil.copytree(MODEL, e.tmp / "hf")
    e.run(ms("convert", str(hf), str(e.tmp / "hfstore"), "--quant", "int8", "-q"))
    return e.tmp / "hfstore"


def _heads(e: Env) -> Path:
    """Heads trained with -m the Hugging Face folder (written there), from a hidden trace."""
    args = ["-m", e.need("hfstore"), "--prompts", e.need("prompts"), "-n", "16", "--hidden"]
    e.run(ms("trace", *args, "-o", str(e.tmp / "htrace")))
    e.run(ms("train-prerouter", "-m", str(e.tmp / "hf"), "--traces", str(e.tmp / "htrace"),
             "--epochs", "2", "--device", "cpu"))  # fmt: skip
    return e.tmp / "hf" / "prerouter.heads"


def _cut(e: Env) -> Path:
    cut = shutil.copytree(e.need("store"), e.tmp / "cut")
    f = cut / "dense.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return cut


def _notok(e: Env) -> Path:
    d = shutil.copytree(MODEL, e.tmp / "notok")
    (d / "tokenizer.json").unlink()
    return d


def _docs(e: Env) -> Path:
    (e.tmp / "docs").mkdir()
    (e.tmp / "docs" / "notes.txt").write_text("not a model")
    return e.tmp / "docs"


def _text(e: Env) -> Path:
    (e.tmp / "text.txt").write_text((MODEL / "README.md").read_text()[:4000])
    return e.tmp / "text.txt"


def _empty(e: Env) -> Path:
    (e.tmp / "empty.txt").write_text("")
    return e.tmp / "empty.txt"


FIXTURES = {
    "store": _store,
    "prompts": _prompts,
    "trace": _trace,
    "hfstore": _hfstore,
    "heads": _heads,
    "cut": _cut,
    "notok": _notok,
    "docs": _docs,
    "text": _text,
    "empty": _empty,
}


def env(tmp: Path) -> dict:
    """Conversions into the run's folder, never ~/.cache/moestream; the native kernels' build
    shared with the test suite's (the checkout's ignored .cache/ext)."""
    out = {**os.environ, "MOESTREAM_CACHE": str(tmp / "cache"), "OMP_WAIT_POLICY": "PASSIVE"}
    out.setdefault("MOESTREAM_EXT_CACHE", str(ROOT / ".cache" / "ext"))
    out["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return out


def show(argv: list[str] | str) -> str:
    text = argv if isinstance(argv, str) else shlex.join(argv)
    return text.replace(shlex.join(MS), "moestream")


def fill(x: str, e: Env) -> str:
    for name in FIXTURES:
        if "{" + name + "}" in x:
            x = x.replace("{" + name + "}", e.need(name))
    return x.replace("{tmp}", str(e.tmp))


def run_case(c: Case, e: Env) -> tuple[int, str, str]:
    for name in c.needs:
        e.need(name)
    if c.argv == "serve":
        return serve(e)
    argv = fill(c.argv, e) if isinstance(c.argv, str) else [fill(x, e) for x in c.argv]
    print(f"$ {show(argv)}" + (f"  <<< {c.stdin!r}" if c.stdin else ""), flush=True)
    r = subprocess.run(argv, input=c.stdin or "", capture_output=True, text=True, env=env(e.tmp),
                       shell=isinstance(argv, str), executable="/bin/bash" if isinstance(argv, str)
                       else None, timeout=TIMEOUT)  # fmt: skip
    return r.returncode, r.stdout, r.stderr


def serve(e: Env) -> tuple[int, str, str]:
    """serve STORE on a free port until /health answers, then SIGTERM (a clean exit is 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = ms("serve", e.need("store"), "--port", str(port), "--log-level", "warning")
    print(f"$ {show(argv)}  (then GET /health, then SIGTERM)", flush=True)
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env(e.tmp))  # fmt: skip
    health = ""
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and p.poll() is None and not health:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    health = r.read().decode()
            except OSError:
                time.sleep(0.5)
    finally:
        if p.poll() is None:
            p.terminate()
        out, err = p.communicate(timeout=60)
    return p.returncode, out + (f"/health: {health}\n" if health else ""), err


def check(c: Case, rc: int, out: str, err: str, e: Env) -> list[str]:
    problems = []
    if rc != c.rc:
        problems.append(f"exit {rc}, expected {c.rc}")
    for text in c.expect:
        text = fill(text, e)
        if text not in out + err:
            problems.append(f"missing {text!r}")
    if STACK in out + err:
        problems.append("a Python stack trace")
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    ap.add_argument("--keep", default=None, help="work in this folder and keep it")
    a = ap.parse_args()
    if a.list:
        for c in CASES:
            print(f"{c.name:24} {c.what}")
        return 0
    names = a.cases.split(",") if a.cases else [c.name for c in CASES]
    unknown = sorted(set(names) - {c.name for c in CASES})
    if unknown:
        print(f"unknown cases: {', '.join(unknown)} (--list names them)", file=sys.stderr)
        return 2
    tmp = Path(a.keep or tempfile.mkdtemp(prefix="replay-issue18-"))
    tmp.mkdir(parents=True, exist_ok=True)
    e, failed, t0 = Env(tmp), [], time.monotonic()
    try:
        for i, c in enumerate(c for c in CASES if c.name in names):
            print(f"\n[{i + 1}] {c.name}: {c.what}", flush=True)
            t1 = time.monotonic()
            rc, out, err = run_case(c, e)
            problems = check(c, rc, out, err, e)
            verdict = "FAIL: " + "; ".join(problems) if problems else "ok"
            print(f"-> exit {rc} (expected {c.rc}) {verdict} [{time.monotonic() - t1:.1f} s]")
            for line in err.strip().splitlines()[:3]:
                print(f"   {line[:200]}")
            if problems:
                failed.append(c.name)
    finally:
        if a.keep is None:
            shutil.rmtree(tmp, ignore_errors=True)
    n = len(names)
    print(f"\nsummary: {n - len(failed)}/{n} cases as expected in {time.monotonic() - t0:.0f} s; "
          f"failed: {', '.join(failed) or 'none'}")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
