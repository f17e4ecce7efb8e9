"""Pydantic models of the OpenAI request and response bodies the server speaks.

They are the validation (a wrong type or range is a 400 naming the field, never a 500) and the
source of /openapi.json. Fields beyond the OpenAI spec are marked "extension" (vLLM has the same).
Unknown fields are ignored, as OpenAI clients send optional fields this engine has no use for.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_serializer,
)

# torch.Generator.manual_seed accepts exactly this range.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


def _integral(value):
    # JSON Schema counts 2.0 as an integer; strict pydantic would not.
    return int(value) if isinstance(value, float) and value.is_integer() else value


Int = Annotated[int, BeforeValidator(_integral)]
StopString = Annotated[str, Field(min_length=1)]
TokenId = Annotated[Int, Field(ge=0)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = Field(False, description="send a last chunk with the usage counts")


def no_alternatives(value, param: str):
    """Say plainly why top-N alternatives are refused (the schema says maximum 0)."""
    value = _integral(value)
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        raise ValueError(
            f"{param}={value} asks for alternative tokens, which this engine does not record; "
            f"use {param}: 0 for the chosen tokens' log-probabilities"
        )
    return value


class _Sampling(BaseModel):
    """Fields shared by completions and chat completions."""

    # strict: 4.0 is not an integer and false is not 0, as the published schema says.
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str = Field(description="the id listed by /v1/models")
    temperature: float | None = Field(
        None, ge=0, le=2, allow_inf_nan=False, description="0 = greedy; default 1"
    )
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False, description="default 1")
    top_k: Int | None = Field(None, ge=0, description="extension: 0 = off")
    seed: Int | None = Field(
        None, ge=SEED_MIN, le=SEED_MAX, description="makes sampling repeatable"
    )
    stop: StopString | Annotated[list[StopString], Field(max_length=4)] | None = Field(
        None, description="generation stops before the first of these strings"
    )
    max_tokens: Int | None = Field(None, ge=0, description="tokens to generate at most")
    n: Int = Field(1, ge=1, le=1, description="only 1 choice per request is supported")
    stream: bool = Field(False, description="send server-sent events as text is produced")
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(False, description="extension: keep generating past end-of-sequence")
    frequency_penalty: float | None = Field(
        None, ge=-2, le=2, allow_inf_nan=False, description="subtracted per occurrence so far"
    )
    presence_penalty: float | None = Field(
        None, ge=-2, le=2, allow_inf_nan=False, description="subtracted once per token seen"
    )
    repetition_penalty: float | None = Field(
        None,
        ge=0.01,
        le=100,
        allow_inf_nan=False,
        description="extension (vLLM/llama.cpp): 1 = off",
    )


class CompletionRequest(_Sampling):
    prompt: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=1)]
        | Annotated[list[TokenId], Field(min_length=1)]
    ) = Field(
        description="text, or token ids; a list of several prompts is not supported (send one "
        "request per prompt)"
    )
    logprobs: Int | None = Field(
        None, ge=0, le=0, description="0 = each chosen token's log-probability (no alternatives)"
    )

    _logprobs = field_validator("logprobs", mode="before")(lambda v: no_alternatives(v, "logprobs"))


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Int | None = Field(None, ge=0, description="wins over max_tokens")
    logprobs: bool | None = Field(None, description="return each chosen token's log-probability")
    top_logprobs: Int | None = Field(
        None, ge=0, le=0, description="alternatives are not recorded: only 0 is served"
    )

    _top_logprobs = field_validator("top_logprobs", mode="before")(
        lambda v: no_alternatives(v, "top_logprobs")
    )


# ---- responses ----


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[dict] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length"]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        # OpenAI sends {"role": ...} first, then {"content": ...}, then {}: no null keys.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "moestream"
    max_model_len: int = Field(description="extension: the context length in tokens")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Health(BaseModel):
    status: Literal["ok"] = "ok"
    model: str


class Stats(BaseModel):
    """Counters since the server started; the tok/s figures are over the engine's busy time."""

    model: str
    uptime_seconds: float
    queue_depth: int = Field(description="requests waiting for the engine (FIFO)")
    active: int = Field(description="requests the engine is generating now (0 or 1)")
    requests_completed: int
    requests_cancelled: int = Field(description="stopped because the client disconnected")
    requests_failed: int
    prompt_tokens: int
    generated_tokens: int
    decode_tokens: int
    prefill_seconds: float
    decode_seconds: float
    prefill_tok_s: float
    decode_tok_s: float
    last_decode_tok_s: float
    peak_rss_bytes: int
    experts: dict | None = Field(
        None, description="the expert provider's counters (cache hits, bytes read) when it has any"
    )
