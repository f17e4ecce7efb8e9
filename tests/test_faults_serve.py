"""Server faults: one request must not stall or exhaust the server, and a damaged store's error
reaches the client by name.

The app runs in-process under uvicorn on a loopback port (a thread), driven with urllib /
http.client: a 10 MB body gets 413, an over-long prompt 400, a template bomb a quick 400, /health
answers within 1 s while a long prompt is tokenized.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from moestream.runtime import open_model  # noqa: E402
from moestream.serve.app import create_app  # noqa: E402

MODEL = "tiny"
BOMB = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(rt, **app_kwargs):
    port = _free_port()
    cfg = uvicorn.Config(create_app(rt, MODEL, **app_kwargs), port=port, log_level="warning")
    server = uvicorn.Server(cfg)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def post(url: str, path: str, body: bytes | dict, timeout: float = 120) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def rt(tiny_dir):
    with open_model(tiny_dir("qwen3_moe"), threads=1) as rt:
        yield rt


@pytest.fixture(scope="module")
def url(rt):
    with serving(rt) as url:
        yield url


def test_large_body_is_413_with_the_limit_named(url):
    status, body = post(url, "/v1/completions", b"x" * (10 * 2**20))
    assert status == 413
    assert "limit of 4194304 bytes" in body["error"]["message"]
    assert "--max-body-bytes" in body["error"]["message"]


def test_chunked_large_body_is_413(url):
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    chunks = (b"x" * 2**20 for _ in range(10))  # no Content-Length: counted as it arrives
    conn.request("POST", "/v1/completions", chunks, {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 413
    assert "limit of 4194304 bytes" in json.loads(r.read())["error"]["message"]
    conn.close()


def test_body_limit_is_configurable(rt):
    with serving(rt, max_body_bytes=1000) as small:
        status, body = post(small, "/v1/completions", {"model": MODEL, "prompt": "x" * 2000})
        assert status == 413 and "limit of 1000 bytes" in body["error"]["message"]
        status, _ = post(
            small, "/v1/completions", {"model": MODEL, "prompt": "def", "max_tokens": 1}
        )
        assert status == 200


def test_prompt_over_the_context_is_400_naming_it(url, rt):
    ctx = rt.args.max_position_embeddings
    status, body = post(url, "/v1/completions", {"model": MODEL, "prompt": "def f(n): " * ctx})
    assert status == 400
    assert f"the model's context is {ctx}" in body["error"]["message"]
    assert body["error"]["code"] == "context_length_exceeded"


def test_template_bomb_fails_the_request_quickly(url, rt, monkeypatch):
    monkeypatch.setattr(rt.tokenizer, "chat_template", BOMB)
    monkeypatch.setattr(rt.tokenizer, "render_seconds", 0.5)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    start = time.monotonic()
    status, body = post(url, "/v1/chat/completions", chat)
    assert status == 400
    assert "chat template ran longer than 0.5 s" in body["error"]["message"]
    assert time.monotonic() - start < 10
    with urllib.request.urlopen(url + "/health", timeout=5) as r:  # the server lives on
        assert r.status == 200


def test_health_answers_while_a_long_prompt_is_tokenized(url, rt, monkeypatch):
    started, span = threading.Event(), {}
    encode = rt.tokenizer.encode

    def watched(*a, **k):  # the span of the tokenization, as the tokenizing thread sees it
        span["start"] = time.monotonic()
        started.set()
        try:
            return encode(*a, **k)
        finally:
            span["end"] = time.monotonic()

    monkeypatch.setattr(rt.tokenizer, "encode", watched)
    prompt = ("def fibonacci(n): return n " * 200_000)[: 4 * 2**20 - 1000]
    result = {}
    body = {"model": MODEL, "prompt": prompt}
    worker = threading.Thread(target=lambda: result.update(r=post(url, "/v1/completions", body)))
    worker.start()
    assert started.wait(60)
    answered = []  # when each /health answer came back
    while "end" not in span and len(answered) < 5:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            assert r.status == 200
        answered.append(time.monotonic())
    worker.join(120)
    # A tokenizer holding the GIL blocks this thread too: the first answer then comes after the end.
    assert answered and answered[0] < span["end"], "no /health answer while tokenizing"
    gaps = [b - a for a, b in zip([span["start"], *answered], answered)]
    assert max(gaps) < 1.0, gaps
    assert result["r"][0] == 400  # far over the tiny model's context


def test_memory_pressure_fails_the_request_with_503(url, rt):
    from moestream.obs.guard import MemoryPressureError

    def pressure(_m, _args):
        raise MemoryPressureError("memory pressure: PSI full avg10 50% > 20%")

    hook = rt.model.register_forward_pre_hook(pressure)
    try:
        status, body = post(url, "/v1/completions", {"model": MODEL, "prompt": "def"})
    finally:
        hook.remove()
    assert status == 503
    assert "stopped under memory pressure: memory pressure: PSI" in body["error"]["message"]
    status, _ = post(url, "/v1/completions", {"model": MODEL, "prompt": "def", "max_tokens": 1})
    assert status == 200  # the server lives on


@pytest.mark.parametrize("command", ["serve", "chat"])
def test_serve_and_chat_run_with_the_memory_guard(tiny_dir, monkeypatch, command):
    import moestream.chat
    from moestream.cli import main
    from moestream.obs.guard import MemoryGuard

    attached = []
    monkeypatch.setattr(MemoryGuard, "attach", lambda self, model: attached.append(model))
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: None)
    monkeypatch.setattr(moestream.chat, "run_chat", lambda *a, **k: 0)
    argv = [command, "-m", str(tiny_dir("qwen3_moe")), "--threads", "1"]
    assert main(argv) == 0
    assert len(attached) == 1
    assert main([*argv, "--no-memory-guard"]) == 0
    assert len(attached) == 1


@pytest.fixture
def damaged_store(tiny_dir, tmp_path):
    """A store whose every expert of layer 0 has one flipped byte: any token routes into one."""
    from moestream.convert.writer import convert
    from moestream.quant import make_scheme
    from moestream.store.format import Store

    folder = convert(tiny_dir("qwen3_moe"), tmp_path / "s", make_scheme("int8"), False)
    store = Store(folder)
    with open(store.path(0), "r+b") as f:
        for e in range(store.args.num_experts):
            f.seek(store.offset(0, e) + 100)
            b = f.read(1)
            f.seek(store.offset(0, e) + 100)
            f.write(bytes([b[0] ^ 0xFF]))
    return folder


def test_damaged_store_error_reaches_the_client(damaged_store):
    from moestream.experts.config import StreamConfig

    with open_model(damaged_store, experts=StreamConfig(memory_budget=1 << 20), threads=1) as rt:
        with serving(rt) as url:
            status, body = post(url, "/v1/completions", {"model": MODEL, "prompt": "def"})
            assert status == 500
            msg = body["error"]["message"]
            assert "experts-L000.bin: layer 0 expert" in msg and "is damaged" in msg
            assert "convert the model again" in msg
            chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
            req = urllib.request.Request(
                url + "/v1/chat/completions",
                json.dumps({**chat, "stream": True}).encode(),
                {"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=120) as r:
                events = r.read().decode()
            assert "layer 0 expert" in events and "server_error" in events


def test_max_body_bytes_flag_reaches_the_app(tiny_dir, monkeypatch):
    from moestream.cli import main
    from moestream.serve.limits import BodyLimit

    apps = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **k: apps.append(app))
    argv = ["serve", "-m", str(tiny_dir("qwen3_moe")), "--threads", "1"]
    assert main([*argv, "--max-body-bytes", "16MiB"]) == 0
    (limit,) = [m.kwargs["limit"] for m in apps[0].user_middleware if m.cls is BodyLimit]
    assert limit == 16 * 2**20
