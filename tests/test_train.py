"""CPU tests of the training code (moestream.train) at toy size."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from moestream.train.tokenizer import (  # noqa: E402
    EOT,
    iter_documents,
    load_tokenizer,
    save_tokenizer,
    tokenize_file,
    train_tokenizer,
)
from moestream.train.trainer import ModelSpec, TrainArgs, Trainer, export_hf, lr_at  # noqa: E402

CODE = '''def add(a, b):
    """Return the sum of a and b."""
    return a + b


class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)
'''


def _spec(**kw):
    base = dict(
        vocab_size=97,
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        num_experts=8,
        top_k=2,
        moe_intermediate_size=16,
        max_position_embeddings=64,
        eot_id=0,
    )
    base.update(kw)
    return ModelSpec(**base)


def _args(tmp_path, **kw):
    base = dict(
        out=str(tmp_path / "run"),
        steps=20,
        batch_size=4,
        seq_len=16,
        lr=1e-2,
        warmup=2,
        device="cpu",
        experts_impl="grouped_mm",
        eval_windows=4,
        log_every=1,
        eval_every=0,
    )
    base.update(kw)
    return TrainArgs(**base)


def _tokens(n=4000, vocab=97, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(1, vocab, size=n).astype(np.uint16)


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "train.txt"
    docs = [CODE.replace("add", f"add{i}").replace("Stack", f"Stack{i}") for i in range(30)]
    path.write_text("".join(d + EOT + "\n" for d in docs), encoding="utf-8")
    return path, docs


def test_tokenizer_roundtrip_special_tokens_and_files(tmp_path, corpus):
    path, docs = corpus
    assert list(iter_documents(str(path))) == docs
    tok = train_tokenizer([str(path)], vocab_size=400)
    assert 256 < tok.get_vocab_size() <= 400
    eot = tok.token_to_id(EOT)
    assert eot == 0
    enc = tok.encode(CODE)  # special tokens on: EOT is prepended like a document start
    assert enc.ids[0] == eot
    assert tok.decode(enc.ids, skip_special_tokens=True) == CODE
    raw = tok.encode(CODE, add_special_tokens=False).ids
    assert eot not in raw and len(raw) < len(CODE.encode()) / 2  # BPE merged the repeated text

    stream = tokenize_file(tok, str(path))
    assert stream.dtype == np.uint16
    assert int((stream == eot).sum()) == len(docs) and stream[-1] == eot

    save_tokenizer(tok, str(tmp_path / "tok"))
    cfg = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    assert cfg["eos_token"] == cfg["bos_token"] == EOT and "chat_template" in cfg
    assert load_tokenizer(str(tmp_path / "tok")).encode(CODE).ids == enc.ids

    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert hf(CODE).input_ids == enc.ids
    assert hf.eos_token_id == eot
    chat = hf.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_steps_reduce_loss_on_repeated_batch_and_aux_loss_present(tmp_path):
    tr = Trainer(_spec(), _args(tmp_path), train_tokens=_tokens())
    window = tr.train.batch(0, 0, 4, 16)
    with torch.no_grad():
        loss, ce, aux = tr._loss(window)
    # HF's load-balancing loss is present and is added with the configured coefficient
    assert torch.isfinite(aux) and aux.item() > 0
    assert torch.allclose(loss, ce + tr.model.config.router_aux_loss_coef * aux)
    first = tr.train_step([window])
    for _ in range(8):
        last = tr.train_step([window])
    assert float(last["ce"]) < float(first["ce"]) - 0.5
    assert tr.step == 9 and tr.tokens_seen == 9 * 4 * 16
    # the router is trained: its weights moved
    assert tr.model.model.layers[0].mlp.gate.weight.abs().sum() > 0


def test_batches_depend_only_on_step(tmp_path):
    tr = Trainer(_spec(), _args(tmp_path), train_tokens=_tokens())
    a, b = tr.train.batch(5, 1, 4, 16), tr.train.batch(5, 1, 4, 16)
    assert torch.equal(a, b)
    assert not torch.equal(a, tr.train.batch(6, 1, 4, 16))
    assert a.shape == (4, 17)


def test_resume_restores_step_weights_and_continues_identically(tmp_path):
    toks = _tokens()
    a = Trainer(_spec(), _args(tmp_path), train_tokens=toks)
    for s in range(3):
        a.train_step([a.train.batch(s, 0, 4, 16)])
    ckpt = str(tmp_path / "ckpt")
    a.save(ckpt)
    assert os.path.exists(os.path.join(ckpt, "optimizer.pt"))

    b = Trainer(_spec(), _args(tmp_path), train_tokens=toks)  # fresh: untrained weights, step 0
    assert not torch.equal(b.model.model.embed_tokens.weight, a.model.model.embed_tokens.weight)
    assert b.load(ckpt) is True
    assert b.step == 3 and b.tokens_seen == a.tokens_seen
    for (n, pa), (_, pb) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(pa, pb), n
    ma = a.train_step([a.train.batch(3, 0, 4, 16)])
    mb = b.train_step([b.train.batch(3, 0, 4, 16)])
    assert ma["lr"] == mb["lr"]
    assert torch.allclose(ma["ce"], mb["ce"])
    for (n, pa), (_, pb) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.allclose(pa, pb, atol=1e-6), n


def test_resume_without_optimizer_rewarms_lr(tmp_path):
    args = _args(tmp_path, save_optimizer=False, ckpt_dtype="bfloat16", rewarm_steps=4)
    a = Trainer(_spec(), args, train_tokens=_tokens())
    for s in range(5):
        a.train_step([a.train.batch(s, 0, 4, 16)])
    a.save(str(tmp_path / "ck"))
    b = Trainer(_spec(), args, train_tokens=_tokens())
    assert b.load(str(tmp_path / "ck")) is False
    assert b.step == 5 and b.rewarm_from == 5
    assert lr_at(5, args, b.rewarm_from) == pytest.approx(lr_at(5, args) / 4)
    assert lr_at(9, args, b.rewarm_from) == lr_at(9, args)
    w = a.model.model.embed_tokens.weight
    assert torch.equal(b.model.model.embed_tokens.weight, w.to(torch.bfloat16).float())


def test_fit_logs_and_export_loads_in_transformers(tmp_path, corpus):
    path, _ = corpus
    tok = train_tokenizer([str(path)], vocab_size=300)
    save_tokenizer(tok, str(tmp_path / "tok"))
    stream = tokenize_file(tok, str(path))
    spec = _spec(vocab_size=tok.get_vocab_size())
    args = _args(tmp_path, steps=6, eval_every=3)
    tr = Trainer(spec, args, train_tokens=stream, valid_tokens=stream[:200])
    tr.fit()
    recs = [json.loads(line) for line in open(os.path.join(args.out, "log.jsonl"))]
    assert [r["step"] for r in recs if "ce" in r] == [1, 2, 3, 4, 5, 6]
    assert sum("val_ce" in r for r in recs) == 2

    out = str(tmp_path / "hf")
    export_hf(os.path.join(args.out, "ckpt"), out, str(tmp_path / "tok"))
    cfg = json.loads(open(os.path.join(out, "config.json")).read())
    assert (
        cfg["model_type"] == "qwen3_moe" and cfg["num_experts"] == 8 and cfg["dtype"] == "bfloat16"
    )
    for name in (
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert os.path.exists(os.path.join(out, name)), name

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    x = torch.from_numpy(stream[:16].astype(np.int64))[None]
    tr.model.eval()
    with torch.no_grad():
        ref = tr.model(input_ids=x).logits
        got = hf(input_ids=x).logits
    assert got.shape == ref.shape
    assert ((got - ref).norm() / ref.norm()) < 0.05  # bf16 weights vs fp32 master
    gen = hf.generate(x[:, :4], max_new_tokens=5, do_sample=False)
    assert gen.shape == (1, 9)
