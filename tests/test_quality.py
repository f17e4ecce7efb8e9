"""Quality metrics: perplexity equals transformers' exp(mean NLL), the stderr formula, the flip
margin rule, KL; llama-perplexity's chunk layout; `moestream eval --json` end to end."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from moestream.config import ConfigError
from moestream.quality.eval import evaluate, evaluate_windows, llama_chunks
from moestream.quality.metrics import flips, kl_div, perplexity, token_nll
from moestream.runtime import open_model

TEXT = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n" * 3


def test_perplexity_equals_transformers_exp_mean_nll(tiny_dir):
    import transformers

    folder = tiny_dir("qwen3_moe")
    rt = open_model(folder)
    ids = rt.tokenizer.encode(TEXT)
    assert len(ids) > 20
    got = evaluate(rt, None, ids, ctx=len(ids))
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        loss = hf(torch.tensor([ids]), labels=torch.tensor([ids])).loss
    assert got["tokens"] == len(ids) - 1
    assert got["perplexity"] == pytest.approx(math.exp(float(loss)), rel=1e-5)
    # Windows: two halves are scored independently (the second one restarts its context).
    half = evaluate(rt, None, ids, ctx=len(ids) // 2 + 1)
    assert half["tokens"] == len(ids) - 2


def test_llama_chunks_score_the_second_half_of_each_chunk_as_llama_perplexity(tiny_dir):
    """Chunks of n_ctx with BOS first, only positions n_ctx // 2 .. n_ctx - 2 scored: the mean NLL
    is transformers' loss over those targets alone, with the whole chunk as context."""
    import transformers

    folder = tiny_dir("qwen3_moe")
    rt = open_model(folder)
    ids = rt.tokenizer.encode(TEXT)
    n_ctx, bos = 16, 7
    chunks, first = llama_chunks(ids, n_ctx, bos)
    assert first == 8 and len(chunks) == len(ids) // n_ctx >= 2
    for i, c in enumerate(chunks):
        assert c == [bos, *ids[i * n_ctx + 1 : (i + 1) * n_ctx]]
    assert llama_chunks(ids, n_ctx, None)[0][1] == ids[n_ctx : 2 * n_ctx]
    got = evaluate_windows(rt, rt, chunks, first)
    assert got["tokens"] == got["positions"] == len(chunks) * (n_ctx - 1 - first)
    assert got["flips"] == 0 and got["kl_mean"] < 1e-9
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    x = torch.tensor(chunks)
    labels = x.clone()
    labels[:, : first + 1] = -100  # targets first+1 .. n_ctx-1, as the logits first .. n_ctx-2
    with torch.no_grad():
        loss = hf(x, labels=labels).loss  # equal counts per chunk: the mean over all
    assert got["nll_mean"] == pytest.approx(float(loss), rel=1e-5)
    with pytest.raises(ConfigError, match="at least 4"):
        llama_chunks(ids, 3, None)


def test_stderr_is_delta_method():
    nll = torch.tensor([1.0, 2.0, 0.5, 3.0])
    got = perplexity(nll)
    mean, sd = 1.625, float(nll.std(unbiased=True))
    assert got["perplexity"] == pytest.approx(math.exp(mean))
    assert got["stderr"] == pytest.approx(math.exp(mean) * sd / 2.0)
    assert token_nll(torch.tensor([[0.0, 0.0]]), torch.tensor([1]))[0] == pytest.approx(math.log(2))


