"""The OpenAI HTTP schema refserve serves: request bodies, responses and stream chunks.

Requests are pydantic models so that a bad body is a 400 naming the field (the app turns
pydantic's location into OpenAI's ``param``). Fields OpenAI defines that refserve cannot
honour (penalties, ``logit_bias``, top logprobs beyond the sampled token) are accepted at
their neutral value and refused otherwise, by name: silently ignoring them would return
text the client did not ask for. Unknown fields are ignored, as OpenAI and vLLM do
(clients send ``user``, ``metadata``...).

Responses follow OpenAI's shapes field for field, so the official ``openai`` client reads
them unchanged. ``finish_reason`` is the engine's (``stop``, ``length``, ``abort``, and
``error`` for a request whose logits could not be sampled).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

#: The most tokens one request may ask for (a bound on the work a body can demand; the
#: model's context bounds it further).
MAX_TOKENS_LIMIT = 1 << 20
#: The most choices one request may ask for (each is a sequence and a scheduler slot).
MAX_N = 64
#: The most stop strings / stop token ids one request may carry.
MAX_STOPS = 16


class RequestBody(BaseModel):
    """The fields the completion and chat bodies share (sampling, stops, streaming)."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1, le=1 << 20)  # vLLM's extension; -1/0: off
    seed: int | None = Field(default=None, ge=0, le=(1 << 63) - 1)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOPS)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # vLLM's extension: logprobs name tokens "token_id:<id>" instead of their text, so a
    # black-box client can compare token ids (conformance-http does).
    return_tokens_as_token_ids: bool = False

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class CompletionRequest(RequestBody):
    """``POST /v1/completions``: one prompt (text or token ids)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1, le=MAX_TOKENS_LIMIT)  # OpenAI's default
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str = Field(min_length=1, max_length=64)
    content: str | list[ContentPart] | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class ChatCompletionRequest(RequestBody):
    """``POST /v1/chat/completions``: messages rendered by the chat template."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)


# --------------------------------------------------------------------- responses
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


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
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


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


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "refserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


def error_body(status: int, message: str, kind: str, param: str | None = None) -> dict[str, Any]:
    return ErrorResponse(
        error=ErrorInfo(message=message, type=kind, param=param, code=status)
    ).model_dump()


# Forward references (StreamOptions, ContentPart, TopLogprob are defined after their users).
CompletionRequest.model_rebuild()
ChatCompletionRequest.model_rebuild()
ChatMessage.model_rebuild()
TokenLogprob.model_rebuild()
