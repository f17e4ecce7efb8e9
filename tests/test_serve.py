"""`moestream serve` as a real process on loopback, driven by the official `openai` client.

Greedy completions and chats (streamed or not) must equal `moestream generate --json`; 16
concurrent streams must each get their own text; bad requests get a 4xx with a message; a bounded
schemathesis run over /openapi.json finds no 5xx and no schema violation.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

openai = pytest.importorskip("openai")

MODEL_ID = "tiny"
N = 20  # tokens per greedy request
LONG = 8192  # context of the model the cancellation tests use
PROMPT = "def fibonacci(n):"
# One torch thread per process: on 2 cores, server + client processes with 2 threads each
# spend their time spinning on each other.
THREADS = ["--threads", "1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {proc.stderr.read()}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError("server did not become healthy in time")


@pytest.fixture(scope="module")
def model_dir(tiny_dir) -> Path:
    return tiny_dir("qwen3_moe")


@contextlib.contextmanager
def running_server(model_dir: Path, *flags: str):
    port = free_port()
    cmd = [sys.executable, "-m", "moestream", "serve", "-m", str(model_dir), "--port", str(port)]
    cmd += ["--model-name", MODEL_ID, "--log-level", "warning", *THREADS, *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=20)


@pytest.fixture(scope="module")
def server(model_dir):
    with running_server(model_dir) as url:
        yield url


@pytest.fixture(scope="module")
def store_env(tmp_path_factory):
    """Converted stores go to a test folder, not ~/.cache (the variable is read by the
    subprocesses; pytest's own environment is restored afterwards)."""
    old = os.environ.get("MOESTREAM_CACHE")
    os.environ["MOESTREAM_CACHE"] = str(tmp_path_factory.mktemp("store-cache"))
    yield
    if old is None:
        del os.environ["MOESTREAM_CACHE"]
    else:
        os.environ["MOESTREAM_CACHE"] = old


@pytest.fixture(scope="module")
def long_server(tmp_path_factory):
    """A server whose model has a long context: a full generation takes seconds, so a client
    that leaves early is certain to leave while its request is still queued or generating."""
    from tiny_models import perturbed_model, save

    folder = save(
        perturbed_model("qwen3_moe", max_position_embeddings=LONG),
        tmp_path_factory.mktemp("long") / "qwen3_moe-long",
        "per_expert",
    )
    with running_server(folder) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def rt(model_dir):
    from moestream.runtime import open_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield open_model(model_dir)
    torch.set_num_threads(threads)


def cli_generate(model_dir: Path, prompt: str, n: int, chat: bool = False, *flags: str) -> dict:
    cmd = [sys.executable, "-m", "moestream", "generate", "-m", str(model_dir), "-p", prompt]
    cmd += ["-n", str(n), "--temp", "0", "--json", *THREADS, *flags]
    cmd += ["--chat"] if chat else []
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=120)
    return json.loads(out.stdout)


def greedy(rt, prompt: str, n: int, chat: bool = False):
    from moestream.config import SamplingConfig

    ids = rt.encode_prompt(prompt, chat=chat)
    return rt.generator.generate(ids, SamplingConfig(temperature=0.0, max_new_tokens=n))


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def post_raw(url: str, body: bytes | str) -> tuple[int, dict]:
    data = body.encode() if isinstance(body, str) else body
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# ---- equality with `moestream generate` ----


@pytest.fixture(scope="module")
def expected_completion(model_dir):
    return cli_generate(model_dir, PROMPT, N)


@pytest.fixture(scope="module")
def expected_chat(model_dir):
    return cli_generate(model_dir, PROMPT, N, chat=True)


def test_completion_equals_generate(client, expected_completion):
    exp = expected_completion
    r = client.completions.create(
        model=MODEL_ID, prompt=PROMPT, max_tokens=N, temperature=0, logprobs=0
    )
    choice = r.choices[0]
    assert choice.text == exp["text"]
    assert choice.finish_reason == exp["stats"]["finish_reason"]
    assert r.usage.prompt_tokens == len(exp["prompt_ids"])
    assert r.usage.completion_tokens == len(exp["ids"])
    assert r.usage.total_tokens == len(exp["prompt_ids"]) + len(exp["ids"])
    assert choice.logprobs.token_logprobs == pytest.approx(exp["logprobs"], abs=1e-4)


