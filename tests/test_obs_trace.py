"""Router traces: ids, weights and hidden states equal what transformers' own router modules see on
the same checkpoint, prompt and greedy continuation; the folder format round-trips."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tiny_models import ARCHS

from moestream.cli import main as cli_main
from moestream.config import SamplingConfig
from moestream.obs.trace import TraceError, load_trace, read_prompts, record_trace
from moestream.runtime import open_model

PROMPTS = ["def fibonacci(n):", "return n if n < 2"]
N_NEW = 12


def hf_routes(folder, fed: list[int]):
    """Per MoE layer: transformers' top-k ids [N, K], weights [N, K] and router input [N, D] for
    one forward over the fed tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    got, hooks = {}, []
    for i, layer in enumerate(model.model.layers):
        block = layer.mlp if hasattr(layer, "mlp") else layer.feed_forward  # lfm2_moe
        gate = getattr(block, "gate", None) or getattr(block, "router", None)  # gpt_oss
        if gate is None or not hasattr(gate, "top_k"):
            continue

        def hook(_m, inp, out, i=i):
            got[i] = (out[2].clone(), out[1].float().clone(), inp[0].reshape(out[2].shape[0], -1))

        hooks.append(gate.register_forward_hook(hook))
    with torch.no_grad():
        model(torch.tensor([fed]))
    for h in hooks:
        h.remove()
    return model, got


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids, out = torch.tensor([prompt]), []
    with torch.no_grad():
        for _ in range(n):
            tok = int(model(ids).logits[0, -1].argmax())
            out.append(tok)
            ids = torch.cat([ids, torch.tensor([[tok]])], dim=1)
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_trace_matches_transformers_router(tiny_dir, tmp_path, arch):
    folder = tiny_dir(arch)
    rt = open_model(folder)
    cfg = SamplingConfig(max_new_tokens=N_NEW, ignore_eos=True)
    t = load_trace(record_trace(rt, PROMPTS, cfg, tmp_path / "tr", hidden=True))
    assert t.model.moe_layers == rt.args.moe_layer_ids
    assert t.n_positions == sum(len(rt.encode_prompt(p)) + N_NEW - 1 for p in PROMPTS)
    for seq, sl in zip(t.sequences, t.sequence_slices()):
        prompt = t.tokens[sl][: seq["prompt_tokens"]].tolist()
        fed = t.tokens[sl].tolist()
        model, ref = hf_routes(folder, fed)
        assert hf_greedy(model, prompt, N_NEW) == seq["generated_ids"]
        assert fed[len(prompt) :] == seq["generated_ids"][:-1]
        for col, layer in enumerate(t.model.moe_layers):
            ids, w, x = ref[layer]
            np.testing.assert_array_equal(t.ids[sl, col], ids.numpy())
            np.testing.assert_allclose(t.weights[sl, col], w.numpy(), atol=1e-5)
            # fp16 storage of the router input: relative error ~1e-3.
            np.testing.assert_allclose(
                t.hidden[sl, col].astype(np.float32), x.numpy(), rtol=2e-3, atol=2e-3
            )
        assert t.is_prompt[sl].sum() == len(prompt)


def test_trace_cli_and_format(tiny_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text('def fibonacci(n):\n\n{"prompt": "return n"}\n')
    out = tmp_path / "tr"
    rc = cli_main(
        [
            "trace",
            "-m",
            str(tiny_dir("olmoe")),
            "--prompts",
            str(prompts),
            "-n",
            "5",
            "-o",
            str(out),
            "--ignore-eos",
        ]
    )
    assert rc == 0
    header = json.loads((out / "trace.json").read_text())
    assert header["format"] == "moestream-trace" and header["hidden"] is False
    assert [s["prompt"] for s in header["sequences"]] == ["def fibonacci(n):", "return n"]
    assert not (out / "hidden.npy").exists()
    t = load_trace(out)
    assert t.hidden is None
    # npy files are plain numpy arrays with the documented dtypes and shapes.
    ids = np.load(out / "ids.npy")
    assert ids.dtype == np.int16 and ids.shape == (header["positions"], 3, 2)
    assert np.load(out / "weights.npy").dtype == np.float32
    # every row's ids are distinct and in range
    assert all(len(set(r)) == 2 for r in ids.reshape(-1, 2).tolist())
    assert ids.min() >= 0 and ids.max() < 8


def test_read_prompts(tmp_path):
    p = tmp_path / "p.txt"
    p.write_text('plain line\n{"prompt": "a\\nb", "id": 3}\n{not json\n\n')
    assert read_prompts(p) == ["plain line", "a\nb", "{not json"]
    p.write_text('{"text": "x"}\n')
    with pytest.raises(TraceError, match="prompt"):
        read_prompts(p)


def test_load_trace_rejects_other_folders(tmp_path):
    with pytest.raises(TraceError, match="trace.json"):
        load_trace(tmp_path)
    (tmp_path / "trace.json").write_text(json.dumps({"format": "other", "version": 1}))
    with pytest.raises(TraceError, match="re-record"):
        load_trace(tmp_path)