def test_flip_counts_only_when_oracle_margin_is_at_least_a_tenth():
    oracle = torch.tensor(
        [
            [2.0, 1.95, 0.0],  # candidate picks 1: margin 0.05 -> tie
            [2.0, 1.5, 0.0],  # candidate picks 1: margin 0.5 -> flip
            [0.0, 3.0, 2.9],  # candidate agrees (1)
            [1.0, 0.0, 0.9],  # candidate picks 2: margin exactly 0.1 -> flip (>=)
        ]
    )
    cand = torch.tensor([[0.0, 1.0, 0.0], [0.0, 1.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    f = flips(cand, oracle)
    assert (f["flips"], f["ties"], f["positions"]) == (2, 1, 4)
    assert f["flip_positions"] == [1, 3]


def test_kl_divergence():
    a = torch.tensor([[0.0, 0.0]])
    assert float(kl_div(a, a)[0]) == 0.0
    b = torch.log(torch.tensor([[0.25, 0.75]]))
    want = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert float(kl_div(b, a)[0]) == pytest.approx(want)


def test_cli_eval_json_compares_int8_and_predicted_routing(tiny_dir, tmp_path):
    folder = tiny_dir("olmoe")
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    base = [sys.executable, "-m", "moestream", "eval", "-m", str(folder), "--text", str(text)]
    base += ["--json", "--threads", "1", "--ctx", "32"]
    out = json.loads(subprocess.run(base, capture_output=True, text=True, check=True).stdout)
    assert out["flips"] == 0 and out["kl_mean"] < 1e-9  # fp32 against itself
    assert out["perplexity"] == pytest.approx(out["oracle"]["perplexity"])
    cmd = base + ["--quant", "int8", "--resident", "--predictor", "stale-gate"]
    cmd += ["--routing", "predicted"]
    r = subprocess.run(cmd, capture_output=True, text=True, check=True)
    out = json.loads(r.stdout)
    assert {"perplexity", "stderr", "flips", "kl_mean"} <= out.keys()
    assert out["kl_mean"] > 0 and out["provider"]["predict_forced_layers"] > 0


def test_eval_oracle_is_the_stores_source_never_the_store(tiny_dir, tmp_path):
    """A store is judged against the Hugging Face folder its manifest names (0 flips against
    itself would say nothing); a moved or changed source, or a store as --reference, is refused."""
    import shutil

    from moestream.config import ConfigError
    from moestream.convert.writer import convert
    from moestream.quality.eval import oracle_folder
    from moestream.quant import make_scheme

    src = tmp_path / "hf"
    shutil.copytree(tiny_dir("qwen3_moe"), src)
    store = convert(src, tmp_path / "store", make_scheme("int4"), False)
    assert oracle_folder(store, None) == (
        src.resolve(),
        f"the source of store {store} (its manifest)",
    )
    assert oracle_folder(src, None)[0] == src
    assert oracle_folder(store, src) == (src, "--reference")
    with pytest.raises(ConfigError, match="is a store"):
        oracle_folder(store, store)
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    cmd = [sys.executable, "-m", "moestream", "eval", "-m", str(store), "--text", str(text)]
    cmd += ["--json", "--threads", "1", "--ctx", "32"]
    out = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    assert out["config"]["reference"] == str(src.resolve()) and out["kl_mean"] > 0
    (src / "config.json").write_text((src / "config.json").read_text() + " ")
    with pytest.raises(ConfigError, match="changed since the convert"):
        oracle_folder(store, None)
    shutil.rmtree(src)
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 2 and "pass --reference" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("tty,flags,bar", [(True, [], True), (True, ["-q"], False),
                                           (True, ["--json"], False), (False, [], False)])  # fmt: skip
def test_eval_progress_bar_on_a_terminal_unless_quiet(tiny_dir, tmp_path, capsys, monkeypatch, tty,
                                                      flags, bar):  # fmt: skip
    """A bar of the tokens scored on stderr when it is a terminal; --quiet, --json or a pipe: none."""
    from moestream.cli import main

    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: tty)
    argv = ["eval", "-m", str(tiny_dir("olmoe")), "--text", str(text), "--ctx", "32", "-t", "1"]
    assert main([*argv, "--no-reference", *flags]) == 0
    cap = capsys.readouterr()
    assert ("eval:" in cap.err and "tok" in cap.err) is bar
    assert "eval:" not in cap.out and ("perplexity" in cap.out)