def test_completion_stream_equals_generate(client, expected_completion):
    exp = expected_completion
    stream = client.completions.create(
        model=MODEL_ID,
        prompt=PROMPT,
        max_tokens=N,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == exp["text"]
    assert len([c for c in chunks if c.choices and c.choices[0].text]) > 1  # really streamed
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == len(exp["ids"])


def test_token_id_prompt(client, expected_completion):
    exp = expected_completion
    r = client.completions.create(
        model=MODEL_ID, prompt=exp["prompt_ids"], max_tokens=N, temperature=0
    )
    assert r.choices[0].text == exp["text"]


def test_chat_equals_generate_chat(client, expected_chat):
    exp = expected_chat
    messages = [{"role": "user", "content": PROMPT}]
    r = client.chat.completions.create(
        model=MODEL_ID, messages=messages, max_tokens=N, temperature=0, logprobs=True
    )
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == exp["text"]
    assert r.usage.prompt_tokens == len(exp["prompt_ids"])
    assert r.usage.completion_tokens == len(exp["ids"])
    lps = [t.logprob for t in r.choices[0].logprobs.content]
    assert lps == pytest.approx(exp["logprobs"], abs=1e-4)

    stream = client.chat.completions.create(
        model=MODEL_ID, messages=messages, max_tokens=N, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == exp["text"]
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_string_and_seeded_sampling(client, rt, expected_completion):
    text = expected_completion["text"]
    stop = text[5:7]
    r = client.completions.create(
        model=MODEL_ID, prompt=PROMPT, max_tokens=N, temperature=0, stop=[stop]
    )
    assert r.choices[0].text == text[: text.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    kw = dict(model=MODEL_ID, prompt=PROMPT, max_tokens=N, temperature=1.0, top_p=0.9, seed=3)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text  # the seed makes sampling repeatable


def test_streaming_store_flags_and_expert_stats(model_dir, store_env):
    """serve takes generate's store flags; /stats then reports the expert cache's counters."""
    flags = ("--memory-budget", "64KiB")
    exp = cli_generate(model_dir, PROMPT, N, False, *flags)  # converts the store first
    with running_server(model_dir, *flags) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        r = client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=N, temperature=0)
        assert r.choices[0].text == exp["text"]
        experts = get_json(url + "/stats")["experts"]
    assert experts["bytes_read"] > 0 and experts["misses"] > 0


# ---- concurrency and cancellation ----


def test_16_concurrent_streams_no_cross_talk(client, rt, server):
    prompts = [f"def f{i}(n): return n * {i}" for i in range(16)]
    n = 8
    # Even clients use completions, odd ones chat, so both streaming paths interleave.
    expected = [greedy(rt, p, n, chat=i % 2 == 1).text for i, p in enumerate(prompts)]
    assert len(set(expected)) > 8, "prompts should give different outputs"
    got: dict[int, str] = {}
    errors: list[BaseException] = []
    before = get_json(server + "/stats")["requests_completed"]

    def run(i: int) -> None:
        try:
            if i % 2 == 0:
                s = client.completions.create(
                    model=MODEL_ID, prompt=prompts[i], max_tokens=n, temperature=0, stream=True
                )
                got[i] = "".join(c.choices[0].text for c in s if c.choices)
            else:
                s = client.chat.completions.create(
                    model=MODEL_ID,
                    messages=[{"role": "user", "content": prompts[i]}],
                    max_tokens=n,
                    temperature=0,
                    stream=True,
                )
                got[i] = "".join(c.choices[0].delta.content or "" for c in s if c.choices)
        except BaseException as e:  # surfaced below; a thread cannot fail the test itself
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert [got.get(i) for i in range(16)] == expected
    assert get_json(server + "/stats")["requests_completed"] - before == 16


def wait_for_cancels(url: str, before: dict, n: int) -> dict:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        now = get_json(url + "/stats")
        if now["requests_cancelled"] >= before["requests_cancelled"] + n:
            return now
        time.sleep(0.05)
    raise AssertionError(f"expected {n} cancelled requests, /stats says {now}")


def long_stream(url: str):
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    return client.completions.with_streaming_response.create(
        model=MODEL_ID,
        prompt=PROMPT,
        max_tokens=LONG - 16,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )


def test_disconnect_cancels_running_and_queued_requests(long_server):
    before = get_json(long_server + "/stats")
    t0 = time.monotonic()
    with long_stream(long_server) as running:
        lines = running.iter_lines()
        assert next(lines).startswith("data: ")  # generating now
        with long_stream(long_server):
            pass  # queued behind `running`; leaving closes its connection
    after = wait_for_cancels(long_server, before, 2)
    # Far fewer than the 2 x (LONG - 16) tokens asked for: `running` stopped when its client
    # left, and the queued one was dropped without generating.
    assert after["generated_tokens"] - before["generated_tokens"] < (LONG - 16) // 2
    assert time.monotonic() - t0 < 15
    assert after["queue_depth"] == 0 and after["active"] == 0


def test_disconnect_cancels_non_streamed_request(long_server):
    before = get_json(long_server + "/stats")
    body = json.dumps(
        {"model": MODEL_ID, "prompt": PROMPT, "max_tokens": LONG - 16, "ignore_eos": True}
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    port = int(long_server.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(head + body)
        deadline = time.monotonic() + 30
        while get_json(long_server + "/stats")["active"] == 0:  # wait until it is generating
            assert time.monotonic() < deadline
            time.sleep(0.05)
    after = wait_for_cancels(long_server, before, 1)
    assert after["generated_tokens"] - before["generated_tokens"] < (LONG - 16) // 2
    client = openai.OpenAI(base_url=long_server + "/v1", api_key="unused", max_retries=0)
    r = client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2  # the engine is free again


# ---- errors, discovery ----


@pytest.mark.parametrize(
    "path, body, status, words",
    [
        ("/v1/completions", "{not json", 400, "not valid JSON"),
        ("/v1/completions", '{"model": "tiny", "prompt": 5}', 400, "prompt"),
        (
            "/v1/completions",
            '{"model": "tiny", "prompt": "x", "max_tokens": -1}',
            400,
            "max_tokens",
        ),
        (
            "/v1/completions",
            '{"model": "tiny", "prompt": "x", "temperature": "hot"}',
            400,
            "temperature",
        ),
        ("/v1/completions", '{"model": "other", "prompt": "x"}', 404, "not served"),
        ("/v1/completions", '{"model": "tiny", "prompt": "x", "max_tokens": 255}', 200, ""),
        ("/v1/completions", '{"model": "tiny", "prompt": "x", "max_tokens": 256}', 400, "context"),
        ("/v1/completions", json.dumps({"model": "tiny", "prompt": "fib " * 300}), 400, "context"),
        ("/v1/completions", '{"model": "tiny", "prompt": [1, 99999]}', 400, "vocabulary"),
        ("/v1/completions", '{"model": "tiny", "prompt": "x", "logprobs": 3}', 400, "alternative"),
        ("/v1/completions", '{"model": "tiny", "prompt": "\\ud800"}', 400, "unicode"),
        ("/v1/chat/completions", '{"model": "tiny", "messages": []}', 400, "messages"),
        ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "king"}]}', 400, "role"),
        ("/v1/chat/completions", '{"model": "tiny"}', 400, "messages"),
        (
            "/v1/chat/completions",
            '{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}',
            400,
            "messages[0].content",
        ),
    ],
)
def test_malformed_requests_get_4xx(server, path, body, status, words):
    code, out = post_raw(server + path, body)
    assert code == status, out
    if status >= 400:
        assert words in out["error"]["message"]
        assert out["error"]["type"] == "invalid_request_error"


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.NotFoundError, match="not served"):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model=MODEL_ID, prompt="x", max_tokens=10_000)


