"""Generation behaviour: sampling, EOS, stop strings, streaming text, the CLI's JSON interface."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from eager_ahead import AheadGraphs

from moestream.config import ConfigError, SamplingConfig
from moestream.engine.generate import TextStream
from moestream.engine.sampling import sample
from moestream.runtime import open_model


@pytest.fixture(scope="module")
def rt(tiny_dir):
    return open_model(tiny_dir("qwen3_moe"))


def test_sampling_rules():
    logits = torch.tensor([1.0, 3.0, 2.0, -1.0])
    assert sample(logits, SamplingConfig(), None) == 1
    # top_k=1 and a tiny top_p both leave only the argmax.
    for cfg in (
        SamplingConfig(temperature=1.0, top_k=1),
        SamplingConfig(temperature=1.0, top_p=1e-6),
    ):
        assert {sample(logits, cfg, torch.Generator().manual_seed(s)) for s in range(20)} == {1}
    # top_k=2 never picks outside the two best.
    picks = {
        sample(logits, SamplingConfig(temperature=5.0, top_k=2), torch.Generator().manual_seed(s))
        for s in range(200)
    }
    assert picks == {1, 2}
    # top_p=0.8: softmax = [.09, .67, .24, .01] -> nucleus {1, 2}
    picks = {
        sample(logits, SamplingConfig(temperature=1.0, top_p=0.8), torch.Generator().manual_seed(s))
        for s in range(300)
    }
    assert picks == {1, 2}


def test_seeded_sampling_is_reproducible(rt):
    cfg = SamplingConfig(temperature=1.0, top_p=0.9, seed=7, max_new_tokens=12, ignore_eos=True)
    ids = rt.encode_prompt("def fib")
    a, b = rt.generator.generate(ids, cfg), rt.generator.generate(ids, cfg)
    c = rt.generator.generate(
        ids, SamplingConfig(temperature=1.0, top_p=0.9, seed=8, max_new_tokens=12, ignore_eos=True)
    )
    assert a.ids == b.ids and len(a.ids) == 12
    assert a.ids != c.ids


def test_greedy_logprobs_and_eos(rt):
    ids = rt.encode_prompt("def fib")
    res = rt.generator.generate(ids, SamplingConfig(max_new_tokens=10, ignore_eos=True))
    assert len(res.logprobs) == len(res.ids) == 10
    assert all(lp <= 0 for lp in res.logprobs)
    # Make the 4th greedy token an EOS: generation stops there with finish_reason "stop".
    gen = rt.generator
    saved = gen.eos_ids
    gen.eos_ids = {res.ids[3]}
    try:
        stopped = gen.generate(ids, SamplingConfig(max_new_tokens=10))
    finally:
        gen.eos_ids = saved
    first = res.ids.index(res.ids[3])
    assert stopped.ids == res.ids[: first + 1] and stopped.finish_reason == "stop"


def test_stop_string_truncates_and_stream_matches_text(rt):
    ids = rt.encode_prompt("def fib")
    full = rt.generator.generate(ids, SamplingConfig(max_new_tokens=24, ignore_eos=True))
    assert len(full.text) > 6
    stop = full.text[3:6]
    cfg = SamplingConfig(max_new_tokens=24, stop=(stop,), ignore_eos=True)
    pieces = list(rt.generator.stream(ids, cfg))
    res = rt.generator.generate(ids, cfg)
    assert res.text == full.text[: full.text.find(stop)]
    assert "".join(pieces) == res.text
    assert res.finish_reason == "stop"


class _ByteTok:
    """Decodes ids as UTF-8 bytes, like a byte-level BPE mid-character."""

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def test_text_stream_never_emits_half_characters_or_stop_prefixes():
    ts = TextStream(_ByteTok(), stop=("END",))
    out = [ts.push(b) for b in "é ok EN".encode()]
    assert "\ufffd" not in "".join(out)
    assert "".join(out) == "é ok "  # "EN" is held back: it may become "END"
    assert ts.push(ord("D")) == "" and ts.stopped and ts.text == "é ok "
    # A stop string whose next character is still half decoded: its prefix is held as well
    # (it was emitted once the text ended in U+FFFD, then the stop matched before it).
    ts = TextStream(_ByteTok(), stop=("amé",))
    out = [ts.push(b) for b in "x amé!".encode()]
    assert ts.stopped and ts.text == "x " and "".join(out) == "x "
    ts = TextStream(_ByteTok(), stop=("amé",))
    out = [ts.push(b) for b in "x amè".encode()] + [ts.flush()]  # not the stop: all of it
    assert not ts.stopped and "".join(out) == ts.text == "x amè"


def test_byte_level_text_after_the_prompt_is_unchanged(rt):
    """Generated ids are decoded after the prompt's last token (for SentencePiece's leading
    space, test_gguf_spm.py); with a byte-level BPE tokenizer that gives exactly the ids' own
    text, pieces and per-token strings, at every cut of texts with multi-byte characters."""
    from types import SimpleNamespace

    from moestream.engine.tokenizer import context_of, decode_after
    from moestream.serve.protocol import token_strings

    tok = rt.tokenizer
    cuts = 0
    for text in ("def fibonacci(n): return n", " café naïve 東京 🙂!", "a\n\n  b\tc  "):
        full = tok.encode(text)
        for k in range(1, len(full)):
            prompt, ids = full[:k], full[k:]
            assert decode_after(tok, context_of(tok, prompt), ids) == tok.decode(ids), (text, k)
            with_context = TextStream(tok, (), context_of(tok, prompt))
            alone = TextStream(tok, ())
            assert [with_context.push(t) for t in ids] == [alone.push(t) for t in ids]
            assert with_context.flush() == alone.flush()
            strings = token_strings(SimpleNamespace(tokenizer=tok), ids, prompt)
            assert strings == [tok.decode([t]) for t in ids]
            cuts += 1
    assert cuts >= 30


def test_chat_template_applied(rt):
    ids = rt.encode_prompt("hi", chat=True)
    assert (
        rt.tokenizer.tk.decode(ids, skip_special_tokens=False) == "<|user|>hi<|end|><|assistant|>"
    )
    assert rt.tokenizer.token_id("<|assistant|>") == ids[-1]


def test_empty_prompt_is_an_error(rt):
    with pytest.raises(ConfigError, match="prompt is empty"):
        rt.generator.generate([], SamplingConfig())


def run_generate(folder, *extra: str) -> subprocess.CompletedProcess:
    """`moestream generate` on the tiny model: 8 greedy tokens of "def fib", past EOS."""
    cmd = [sys.executable, "-m", "moestream", "generate", "-m", str(folder), "-p", "def fib"]
    return subprocess.run(
        [*cmd, "-n", "8", "--ignore-eos", *extra], capture_output=True, text=True, check=True
    )


def greedy_8(rt):
    return rt.generator.generate(
        rt.encode_prompt("def fib"), SamplingConfig(max_new_tokens=8, ignore_eos=True)
    )


def test_cli_json_interface(tiny_dir, rt):
    out = json.loads(run_generate(tiny_dir("qwen3_moe"), "--json").stdout)
    assert set(out) == {"prompt_ids", "ids", "text", "logprobs", "stats", "mode"}
    assert out["mode"]["experts"] == "resident" and out["mode"]["device"] == "cpu"
    want = greedy_8(rt)
    assert out["prompt_ids"] == rt.encode_prompt("def fib")
    assert out["ids"] == want.ids and out["text"] == want.text
    assert len(out["logprobs"]) == 8
    for key in ("prefill_tok_s", "decode_tok_s", "peak_rss_bytes"):
        assert out["stats"][key] > 0


def test_cli_streams_text_then_stats(tiny_dir, rt):
    r = run_generate(tiny_dir("qwen3_moe"))
    want = greedy_8(rt)
    assert r.stdout.rstrip("\n") == want.text
    assert "decode 8 tok" in r.stderr and "peak RSS" in r.stderr


def test_small_models_decode_on_one_thread_and_restore_the_setting(rt):
    import dataclasses

    from moestream.engine.generate import small_decode_threads

    assert rt.generator.decode_threads == 1  # tiny dims: opened with the default threads
    big = dataclasses.replace(rt.args, hidden_size=2048, moe_intermediate_size=768)
    assert small_decode_threads(big) is None  # Qwen3-30B-sized experts keep every thread

    seen = []
    model = rt.generator.model
    inner = model.forward

    def spy(ids, *a, **k):
        seen.append((ids.shape[0], torch.get_num_threads()))
        return inner(ids, *a, **k)

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    model.forward = spy
    try:
        cfg = SamplingConfig(max_new_tokens=6, ignore_eos=True)
        one = rt.generator.generate(rt.encode_prompt("def fib"), cfg)
        rt.generator.decode_threads = None
        both = rt.generator.generate(rt.encode_prompt("def fib"), cfg)
        assert torch.get_num_threads() == 2  # restored after the decode loop
    finally:
        del model.forward
        rt.generator.decode_threads = 1
        torch.set_num_threads(before)
    assert seen[0] == (len(one.prompt_ids), 2)  # the prompt ran on the process's threads
    assert {t for n, t in seen[1:6]} == {1}  # decode steps on one
    assert one.ids == both.ids
    assert rt.generator.model.forward == inner


def test_explicit_threads_switch_the_policy_off(tiny_dir):
    assert open_model(tiny_dir("qwen3_moe"), threads=2).generator.decode_threads is None


def test_decode_time_is_kept_when_the_consumer_stops_early(rt):
    from moestream.engine.generate import GenerationResult

    ids = rt.encode_prompt("def fib")
    res = GenerationResult(ids)
    stream = rt.generator.stream(ids, SamplingConfig(max_new_tokens=32, ignore_eos=True), res)
    for _ in zip(range(3), stream):
        pass
    stream.close()  # as chat does on Ctrl-C
    assert 0 < len(res.ids) < 32 and res.decode_seconds > 0 and res.stats()["decode_tok_s"] > 0


def test_penalties():
    from moestream.engine.sampling import penalized

    logits = torch.tensor([2.0, -1.0, 0.5, 3.0])
    off = SamplingConfig()
    assert penalized(logits, [0, 1, 1], off) is logits  # defaults: untouched
    rp = penalized(logits, [0, 1, 1], SamplingConfig(repeat_penalty=2.0))
    assert rp.tolist() == [1.0, -2.0, 0.5, 3.0]  # positive divided, negative multiplied
    fp = penalized(logits, [0, 1, 1], SamplingConfig(frequency_penalty=0.5, presence_penalty=0.25))
    assert fp.tolist() == [2.0 - 0.5 - 0.25, -1.0 - 1.0 - 0.25, 0.5, 3.0]
    last = penalized(logits, [3, 0, 1], SamplingConfig(repeat_penalty=2.0, repeat_last_n=2))
    assert last.tolist() == [1.0, -2.0, 0.5, 3.0]  # token 3 is outside the window
    for bad in ({"repeat_penalty": 0.0}, {"frequency_penalty": 3.0}, {"repeat_last_n": -1}):
        with pytest.raises(ConfigError):
            SamplingConfig(**bad)


def test_repeat_penalty_changes_a_looping_greedy_run(rt):
    ids = rt.encode_prompt("def fib")
    plain = rt.generator.generate(ids, SamplingConfig(max_new_tokens=24, ignore_eos=True))
    again = rt.generator.generate(ids, SamplingConfig(max_new_tokens=24, ignore_eos=True))
    pen = rt.generator.generate(
        ids, SamplingConfig(max_new_tokens=24, ignore_eos=True, repeat_penalty=1.5)
    )
    assert plain.ids == again.ids and pen.ids != plain.ids
    assert len(set(pen.ids)) >= len(set(plain.ids))


@pytest.mark.parametrize("n", [1, 2, 3, 9])
def test_decode_ahead_gives_the_step_by_step_tokens(rt, n):
    """Greedy decode through a step that feeds its pick back (issued one step ahead of the host)
    gives the tokens, log-probs, stop reasons and streamed text of the plain loop; it launches
    each position once, in order, never more than two steps ahead, and stops issuing at -n."""
    ids = rt.encode_prompt("def fib")
    gen = rt.generator
    plain = gen.generate(ids, SamplingConfig(max_new_tokens=24, ignore_eos=True))
    stop = plain.text[3:6]
    cases = [
        SamplingConfig(max_new_tokens=n, ignore_eos=True),
        SamplingConfig(max_new_tokens=24, stop=(stop,), ignore_eos=True),
    ]
    saved = gen.eos_ids
    try:
        for cfg, eos in [(c, saved) for c in cases] + [(cases[0], {plain.ids[min(n, 3) - 1]})]:
            gen.eos_ids = eos
            gen.graphs = None
            want = type(plain)(list(ids))
            want_pieces = list(gen.stream(ids, cfg, want))
            log = []
            gen.graphs = AheadGraphs(gen.model, gen.args, log)
            pieces = list(gen.stream(ids, cfg, got := type(want)(list(ids))))
            assert got.ids == want.ids and got.logprobs == want.logprobs
            assert got.finish_reason == want.finish_reason and got.text == want.text
            assert pieces == want_pieces
            positions = [p for p, _, _ in log]
            assert positions == list(range(len(ids), len(ids) + len(positions)))
            assert log == [] or log[0][1] == want.ids[0]  # only the first launch takes a token
            assert all(t is None for _, t, _ in log[1:]) and all(k <= 2 for *_, k in log)
            assert (
                len(want.ids) - 1
                <= len(positions)
                <= min(len(want.ids) + 1, cfg.max_new_tokens - 1)
            )
    finally:
        gen.eos_ids, gen.graphs = saved, None
