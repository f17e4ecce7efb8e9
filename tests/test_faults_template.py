"""Chat templates are rendered in a child process within a time, memory and size bound
(engine/chat_template.py): a bomb is a TemplateError that says which bound it hit, including the
ones that allocate gigabytes in one C call; the caller's memory is untouched, the next render
works, and an ordinary template renders as jinja renders it."""

from __future__ import annotations

import time

import pytest
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from moestream.engine.chat_template import render

MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
TEMPLATE = (
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
    "<|{{ m['role'] }}|>{{ m['content'] | trim }}{{ loop.index }}{% endfor %}"
    "{{ ns.n }}{{ messages | tojson }}{{ '-' * 3 }}{{ 'ab'.upper() }}"
)


def test_ordinary_template_renders_as_jinja_does():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    assert render(TEMPLATE, messages=MESSAGES) == env.from_string(TEMPLATE).render(
        messages=MESSAGES
    )


@pytest.mark.parametrize(
    "source, message",
    [
        (
            "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
            "ran longer than 0.5 s|output is over 1000000 characters",
        ),
        (
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            "ran longer than 0.5 s",
        ),
        ("{% for i in range(100000) %}{{ big }}{% endfor %}", "output is over 1000000 characters"),
        ("{{ 'x' * 1000000000 }}", "'\\*' with 1000000000 is over the limit"),
        ("{{ 'x'.center(1000000000) }}", "a call with 1000000000 is over the limit"),
        ("{{ 'x' | center(1000000000) }}", "filter do_center with 1000000000 is over the limit"),
        ("{{ 2 ** 100000 }}", "is over the limit"),
    ],
)
def test_bombs_stop_at_a_named_bound(source, message):
    start = time.monotonic()
    with pytest.raises(TemplateError, match=message):
        render(source, 0.5, max_chars=10**6, messages=MESSAGES, big="y" * 1000)
    assert time.monotonic() - start < 5


DOUBLING = (
    "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}{{ ns.s | length }}"
)


@pytest.mark.parametrize(
    "source, message",
    [
        ("{{ ('x' * 999999) * 999999 }}", "needs more than 1024 MiB"),
        ("{{ ('x' * 999999).replace('x', 'x' * 999999) }}", "needs more than 1024 MiB"),
        ("{{ ([('x' * 999999)] * 999999) | join }}", "needs more than 1024 MiB"),
        (DOUBLING, "needs more than 1024 MiB"),
        ("{{ '%999999999d' % 1 }}", "needs more than 1024 MiB|output is over"),
    ],
)
def test_one_call_memory_bombs_stop_in_the_child(source, message):
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    with pytest.raises(TemplateError, match=message):
        render(source, 30, messages=MESSAGES)
    assert time.monotonic() - start < 30
    # the caller's peak RSS did not grow by the bomb's gigabytes (KiB on Linux)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200 * 1024
    assert render("{{ messages[0]['content'] }}", messages=MESSAGES) == "hi"


def test_renders_go_on_after_a_timed_out_child():
    bomb = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    with pytest.raises(TemplateError, match="ran longer than 0.5 s"):
        render(bomb, 0.5, messages=MESSAGES)
    assert render(TEMPLATE, messages=MESSAGES).startswith("<|user|>hi1")


def test_raise_exception_and_template_errors_are_template_errors():
    with pytest.raises(TemplateError, match="^no$"):
        render("{{ raise_exception('no') }}")
    with pytest.raises(TemplateError, match="RecursionError"):
        render("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}")


def test_generate_chat_with_a_bomb_exits_2(tiny_dir, tmp_path, monkeypatch, capsys):
    import json
    import shutil

    from moestream.cli import main
    from moestream.engine.tokenizer import Tokenizer

    d = shutil.copytree(tiny_dir("qwen3_moe"), tmp_path / "m")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    )
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    monkeypatch.setattr(Tokenizer, "render_seconds", 0.5)
    capsys.readouterr()  # the tiny checkpoint's build output
    argv = ["generate", "-m", str(d), "-p", "hi", "--chat", "-n", "1", "--json", "--threads", "1"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err
        == "moestream: error: chat template failed: chat template ran longer than 0.5 s; stopped"
    )
