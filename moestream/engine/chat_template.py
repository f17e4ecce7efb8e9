"""Chat templates rendered in a jinja2 sandbox with a time and a size bound.

A checkpoint's template is code from the download: nested `range(100000)` loops pass jinja's
sandbox and would hold the caller (the server's request, `generate --chat`) for hours. The
bounds here:
- time: a trace function counts the lines the compiled template runs (in this thread only) and
  stops it once `seconds` have passed;
- size: the output is generated piece by piece and stopped past `max_chars`;
- one operation: `*` / `**` and calls (functions, methods, filters) with an integer argument
  above MAX_NUMBER are refused, since `'x' * 10**9` or `'x'.center(10**9)` is one C call that no
  trace line interrupts.
Every bound raises jinja2's TemplateError with a message saying which bound was hit.
"""

from __future__ import annotations

import functools
import sys
import time
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

RENDER_SECONDS = 5.0
MAX_CHARS = 64 * 2**20
MAX_NUMBER = 1_000_000  # no sensible template multiplies, pads or repeats by more
CHECK_EVERY = 1000  # trace lines between clock reads
TEMPLATE_FILE = "<template>"  # the filename jinja gives code compiled from a string


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


class _Deadline:
    """A sys.settrace function that raises in template code once the time is up."""

    def __init__(self, seconds: float):
        self.seconds, self.end, self.lines = seconds, time.monotonic() + seconds, 0

    def __call__(self, frame, event, arg):
        return self._line if frame.f_code.co_filename == TEMPLATE_FILE else None

    def _line(self, frame, event, arg):
        self.lines += 1
        if self.lines % CHECK_EVERY == 0 and time.monotonic() > self.end:
            raise TemplateError(f"chat template ran longer than {self.seconds:g} s; stopped")
        return self._line


def render(
    source: str, seconds: float = RENDER_SECONDS, max_chars: int = MAX_CHARS, **context
) -> str:
    """The template rendered with `context`, within the bounds (TemplateError past one)."""
    env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(msg):
        raise TemplateError(msg)

    env.globals["raise_exception"] = raise_exception
    template = env.from_string(source)
    pieces, size = [], 0
    previous = sys.gettrace()
    sys.settrace(_Deadline(seconds))
    try:
        for piece in template.generate(**context):
            size += len(piece)
            if size > max_chars:
                raise TemplateError(f"chat template output is over {max_chars} characters")
            pieces.append(piece)
    finally:
        sys.settrace(previous)
    return "".join(pieces)
