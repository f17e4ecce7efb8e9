"""The recovery adapter (Edge0 stages 2-3): its unmerged math equals a merged fp32 model; the
student path over a window equals predicted routing token by token; the file is found, disabled,
and refused when missing, corrupt or made for another model; train-recovery is deterministic.
Its --device: auto is what torch sees, --device cpu the CPU run bit for bit, cuda without a GPU a
one-line error; the GPU path's code (both models' experts as BatchedExperts: every expert in
batched GEMMs) trains on CPU tensors as the CPU path does; on a GPU (marked cuda) a few
steps lower the loss, a seed gives the same file, and the adapter loads and runs."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import numpy as np
import pytest
import torch

from moestream.config import ConfigError
from moestream.convert.writer import convert
from moestream.engine.kv_cache import KVCache
from moestream.experts.batched import BatchedExperts
from moestream.experts.config import GpuConfig, PredictConfig, StreamConfig
from moestream.experts.predicting import attach
from moestream.kernels.moe_cpu import moe_grouped
from moestream.loader import load_model
from moestream.models.lowrank import plus_lora
from moestream.predict.prerouter import PrerouterHeads, PrerouterPredictor
from moestream.quality.eval import window_logits
from moestream.quant import make_scheme
from moestream.recovery.adapter import (
    ADAPTER_FILE,
    AdapterError,
    adapter_modules,
    add_adapter,
    load_adapter,
    lora_sites,
    remove_adapter,
    save_adapter,
)
from moestream.recovery.student import StudentPath
from moestream.recovery.train import (
    STUDENT_EXPERTS,
    RecoveryConfig,
    RecoveryTrainer,
    eval_loss,
    fit,
    student_on,
    tail_topk_reverse_kl,
    teacher_on,
)
from moestream.runtime import open_model
from moestream.store.format import Store

IDS = torch.randint(0, 320, (14,), generator=torch.Generator().manual_seed(5)).tolist()
TEXT = "def f(x):\n    return x + 1\n\nclass A:\n    pass\n" * 40


def heads_for(model, seed: int = 0, next_state: bool = False) -> PrerouterHeads:
    """Warm-started heads with a random fc2, so they predict something other than the router."""
    torch.manual_seed(seed)
    a = model.args
    heads = PrerouterHeads(
        len(model.moe_blocks), a.hidden_size, a.num_experts, a.num_experts_per_tok, 16, next_state
    )
    heads.warm_start([b.gate.weight for b in model.moe_blocks])
    with torch.no_grad():
        for h in heads.heads:
            h.fc2.weight.normal_(0, 0.5)
    return heads.eval()


def _randomize(model, seed: int = 1) -> None:
    """Non-zero B, so every adapter changes its projection."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in adapter_modules(model).values():
            m.B.copy_(torch.randn(m.B.shape, generator=g) * 0.05)


def logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor(ids), KVCache(model.args, len(ids), model.dtype), 0).float()


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])  # qwen2_moe: a shared expert
def test_unmerged_adapter_equals_merged_fp32_weights(tiny_dir, arch):
    model = load_model(tiny_dir(arch)).model
    info = add_adapter(model, rank=4, alpha=8.0, seed=0)
    _randomize(model)
    names = set(info.targets)
    assert any(n.endswith("self_attn.q_proj") for n in names)
    assert all(".experts." not in n for n in names)  # never the streamed experts
    if arch == "qwen2_moe":
        assert any(".shared_expert.down_proj" in n for n in names)
    got = logits(model)
    merged = load_model(tiny_dir(arch)).model
    mods, sites = adapter_modules(model), lora_sites(merged)
    with torch.no_grad():
        for n, m in mods.items():
            owner, proj = sites[n]
            getattr(owner, proj).weight += m.scale * (m.B @ m.A)
        for attn in merged.modules():
            if hasattr(attn, "fuse_qkv"):
                attn.fuse_qkv()  # the fused q/k/v copy follows the merged weights
    want = logits(merged)
    assert not torch.allclose(got, logits(load_model(tiny_dir(arch)).model), atol=1e-3)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    remove_adapter(model)
    torch.testing.assert_close(logits(model), logits(load_model(tiny_dir(arch)).model))