def test_models_health_stats_openapi(client, server, model_dir):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_ID]
    assert client.models.retrieve(MODEL_ID).id == MODEL_ID
    assert get_json(server + "/health") == {"status": "ok", "model": MODEL_ID}
    stats = get_json(server + "/stats")
    assert stats["requests_completed"] >= 1 and stats["decode_tok_s"] > 0
    spec = get_json(server + "/openapi.json")
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/stats"} <= set(spec["paths"])
    model_prop = spec["components"]["schemas"]["CompletionRequest"]["properties"]["model"]
    assert model_prop["enum"] == [MODEL_ID]


def test_schemathesis_finds_no_5xx(server, tmp_path):
    """Bounded property-based run over the published schema (about 20 s on 2 cores).

    positive_data_acceptance is left out: a schema-valid max_tokens can still be refused because
    prompt + max_tokens exceeds the context, which a JSON schema cannot express.
    """
    exe = Path(sys.executable).with_name("schemathesis")
    checks = (
        "not_a_server_error,status_code_conformance,content_type_conformance,"
        "response_schema_conformance,negative_data_rejection,unsupported_method"
    )
    cmd = [str(exe), "run", server + "/openapi.json", "--checks", checks]
    cmd += ["--max-examples", "25", "--workers", "1", "--seed", "1", "--no-color"]
    cmd += ["--generation-database", "none", "--request-timeout", "60"]
    env = {**os.environ, "NO_COLOR": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=240)
    assert out.returncode == 0, out.stdout[-6000:]


