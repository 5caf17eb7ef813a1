"""The FastAPI app: OpenAI's completions, chat completions and models endpoints over an
:class:`~refserve.serve.loop.EngineLoop`, plus ``/health``, ``/metrics``, ``/debug/steps``
and ``/debug/pools`` (and ``POST /debug/replicas/{i}/kill`` with
``ServeSettings.fault_endpoints``: a soak's faults).

What happens on the asyncio side: parsing and validating the body (pydantic), the chat
template, tokenizing the prompt, building the response and the server-sent events. What
happens on the engine thread: admission (``add_request``), steps, and detokenization
(the engine does it inside its step; moving it out would mean changing the engine).

Errors are OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: a body that
is not JSON or breaks the schema, or parameters the engine refuses, answer 400 with
``param`` naming the field; an unknown model 404; a full waiting queue 429; a draining
server 503; a missing or wrong API key 401. A refused request changes nothing for the
requests already running (the engine's ``add_request`` guarantees it).

A streaming client that disconnects cancels its response generator (Starlette listens
for ``http.disconnect``): the ``finally`` aborts the request on the engine thread, whose
blocks go back to the pool in that command, before the next step. A non-streaming
client that disconnects is noticed by polling (:data:`DISCONNECT_POLL_S`) and aborted
the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from dataclasses import asdict, dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from refserve.cluster.errors import NoLiveReplica, ReplicaDead
from refserve.cluster.pool_check import pool_report
from refserve.engine.llm_engine import InvalidPrompt, RequestOutput
from refserve.errors import ExceedsCapacity, InvalidArgument, QueueFull, RefserveError
from refserve.model.sampler import InvalidSamplingParams, SamplingParams
from refserve.serve.chat import ChatMessageText, ChatTemplate
from refserve.serve.cluster_loop import ClusterLoop, ReplicaPools
from refserve.serve.loop import EngineLoop, ServerDraining, ServingLoop, gap_summary
from refserve.serve.metrics import ClusterServeMetrics, ServerMetrics
from refserve.serve.request_timing import CLIENT_ID_HEADER, RequestTimings
from refserve.serve.schema import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Delta,
    ModelCard,
    ModelList,
    RequestBody,
    TokenLogprob,
    Usage,
    error_body,
)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: How often a non-streamed request checks that its client is still there (seconds).
DISCONNECT_POLL_S = 0.25
#: Default bound on a request body (bytes): a prompt of the longest context in JSON fits.
DEFAULT_MAX_BODY_BYTES = 4 << 20


@dataclass(frozen=True)
class ServeSettings:
    model_name: str
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    drain_timeout_s: float = 30.0
    fault_endpoints: bool = False
    """``POST /debug/replicas/{i}/kill`` (a soak's replica kills); never in production."""


class ApiError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, kind: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def response(self) -> JSONResponse:
        return JSONResponse(
            error_body(self.status, self.message, self.kind, self.param), status_code=self.status
        )


def _bad(message: str, param: str | None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param)


def engine_error(e: BaseException, prompt_param: str) -> ApiError:
    """The HTTP answer to an error the engine raised at ``add_request``."""
    if isinstance(e, InvalidSamplingParams):
        return _bad(str(e), e.field)
    if isinstance(e, InvalidPrompt | ExceedsCapacity):
        return _bad(str(e), prompt_param)
    if isinstance(e, QueueFull):
        return ApiError(429, f"server busy: {e}", "rate_limit_error")
    if isinstance(e, ServerDraining | ReplicaDead | NoLiveReplica):
        return ApiError(503, str(e), "service_unavailable")
    if isinstance(e, InvalidArgument):
        return _bad(str(e), None)
    return ApiError(500, f"{type(e).__name__}: {e}", "internal_error")


# --------------------------------------------------------------------- guard middleware
class Guard:
    """Pure ASGI middleware: the API key (every path but ``/health``) and the body bound.

    The key is compared with :func:`hmac.compare_digest` (constant time). A body is
    bounded by its ``Content-Length``; a body without one (chunked) is counted as it
    arrives and refused once past the bound.
    """

    def __init__(self, app: ASGIApp, settings: ServeSettings) -> None:
        self.app, self.settings = app, settings
        key = settings.api_key
        self._expected = None if key is None else f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if self._expected is not None and scope.get("path") != "/health":
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                err = ApiError(401, "missing or wrong API key", "authentication_error")
                await err.response()(scope, receive, send)
                return
        limit = self.settings.max_body_bytes
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            await _too_large(limit)(scope, receive, send)
            return
        if length is None and scope.get("method") in ("POST", "PUT", "PATCH"):
            body = await _read_bounded(receive, limit)
            if body is None:  # past the bound, or the client went away
                await _too_large(limit)(scope, receive, send)
                return
            receive = _replay(body, receive)
        await self.app(scope, receive, send)


def _too_large(limit: int) -> JSONResponse:
    return ApiError(413, f"request body over {limit} bytes", "invalid_request_error").response()


async def _read_bounded(receive: Receive, limit: int) -> bytes | None:
    """A body without ``Content-Length`` (chunked), read up to ``limit`` bytes; None past
    it (nothing more is read) or on a disconnect."""
    body = bytearray()
    while True:
        message = await receive()
        if message.get("type") != "http.request":
            return None
        body.extend(message.get("body", b""))
        if len(body) > limit:
            return None
        if not message.get("more_body"):
            return bytes(body)


def _replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` that hands over the buffered body once, then the real messages (a
    disconnect)."""
    sent = False

    async def wrapped() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return wrapped


def _cluster_shape(loop: ServingLoop) -> dict[str, Any]:
    """How many replicas the step records come from, and the routing in front of them
    (what ``bench-serve --fit`` replays): a cluster loop's ``loops`` and ``router``."""
    from refserve.serve.cluster_loop import ClusterLoop

    if not isinstance(loop, ClusterLoop):
        return {"replicas": 1, "router": None}
    return {"replicas": len(loop.loops), "router": loop.router.policy.value}


# --------------------------------------------------------------------- the app
def create_app(
    loop: ServingLoop,
    settings: ServeSettings,
    chat_template: ChatTemplate,
    metrics: ServerMetrics | ClusterServeMetrics | None = None,
) -> Guard:
    """The app over a started or not yet started loop (the lifespan starts it and, on
    shutdown, drains it: stop admitting, let in-flight requests finish, abort the rest)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not loop.alive:
            loop.start()
        yield
        loop.stop_admitting()
        await asyncio.to_thread(loop.shutdown, settings.drain_timeout_s)

    app = FastAPI(title="refserve", lifespan=lifespan, docs_url=None, redoc_url=None)
    api = _Api(loop, settings, chat_template)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Starlette's own answers (an unknown path, a wrong method) in OpenAI's shape.
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return ApiError(exc.status_code, str(exc.detail), kind).response()

    @app.get("/health")
    async def health() -> Response:
        ok = loop.alive
        return Response(status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models() -> ModelList:
        card = ModelCard(
            id=settings.model_name, created=api.created, max_model_len=loop.max_model_len
        )
        return ModelList(data=[card])

    @app.get("/metrics")
    async def prometheus() -> Response:
        body = metrics.render() if metrics is not None else b""
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/debug/steps")
    async def steps(last: int = 1000, since: int | None = None) -> dict[str, Any]:
        """The loop's recent step records (``since``: those with index >= it): what
        ``bench-serve --fit`` fits the simulator's iteration cost to."""
        timings = list(loop.timings)
        if since is not None:
            timings = [t for t in timings if t.index >= since]
        else:
            timings = timings[-max(1, min(last, len(timings) or 1)) :]
        cfg = loop.scheduler_config
        return {
            "scheduler": {
                "max_num_batched_tokens": cfg.max_num_batched_tokens,
                "max_num_seqs": cfg.max_num_seqs,
                "block_size": cfg.block_size,
                "num_blocks": cfg.num_blocks,
                "max_model_len": cfg.max_model_len,
                "enable_prefix_caching": cfg.enable_prefix_caching,
                "enable_chunked_prefill": cfg.enable_chunked_prefill,
                "policy": str(cfg.policy.value),
            },
            **_cluster_shape(loop),
            "summary": gap_summary(timings),
            "steps": [
                {
                    "index": t.index,
                    "start_s": t.start_s,
                    "duration_ms": (t.end_s - t.start_s) * 1e3,
                    "num_prefill_tokens": t.num_prefill_tokens,
                    "num_decodes": t.num_decodes,
                    "gap_ms": t.gap_ms,
                }
                for t in timings
            ],
        }

    @app.get("/debug/requests")
    async def requests(since: int = 0) -> dict[str, Any]:
        """The streamed requests' checkpoints (ref/serve/request_timing.py), those with
        index >= ``since``: what ``bench-serve --fit`` models around the engine."""
        return {
            "last_index": api.timings.last_index(),
            "requests": [asdict(t) for t in api.timings.since(since)],
        }

    @app.get("/debug/pools")
    async def pools() -> dict[str, Any]:
        """Each engine's KV pools held to the spec, read on its own thread between two
        steps (ref/cluster/pool_check.py): a soak's leak check."""
        if isinstance(loop, ClusterLoop):
            slots = await asyncio.to_thread(loop.pool_reports)
        elif isinstance(loop, EngineLoop) and loop.alive:
            engine = loop.engine
            one = await loop.call(lambda: pool_report(engine))
            slots = [ReplicaPools(0, True, 0, one)]
        else:
            slots = []
        return {"replicas": [dataclasses.asdict(s) for s in slots]}

    if settings.fault_endpoints and isinstance(loop, ClusterLoop):
        cluster = loop

        @app.post("/debug/replicas/{replica}/kill")
        async def kill(replica: int) -> dict[str, Any]:
            """Kill a replica as a crash would (``--fault-endpoints``: a soak's fault)."""
            try:
                cluster.kill_replica(replica)
            except InvalidArgument as e:
                raise ApiError(404, str(e), "not_found_error", "replica") from None
            return {"killed": replica}

    @app.post("/v1/completions", response_model=None)
    async def completions(
        body: CompletionRequest, request: Request
    ) -> Response | CompletionResponse:
        return await api.completions(body, request)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(
        body: ChatCompletionRequest, request: Request
    ) -> Response | ChatCompletionResponse:
        return await api.chat(body, request)

    return Guard(app, settings)


def _validation_error(exc: RequestValidationError) -> ApiError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        return _bad(f"malformed JSON body: {first.get('msg', '')}", None)
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid request")
    if param is None:  # the body as a whole: not JSON, or JSON that is not an object
        return _bad(f"the request body must be a JSON object: {msg}", None)
    return _bad(f"{param}: {msg}", param)


# --------------------------------------------------------------------- requests
@dataclass(frozen=True)
class _Prepared:
    prompt: list[int]
    params: SamplingParams
    request_id: str
    include_usage: bool
    token_ids_as_text: bool = False


@dataclass
class _Marks:
    """A streamed request's checkpoints so far (ref/serve/request_timing.py), and when
    the handler took each of its outputs with text off the queue."""

    received_s: float
    queued_s: float
    submitted_s: float
    client_id: str | None
    added_s: float | None
    taken_s: list[float] = field(default_factory=list)


def _client_id(request: Request) -> str | None:
    return request.headers.get(CLIENT_ID_HEADER)


class _Api:
    def __init__(self, loop: ServingLoop, settings: ServeSettings, chat: ChatTemplate) -> None:
        self.loop, self.settings, self.template = loop, settings, chat
        self.tokenizer = loop.tokenizer
        self.created = int(time.time())
        self.timings = RequestTimings()

    # ---------------------------------------------------------------- endpoints
    async def completions(
        self, body: CompletionRequest, request: Request
    ) -> Response | CompletionResponse:
        self._check_common(body)
        if body.echo:
            raise _bad("echo is not supported", "echo")
        if body.logprobs is not None and body.logprobs > 0:
            raise _bad(
                "refserve reports the sampled token's logprob only: use logprobs=0",
                "logprobs",
            )
        received = time.perf_counter()
        prompt = self._completion_prompt(body.prompt)
        prep = self._prepare(body, prompt, body.max_tokens, body.logprobs is not None, "cmpl")
        queued = time.perf_counter()
        sub = await self._submit(prep, "prompt")
        if body.stream:
            marks = _Marks(received, queued, time.perf_counter(), _client_id(request), sub.added_s)
            return _sse(self._completion_stream(prep, sub.queue, sub.n, marks))
        finals = await _collect(self.loop, prep.request_id, sub.queue, sub.n, request)
        choices = [
            CompletionChoice(
                index=o.index,
                text=o.text,
                logprobs=self._completion_logprobs(o, prep) if prep.params.logprobs else None,
                finish_reason=o.finish_reason,
                stop_reason=o.stop_reason,
            )
            for o in finals
        ]
        return CompletionResponse(
            id=prep.request_id,
            created=int(time.time()),
            model=self.settings.model_name,
            choices=choices,
            usage=_usage(prep, finals),
        )

    async def chat(
        self, body: ChatCompletionRequest, request: Request
    ) -> Response | ChatCompletionResponse:
        self._check_common(body)
        if body.top_logprobs:
            raise _bad(
                "refserve reports the sampled token's logprob only: use top_logprobs=0",
                "top_logprobs",
            )
        received = time.perf_counter()
        messages = [ChatMessageText(m.role, _content(m.content)) for m in body.messages]
        try:
            text = self.template.render(messages)
        except InvalidArgument as e:
            raise _bad(str(e), "messages") from None
        prompt = self.tokenizer.encode(text, add_special_tokens=self.template.add_special_tokens)
        limit = body.max_completion_tokens or body.max_tokens
        prep = self._prepare(body, prompt, limit, body.logprobs, "chatcmpl")
        queued = time.perf_counter()
        sub = await self._submit(prep, "messages")
        if body.stream:
            marks = _Marks(received, queued, time.perf_counter(), _client_id(request), sub.added_s)
            return _sse(self._chat_stream(prep, sub.queue, sub.n, marks))
        finals = await _collect(self.loop, prep.request_id, sub.queue, sub.n, request)
        choices = [
            ChatChoice(
                index=o.index,
                message=AssistantMessage(content=o.text),
                logprobs=self._chat_logprobs(o, prep) if prep.params.logprobs else None,
                finish_reason=o.finish_reason,
                stop_reason=o.stop_reason,
            )
            for o in finals
        ]
        return ChatCompletionResponse(
            id=prep.request_id,
            created=int(time.time()),
            model=self.settings.model_name,
            choices=choices,
            usage=_usage(prep, finals),
        )

    # ---------------------------------------------------------------- preparing
    def _check_common(self, body: RequestBody) -> None:
        if body.model != self.settings.model_name:
            raise ApiError(
                404,
                f"model {body.model!r} does not exist; this server serves "
                f"{self.settings.model_name!r}",
                "not_found_error",
                "model",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(body, name) != 0:
                raise _bad(f"{name} is not supported (only 0)", name)
        if body.logit_bias:
            raise _bad("logit_bias is not supported", "logit_bias")
        if body.stream_options is not None and not body.stream:
            raise _bad("stream_options needs stream=true", "stream_options")

    def _completion_prompt(
        self, prompt: str | list[int] | list[str] | list[list[int]]
    ) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise _bad("prompt is an empty string", "prompt")
            return self.tokenizer.encode(prompt)
        if prompt and all(isinstance(x, int) for x in prompt):
            return [int(x) for x in prompt]  # type: ignore[arg-type]
        first = prompt[0] if len(prompt) == 1 else None
        if isinstance(first, str | list):  # a batch of one
            return self._completion_prompt(first)
        raise _bad("prompt must be one string or one list of token ids (no batches)", "prompt")

    def _prepare(
        self,
        body: RequestBody,
        prompt: list[int],
        max_tokens: int | None,
        logprobs: bool,
        prefix: str,
    ) -> _Prepared:
        max_len = self.loop.max_model_len
        if len(prompt) >= max_len:
            raise _bad(
                f"prompt has {len(prompt)} tokens; the model's context (max_model_len) is "
                f"{max_len}, which leaves no room for output",
                "messages" if prefix == "chatcmpl" else "prompt",
            )
        room = max_len - len(prompt)
        if max_tokens is None:
            max_tokens = room
        elif max_tokens > room:
            raise _bad(
                f"max_tokens {max_tokens} + the prompt's {len(prompt)} tokens exceed the "
                f"model's context ({max_len})",
                "max_tokens",
            )
        try:
            params = SamplingParams(
                n=body.n,
                max_tokens=max_tokens,
                temperature=body.temperature,
                top_k=body.top_k,
                top_p=body.top_p,
                seed=body.seed,
                stop=body.stop_strings(),
                stop_token_ids=tuple(body.stop_token_ids or ()),
                ignore_eos=body.ignore_eos,
                logprobs=logprobs,
            )
        except InvalidSamplingParams as e:
            raise _bad(str(e), e.field) from None
        usage = body.stream_options is not None and body.stream_options.include_usage
        rid = f"{prefix}-{uuid.uuid4().hex}"
        return _Prepared(prompt, params, rid, usage, body.return_tokens_as_token_ids)

    async def _submit(self, prep: _Prepared, prompt_param: str) -> Any:
        try:
            return await self.loop.submit(prep.prompt, prep.params, prep.request_id)
        except RefserveError as e:
            raise engine_error(e, prompt_param) from None

    # ---------------------------------------------------------------- streams
    def _record(self, marks: _Marks, last: RequestOutput | None) -> None:
        """The stream ended: record its checkpoints (one sample's; ``last`` its final
        output, whose metrics hold the engine's token times)."""
        if last is None or not marks.taken_s or last.metrics.ttft_ms is None:
            return
        engine = last.metrics.token_times_ms
        self.timings.add(
            marks.received_s,
            marks.queued_s,
            marks.submitted_s,
            marks.taken_s[0],
            last.metrics.ttft_ms,
            marks.client_id,
            tuple(t - engine[0] for t in engine),
            tuple((t - marks.taken_s[0]) * 1e3 for t in marks.taken_s),
            marks.added_s,
        )

    async def _completion_stream(
        self,
        prep: _Prepared,
        q: asyncio.Queue[RequestOutput | BaseException],
        n: int,
        marks: _Marks,
    ) -> AsyncIterator[str]:
        finals: list[RequestOutput] = []

        def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> str:
            return _event(
                CompletionChunk(
                    id=prep.request_id,
                    created=int(time.time()),
                    model=self.settings.model_name,
                    choices=choices,
                    usage=usage,
                ),
                prep.include_usage,
            )

        last: RequestOutput | None = None
        async for o in _outputs(self.loop, prep.request_id, q, n):
            if o.finished:
                finals.append(o)
            if not o.new_text and not o.finished:
                continue
            marks.taken_s.append(time.perf_counter())
            if o.finished and o.index == 0:
                last = o
            lp = self._completion_logprobs(o, prep, new=True) if prep.params.logprobs else None
            yield chunk(
                [
                    CompletionChoice(
                        index=o.index,
                        text=o.new_text,
                        logprobs=lp,
                        finish_reason=o.finish_reason,
                        stop_reason=o.stop_reason,
                    )
                ]
            )
        self._record(marks, last)
        if prep.include_usage:
            yield chunk([], _usage(prep, finals))
        yield "data: [DONE]\n\n"

    async def _chat_stream(
        self,
        prep: _Prepared,
        q: asyncio.Queue[RequestOutput | BaseException],
        n: int,
        marks: _Marks,
    ) -> AsyncIterator[str]:
        finals: list[RequestOutput] = []

        def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
            return _event(
                ChatCompletionChunk(
                    id=prep.request_id,
                    created=int(time.time()),
                    model=self.settings.model_name,
                    choices=choices,
                    usage=usage,
                ),
                prep.include_usage,
            )

        for i in range(n):  # OpenAI's first chunk of each choice names the role
            yield chunk([ChatChunkChoice(index=i, delta=Delta(role="assistant", content=""))])
        last: RequestOutput | None = None
        async for o in _outputs(self.loop, prep.request_id, q, n):
            if o.finished:
                finals.append(o)
            if not o.new_text and not o.finished:
                continue
            marks.taken_s.append(time.perf_counter())
            if o.finished and o.index == 0:
                last = o
            lp = self._chat_logprobs(o, prep, new=True) if prep.params.logprobs else None
            delta = Delta(content=o.new_text) if o.new_text else Delta()
            yield chunk(
                [
                    ChatChunkChoice(
                        index=o.index, delta=delta, logprobs=lp, finish_reason=o.finish_reason
                    )
                ]
            )
        self._record(marks, last)
        if prep.include_usage:
            yield chunk([], _usage(prep, finals))
        yield "data: [DONE]\n\n"

    # ---------------------------------------------------------------- logprobs
    def _token_pieces(
        self, o: RequestOutput, prep: _Prepared, new: bool
    ) -> list[tuple[str, float]]:
        ids = o.new_token_ids if new else o.token_ids
        lps = (o.new_logprobs if new else o.logprobs) or ()

        def name(t: int) -> str:
            return f"token_id:{t}" if prep.token_ids_as_text else self.tokenizer.decode([t])

        return [(name(t), float(lp)) for t, lp in zip(ids, lps, strict=False)]

    def _completion_logprobs(
        self, o: RequestOutput, prep: _Prepared, new: bool = False
    ) -> CompletionLogprobs:
        pieces = self._token_pieces(o, prep, new)
        offsets, at = [], 0
        for text, _ in pieces:
            offsets.append(at)
            at += len(text)
        return CompletionLogprobs(
            tokens=[t for t, _ in pieces],
            token_logprobs=[lp for _, lp in pieces],
            top_logprobs=None,
            text_offset=offsets,
        )

    def _chat_logprobs(self, o: RequestOutput, prep: _Prepared, new: bool = False) -> ChatLogprobs:
        pieces = self._token_pieces(o, prep, new)
        return ChatLogprobs(
            content=[
                TokenLogprob(token=t, logprob=lp, bytes=list(t.encode("utf-8", "replace")))
                for t, lp in pieces
            ]
        )


def _content(content: object) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    assert isinstance(content, list)
    return "".join(part.text for part in content)


def _usage(prep: _Prepared, finals: list[RequestOutput]) -> Usage:
    out = sum(len(o.token_ids) for o in finals)
    return Usage(
        prompt_tokens=len(prep.prompt), completion_tokens=out, total_tokens=len(prep.prompt) + out
    )


def _event(model: BaseModel, include_usage: bool) -> str:
    # OpenAI sends "usage": null on every chunk when usage was asked for, none otherwise.
    doc = model.model_dump(exclude_none=False)
    if not include_usage:
        doc.pop("usage", None)
    return f"data: {json.dumps(doc, separators=(',', ':'))}\n\n"


async def _guarded(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """The stream, or, if the engine fails mid-stream (the status line is already sent),
    an OpenAI error event and the end of the stream."""
    try:
        async for event in events:
            yield event
    except ApiError as e:
        yield f"data: {json.dumps(error_body(e.status, e.message, e.kind, e.param))}\n\n"
        yield "data: [DONE]\n\n"


def _sse(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        _guarded(events), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


async def _outputs(
    loop: ServingLoop,
    request_id: str,
    q: asyncio.Queue[RequestOutput | BaseException],
    n: int,
) -> AsyncIterator[RequestOutput]:
    """The request's outputs until each of its ``n`` samples finished. If the consumer
    stops early (a client disconnect cancels it; the server shuts down), the request is
    aborted on the engine thread, which frees its blocks."""
    finished = 0
    try:
        while finished < n:
            item = await q.get()
            if isinstance(item, ReplicaDead):  # its replica died: the request ended there
                raise ApiError(503, str(item), "service_unavailable")
            if isinstance(item, BaseException):
                raise ApiError(500, str(item), "internal_error")
            if item.finished:
                finished += 1
            yield item
    finally:
        if finished < n:
            loop.abort(request_id)


async def _collect(
    loop: ServingLoop,
    request_id: str,
    q: asyncio.Queue[RequestOutput | BaseException],
    n: int,
    request: Request,
) -> list[RequestOutput]:
    """The final outputs of a non-streamed request. A client that goes away meanwhile
    (Starlette does not cancel a non-streaming handler) is noticed within
    :data:`DISCONNECT_POLL_S`; the request is then aborted like a dropped stream."""

    async def finals() -> list[RequestOutput]:
        out = [o async for o in _outputs(loop, request_id, q, n) if o.finished]
        return sorted(out, key=lambda o: o.index)

    task = asyncio.ensure_future(finals())
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()  # _outputs' finally aborts the request
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise ApiError(499, "the client closed the request", "client_closed_request")