def _prefill_and_step(model, grad: bool) -> torch.Tensor:
    """Logits of IDS as a prompt, then of one decode step, with gradients on (training: every
    delta its own module) or off (inference: q/k/v stacked, each delta one addmm)."""
    with torch.set_grad_enabled(grad):
        cache = KVCache(model.args, len(IDS) + 1, model.dtype)
        prompt = model(torch.tensor(IDS), cache, 0)
        step = model(torch.tensor([7]), cache, len(IDS))
    return torch.cat([prompt, step]).detach().float()


def test_inference_path_equals_each_delta_on_its_own(tiny_dir, tmp_path):
    """The stacked q/k/v GEMMs and the addmm give the training path's values, follow an adapter
    changed in place (an optimizer step), and step aside when the scales differ."""
    store = convert(tiny_dir("qwen2_moe"), tmp_path / "s", make_scheme("int8"), False)
    # qwen2_moe: a shared expert, so MLP adapters too; the ref kernels take gradients (training's)
    model = load_model(store, StreamConfig(resident=True, kernel="ref")).model
    add_adapter(model, rank=4, alpha=8.0, seed=0)
    _randomize(model)
    attn = model.model.layers[0].self_attn
    tight = dict(atol=2e-5, rtol=1e-5)
    fast = _prefill_and_step(model, grad=False)
    assert attn._lora_stack._mats is not None  # the stacked path ran
    torch.testing.assert_close(fast, _prefill_and_step(model, grad=True), **tight)
    with torch.no_grad():
        attn.lora["k_proj"].B.mul_(3.0)
    moved = _prefill_and_step(model, grad=False)
    assert not torch.allclose(moved, fast, atol=1e-4)
    torch.testing.assert_close(moved, _prefill_and_step(model, grad=True), **tight)
    attn.lora["v_proj"].scale = 0.5  # scales differ: one projection at a time
    mixed = _prefill_and_step(model, grad=False)
    assert attn._lora_stack._mats is None
    torch.testing.assert_close(mixed, _prefill_and_step(model, grad=True), **tight)
    assert not torch.allclose(mixed, moved, atol=1e-4)
    with torch.inference_mode():  # adapters made under inference_mode: tensors without versions
        remove_adapter(model)
        add_adapter(model, rank=4, alpha=8.0, seed=0)
        _randomize(model)
        inferred = _prefill_and_step(model, grad=False)
    assert attn._lora_stack._mats is not None
    torch.testing.assert_close(inferred, fast, **tight)


def test_adapter_on_quantized_dense_adds_only_its_delta(tiny_dir, tmp_path):
    """Beside an int4 QuantLinear base the delta is the same fp32 B A x: the output moves by it."""
    from moestream.kernels.dense import QuantLinear
    from moestream.quant import DenseQuant, make_dense

    scheme = make_scheme("int4")
    d = make_dense("int4", scheme)  # no size floor: the tiny model's tensors are all small
    dense = DenseQuant(d.weights, d.output, min_params=0)
    store = convert(tiny_dir("qwen3_moe"), tmp_path / "s", scheme, False, dense)
    model = load_model(store, StreamConfig(resident=True, kernel="ref")).model
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.o_proj, QuantLinear)
    x = torch.randn(3, attn.o_proj.in_features)
    base = attn.o_proj(x)
    add_adapter(model, rank=2, alpha=2.0, targets=["model.layers.0.self_attn.o_proj"])
    _randomize(model)
    m = attn.lora["o_proj"]
    got = plus_lora(attn.lora, "o_proj", attn.o_proj(x), x)
    torch.testing.assert_close(got - base, m.scale * (x @ m.A.T @ m.B.T))
    with torch.no_grad():  # the inference path's addmm, the same delta
        fast = plus_lora(attn.lora, "o_proj", attn.o_proj(x), x)
    torch.testing.assert_close(fast - base, m.scale * (x @ m.A.T @ m.B.T))
    # every site, q/k/v stacked beside the fused int4 q/k/v: the training path's logits
    assert attn._qfused is not None
    remove_adapter(model)
    add_adapter(model, rank=2, alpha=2.0)
    _randomize(model)
    torch.testing.assert_close(
        _prefill_and_step(model, grad=False),
        _prefill_and_step(model, grad=True),
        atol=2e-5,
        rtol=1e-5,
    )
    assert attn._lora_stack._mats is not None


@pytest.fixture
def student(tiny_dir, tmp_path):
    """An int8 store of the tiny qwen3_moe on the ref kernels, heads and a random adapter."""
    store = convert(tiny_dir("qwen3_moe"), tmp_path / "st", make_scheme("int8"), False)
    loaded = load_model(store, StreamConfig(resident=True, kernel="ref"))
    heads = heads_for(loaded.model)
    add_adapter(loaded.model, rank=4, alpha=8.0, seed=0)
    _randomize(loaded.model)
    return loaded, heads


