"""`moestream chat` driven through stdin: replies stream to stdout, history carries across turns,
/reset forgets it, and each reply equals a greedy generation over the rendered conversation."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest
import torch

from moestream.config import SamplingConfig

N = 12


@pytest.fixture(scope="module")
def model_dir(tiny_dir):
    return tiny_dir("qwen3_moe")


@pytest.fixture(scope="module")
def rt(model_dir):
    from moestream.runtime import open_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield open_model(model_dir)
    torch.set_num_threads(threads)


def greedy_reply(rt, messages: list[dict]) -> str:
    ids = rt.tokenizer.encode_chat(messages)
    return rt.generator.generate(ids, SamplingConfig(max_new_tokens=N)).text


def expected_transcript(rt, system: str | None, lines: list[str]) -> list[str]:
    """The replies the chat must print, computed by replaying the conversation."""
    turns, replies = [], []
    head = [{"role": "system", "content": system}] if system else []
    for line in lines:
        if line == "/reset":
            turns = []
            continue
        turns.append({"role": "user", "content": line})
        reply = greedy_reply(rt, head + turns)
        turns.append({"role": "assistant", "content": reply})
        replies.append(reply)
    return replies


def test_chat_subprocess_history_and_reset(model_dir, rt):
    lines = ["def fibonacci(n):", "return n", "/reset", "return n"]
    cmd = [sys.executable, "-m", "moestream", "chat", "-m", str(model_dir), "-n", str(N)]
    cmd += ["--threads", "1", "--system", "be brief"]
    out = subprocess.run(
        cmd, input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    replies = expected_transcript(rt, "be brief", lines)
    assert out.stdout == "".join(r + "\n" for r in replies)
    # History matters: the second turn differs from the same message asked fresh after /reset...
    assert replies[1] != replies[2]
    # ...and /reset really forgets: the message after it is answered as a new conversation.
    fresh = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "return n"}]
    assert replies[2] == greedy_reply(rt, fresh)
    assert out.stderr.count("tok/s") == 3  # one stats line per reply
    assert "[history cleared]" in out.stderr


def test_reply_streams_pieces(rt):
    from moestream.chat import Conversation, reply

    class Recorder(io.StringIO):
        def __init__(self):
            super().__init__()
            self.writes: list[str] = []

        def write(self, s):
            self.writes.append(s)
            return super().write(s)

    conv = Conversation(turns=[{"role": "user", "content": "def fibonacci(n):"}])
    out = Recorder()
    res = reply(rt, conv, SamplingConfig(max_new_tokens=N), out)
    pieces = [w for w in out.writes if w != "\n"]
    assert len(pieces) > 1  # written piece by piece as generated, not once at the end
    assert out.getvalue() == res.text + "\n"
    assert conv.turns[-1] == {"role": "assistant", "content": res.text}


def test_old_turns_dropped_when_context_is_full(rt):
    from moestream.chat import Conversation, fit_prompt

    long = "fibonacci " * 40
    turns = []
    for _ in range(6):
        turns += [{"role": "user", "content": long}, {"role": "assistant", "content": long}]
    conv = Conversation(system="sys", turns=turns + [{"role": "user", "content": "last"}])
    ids, budget = fit_prompt(rt, conv, 64)
    ctx = rt.args.max_position_embeddings
    assert len(ids) + budget <= ctx and budget == 64
    assert conv.turns[-1] == {"role": "user", "content": "last"}
    assert conv.messages()[0] == {"role": "system", "content": "sys"}  # the system message stays
    assert len(conv.turns) % 2 == 1 and len(conv.turns) < 13  # whole exchanges were dropped


def test_help_and_unknown_commands_stay_out_of_the_conversation(rt, capsys):
    import io

    from moestream.chat import HELP, run_chat

    inp = io.StringIO("/help\n/frobnicate\n")
    out = io.StringIO()
    assert run_chat(rt, SamplingConfig(max_new_tokens=N), inp=inp, out=out) == 0
    err = capsys.readouterr().err
    assert HELP in err and "unknown command" in err and out.getvalue() == ""


def test_a_reply_cut_by_the_context_says_so(rt, capsys):
    from moestream.chat import Conversation, reply

    ctx = rt.args.max_position_embeddings
    conv = Conversation(turns=[{"role": "user", "content": "fibonacci " * (ctx // 3)}])
    ids = rt.tokenizer.encode_chat(conv.messages())
    assert ctx - len(ids) < 500  # the reply budget is the context's rest, below what was asked
    res = reply(rt, conv, SamplingConfig(max_new_tokens=500, ignore_eos=True), io_out())
    assert res.finish_reason == "length" and len(ids) + len(res.ids) == ctx
    assert "reply cut: the context is full" in capsys.readouterr().err
    assert res.stats()["decode_seconds"] > 0


def io_out():
    import io

    return io.StringIO()
