"""The CLI says what runs (issue 18): flags that the others would leave unused are refused before
anything loads (exit 2, one line naming the flag and the fix), prediction without a cache is noted,
budgets read one syntax (bytes or a fraction of the expert bytes), and output paths are never
overwritten unasked."""

from __future__ import annotations

import io
import shutil
import subprocess
import sys

import pytest

import moestream
from moestream.cli import _store_kwargs, build_parser, main
from moestream.config import Budget, ConfigError, parse_budget
from moestream.convert.writer import convert
from moestream.experts.config import GpuConfig, StreamConfig, slot_count
from moestream.obs.trace import load_trace
from moestream.quant import make_scheme
from moestream.store.format import Store


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """Conversions of Hugging Face folders go to a temporary cache, never ~/.cache."""
    monkeypatch.setenv("MOESTREAM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def store(tiny_dir, tmp_path_factory):
    return convert(
        tiny_dir("qwen3_moe"), tmp_path_factory.mktemp("s") / "s", make_scheme("int8"), False
    )


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    f = tmp_path_factory.mktemp("p") / "prompts.txt"
    f.write_text("def fibonacci(n):\nreturn n\n")
    return f


def total_bytes(folder) -> int:
    s = Store(folder)
    return len(s.crc) * s.args.num_experts * s.layout.size


def refused(capsys, argv) -> str:
    """Run the CLI, expect a user error; returns its one stderr line."""
    capsys.readouterr()  # what earlier calls printed
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("moestream: error: ") and "Traceback" not in err
    return err


# ---- one budget syntax --------------------------------------------------------------------------
def test_budget_syntax():
    assert parse_budget("512MiB") == Budget(nbytes=512 * 2**20)
    assert parse_budget("4GB") == Budget(nbytes=4 * 2**30)  # binary units, as KiB/MiB/GiB
    assert parse_budget("1KB") == Budget(nbytes=1024)
    assert parse_budget("4096") == Budget(nbytes=4096)
    assert parse_budget("25%") == parse_budget("0.25") == Budget(fraction=0.25)
    assert parse_budget("1.0").resolve(1000) == 1000
    assert parse_budget("0.25").resolve(1000) == 250
    for text, msg in [
        ("1.5", r"--memory-budget 1.5 \(150%\).*\(0, 1\]"),
        ("150%", r"\(0, 1\]"),
        ("0", "> 0"),
        ("0%", r"\(0, 1\]"),
        ("lots", "cannot read --memory-budget 'lots'"),
        ("-1MiB", "cannot read"),
    ]:
        with pytest.raises(ConfigError, match=msg):
            parse_budget(text, "--memory-budget")


def test_fraction_resolves_against_the_stores_expert_bytes(store):
    s = Store(store)
    total, size = total_bytes(store), s.layout.size
    for cfg in (
        StreamConfig(memory_budget=Budget(fraction=0.5)),
        GpuConfig(gpu_budget=Budget(fraction=0.5), kernel="ref", device="cpu"),
    ):
        assert slot_count(s, cfg) == (total // 2) // size
    with pytest.raises(ConfigError, match=r"--memory-budget 1% = \d+ bytes is below the minimum"):
        slot_count(s, StreamConfig(memory_budget=Budget(fraction=0.01, flag="--memory-budget")))


@pytest.mark.parametrize("flag", ["25%", "0.25"])
def test_cli_memory_budget_fraction(store, flag, capsys):
    a = build_parser().parse_args(
        ["generate", "-m", str(store), "-p", "x", "--memory-budget", flag]
    )
    cfg = _store_kwargs(a)["experts"]
    assert cfg.memory_budget == Budget(fraction=0.25) and cfg.policy == "lrfu"
    argv = ["generate", "-m", str(store), "-p", "def f", "-n", "2", "--io", "pagecache"]
    assert main([*argv, "--memory-budget", flag]) == 0
    assert "experts hit" in capsys.readouterr().err


def test_hf_folder_fraction_resolves_after_conversion(tiny_dir, cache, capsys):
    argv = ["generate", "-m", str(tiny_dir("olmoe")), "-p", "def f", "-n", "2"]
    assert main([*argv, "--memory-budget", "0.5", "--io", "pagecache"]) == 0
    (converted,) = cache.iterdir()  # converted once into the cache, then opened streaming
    assert Store(converted).scheme.name == "bf16"


def test_simulate_budget_syntax(store, prompts, tmp_path, capsys):
    tr = tmp_path / "tr"
    assert (
        main(["trace", "-m", str(store), "--prompts", str(prompts), "-n", "4", "-o", str(tr)]) == 0
    )
    capsys.readouterr()
    runs = {}
    for b in ("25%", "0.25"):
        assert main(["simulate", str(tr), "--budget", b, "--json"]) == 0
        runs[b] = capsys.readouterr().out
    assert runs["25%"].replace('"25%"', '"0.25"') == runs["0.25"]
    assert "--budget 2 holds no expert" in refused(capsys, ["simulate", str(tr), "--budget", "2"])
    assert "(0, 1]" in refused(capsys, ["simulate", str(tr), "--budget", "1.5"])


# ---- conflicting flags: refused before anything loads -------------------------------------------
CONFLICTS = [
    (["--io", "mmap", "--memory-budget", "1MiB"], "--io mmap reads experts through the OS page"),
    (["--resident", "--memory-budget", "1MiB"], "--resident keeps every expert in RAM"),
    (["--gpu-budget", "1MiB"], "--gpu-budget is for the GPU expert pool: add --device cuda"),
    (["--pin-experts"], "--pin-experts is for the GPU expert pool: add --device cuda"),
    (["--compile"], "--compile is for the GPU expert pool: add --device cuda"),
    (["--min-score", "0.1"], "--min-score 0.1 filters the prefetches of a --predictor"),
    (["--predictor", "temporal", "--routing", "predicted", "--min-score", "0.1"], "--min-score"),
    (["--oracle-trace", "tr"], "--predictor oracle replays --oracle-trace"),
    (["--predictor", "temporal", "--routing", "predicted", "--no-lora"], "--no-lora: with"),
    (["--predictor", "oracle"], "--predictor oracle replays --oracle-trace"),
    (["--policy", "lru"], "--policy lru picks what a slot cache evicts, but every expert is"),
    (["--policy", "lfu", "--resident"], "but every expert is resident"),
    (["--policy", "lfu", "--io", "mmap"], "but --io mmap pages experts in"),
    (["--threads", "0"], "--threads 0: give a positive number"),
    (["--threads", "-2"], "--threads -2: give a positive number"),
    (["--memory-budget", "1.5"], r"(0, 1]"),
    (["--memory-budget", "0"], "--memory-budget must be > 0"),
    (["--memory-budget", "lots"], "cannot read --memory-budget"),
]
GPU_CONFLICTS = [
    (["--resident", "--gpu-budget", "1MiB"], "--resident keeps every expert in VRAM"),
    (["--pin-experts"], "--pin-experts mirrors records in host RAM for a streaming VRAM pool"),
    (["--policy", "lru"], "but every expert is resident"),
    (["--memory-budget", "1MiB"], "with --device cuda use --gpu-budget"),
    (["--compile", "--gpu-budget", "1MiB"], "--compile fuses the captured decode step"),
    (["--compile", "--no-cuda-graph"], "--compile fuses the captured decode step"),
]


@pytest.fixture
def no_load(monkeypatch):
    """Fail the test if a model starts loading: every refusal must come first."""
    import moestream.runtime as runtime

    def never(*a, **k):
        raise AssertionError("the model loaded before the flags were checked")

    monkeypatch.setattr(runtime, "load_model", never)
    monkeypatch.setattr(runtime, "cached_store", never)


@pytest.mark.parametrize("flags,msg", CONFLICTS)
def test_conflicting_flags_are_refused(store, tiny_dir, no_load, capsys, flags, msg):
    for model in (store, tiny_dir("qwen3_moe")):  # a store, and a folder that would convert
        err = refused(capsys, ["generate", "-m", str(model), "-p", "x", *flags])
        assert msg in err


@pytest.mark.parametrize("flags,msg", GPU_CONFLICTS)
def test_conflicting_gpu_flags_are_refused(store, no_load, monkeypatch, capsys, flags, msg):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the checks need no GPU
    err = refused(capsys, ["generate", "-m", str(store), "-p", "x", "--device", "cuda", *flags])
    assert msg in err


def test_cuda_without_cuda_is_a_clear_error(store, no_load, monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = refused(capsys, ["generate", "-m", str(store), "-p", "x", "--device", "cuda"])
    assert "--device cuda, but torch" in err and "sees no CUDA GPU" in err


# ---- prediction without a cache: it runs, and the CLI says what it does -------------------------
@pytest.mark.parametrize(
    "flags,note",
    [
        (["--predictor", "temporal"], "every expert is resident, so nothing is prefetched"),
        (["--predictor", "temporal", "--resident"], "predictions are only scored"),
        (["--predictor", "temporal", "--io", "mmap"], "--io mmap pages experts in"),
        (["--predictor", "temporal", "--routing", "predicted"], "no reads are saved"),
    ],
)
def test_prediction_without_a_cache_is_noted(store, capsys, flags, note):
    assert main(["generate", "-m", str(store), "-p", "def f", "-n", "3", *flags]) == 0
    err = capsys.readouterr().err
    assert "moestream: note: --predictor temporal: " in err and note in err


def test_prediction_with_a_cache_has_no_note(store, capsys):
    argv = ["generate", "-m", str(store), "-p", "def f", "-n", "3", "--predictor", "temporal"]
    assert main([*argv, "--memory-budget", "0.5", "--io", "pagecache"]) == 0
    assert "note:" not in capsys.readouterr().err


# ---- outputs: never overwritten unasked ---------------------------------------------------------
def test_trace_refuses_an_existing_folder_unless_forced(store, prompts, tmp_path, capsys):
    tr = tmp_path / "tr"
    argv = ["trace", "-m", str(store), "--prompts", str(prompts), "-n", "3", "-o", str(tr)]
    assert main([*argv, "--hidden"]) == 0
    assert (tr / "hidden.npy").is_file()
    assert "already exists; pass --force" in refused(capsys, argv)
    assert "--policy lru" in refused(capsys, [*argv, "--force", "--policy", "lru"])
    assert (tr / "hidden.npy").is_file()  # bad flags are refused before the old trace goes
    assert main([*argv, "--force"]) == 0
    assert not (tr / "hidden.npy").exists()  # the old trace's file is gone, not left stale
    assert load_trace(tr).hidden is None
    (tr / "notes.txt").write_text("mine")
    assert "is not a trace folder" in refused(capsys, [*argv, "--force"])
    assert (tr / "notes.txt").is_file() and (tr / "trace.json").is_file()


def test_plot_to_an_existing_file_is_refused(store, prompts, tmp_path, capsys):
    tr = tmp_path / "tr"
    assert (
        main(["trace", "-m", str(store), "--prompts", str(prompts), "-n", "3", "-o", str(tr)]) == 0
    )
    f = tmp_path / "plots.png"
    f.write_bytes(b"x")
    assert "is a file; plot -o names a folder" in refused(capsys, ["plot", str(tr), "-o", str(f)])


def test_convert_of_a_store_is_refused(store, tmp_path, capsys):
    err = refused(capsys, ["convert", str(store), str(tmp_path / "again")])
    assert "is already a moestream store" in err and "run it as it is" in err
    assert not (tmp_path / "again").exists()


def test_convert_without_a_tokenizer_writes_nothing(tiny_dir, tmp_path, capsys):
    src = shutil.copytree(tiny_dir("qwen3_moe"), tmp_path / "hf")
    (src / "tokenizer.json").unlink()
    err = refused(capsys, ["convert", str(src), str(tmp_path / "out")])
    assert "tokenizer.json not found" in err
    assert [p.name for p in tmp_path.iterdir() if "out" in p.name] == []  # nor a .partial


# ---- --version, broken pipes ---------------------------------------------------------------------
def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"moestream {moestream.__version__}"


def test_broken_pipe_exits_quietly(store, monkeypatch, capsys):
    class ClosedPipe(io.StringIO):
        def write(self, s):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert main(["generate", "-m", str(store), "-p", "def f", "-n", "3"]) == 0
    assert "Traceback" not in capsys.readouterr().err


def test_generate_into_head_exits_quietly(store):
    """A real closed pipe: the reader takes one byte and leaves (`... | head -c 1`)."""
    argv = [sys.executable, "-m", "moestream", "generate", "-m", str(store), "-p", "def f"]
    p = subprocess.Popen(
        [*argv, "-n", "200", "--ignore-eos"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    p.stdout.read(1)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 0
    assert "Traceback" not in err and "BrokenPipe" not in err


# ---- the mode a run used ------------------------------------------------------------------------
def test_every_run_names_its_mode(store, tiny_dir, capsys):
    """The stats line and --json say which experts path ran, its size, policy, quant, device."""
    import json

    from moestream.cli import mode_line
    from moestream.experts.config import PredictConfig
    from moestream.runtime import open_model
    from moestream.store.io import IOConfig

    io = IOConfig(mode="pagecache", threads=1)
    budget = total_bytes(store) // 4
    cases = [
        (open_model(tiny_dir("qwen3_moe")), "resident", "none (checkpoint weights)"),
        (open_model(store), "resident", "int8"),
        (open_model(store, experts=StreamConfig(io=IOConfig(mode="mmap"))), "mmap", "int8"),
        (
            open_model(store, experts=StreamConfig(memory_budget=budget, io=io)),
            "slot cache",
            "int8",
        ),
    ]
    for rt, experts, quant in cases:
        with rt:
            m = rt.mode
            assert (m["experts"], m["quant"], m["device"], m["dtype"]) == (
                experts,
                quant,
                "cpu",
                "float32",
            )
            assert m["cuda_graph"] is False
    with open_model(
        store,
        experts=StreamConfig(memory_budget=budget, io=io, policy="lru"),
        predict=PredictConfig(predictor="temporal"),
    ) as rt:
        m = rt.mode
        assert m["policy"] == "lru" and m["predictor"] == "temporal" and m["routing"] == "exact"
        assert m["cache_bytes"] <= budget and 0.2 < m["cache_fraction"] <= 0.25
        line = mode_line(m)
        assert line.startswith("[mode: slot cache") and "lru" in line and "temporal" in line
    capsys.readouterr()
    argv = ["generate", "-m", str(store), "-p", "x", "-n", "2", "--io", "mmap", "--json"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["mode"]["experts"] == "mmap"
    assert main(["generate", "-m", str(store), "-p", "x", "-n", "2", "--io", "mmap"]) == 0
    assert "[mode: mmap, int8, cpu float32]" in capsys.readouterr().err


def test_prompt_from_file_or_stdin_and_short_threads(store, tmp_path, capsys):
    import json

    f = tmp_path / "prompt.txt"
    f.write_text("def fibonacci(n):")
    base = ["generate", "-m", str(store), "-n", "3", "--json", "-t", "1"]
    assert main([*base, "-f", str(f)]) == 0
    from_file = json.loads(capsys.readouterr().out)
    assert main([*base, "-p", "def fibonacci(n):"]) == 0
    assert json.loads(capsys.readouterr().out)["ids"] == from_file["ids"]
    cmd = [sys.executable, "-m", "moestream", *base, "-p", "-"]
    r = subprocess.run(cmd, input="def fibonacci(n):", capture_output=True, text=True)
    assert r.returncode == 0 and json.loads(r.stdout)["ids"] == from_file["ids"]
    err = refused(capsys, [*base, "-f", str(tmp_path / "missing.txt")])
    assert "-f" in err and "cannot read the prompt" in err
    with pytest.raises(SystemExit) as e:  # neither -p nor -f: argparse's usage error
        main(base)
    assert e.value.code == 2


def test_eval_window_and_text_are_checked(store, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("def fibonacci(n):\n    return n\n")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    base = ["eval", "-m", str(store), "--no-reference", "-t", "1"]
    assert "at least 2 tokens" in refused(capsys, [*base, "--text", str(text), "--ctx", "1"])
    assert "exceeds the model's context" in refused(
        capsys, [*base, "--text", str(text), "--ctx", "100000"]
    )
    assert "eval needs at least 2" in refused(capsys, [*base, "--text", str(empty)])


def test_not_a_model_and_a_store_without_manifest_are_named(store, tmp_path, capsys):
    other = tmp_path / "docs"
    other.mkdir()
    (other / "readme.txt").write_text("hi")
    err = refused(capsys, ["generate", "-m", str(other), "-p", "x"])
    assert "is not a model folder" in err and "tokenizer" not in err
    broken = tmp_path / "broken"
    shutil.copytree(store, broken)
    (broken / "manifest.json").unlink()
    err = refused(capsys, ["generate", "-m", str(broken), "-p", "x"])
    assert "no manifest.json" in err and "convert the model again" in err


def test_recall_of_hidden_state_predictors_needs_a_hidden_trace(store, prompts, tmp_path, capsys):
    out = tmp_path / "trace"
    assert (
        main(["trace", "-m", str(store), "--prompts", str(prompts), "-n", "3", "-o", str(out)]) == 0
    )
    err = refused(
        capsys, ["recall", "-m", str(store), "--trace", str(out), "--predictor", "stale-gate"]
    )
    assert "moestream trace --hidden" in err


def test_ctx_size_bounds_a_sequence(store, capsys):
    import json

    from moestream.runtime import open_model

    with open_model(store, context=16) as rt:
        assert rt.generator.context == 16
    base = ["generate", "-m", str(store), "-p", "def fibonacci(n):", "--json"]
    assert main([*base, "-n", "4", "-c", "64"]) == 0
    assert len(json.loads(capsys.readouterr().out)["ids"]) == 4
    err = refused(capsys, [*base, "-n", "40", "-c", "16"])
    assert "--ctx-size context of 16" in err
    err = refused(capsys, [*base, "-n", "4", "--ctx-size", "100000"])
    assert "--ctx-size 100000 must be in [2," in err


def test_serve_takes_the_model_as_its_first_argument(capsys):
    from moestream.cli import _model_folder

    assert _model_folder(build_parser().parse_args(["serve", "some/dir"])) == "some/dir"
    assert _model_folder(build_parser().parse_args(["serve", "-m", "some/dir"])) == "some/dir"
    assert "give the model folder" in refused(capsys, ["serve"])
    assert "two models given" in refused(capsys, ["serve", "a", "-m", "b"])


def test_the_cli_quant_choices_are_the_schemes():
    """--quant's choices (spelled in cli.py so --help stays light) are quant.SCHEMES, in order."""
    from moestream.cli import QUANT_CHOICES
    from moestream.quant import SCHEMES

    assert QUANT_CHOICES == SCHEMES


def test_stats_line_reports_prediction_recall_and_prefetch_use():
    """With a predictor the stats line adds its recall and, where it prefetched, how many of the
    prefetched records a routed expert read; without one it stays as it was."""
    from moestream.cli import _expert_stats

    s = {"hits": 30, "misses": 10, "bytes_read": 0, "prompt_tokens": 4, "generated_tokens": 4,
         "read_gbps": 0.0, "stall_read_gbps": 0.0}  # fmt: skip
    plain = _expert_stats(s)
    assert plain.startswith("experts hit 75%") and "recall" not in plain
    pred = _expert_stats({**s, "predict_routed": 64, "predict_correct": 48, "prefetch_reads": 20,
                          "prefetch_used": 15})  # fmt: skip
    assert pred == plain + "15/20 prefetches used, prediction recall 75% | "
    scored = _expert_stats({**s, "predict_routed": 64, "predict_correct": 16})
    assert scored == plain + "prediction recall 25% | "
    # the GPU pool's device misses: how many crossed from pinned RAM, how many were not kept
    gpu = _expert_stats({**s, "host_reads": 40, "admissions_declined": 12})
    assert gpu == plain + "40 misses read from pinned RAM, 12 not admitted | "
