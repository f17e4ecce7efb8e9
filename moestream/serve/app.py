"""The FastAPI app: OpenAI routes, /health, /stats, errors in OpenAI's shape, SSE streaming.

Every request is validated (schemas.py, protocol.py) before it reaches the engine worker, so bad
input is a 4xx with a message, never a 5xx; bodies are bounded (limits.py) and prompts are
tokenized off the event loop. A streamed request is cancelled when Starlette sees the
client disconnect (it cancels the body iterator); a non-streamed one polls for the disconnect while
it waits.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from moestream.runtime import Runtime
from moestream.serve import protocol as P
from moestream.serve.limits import DEFAULT_MAX_BODY_BYTES, BodyLimit
from moestream.serve.schemas import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    Delta,
    ErrorResponse,
    Health,
    ModelCard,
    ModelList,
    Stats,
)
from moestream.serve.worker import Failed, Finished, Job, Piece, Worker

DISCONNECT_POLL_S = 0.25
ERRORS = {400: {"model": ErrorResponse}, 404: {"model": ErrorResponse}}
# Before OpenAPI 3.2 an event-stream schema describes one event; `data` is a JSON chunk or [DONE].
SSE_EVENT = {
    "type": "object",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
    "required": ["data"],
}
SSE = {200: {"content": {"text/event-stream": {"schema": SSE_EVENT}}}}


def error_body(status: int, message: str, param=None, code=None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    detail = {"message": message, "type": kind, "param": param, "code": code}
    return JSONResponse({"error": detail}, status_code=status)


def _field_path(loc) -> str:
    """('body', 'prompt', 'list[str]', 0) -> 'prompt[0]': drop pydantic's union-branch tags."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part != "body" and part.isidentifier() and part not in ("str", "int", "float"):
            out += f".{part}" if out else part
    return out


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """pydantic's error list -> one line naming each bad field once, and the first field."""
    by_field: dict[str, list[str]] = {}
    for err in exc.errors():
        kind, loc = err.get("type"), err.get("loc", ())
        if kind == "json_invalid":
            reason = (err.get("ctx") or {}).get("error", "syntax error")
            return f"the request body is not valid JSON ({reason}); send a JSON object", None
        if kind == "missing" and tuple(loc) == ("body",):
            return "the request has no body; send a JSON object", None
        if tuple(loc) == ("body",) and isinstance(err.get("input"), bytes):
            # FastAPI parses only JSON bodies; anything else reaches validation as raw bytes.
            return (
                "the body was not read as JSON: send it with Content-Type: application/json",
                None,
            )
        got = json.dumps(err.get("input"), default=str)[:60]
        msgs = by_field.setdefault(_field_path(loc) or "body", [])
        if len(msgs) < 2:  # a union reports every branch; two say enough
            msgs.append(f"{err.get('msg')} (got {got})")
    parts = [f"{field}: {' / '.join(msgs)}" for field, msgs in list(by_field.items())[:4]]
    first = next(iter(by_field), None)
    return "invalid request: " + "; ".join(parts), None if first == "body" else first


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        message, param = validation_message(exc)
        return error_body(400, message, param)

    @app.exception_handler(P.ApiError)
    async def _api(request: Request, exc: P.ApiError):
        return error_body(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        response = error_body(exc.status_code, str(exc.detail))
        response.headers.update(exc.headers or {})  # e.g. Allow on a 405
        return response


class Server:
    """What the routes share: the runtime, the served model id and the engine worker."""

    def __init__(self, runtime: Runtime, model_id: str):
        self.rt, self.model_id = runtime, model_id
        self.worker = Worker(runtime.generator)

    def check_model(self, model: str) -> None:
        if model != self.model_id:
            raise P.ApiError(
                404,
                f"model {model!r} is not served here; this server serves {self.model_id!r} "
                "(see /v1/models)",
                "model",
                "model_not_found",
            )

    def submit(self, prompt_ids: list[int], req) -> Job:
        cfg = P.sampling_config(self.rt, req, len(prompt_ids))
        job = Job(prompt_ids, cfg, asyncio.get_running_loop())
        self.worker.submit(job)
        return job


async def events(job: Job, request: Request | None) -> AsyncIterator[Piece | Finished | Failed]:
    """The job's events until it ends. With `request`, check for a client disconnect every
    DISCONNECT_POLL_S (pieces may arrive faster than that, so the check runs on a clock).

    Leaving early (a disconnect, or Starlette cancelling a stream) cancels the job.
    """
    loop = asyncio.get_running_loop()
    next_check = loop.time() + DISCONNECT_POLL_S
    try:
        while True:
            if request is None:
                ev = await job.events.get()
            else:
                try:
                    ev = await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    ev = None
                if loop.time() >= next_check:
                    if await request.is_disconnected():
                        return
                    next_check = loop.time() + DISCONNECT_POLL_S
                if ev is None:
                    continue
            yield ev
            if not isinstance(ev, Piece):
                return
    finally:
        job.cancel()  # a no-op for a job that already finished


async def collect(job: Job, request: Request):
    """Wait for a non-streamed job: (result, visible ids, their logprobs), or None on disconnect."""
    ids, lps = [], []
    async for ev in events(job, request):
        if isinstance(ev, Piece):
            ids += ev.ids
            lps += ev.logprobs
        elif isinstance(ev, Failed):
            raise P.ApiError(ev.status, ev.message)
        else:
            return ev.result, ids, lps
    return None


def sse(obj) -> str:
    body = obj if isinstance(obj, str) else obj.model_dump_json()
    return f"data: {body}\n\n"


def sse_error(ev: Failed) -> str:
    kind = "invalid_request_error" if ev.status < 500 else "server_error"
    return sse(json.dumps({"error": {"message": ev.message, "type": kind}}))


async def completion_stream(server: Server, job: Job, req: CompletionRequest):
    cid, created, offset = P.new_id("cmpl"), P.now(), 0
    logprobs = P.wants_logprobs(req)

    def chunk(choice: CompletionChoice, usage=None) -> str:
        return sse(
            CompletionResponse(
                id=cid, created=created, model=server.model_id, choices=[choice], usage=usage
            )
        )

    async for ev in events(job, None):
        if isinstance(ev, Failed):
            yield sse_error(ev)
            return
        if isinstance(ev, Piece):
            lp = (
                P.completion_logprobs(server.rt, ev.ids, ev.logprobs, ev.before, offset)
                if logprobs
                else None
            )
            offset += len(ev.text)
            yield chunk(CompletionChoice(text=ev.text, logprobs=lp))
            continue
        res = ev.result
        yield chunk(CompletionChoice(text="", finish_reason=res.finish_reason))
        if req.stream_options and req.stream_options.include_usage:
            usage = P.usage(len(res.prompt_ids), len(res.ids))
            yield sse(
                CompletionResponse(
                    id=cid, created=created, model=server.model_id, choices=[], usage=usage
                )
            )
    yield sse("[DONE]")


async def chat_stream(server: Server, job: Job, req: ChatCompletionRequest):
    cid, created = P.new_id("chatcmpl"), P.now()
    logprobs = P.wants_logprobs(req)

    def chunk(choices: list[ChatChunkChoice], usage=None) -> str:
        return sse(
            ChatCompletionChunk(
                id=cid, created=created, model=server.model_id, choices=choices, usage=usage
            )
        )

    yield chunk([ChatChunkChoice(delta=Delta(role="assistant", content=""))])
    async for ev in events(job, None):
        if isinstance(ev, Failed):
            yield sse_error(ev)
            return
        if isinstance(ev, Piece):
            lp = P.chat_logprobs(server.rt, ev.ids, ev.logprobs, ev.before) if logprobs else None
            yield chunk([ChatChunkChoice(delta=Delta(content=ev.text), logprobs=lp)])
            continue
        res = ev.result
        yield chunk([ChatChunkChoice(delta=Delta(), finish_reason=res.finish_reason)])
        if req.stream_options and req.stream_options.include_usage:
            yield chunk([], P.usage(len(res.prompt_ids), len(res.ids)))
    yield sse("[DONE]")


def streaming(body) -> StreamingResponse:
    # no-cache / no buffering so proxies pass each event on as it is produced.
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(body, media_type="text/event-stream", headers=headers)


async def prompt_ids(encode, server: Server, req) -> list[int]:
    """Tokenize (and render the chat template) in a thread: the event loop keeps answering
    /health and other streams meanwhile (the tokenizer releases the GIL, templates are bounded)."""
    return await asyncio.to_thread(encode, server.rt, req)


def add_routes(app: FastAPI, server: Server) -> None:
    @app.get("/health", response_model=Health)
    async def health():
        return Health(model=server.model_id)

    @app.get("/stats", response_model=Stats)
    async def stats():
        return Stats(model=server.model_id, **server.worker.stats())

    @app.get("/v1/models", response_model=ModelList)
    async def models():
        return ModelList(data=[model_card(server)])

    @app.get("/v1/models/{model}", response_model=ModelCard, responses=ERRORS)
    async def model(model: str):
        server.check_model(model)
        return model_card(server)

    @app.post("/v1/completions", response_model=CompletionResponse, responses={**ERRORS, **SSE})
    async def completions(req: CompletionRequest, request: Request):
        server.check_model(req.model)
        job = server.submit(await prompt_ids(P.completion_prompt_ids, server, req), req)
        if req.stream:
            return streaming(completion_stream(server, job, req))
        done = await collect(job, request)
        if done is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        return P.completion_response(server.rt, server.model_id, *done, P.wants_logprobs(req))

    @app.post(
        "/v1/chat/completions",
        response_model=ChatCompletionResponse,
        responses={**ERRORS, **SSE},
    )
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        server.check_model(req.model)
        job = server.submit(await prompt_ids(P.chat_prompt_ids, server, req), req)
        if req.stream:
            return streaming(chat_stream(server, job, req))
        done = await collect(job, request)
        if done is None:
            return Response(status_code=499)
        return P.chat_response(server.rt, server.model_id, *done, P.wants_logprobs(req))


def model_card(server: Server) -> ModelCard:
    return ModelCard(
        id=server.model_id,
        created=int(server.worker.started),
        max_model_len=server.rt.generator.context,
    )


def _set_maximum(prop: dict, value: int) -> None:
    for branch in prop.get("anyOf", [prop]):
        if branch.get("type") == "integer":
            branch["maximum"] = value


def openapi_schema(app: FastAPI, model_id: str, context: int) -> dict:
    """FastAPI's schema, made exact for this server: validation errors are 400 (not FastAPI's
    422), `model` can only be the served id, max_tokens is at most the context."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    for path in schema["paths"].values():
        for op in path.values():
            op.get("responses", {}).pop("422", None)
            if "requestBody" in op:
                op["responses"]["400"] = {
                    "description": "Invalid request",
                    "content": {
                        "application/json": {
                            "schema": {"$ref": "#/components/schemas/ErrorResponse"}
                        }
                    },
                }
    comps = schema.get("components", {}).get("schemas", {})
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = comps[name]["properties"]
        props["model"]["enum"] = [model_id]
        for field in ("max_tokens", "max_completion_tokens"):
            if field in props:  # never more than the context (the prompt's share is checked later)
                _set_maximum(props[field], context)
    for name in ("HTTPValidationError", "ValidationError"):
        comps.pop(name, None)
    app.openapi_schema = schema
    return schema


def create_app(
    runtime: Runtime, model_id: str, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
) -> FastAPI:
    server = Server(runtime, model_id)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        server.worker.close()

    from moestream import __version__

    app = FastAPI(title="moestream", version=__version__, lifespan=lifespan)
    app.state.server = server
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    install_error_handlers(app)
    add_routes(app, server)
    context = runtime.generator.context
    app.openapi = lambda: openapi_schema(app, model_id, context)
    return app
