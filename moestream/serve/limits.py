"""Request body bound: an ASGI middleware that answers 413 past `limit` bytes, and gives the
memory of a large request back once it is answered.

The body is read here, up to the limit, before any route sees it; past the limit the rest is
read and dropped (memory stays flat) and the answer is a 413 naming the limit. A body within the
limit is handed on whole, so the routes parse it as usual. After a request of TRIM_AFTER_BYTES
or more, `release_memory` runs in a thread: a 4 MB prompt's copies (JSON, pydantic, the
tokenizer's buffers) left the heap's free pages mapped, RSS 480 -> 954 MiB on the tiny model and
staying there; gc.collect + glibc's malloc_trim(0) hand them back.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import json

DEFAULT_MAX_BODY_BYTES = 4 * 2**20
DRAIN_BYTES = 256 * 2**20  # read and dropped for a 413; a larger body is answered unread
TRIM_AFTER_BYTES = 1 * 2**20  # smaller requests leave too little behind to be worth a trim


def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none (musl, macOS)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


MALLOC_TRIM = _malloc_trim()


def release_memory() -> None:
    """Free unreachable objects, then return the heap's free pages to the OS."""
    gc.collect()
    if MALLOC_TRIM is not None:
        MALLOC_TRIM(0)


class BodyLimit:
    def __init__(self, app, limit: int = DEFAULT_MAX_BODY_BYTES):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers", ())).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > DRAIN_BYTES:
            return await self._refuse(send)  # too much to drain: answer and close
        body, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left: nobody to answer
                return None
            body.append(message.get("body", b""))
            size, more = size + len(body[-1]), message.get("more_body", False)
            if size > self.limit:
                body = None
                await self._drain_and_refuse(receive, send, size, more)
                return await _trim(size)
        replay, body = _replay(b"".join(body), receive), None
        try:
            return await self.app(scope, replay, send)
        finally:
            replay = None
            await _trim(size)

    async def _drain_and_refuse(self, receive, send, size: int, more: bool) -> None:
        # Read (and drop) the rest first: closing with unread bytes makes the kernel reset the
        # connection, and the client then sees "connection reset" instead of the 413.
        while more and size <= DRAIN_BYTES:
            message = await receive()
            if message["type"] != "http.request":
                return
            size, more = size + len(message.get("body", b"")), message.get("more_body", False)
        await self._refuse(send)

    async def _refuse(self, send) -> None:
        message = (
            f"the request body is over this server's limit of {self.limit} bytes "
            "(serve --max-body-bytes); send a smaller request"
        )
        error = {"message": message, "type": "invalid_request_error", "param": None}
        payload = json.dumps({"error": {**error, "code": "request_too_large"}}).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


async def _trim(size: int) -> None:
    if size >= TRIM_AFTER_BYTES:
        await asyncio.to_thread(release_memory)


def _replay(body: bytes, receive):
    """A `receive` that gives the buffered body as one message, then defers to the real one
    (which reports the client's disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay():
        return pending.pop() if pending else await receive()

    return replay