@pytest.mark.parametrize("next_state", [False, True])
def test_student_path_equals_predicted_routing_token_by_token(student, next_state):
    loaded, heads = student
    model = loaded.model
    if next_state:
        heads = heads_for(model, next_state=True)
        with torch.no_grad():
            for h in heads.heads:  # the next-state inputs count
                h.fc1.weight.normal_(0, 0.5)

    class Rt:  # what window_logits reads of a Runtime
        args = loaded.args

    Rt.model = model
    Rt.provider = attach(model, loaded.provider, PrerouterPredictor(heads), "predicted")
    stepwise = window_logits(Rt, IDS, stepwise=True)
    assert Rt.provider.stats()["predict_forced_layers"] > 0
    path = StudentPath(loaded.provider, heads, model.moe_blocks)
    model.set_provider(path)
    parallel = logits(model)
    torch.testing.assert_close(parallel, stepwise, atol=1e-4, rtol=1e-4)
    model.set_provider(loaded.provider)  # exact routing differs: the path did force something
    assert not torch.allclose(logits(model), stepwise, atol=1e-3)


def test_tail_topk_reverse_kl_is_zero_on_equal_and_positive_otherwise():
    a = torch.randn(5, 40)
    assert float(tail_topk_reverse_kl(a, a, 4)) == pytest.approx(0.0, abs=1e-6)
    b = a + torch.randn(5, 40)
    assert float(tail_topk_reverse_kl(a, b, 4)) > 0
    # all mass in the top-k (k = V): the exact reverse KL
    full = (a.softmax(-1) * (a.log_softmax(-1) - b.log_softmax(-1))).sum(-1).mean()
    assert float(tail_topk_reverse_kl(a, b, 40)) == pytest.approx(float(full), rel=1e-4)


def test_training_steps_lower_the_distillation_loss(student, tiny_dir):
    loaded, heads = student
    model = loaded.model
    remove_adapter(model)
    model.requires_grad_(False)
    add_adapter(model, rank=4, alpha=8.0, seed=0)
    params = [p for m in adapter_modules(model).values() for p in m.parameters()]
    for p in params:
        p.requires_grad_(True)
    model.set_provider(StudentPath(loaded.provider, heads, model.moe_blocks))
    teacher = load_model(tiny_dir("qwen3_moe")).model
    cfg = RecoveryConfig(rank=4, steps=12, batch=2, ctx=len(IDS), lr=2e-2)
    tr = RecoveryTrainer(model, teacher, params, cfg)
    wins = [IDS, IDS[::-1]]
    before = eval_loss(tr, wins)
    for step in range(cfg.steps):
        tr.distill_step(step, wins)
    assert eval_loss(tr, wins) < before - 1e-3


class _Run:
    def __init__(self, code: int, out: str, err: str):
        self.returncode, self.stdout, self.stderr = code, out, err


@pytest.fixture
def cli(capsys):
    """moestream's main in this process (a subprocess per call would import torch again)."""
    from moestream.cli import main

    def run(*args, check=False):
        capsys.readouterr()
        code = main([str(x) for x in args])
        out, err = capsys.readouterr()
        assert not check or code == 0, err
        return _Run(code, out, err)

    return run


@pytest.fixture
def hf_with_heads(tiny_dir, tmp_path):
    src = tmp_path / "hf"
    shutil.copytree(tiny_dir("qwen3_moe"), src)
    heads_for(load_model(src).model).save(src / "prerouter.heads")
    return src


def test_adapter_is_found_disabled_and_named_in_the_mode(hf_with_heads, cli):
    src = hf_with_heads
    model = load_model(src).model
    info = add_adapter(model, rank=4, alpha=8.0)
    _randomize(model)
    save_adapter(model, info, src / ADAPTER_FILE)
    kw = dict(quant="int8", experts=StreamConfig(resident=True))
    pred = PredictConfig(predictor="prerouter", routing="predicted")
    with open_model(src, predict=pred, **kw) as rt:  # a store: found via its source folder
        assert rt.mode["lora"]["rank"] == 4 and rt.mode["lora"]["path"] == str(src / ADAPTER_FILE)
        with_lora = window_logits(rt, IDS, True)
    off = PredictConfig(predictor="prerouter", routing="predicted", use_lora=False)
    with open_model(src, predict=off, **kw) as rt:
        assert rt.mode["lora"] is None
        without = window_logits(rt, IDS, True)
    with open_model(src, **kw) as rt:  # exact routing never loads it
        assert rt.mode["lora"] is None and not adapter_modules(rt.model)
    assert not torch.allclose(with_lora, without, atol=1e-4)
    r = cli("generate", "-m", src, "-p", "def", "-n", "3", "--quant", "int8", "--resident",
             "--predictor", "prerouter", "--routing", "predicted", check=True)  # fmt: skip
    assert "lora r4 on" in r.stderr and ADAPTER_FILE in r.stderr


