"""Translation between OpenAI requests and the engine: prompt ids, SamplingConfig, response bodies.

Everything a request can get wrong is checked here, before it is queued, and raised as `ApiError`
with the status and a message that says what to change; the engine only sees requests it can run.
"""

from __future__ import annotations

import time
import uuid

from moestream.config import ConfigError, SamplingConfig
from moestream.engine.tokenizer import CONTEXT_TOKENS, context_of, decode_after
from moestream.errors import TokenizerError
from moestream.runtime import Runtime
from moestream.serve.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    TokenLogprob,
    Usage,
)

# OpenAI's documented default for /v1/completions; chat defaults to the rest of the context.
COMPLETION_DEFAULT_MAX_TOKENS = 16


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def _check_text(text: str, param: str) -> None:
    # JSON can carry lone surrogates ("\\udfff") that no tokenizer can encode.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(
            400,
            f"{param} is not valid unicode ({e.reason} at index {e.start}); send UTF-8 text",
            param,
        ) from e


def completion_prompt_ids(rt: Runtime, req: CompletionRequest) -> list[int]:
    prompt = req.prompt
    if isinstance(prompt, list) and isinstance(prompt[0], int):
        bad = [t for t in prompt if t >= rt.args.vocab_size]
        if bad:
            raise ApiError(
                400,
                f"prompt token id {bad[0]} is outside the vocabulary (0..{rt.args.vocab_size - 1})",
                "prompt",
            )
        return list(prompt)
    text = prompt[0] if isinstance(prompt, list) else prompt
    _check_text(text, "prompt")
    return rt.encode_prompt(text)


def chat_messages(req: ChatCompletionRequest) -> list[dict]:
    messages = []
    for i, m in enumerate(req.messages):
        _check_text(m.text(), f"messages[{i}].content")
        # Chat templates know "system"; OpenAI's newer name for it is "developer".
        role = "system" if m.role == "developer" else m.role
        messages.append({"role": role, "content": m.text()})
    return messages


def chat_prompt_ids(rt: Runtime, req: ChatCompletionRequest) -> list[int]:
    try:
        return rt.tokenizer.encode_chat(chat_messages(req))
    except TokenizerError as e:
        raise ApiError(400, str(e), "messages") from e


def sampling_config(
    rt: Runtime, req: CompletionRequest | ChatCompletionRequest, n_prompt: int
) -> SamplingConfig:
    ctx = rt.generator.context
    if n_prompt == 0:
        raise ApiError(400, "the prompt is empty after tokenisation; send some text", "prompt")
    if n_prompt > ctx:
        raise ApiError(
            400,
            f"the prompt is {n_prompt} tokens but the model's context is {ctx}; shorten it",
            "prompt",
            "context_length_exceeded",
        )
    for name in ("max_tokens", "max_completion_tokens"):
        value = getattr(req, name, None)
        if value is not None and value > ctx:
            raise ApiError(400, f"{name}={value} is more than the model's context of {ctx}", name)
    max_new = _max_tokens(req, ctx - n_prompt)
    if n_prompt + max_new > ctx:
        raise ApiError(
            400,
            f"prompt ({n_prompt} tokens) + max_tokens ({max_new}) exceeds the model's context of "
            f"{ctx}; ask for at most {ctx - n_prompt} tokens or shorten the prompt",
            "max_tokens",
            "context_length_exceeded",
        )
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    try:
        return SamplingConfig(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0,
            seed=req.seed,
            max_new_tokens=max_new,
            stop=stop,
            ignore_eos=req.ignore_eos,
            frequency_penalty=req.frequency_penalty or 0.0,
            presence_penalty=req.presence_penalty or 0.0,
            repeat_penalty=req.repetition_penalty or 1.0,
        )
    except ConfigError as e:
        raise ApiError(400, str(e)) from e


def _max_tokens(req: CompletionRequest | ChatCompletionRequest, room: int) -> int:
    if isinstance(req, ChatCompletionRequest):
        chosen = (
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        )
        return room if chosen is None else chosen
    return min(COMPLETION_DEFAULT_MAX_TOKENS, room) if req.max_tokens is None else req.max_tokens


def wants_logprobs(req: CompletionRequest | ChatCompletionRequest) -> bool:
    return req.logprobs is not None and req.logprobs is not False


# ---- responses ----


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(n_prompt: int, n_generated: int) -> Usage:
    return Usage(
        prompt_tokens=n_prompt, completion_tokens=n_generated, total_tokens=n_prompt + n_generated
    )


def token_strings(rt: Runtime, ids: list[int], before: list[int]) -> list[str]:
    """Each token's text after the tokens before it (`before`: those before ids[0]), so a
    SentencePiece piece keeps its leading space, as in the generated text."""
    tok, seq = rt.tokenizer, [*before[-CONTEXT_TOKENS:], *ids]
    n = len(seq) - len(ids)
    return [decode_after(tok, context_of(tok, seq[: n + k]), [t]) for k, t in enumerate(ids)]


def completion_logprobs(
    rt: Runtime, ids: list[int], logprobs: list[float], before: list[int], offset: int = 0
) -> CompletionLogprobs:
    tokens = token_strings(rt, ids, before)
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return CompletionLogprobs(tokens=tokens, token_logprobs=logprobs, text_offset=offsets)


def chat_logprobs(
    rt: Runtime, ids: list[int], logprobs: list[float], before: list[int]
) -> ChoiceLogprobs:
    return ChoiceLogprobs(
        content=[
            TokenLogprob(token=t, logprob=lp, bytes=list(t.encode("utf-8")))
            for t, lp in zip(token_strings(rt, ids, before), logprobs)
        ]
    )


def completion_response(
    rt: Runtime, model: str, result, ids: list[int], lps: list[float], logprobs: bool
) -> CompletionResponse:
    choice = CompletionChoice(
        text=result.text,
        logprobs=completion_logprobs(rt, ids, lps, result.prompt_ids) if logprobs else None,
        finish_reason=result.finish_reason,
    )
    return CompletionResponse(
        id=new_id("cmpl"),
        created=now(),
        model=model,
        choices=[choice],
        usage=usage(len(result.prompt_ids), len(result.ids)),
    )


def chat_response(
    rt: Runtime, model: str, result, ids: list[int], lps: list[float], logprobs: bool
) -> ChatCompletionResponse:
    choice = ChatChoice(
        message=AssistantMessage(content=result.text),
        logprobs=chat_logprobs(rt, ids, lps, result.prompt_ids) if logprobs else None,
        finish_reason=result.finish_reason,
    )
    return ChatCompletionResponse(
        id=new_id("chatcmpl"),
        created=now(),
        model=model,
        choices=[choice],
        usage=usage(len(result.prompt_ids), len(result.ids)),
    )
