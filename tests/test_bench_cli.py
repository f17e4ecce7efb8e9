"""`moestream bench` (issue 18): fixed-length prompt and decode runs after an untimed warm-up,
the row schema of benchmarks/common.py on --json and -o, the model flags of generate, and bad
arguments refused before anything loads."""

from __future__ import annotations

import dataclasses
import json

import pytest

from moestream.cli import main
from moestream.convert.writer import convert
from moestream.engine.generate import Generator
from moestream.obs.bench import dense_bytes_per_token, synthetic_prompt
from moestream.obs.rows import SCHEMA
from moestream.quant import make_scheme
from moestream.store.format import Store


@pytest.fixture(scope="module")
def store(tiny_dir, tmp_path_factory):
    return convert(
        tiny_dir("qwen3_moe"), tmp_path_factory.mktemp("s") / "s", make_scheme("int8"), False
    )


def bench(capsys, *flags) -> dict:
    capsys.readouterr()
    assert main(["bench", *flags, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_row_has_the_schema_and_the_figures(store, capsys, monkeypatch):
    calls = []
    generate = Generator.generate
    monkeypatch.setattr(
        Generator, "generate", lambda self, ids, cfg: calls.append(ids) or generate(self, ids, cfg)
    )
    flags = ["-m", str(store), "-p", "8", "-n", "4", "-r", "3", "--warmup", "2", "-t", "1"]
    row = bench(capsys, *flags, "--memory-budget", "50%", "--io", "pagecache", "--policy", "lru")
    assert len(calls) == 5 and all(ids == calls[0] and len(ids) == 8 for ids in calls)
    assert (row["schema"], row["bench"]) == (SCHEMA, "moestream bench")
    assert set(row["source"]) == {"commit", "dirty"} and row["hardware"]["cores"] >= 1
    c = row["config"]
    assert (c["n_prompt"], c["n_gen"], c["repetitions"], c["warmup"]) == (8, 4, 3, 2)
    assert (c["memory_budget"], c["io"], c["policy"], c["threads"]) == (
        "50%",
        "pagecache",
        "lru",
        1,
    )
    for key in ("prompt_tok_s", "decode_tok_s"):
        s = row[key]
        assert len(s["values"]) == 3, "the warm-up runs are not timed"
        assert 0 < s["min"] <= s["median"] <= s["max"]
    m = row["mode"]
    assert (m["experts"], m["quant"], m["policy"], m["device"]) == (
        "slot cache",
        "int8",
        "lru",
        "cpu",
    )
    assert 0 <= row["hit_rate"] <= 1 and row["disk_bytes_per_tok"] >= 0
    s = Store(store)
    experts = len(s.crc) * s.args.num_experts_per_tok * s.layout.size
    assert row["expert_bytes_per_tok"] == experts
    assert row["bytes_per_tok"] == row["dense_bytes_per_tok"] + experts
    assert row["peak_rss_bytes"] > 0 and row["peak_vram_bytes"] is None
    assert row["threads"] == 1 and row["decode_threads"] == 1


def test_table_and_output_file(store, tmp_path, capsys):
    out = tmp_path / "rows" / "bench.jsonl"
    flags = ["bench", "-m", str(store), "-p", "6", "-n", "3", "-r", "1", "-o", str(out)]
    for _ in range(2):
        assert main(flags) == 0
    table = capsys.readouterr().out
    assert "[mode: resident, int8, cpu float32]" in table
    assert "pp6" in table and "tg3" in table and "peak RSS" in table
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2 and all(r["schema"] == SCHEMA and r["config"]["n_gen"] == 3 for r in rows)
    assert rows[0]["hit_rate"] == 1 and rows[0]["disk_bytes_per_tok"] == 0  # all resident


def test_a_hugging_face_folder_has_no_expert_records(tiny_dir, capsys):
    row = bench(capsys, "-m", str(tiny_dir("qwen3_moe")), "-p", "4", "-n", "2", "-r", "1")
    assert row["mode"]["experts"] == "resident" and row["expert_bytes_per_tok"] is None
    assert row["bytes_per_tok"] == row["dense_bytes_per_tok"]


def test_dense_bytes_count_the_head_whole_and_one_embedding_row(tiny_dir):
    from moestream.runtime import open_model

    with open_model(tiny_dir("qwen3_moe")) as rt:
        m = rt.model
        embed, head = m.model.embed_tokens.weight, m.lm_head.weight
        others = sum(
            p.numel() * p.element_size()
            for p in {id(p): p for p in m.parameters()}.values()
            if p is not embed and p is not head
        )
        row = embed.shape[1] * embed.element_size()
        assert dense_bytes_per_token(m) == others + row + head.numel() * head.element_size()


def test_dense_bytes_of_a_quantized_dense_store(tiny_dir, tmp_path):
    """Quantized dense weights count as their sections; the tied table (int8 under int4) whole,
    once, as the output layer's read."""
    from moestream.convert.writer import convert
    from moestream.quant import make_dense, make_scheme
    from moestream.runtime import open_model

    scheme = make_scheme("int4")
    dense = dataclasses.replace(make_dense("auto", scheme), min_params=0)  # tiny: all of them
    store = convert(tiny_dir("qwen3_moe"), tmp_path / "s", scheme, False, dense)
    with open_model(store) as rt:
        m = rt.model
        want = sum(
            t.numel() * t.element_size()
            for t in {t.data_ptr(): t for t in [*m.parameters(), *m.buffers()]}.values()
        )
        head = sum(t.numel() * t.element_size() for t in m.lm_head.qweight.buffers())
        embed = sum(t.numel() * t.element_size() for t in m.model.embed_tokens.qweight.buffers())
        tied = m.lm_head.qweight is m.model.embed_tokens.qweight
        row = 0 if tied else embed // m.args.vocab_size
        assert dense_bytes_per_token(m) == want - (0 if tied else embed) + row
        assert head > 0


def test_synthetic_prompt_is_fixed():
    a = synthetic_prompt(16, 100)
    assert a == synthetic_prompt(16, 100) and len(a) == 16 and all(0 <= t < 100 for t in a)


@pytest.mark.parametrize(
    "flags,msg",
    [
        (["-p", "0"], "-p/--n-prompt 0: give a whole number >= 1"),
        (["-n", "0"], "-n/--n-gen 0: give a whole number >= 1"),
        (["-r", "0"], "-r/--repetitions 0: give a whole number >= 1"),
        (["--warmup", "-1"], "--warmup -1: give a whole number >= 0"),
        (["--io", "mmap", "--memory-budget", "1MiB"], "--io mmap reads experts through the OS"),
        (["--policy", "lru"], "but every expert is resident"),
        (["--gpu-budget", "1MiB"], "add --device cuda"),
        (["-t", "0"], "--threads 0: give a positive number"),
        (["-p", "100000"], "-p 100000 + -n 128 exceeds the context of"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(store, capsys, flags, msg):
    capsys.readouterr()
    assert main(["bench", "-m", str(store), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moestream: error: ") and msg in err and "Traceback" not in err


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_gpu_dense_bytes_are_the_quantized_sections(tiny_dir, tmp_path, quant):
    """On the GPU (kernel triton) int8 dense weights are read as their sections, as on the CPU:
    the loaded model's count equals bench_peers' count from the store's files alone (float
    weights at bf16), below the bf16 weights' bytes. int4 weights under 65536 rows run from a
    row-major repack on a GPU (kernels/triton/dense.py: int4_rows) of the sections' size."""
    pytest.importorskip("triton")
    from bench_peers import store_bytes_per_token

    from moestream.experts.config import GpuConfig
    from moestream.kernels.dense import QuantLinear
    from moestream.obs.bench import expert_bytes_per_token
    from moestream.quant import make_dense
    from moestream.runtime import open_model

    scheme = make_scheme(quant)
    dense = dataclasses.replace(make_dense("auto", scheme), min_params=0)  # tiny: all of them
    store = convert(tiny_dir("qwen3_moe"), tmp_path / "s", scheme, False, dense)
    cfg = GpuConfig(resident=True, kernel="triton", device="cpu")  # the GPU's layout, on CPU
    with open_model(store, dtype="bfloat16", experts=cfg) as rt:
        mods = [m for m in rt.model.modules() if isinstance(m, QuantLinear)]
        assert mods and all(m.kernel == "triton" for m in mods)
        got = dense_bytes_per_token(rt.model) + expert_bytes_per_token(rt)
        as_bf16 = sum(2 * m.out_features * m.in_features for m in mods)
        held = sum(t.nbytes for m in mods for t in m.buffers())  # sections or repack, once
        # a weight read from its row repack holds it once: its store-layout sections released
        assert all((not list(m.qweight.buffers())) == m.rows_layout for m in mods)
    assert any(m.rows_layout for m in mods) == (quant == "int4")
    assert got == store_bytes_per_token(store, gpu=True)
    assert held < as_bf16


@pytest.mark.parametrize("tied", [False, True])
def test_gpu_q6_k_output_layer_is_held_and_counted_as_its_int8_form(tmp_path, tied):
    """Hidden 256: the int4 rules write lm_head (or the tied table) in q6_k. Kernel triton holds
    it as int8 of group 16 only (kernels/dense.py: triton_form; one table for both ends when
    tied), no block buffer left; bench_peers' count from the store's files (GPU) is the loaded
    model's, which reads that form: 1.25 bytes a weight, not the blocks' 0.82."""
    pytest.importorskip("triton")
    from bench_peers import store_bytes_per_token
    from test_dense_quant import every_dense
    from tiny_models import perturbed_model, save

    from moestream.experts.config import GpuConfig
    from moestream.obs.bench import expert_bytes_per_token
    from moestream.runtime import open_model
    from moestream.store.format import Store

    model = perturbed_model("qwen3_moe", hidden_size=256, tie_word_embeddings=tied)
    src = save(model, tmp_path / "hf", "fused")
    store = convert(src, tmp_path / "s", make_scheme("int4"), False, every_dense("int4"))
    table = "model.embed_tokens.weight" if tied else "lm_head.weight"
    assert Store(store).dense_scheme(table).name == "q6_k"
    cfg = GpuConfig(resident=True, kernel="triton", device="cpu")  # the GPU's layout, on CPU
    with open_model(store, dtype="bfloat16", experts=cfg) as rt:
        head = rt.model.lm_head
        assert (head.qweight.scheme.name, head.qweight.scheme.group_size) == ("int8", 16)
        assert not tied or rt.model.model.embed_tokens.qweight is head.qweight
        assert all(t.dim() < 3 for t in head.qweight.buffers())  # no [N, K/256, 210] blocks
        got = dense_bytes_per_token(rt.model) + expert_bytes_per_token(rt)
    assert got == store_bytes_per_token(store, gpu=True)


def test_bench_peers_variants_per_share():
    """The GPU run's variants: --kernels at share 1, --pool-kernels below it; the pool's own
    variants never at share 1; each kernel name maps to the GpuConfig it claims to run."""
    from bench_peers import child_experts, share_kernels

    top, pool = ["triton", "compiled"], ["triton", "direct"]
    assert share_kernels(top, pool, 1.0) == top and share_kernels(top, pool, 0.5) == pool
    assert share_kernels(["triton", "direct", "host-misses", "prefetch"], None, 1.0) == ["triton"]
    assert share_kernels(["triton", "direct"], None, 0.25) == ["triton", "direct"]
    staged, direct = (child_experts(k, "cuda", 0.5) for k in ("triton", "direct"))
    assert (staged.miss_reads, direct.miss_reads) == ("stage", "direct")
    assert staged.device_side_misses() and direct.device_side_misses()
    # "prefetch": the staged pool; the child adds --predictor stale-gate (GpuConfig.prefetch)
    assert child_experts("prefetch", "cuda", 0.5) == staged
    host = child_experts("host-misses", "cuda", 0.5)
    assert not host.device_side_misses()
    assert child_experts("compiled", "cuda", 1.0).compile_step
    # "-tprefill": the same config with a prompt on the Triton kernels (GpuConfig.prefill)
    assert child_experts("triton", "cuda", 1.0).prefill == "grouped"
    tri = child_experts("triton-tprefill", "cuda", 0.5)
    assert tri == dataclasses.replace(staged, prefill="triton")
    # "-admitall": every device-side miss admitted (GpuConfig.admit; scored by default)
    assert staged.admit == "scored"
    assert child_experts("triton-admitall", "cuda", 0.5) == dataclasses.replace(staged, admit="all")
    # "-pause": admissions wait while a step stages its misses (GpuConfig.admit_pause: None,
    # the default, is on where misses stage; True asks for it), "-nopause": they do not
    assert staged.admit_pause is None
    paused = child_experts("triton-pause", "cuda", 0.5)
    assert paused == dataclasses.replace(staged, admit_pause=True)
    unpaused = child_experts("triton-nopause", "cuda", 0.5)
    assert unpaused == dataclasses.replace(staged, admit_pause=False)
    # "-hitsfirst": a layer's hits computed while its misses are staged; suffixes combine
    both = child_experts("triton-hitsfirst-pause", "cuda", 0.5)
    assert both == dataclasses.replace(staged, admit_pause=True, hits_first=True)
    # "-split": the misses' down sections staged beside the gate/up kernel
    assert not staged.split_staging
    split = child_experts("triton-split-pause", "cuda", 0.5)
    assert split == dataclasses.replace(staged, admit_pause=True, split_staging=True)


def test_sim_gpu_prefetch_replays_the_table_and_counts_the_prefetch(store, tmp_path):
    """benchmarks/sim_gpu_prefetch.py on a --hidden trace of the tiny model: the staged replay's
    misses are the cache simulator's decode misses at the same slots (the same replay), the
    prefetch variant gives up 2K slots, covers at most its misses, copies only predicted experts
    (each layer after the first, K at most), and the MB add up from the record size."""
    import sim_gpu_prefetch

    from moestream.obs.simulate import simulate
    from moestream.obs.trace import load_trace

    prompts = tmp_path / "p.txt"
    prompts.write_text("def fibonacci(n):\nclass Node:\nimport os\n")
    tr = tmp_path / "tr"
    argv = ["trace", "-m", str(store), "--prompts", str(prompts), "-n", "12", "--ignore-eos"]
    assert main([*argv, "--hidden", "-o", str(tr)]) == 0
    out = tmp_path / "rows.jsonl"
    assert sim_gpu_prefetch.main(["-m", str(store), "--trace", str(tr), "--shares", "0.75",
                                  "--out", str(out)]) == 0  # fmt: skip
    staged, pre = (json.loads(line) for line in out.read_text().splitlines())
    t, st = load_trace(tr), Store(store)
    K, L, size = t.top_k, t.n_layers, st.slot_size
    assert (staged["variant"], pre["variant"]) == ("staged", "prefetch")
    assert staged["table_slots"] - pre["table_slots"] == 2 * K
    sim = simulate(t, "lrfu", staged["table_slots"], size)
    tokens = int((~t.is_prompt).sum())
    assert staged["misses"] == pytest.approx(sim.decode_misses / tokens)
    assert staged["covered"] == staged["prefetch_copies"] == 0
    assert 0 < pre["prefetch_copies"] <= (L - 1) * K and 0 <= pre["covered"] <= pre["misses"]
    assert pre["critical_mb_per_token"] == pytest.approx(
        (pre["misses"] - pre["covered"]) * size / 1e6
    )
    assert pre["pcie_mb_per_token"] == pytest.approx(
        pre["critical_mb_per_token"] + (pre["prefetch_copies"] + pre["misses"]) * size / 1e6
    )
    assert staged["routed"] == L * K and staged["decode_tokens"] == tokens


def test_bench_admit_child_sets_the_admission_programs(monkeypatch):
    """ablations/bench_admit.py's child runs bench_peers' child with every SectionCopy made from
    then on using its variant's programs (what the A/B varies), the staged pool at the share."""
    import torch
    from ablations import bench_admit

    from moestream.kernels.triton import copy

    calls = []
    monkeypatch.setattr(
        copy.SectionCopy.__init__, "__defaults__", copy.SectionCopy.__init__.__defaults__
    )
    monkeypatch.setattr(bench_admit, "moestream_child", lambda *a: calls.append(a))
    bench_admit.child("STORE", 256, 0.5, 16, 64, 32)
    assert calls == [("STORE", "triton", 16, 64, 32, "cuda", 0.5)]
    bench_admit.child("STORE", 256, 0.25, 16, 64, 32, "triton-admitall")
    assert calls[-1] == ("STORE", "triton-admitall", 16, 64, 32, "cuda", 0.25)
    src = [torch.zeros(3, 8, dtype=torch.int32)]
    assert copy.SectionCopy(src, [torch.zeros(2, 8, dtype=torch.int32)]).programs == 256
    from moestream.experts.gpu import GpuExperts

    monkeypatch.setattr(GpuExperts, "HURRY_PENDING", GpuExperts.HURRY_PENDING)
    bench_admit.child("STORE", 32, 0.25, 16, 64, 32, "triton-pause@7")  # the hurry's bound
    assert calls[-1][1] == "triton-pause" and GpuExperts.HURRY_PENDING == 7


def test_bench_peers_child_warms_up_on_another_prompt(store, monkeypatch, capsys):
    """bench_peers' moestream child (CPU, a streamed slot cache at share 0.5): the untimed
    warm-up runs a different random prompt of the same length than the measured generation, so
    the pool is not warmed by the measured prompt's own experts; the row it prints has the
    measured run's figures."""
    from bench_peers import moestream_child

    calls = []
    real = Generator.generate

    def spy(self, ids, cfg, *a, **k):
        calls.append((list(ids), cfg.max_new_tokens))
        return real(self, ids, cfg, *a, **k)

    monkeypatch.setattr(Generator, "generate", spy)
    moestream_child(str(store), "native", 1, 12, 5, "cpu", 0.5)
    (warm, n_warm), (ids, n) = calls
    assert (n_warm, n) == (8, 5) and len(warm) == len(ids) == 12 and warm != ids
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["decode_tok_s"] > 0 and row["mode"]["experts"] != "resident"


def test_sim_admission_replays_both_rules_through_the_slot_table(tmp_path):
    """ablations/sim_admission.py: one row per rule and setting, from the engine's SlotTable; on
    skewed routing without locality, scored admission moves fewer records over the link (misses +
    admissions) with fewer admissions, as in docs/gpu.md."""
    from ablations import sim_admission

    out = tmp_path / "rows.jsonl"
    argv = ["--slots", "504", "--skew", "1.0", "--corr", "0", "--tokens", "90", "--out", str(out)]
    assert sim_admission.main(argv) == 0
    rows = {r["config"]["admit"]: r for r in map(json.loads, out.read_text().splitlines())}
    every, scored = rows["all"], rows["scored"]
    assert scored["admissions_per_token"] < every["admissions_per_token"]
    assert scored["records_moved_per_token"] < every["records_moved_per_token"]
    assert 0 < scored["hit_rate"] < 1 and 0 < every["hit_rate"] < 1


def test_sim_admission_cpu_rules(tmp_path):
    """--cpu: every miss is read once (records moved = misses), and scored admission's table
    gives 2 x top-k slots to the scratch sets."""
    from ablations import sim_admission

    out = tmp_path / "rows.jsonl"
    argv = ["--cpu", "--slots", "64", "--layers", "4", "--experts", "32", "--topk", "4",
            "--skew", "1.0", "--corr", "0", "--tokens", "60", "--out", str(out)]  # fmt: skip
    assert sim_admission.main(argv) == 0
    rows = {r["config"]["admit"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert rows["all"]["table_slots"] == 64 and rows["scored"]["table_slots"] == 56
    for r in rows.values():
        assert r["config"]["target"] == "cpu" and 0 < r["hit_rate"] < 1
        assert r["records_moved_per_token"] == pytest.approx((1 - r["hit_rate"]) * 4 * 4)


def test_sim_admission_landed_counts_keys_in_flight_as_misses():
    """--landed: a routed key whose admission has not landed is a miss (the GPU pool reads it
    from the mirror), so it never counts more hits than the table does, and a longer lag
    costs hits; without it the lag leaves the hit rate as the table counts it."""
    from ablations.sim_admission import replay

    kw = dict(slots=504, scored=True, skew=1.0, corr=1.5, tokens=150, warm=50)
    table = replay(lag=6, **kw)["hit_rate"]
    short, long = replay(lag=2, landed=True, **kw), replay(lag=6, landed=True, **kw)
    assert long["hit_rate"] < short["hit_rate"] and long["hit_rate"] < table
    assert long["admissions_per_token"] == replay(lag=6, **kw)["admissions_per_token"]


def test_llama_run_times_the_decode_after_the_prompt(tmp_path, monkeypatch):
    """bench_peers.llama_run asks llama-bench for depths 0 and P and takes the prompt's rate at
    depth 0 and the decode's at depth P: moestream's child decodes after its P-token prompt, and
    llama-bench's tg alone starts from an empty cache."""
    import bench_peers

    seen = {}
    rows = [{"n_prompt": 64, "n_gen": 0, "n_depth": 0, "avg_ts": 4000.0},
            {"n_prompt": 64, "n_gen": 0, "n_depth": 64, "avg_ts": 3000.0},
            {"n_prompt": 0, "n_gen": 16, "n_depth": 0, "avg_ts": 900.0},
            {"n_prompt": 0, "n_gen": 16, "n_depth": 64, "avg_ts": 850.0}]  # fmt: skip

    def fake(cmd):
        seen["cmd"] = cmd
        return json.dumps(rows), 123

    monkeypatch.setattr(bench_peers, "child_rss", fake)
    r, rss = bench_peers.llama_run(tmp_path, tmp_path / "m.gguf", 2, 64, 16, cpu_moe=8)
    assert r == {"prefill_tok_s": 4000.0, "decode_tok_s": 850.0, "decode_depth": 64} and rss == 123
    cmd = seen["cmd"]
    assert cmd[cmd.index("-d") + 1] == "0,64" and cmd[cmd.index("--n-cpu-moe") + 1] == "8"