def test_missing_corrupt_and_mismatched_adapter_files_are_clear_errors(
    hf_with_heads, tiny_dir, cli
):
    src = hf_with_heads
    gen = ["generate", "-m", src, "-p", "def", "-n", "2", "--predictor", "prerouter"]
    gen += ["--routing", "predicted"]
    missing = src / "none.lora"
    r = cli(*gen, "--lora", missing)
    assert r.returncode == 2 and str(missing) in r.stderr and "Traceback" not in r.stderr
    bad = src / ADAPTER_FILE
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    r = cli(*gen)
    assert r.returncode == 2 and str(bad) in r.stderr and "not a readable" in r.stderr
    other = load_model(tiny_dir("olmoe")).model  # another model: its routers differ
    save_adapter(other, add_adapter(other, 2, 2.0), bad)
    r = cli(*gen)
    assert r.returncode == 2 and "another model" in r.stderr and str(bad) in r.stderr
    model = load_model(src).model
    with pytest.raises(AdapterError, match="another model"):
        load_adapter(model, bad)
    assert not adapter_modules(model)  # nothing attached by a refused file
    r = cli("generate", "-m", src, "-p", "x", "--lora", bad)
    assert r.returncode == 2 and "--routing predicted" in r.stderr
    r = cli(*gen, "--lora", bad, "--no-lora")
    assert r.returncode == 2 and "contradict" in r.stderr


def test_train_recovery_is_deterministic_and_eval_compares(hf_with_heads, tmp_path, cli):
    src = hf_with_heads
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    outs = []
    for i in range(2):
        out = tmp_path / f"a{i}.lora"
        r = cli("train-recovery", "-m", src, "--corpus", corpus, "--quant", "int8", "--rank", 2,
                 "--steps", 3, "--batch", 1, "--ctx", 16, "--on-policy-steps", 1,
                 "--gen-tokens", 4, "--seed", 3, "-o", out, "--json", check=True)  # fmt: skip
        rep = json.loads(r.stdout)
        assert [h["stage"] for h in rep["history"]] == [2, 2, 2, 3]
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]
    shutil.copy(tmp_path / "a0.lora", src / ADAPTER_FILE)
    text = tmp_path / "eval.txt"
    text.write_text(TEXT[:400])
    r = cli("eval", "-m", src, "--text", text, "--quant", "int8", "--resident", "--ctx", 24,
             "--max-tokens", 48, "--compare", "--json", check=True)  # fmt: skip
    rows = json.loads(r.stdout)["rows"]
    assert [x["name"] for x in rows] == ["exact", "predicted", "predicted + adapter"]
    assert rows[0]["lora"] is None and rows[1]["lora"] is None and rows[2]["lora"]["rank"] == 2
    assert rows[1]["provider"]["predict_forced_layers"] > 0
    assert rows[1]["kl_mean"] != rows[2]["kl_mean"]


def test_train_recovery_refuses_bad_input_in_one_line(tiny_dir, tmp_path, cli):
    corpus = tmp_path / "c.txt"
    r = cli("train-recovery", "-m", tiny_dir("qwen3_moe"), "--corpus", corpus)
    assert r.returncode == 2 and str(corpus) in r.stderr  # no such file
    corpus.write_text(TEXT)
    r = cli("train-recovery", "-m", tiny_dir("qwen3_moe"), "--corpus", corpus, "--rank", 0)
    assert r.returncode == 2 and "--rank 0" in r.stderr
    r = cli("train-recovery", "-m", tiny_dir("qwen3_moe"), "--corpus", corpus, "--quant", "int8")
    assert r.returncode == 2 and "prerouter.heads" in r.stderr and "train-prerouter" in r.stderr
    assert "Traceback" not in r.stderr


