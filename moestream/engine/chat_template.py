"""Chat templates rendered in a jinja2 sandbox, in a child process with a time and memory bound.

A checkpoint's template is code from the download: nested `range(100000)` loops pass jinja's
sandbox and would hold the caller (the server's request, `generate --chat`) for hours, and one C
call (`('x' * 999999) * 999999`, `'%999999999d' % 1`, `s.replace('', big)`, a doubling `~` in a
loop) allocates gigabytes before any Python-level check runs. So templates render in a child
process (`python -m moestream.engine.chat_template`, started on first use, kept for the next):
- memory: RLIMIT_AS at the child's size at start + RENDER_MEMORY; past it the allocation fails
  (MemoryError in the child), never the caller;
- time: the caller waits `seconds`, then kills the child (the next render starts a new one);
- size: the output is generated piece by piece and stopped past `max_chars`;
- named early: `*` / `**` and calls (functions, methods, filters) with an integer argument above
  MAX_NUMBER are refused in the sandbox, so the common bombs say what they did.
Every bound raises jinja2's TemplateError with a message saying which bound was hit. Renders are
serialized through one child (a lock): a template takes milliseconds, a bomb at most `seconds`.
Context values cross as JSON (a request's messages are JSON already).
"""

from __future__ import annotations

import functools
import json
import os
import select
import subprocess
import sys
import threading
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

RENDER_SECONDS = 5.0
MAX_CHARS = 64 * 2**20
MAX_NUMBER = 1_000_000  # no sensible template multiplies, pads or repeats by more


def _check_numbers(what: str, args) -> None:
    for a in args:
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_NUMBER:
            raise TemplateError(f"chat template: {what} with {a} is over the limit {MAX_NUMBER}")


def _bounded_filter(f):
    @functools.wraps(f)  # keeps jinja's pass_context / pass_environment markers
    def call(*args, **kwargs):
        _check_numbers(f"filter {f.__name__}", [*args, *kwargs.values()])
        return f(*args, **kwargs)

    return call


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(["*", "**"])

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.filters = {name: _bounded_filter(f) for name, f in self.filters.items()}

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        _check_numbers(f"'{operator}'", (left, right))
        if operator == "**" and isinstance(right, int) and abs(right) > 1024:
            raise TemplateError(f"chat template: exponent {right} is over the limit 1024")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # jinja's signature
        _check_numbers("a call", [*args, *kwargs.values()])
        return super().call(__context, __obj, *args, **kwargs)


RENDER_MEMORY = 1 * 2**30  # address space a render may add to the child's (RLIMIT_AS)
STARTUP_SECONDS = 60.0  # the child's interpreter start, on a loaded machine


def _render_here(source: str, max_chars: int, context: dict) -> str:
    """The template rendered in this process (the child), within the output bound."""
    env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(msg):
        raise TemplateError(msg)

    env.globals["raise_exception"] = raise_exception
    pieces, size = [], 0
    for piece in env.from_string(source).generate(**context):
        size += len(piece)
        if size > max_chars:
            raise TemplateError(f"chat template output is over {max_chars} characters")
        pieces.append(piece)
    return "".join(pieces)


class _Renderer:
    """The caller's side: one child process, one request at a time, JSON lines both ways."""

    def __init__(self):
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None

    def _start(self) -> subprocess.Popen:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "moestream.engine.chat_template", str(RENDER_MEMORY)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                env={**os.environ, "PYTHONPATH": _import_path()},
            )
            # Its start (an interpreter, jinja2) is not the template's time: wait for "ready".
            ready, _, _ = select.select([self.proc.stdout], [], [], STARTUP_SECONDS)
            if not ready or not self.proc.stdout.readline():
                self._stop()
                raise TemplateError("the chat template's render process did not start")
        return self.proc

    def _stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()  # our own child, by its handle
            self.proc.wait()
            self.proc = None

    def render(self, source: str, seconds: float, max_chars: int, context: dict) -> str:
        try:
            request = json.dumps({"source": source, "max_chars": max_chars, "context": context})
        except (TypeError, ValueError) as e:
            raise TemplateError(f"chat template context is not JSON data ({e})") from e
        with self.lock:
            proc = self._start()
            try:
                proc.stdin.write(request.encode() + b"\n")
                proc.stdin.flush()
            except BrokenPipeError as e:
                self._stop()
                raise TemplateError("the chat template's render process exited; try again") from e
            ready, _, _ = select.select([proc.stdout], [], [], seconds)
            if not ready:
                self._stop()
                raise TemplateError(f"chat template ran longer than {seconds:g} s; stopped")
            line = proc.stdout.readline()
            if not line:
                self._stop()
                raise TemplateError("chat template killed its render process (out of memory?)")
        reply = json.loads(line)
        if "error" in reply:
            raise TemplateError(reply["error"])
        return reply["text"]

    def close(self) -> None:
        with self.lock:
            self._stop()


def _import_path() -> str:
    """PYTHONPATH for the child: where this moestream was imported from, then the caller's."""
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)


_RENDERER = _Renderer()


def render(
    source: str, seconds: float = RENDER_SECONDS, max_chars: int = MAX_CHARS, **context
) -> str:
    """The template rendered with `context`, within the bounds (TemplateError past one)."""
    return _RENDERER.render(source, seconds, max_chars, context)


def _child(memory: int) -> None:
    """The render process: RLIMIT_AS set, then one JSON request per line, one reply per line."""
    import resource

    with open("/proc/self/statm") as f:
        size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(
        resource.RLIMIT_AS, (size + memory, resource.getrlimit(resource.RLIMIT_AS)[1])
    )
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    for line in sys.stdin:
        req = json.loads(line)
        try:
            reply = {"text": _render_here(req["source"], req["max_chars"], req["context"])}
        except MemoryError:
            reply = {"error": f"chat template needs more than {memory // 2**20} MiB; stopped"}
        except TemplateError as e:
            reply = {"error": str(e)}
        except Exception as e:  # noqa: BLE001 - any failure of template code is the template's
            reply = {"error": f"{type(e).__name__}: {e}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _child(int(sys.argv[1]))