def test_penalties_are_served_as_generate_runs_them(client, model_dir):
    """frequency/presence/repetition penalties reach the sampler (not silently dropped)."""
    flags = ("--frequency-penalty", "0.8", "--presence-penalty", "0.4", "--repeat-penalty", "1.3")
    exp = cli_generate(model_dir, PROMPT, N, False, *flags)
    plain = cli_generate(model_dir, PROMPT, N)
    assert exp["ids"] != plain["ids"]
    r = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=N, temperature=0, frequency_penalty=0.8,
        presence_penalty=0.4, extra_body={"repetition_penalty": 1.3},
    )  # fmt: skip
    assert r.choices[0].text == exp["text"]


# ---- SentencePiece text: the leading space of a generated piece ----
SPM_PROMPT = "2) The quick"  # the tiny model's first greedy piece is "▁left"


@pytest.fixture(scope="module")
def spm_store(tmp_path_factory):
    """A tiny Mixtral GGUF with a SentencePiece vocabulary, converted: (store, vocabulary)."""
    from gguf_models import write_gguf
    from spm_models import spm_vocab
    from test_gguf import hf_checkpoint

    from moestream.cli import main

    root = tmp_path_factory.mktemp("spm-serve")
    hf = hf_checkpoint("mixtral", root / "hf", vocab_size=512, bos_token_id=1, eos_token_id=2)
    v = spm_vocab(512)
    write_gguf(hf, root / "m.gguf", {i: ("Q8_0",) * 3 for i in range(3)}, spm=v)
    assert main(["convert", str(root / "m.gguf"), str(root / "store")]) == 0
    return root / "store", v


def test_sentencepiece_pieces_keep_their_leading_space(spm_store, capsys):
    """A SentencePiece model's generated text is llama.cpp's (" left", not "left": each piece
    decoded after the token before it) from `generate`, the server's completion (streamed and
    not) and its per-token logprob strings; chat equals `generate --chat`."""
    from spm_models import NORMAL, SPACE
    from test_gguf_spm import after

    from moestream.cli import main

    store, v = spm_store
    args = ["generate", "-m", str(store), "-p", SPM_PROMPT, "-n", "6", "--ignore-eos", "--json"]
    exp, chat = [_run_json(capsys, main, [*args, *more]) for more in ([], ["--chat"])]
    assert v.tokens[exp["ids"][0]] == SPACE + "left"
    assert exp["text"].startswith(" left")
    assert exp["text"] == after(v, exp["prompt_ids"], exp["ids"])
    extra = {"ignore_eos": True}
    with running_server(store) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        kw = {"model": MODEL_ID, "max_tokens": 6, "temperature": 0, "extra_body": extra}
        r = client.completions.create(prompt=SPM_PROMPT, logprobs=0, **kw)
        assert r.choices[0].text == exp["text"]
        strings = r.choices[0].logprobs.tokens
        stream = client.completions.create(prompt=SPM_PROMPT, stream=True, **kw)
        assert "".join(c.choices[0].text for c in stream if c.choices) == exp["text"]
        messages = [{"role": "user", "content": SPM_PROMPT}]
        r = client.chat.completions.create(messages=messages, logprobs=True, **kw)
        assert r.choices[0].message.content == chat["text"]
        chat_strings = [t.token for t in r.choices[0].logprobs.content]
        stream = client.chat.completions.create(messages=messages, stream=True, **kw)
        assert "".join(c.choices[0].delta.content or "" for c in stream) == chat["text"]
    pieces = [v.tokens[i].replace(SPACE, " ") for i in exp["ids"]]
    normal = [k for k, i in enumerate(exp["ids"]) if v.types[i] == NORMAL]
    assert [strings[k] for k in normal] == [pieces[k] for k in normal] and 0 in normal
    # after [/INST] the reply's first piece reads as a text's start (transformers' rule)
    pieces = [v.tokens[i].replace(SPACE, " ") for i in chat["ids"]]
    normal = [k for k, i in enumerate(chat["ids"]) if k and v.types[i] == NORMAL]
    assert [chat_strings[k] for k in normal] == [pieces[k] for k in normal] and normal


def _run_json(capsys, main, args: list[str]) -> dict:
    capsys.readouterr()
    assert main([*args, *THREADS]) == 0
    return json.loads(capsys.readouterr().out)