def test_trace_on_the_student_path_records_what_the_heads_see(hf_with_heads, tmp_path, cli):
    """`trace --student-path -n 1` records the student path's router inputs and choices (the
    heads' training rows under predicted routing), not the exact prefill's."""
    from moestream.obs.trace import load_trace

    src = hf_with_heads
    model = load_model(src).model
    info = add_adapter(model, rank=2, alpha=4.0)  # an adapter the trace must go through
    _randomize(model)
    save_adapter(model, info, src / ADAPTER_FILE)
    prompts = tmp_path / "p.txt"
    prompts.write_text(json.dumps({"prompt": "def f(x):\n    return x + 1\n"}) + "\n")
    base = ["trace", "-m", src, "--prompts", prompts, "-n", 1, "--hidden", "--quant", "int8"]
    r = cli(*base, "-o", tmp_path / "t0")
    assert r.returncode == 0, r.stderr
    r = cli(*base, "--student-path", "-o", tmp_path / "t1")
    assert r.returncode == 2 and "--routing predicted --predictor prerouter" in r.stderr
    pred = ["--routing", "predicted", "--predictor", "prerouter"]
    r = cli(*base, *pred, "--student-path", "-o", tmp_path / "t1")
    assert r.returncode == 0, r.stderr
    exact, student = load_trace(tmp_path / "t0"), load_trace(tmp_path / "t1")
    assert np.array_equal(exact.tokens, student.tokens)
    ids = [int(t) for t in student.tokens]
    store = convert(src, tmp_path / "st", make_scheme("int8"), False)
    loaded = load_model(store, StreamConfig(resident=True))
    load_adapter(loaded.model, src / ADAPTER_FILE)
    path = StudentPath(loaded.provider, PrerouterHeads.load(src / "prerouter.heads"),
                       loaded.model.moe_blocks)  # fmt: skip
    loaded.model.set_provider(path)
    seen = []
    loaded.model.set_observer(lambda layer, i, w, x: seen.append((i.clone(), x.clone())))
    logits(loaded.model, ids)
    for col, (i, x) in enumerate(seen):
        assert np.array_equal(student.ids[:, col], i.numpy())
        np.testing.assert_allclose(student.hidden[:, col], x.half().numpy(), atol=2e-3)
    assert not np.array_equal(exact.hidden, student.hidden)  # the student path drifted


TRAIN = ["--quant", "int8", "--rank", "2", "--steps", "3", "--batch", "1", "--ctx", "16",
         "--on-policy-steps", "1", "--gen-tokens", "4", "--seed", "3", "--json"]  # fmt: skip


