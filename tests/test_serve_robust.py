"""Server robustness under attack: while 4 streams run, a 10 MB prompt (413), a prompt just under
the body limit (tokenized off the loop, 400 over the context), a time bomb and a one-call memory
bomb in the chat template (400, rendered in the bounded child) are refused; /health answers
within 1 s throughout, the streams finish, and RSS afterwards is within 10% of before (the body
limit's middleware collects and trims the heap after a large request)."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from test_faults_serve import MODEL, post, serving  # noqa: E402

from moestream.runtime import open_model  # noqa: E402

TIME_BOMB = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
MEMORY_BOMB = "{{ ('x' * 999999) * 999999 }}"


def rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmRSS:"))


def stream(url: str, out: list) -> None:
    body = {"model": MODEL, "prompt": "def fib", "max_tokens": 24, "stream": True}
    body |= {"ignore_eos": True, "temperature": 0}
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        out.append(r.read().decode().count("data: {"))


def chat_with(url: str, rt, template: str, monkeypatch) -> tuple[int, dict]:
    monkeypatch.setattr(rt.tokenizer, "chat_template", template)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    try:
        return post(url, "/v1/chat/completions", chat)
    finally:
        monkeypatch.undo()


def test_attack_leaves_health_streams_and_memory_as_they_were(tiny_dir, monkeypatch):
    with open_model(tiny_dir("qwen3_moe"), threads=1) as rt, serving(rt) as url:
        monkeypatch.setattr(rt.tokenizer, "render_seconds", 1.0)
        warm = []
        stream(url, warm)  # first-use allocations (KV cache, kernels) before the baseline
        before = rss()
        done: list[int] = []
        streams = [threading.Thread(target=stream, args=(url, done)) for _ in range(4)]
        for t in streams:
            t.start()
        gaps, stop = [], threading.Event()

        def watch():
            while not stop.is_set():
                start = time.monotonic()
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    assert r.status == 200
                gaps.append(time.monotonic() - start)
                time.sleep(0.05)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            status, body = post(url, "/v1/completions", b"x" * (10 * 2**20))
            assert status == 413
            near = {"model": MODEL, "prompt": ("def f(n): return n " * 250_000)[: 4 * 2**20 - 200]}
            status, body = post(url, "/v1/completions", near)
            assert status == 400 and "context" in body["error"]["message"]
            status, body = chat_with(url, rt, TIME_BOMB, monkeypatch)
            assert status == 400 and "ran longer than 1 s" in body["error"]["message"]
            monkeypatch.setattr(rt.tokenizer, "render_seconds", 10.0)
            status, body = chat_with(url, rt, MEMORY_BOMB, monkeypatch)
            assert status == 400 and "needs more than 1024 MiB" in body["error"]["message"]
            for t in streams:
                t.join(120)
        finally:
            stop.set()
            watcher.join(10)
        assert done == warm * 4  # every stream got all its tokens, as the warm-up one did
        assert gaps and max(gaps) < 1.0, max(gaps)
        after = rss()
        print(f"RSS before {before / 2**20:.0f} MiB, after {after / 2**20:.0f} MiB")
        assert after < before * 1.10, (before >> 20, after >> 20)