def _train(cli, src, corpus, out, *extra):
    r = cli("train-recovery", "-m", src, "--corpus", corpus, *TRAIN, "-o", out, *extra)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_device_auto_is_the_cpu_without_a_gpu_and_cpu_gives_the_same_bytes(
    hf_with_heads, tmp_path, cli, monkeypatch
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    auto = _train(cli, hf_with_heads, corpus, tmp_path / "auto.lora")
    cpu = _train(cli, hf_with_heads, corpus, tmp_path / "cpu.lora", "--device", "cpu")
    assert auto["device"] == cpu["device"] == "cpu" and auto["config"]["device"] == "auto"
    assert (tmp_path / "auto.lora").read_bytes() == (tmp_path / "cpu.lora").read_bytes()
    assert [h["loss"] for h in auto["history"]] == [h["loss"] for h in cpu["history"]]
    assert auto["step_seconds"] > 0 and auto["seconds"] >= sum(
        h["seconds"] for h in auto["history"]
    )


def test_device_cuda_without_a_gpu_is_a_one_line_error(hf_with_heads, tmp_path, cli, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    out = tmp_path / "a.lora"
    r = cli("train-recovery", "-m", hf_with_heads, "--corpus", corpus, "--device", "cuda",
            "-o", out)  # fmt: skip
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "--device cuda" in r.stderr and "sees no CUDA GPU" in r.stderr
    assert "drop --device cuda" in r.stderr and not out.exists()


@pytest.mark.parametrize("tokens", [9, 1])
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])  # gpt_oss: biases, clamped SwiGLU
def test_batched_experts_are_the_routed_sum_with_its_gradients(tiny_dir, arch, tokens):
    res = load_model(tiny_dir(arch)).provider
    batched = BatchedExperts(res.w13, res.w2, res.b13, res.b2, res.act)
    layer = next(iter(res.w13))
    E, _, D = res.w13[layer].shape
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(tokens)])
    w = torch.rand(tokens, 2, generator=g)

    def grouped(layer, x, ids, w):  # the prefill path's per-expert loop (ResidentExperts')
        biases = (res.b13[layer], res.b2[layer]) if res.b13 is not None else ()
        weights = (res.w13[layer], res.w2[layer], *biases)
        return moe_grouped(x, ids, w, lambda e: [t[e] for t in weights], res.act)

    outs, grads = [], []
    for run in (grouped, batched.experts):
        xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        y = run(layer, xg, ids, wg)
        y.square().sum().backward()
        outs.append(y.detach())
        grads.append((xg.grad, wg.grad))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError, match="unknown GPU kernel"):
        GpuConfig(resident=True, kernel="torch")


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_the_gpu_path_trains_on_cpu_tensors_as_the_cpu_path(hf_with_heads, quant):
    """What student_on / teacher_on run on a GPU (the store's experts dequantized once, both
    models on BatchedExperts), here on CPU tensors: the CPU path's losses step by step."""
    cfg = RecoveryConfig(rank=2, alpha=4.0, steps=3, batch=1, ctx=16, on_policy_steps=1,
                         gen_tokens=4, seed=3)  # fmt: skip
    heads = heads_for(load_model(hf_with_heads).model)
    runs = []
    for batched in (False, True):
        with open_model(hf_with_heads, experts=STUDENT_EXPERTS, quant=quant) as rt:
            with open_model(hf_with_heads) as teacher:
                student, model = rt, teacher.model
                if batched:
                    experts = BatchedExperts.from_store(Store(rt.folder), torch.float32)
                    rt.model.set_provider(experts)
                    student = replace(rt, provider=experts)
                    p = teacher.provider
                    model.set_provider(BatchedExperts(p.w13, p.w2, p.b13, p.b2, p.act))
                _, history = fit(student, model, heads, cfg, TEXT)
            runs.append([h["loss"] for h in history])
    torch.testing.assert_close(runs[1], runs[0], rtol=1e-4, atol=1e-6)


@pytest.mark.cuda
def test_recovery_trains_on_cuda_deterministically_and_the_adapter_runs(
    hf_with_heads, tiny_dir, tmp_path, cli
):
    src = hf_with_heads
    # a few steps on fixed windows lower the distillation loss on the GPU
    with open_model(src, experts=STUDENT_EXPERTS, quant="int8") as opened, open_model(src) as t:
        rt = student_on(opened, "cuda")
        model = rt.model
        model.requires_grad_(False)
        add_adapter(model, rank=4, alpha=8.0, seed=0)
        params = [p for m in adapter_modules(model).values() for p in m.parameters()]
        assert all(p.is_cuda for p in params)
        for p in params:
            p.requires_grad_(True)
        heads = heads_for(load_model(src).model).to("cuda")
        model.set_provider(StudentPath(rt.provider, heads, model.moe_blocks))
        cfg = RecoveryConfig(rank=4, steps=12, batch=2, ctx=len(IDS), lr=2e-2)
        tr = RecoveryTrainer(model, teacher_on(t, "cuda"), params, cfg)
        wins = [IDS, IDS[::-1]]
        before = eval_loss(tr, wins)
        for step in range(12):
            tr.distill_step(step, wins)
        assert eval_loss(tr, wins) < before - 1e-3
    # the CLI on cuda: a seed gives the same file; step 0 (B = 0) is the CPU's loss
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    reps = [_train(cli, src, corpus, tmp_path / f"g{i}.lora", "--device", "cuda") for i in (0, 1)]
    assert reps[0]["device"] == "cuda" and reps[0]["device_name"] != "cpu"
    assert (tmp_path / "g0.lora").read_bytes() == (tmp_path / "g1.lora").read_bytes()
    cpu = _train(cli, src, corpus, tmp_path / "c.lora", "--device", "cpu")
    assert reps[0]["history"][0]["loss"] == pytest.approx(cpu["history"][0]["loss"], rel=2e-2)
    # the GPU-trained adapter loads and runs under predicted routing (on the CPU)
    r = cli("generate", "-m", src, "-p", "def", "-n", "3", "--quant", "int8", "--resident",
            "--kernel", "cpu", "--predictor", "prerouter", "--routing", "predicted",
            "--lora", tmp_path / "g0.lora")  # fmt: skip
    assert r.returncode == 0 and "lora r2 on" in r.stderr, r.stderr
