"""The checks of ``refserve conformance-http`` (docs/GUIDE.md, "Checking any OpenAI-
compatible server"). Each takes the :class:`Context` and returns a note (or ``None``)
when it passes; it raises :class:`~refserve.conformance.http.client.Finding` when the server is
wrong, and :class:`NotSupported` when the server refuses a feature the check needs (that
is not a failure: the report says which).

The reference is an engine on the same checkpoint, run in-process, seen through
:class:`Reference` (its greedy answers and its context length): greedy outputs, token
counts and stop-string cuts are compared with it. ``refserve conformance-http`` hands in
refserve's own engine (ref/cli/conformance_http.py); the checks import no engine. Token
ids are compared when the server names them in logprobs (vLLM's
``return_tokens_as_token_ids``, which refserve serve also implements); text otherwise.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from refserve.conformance.http.client import Finding, ServerClient, need, quote

#: Prompts of the greedy checks: short, varied, plain ASCII (any tokenizer has them).
DEFAULT_PROMPTS = (
    "Hello",
    "The quick brown fox",
    "Count to four.",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3,",
)


class NotSupported(Exception):
    """The server refused something the check needs (not a conformance failure)."""


@dataclass(frozen=True)
class Expected:
    """The reference engine's greedy answer to one prompt."""

    prompt: str
    prompt_tokens: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str


class Reference(Protocol):
    """What the checks need of the reference engine (module doc)."""

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt and output) it takes."""
        ...

    def greedy(self, prompt: str, max_tokens: int, stop: tuple[str, ...]) -> Expected:
        """Its greedy answer to ``prompt``: at most ``max_tokens`` tokens, cut at the
        first of the ``stop`` strings."""
        ...


@dataclass
class Context:
    client: ServerClient
    model: str
    reference: Reference
    prompts: tuple[str, ...] = DEFAULT_PROMPTS
    max_tokens: int = 16
    _expected: dict[tuple[str, int, tuple[str, ...]], Expected] = field(default_factory=dict)
    # The server's own greedy answers (text), for batch invariance.
    alone: dict[str, str] = field(default_factory=dict)

    def expected(
        self, prompt: str, max_tokens: int | None = None, stop: tuple[str, ...] = ()
    ) -> Expected:
        n = self.max_tokens if max_tokens is None else max_tokens
        key = (prompt, n, stop)
        if key not in self._expected:
            self._expected[key] = self.reference.greedy(prompt, n, stop)
        return self._expected[key]

    def body(self, prompt: str, **kw: Any) -> dict[str, Any]:
        return {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": self.max_tokens,
            "temperature": 0,
            **kw,
        }

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        """A non-streamed completion that must succeed (200 with a JSON object)."""
        a = self.client.post("/v1/completions", body)
        if a.status != 200 or not isinstance(a.body, dict):
            raise Finding(
                f"POST /v1/completions answered {a.status}",
                expected="200 with a JSON object",
                seen=quote(a.text),
                request=body,
            )
        return a.body


def _choice_text(doc: dict[str, Any], i: int = 0) -> str:
    text: str = need(doc, "choices", i, "text", kind=str)
    return text


def _token_ids(doc: dict[str, Any]) -> tuple[int, ...] | None:
    """Token ids from ``logprobs.tokens`` when the server names them ``token_id:N``."""
    lp = (
        doc.get("choices", [{}])[0].get("logprobs")
        if isinstance(doc.get("choices"), list)
        else None
    )
    tokens = lp.get("tokens") if isinstance(lp, dict) else None
    if not isinstance(tokens, list) or not all(
        isinstance(t, str) and t.startswith("token_id:") and t[9:].lstrip("-").isdigit()
        for t in tokens
    ):
        return None
    return tuple(int(t[9:]) for t in tokens)


def _fail(message: str, expected: object, seen: object, request: dict[str, Any]) -> Finding:
    return Finding(message, expected=quote(expected), seen=quote(seen), request=request)


# --------------------------------------------------------------------- the checks
def check_models(ctx: Context) -> str | None:
    a = ctx.client.get("/v1/models")
    if a.status != 200:
        raise Finding(f"GET /v1/models answered {a.status}", seen=quote(a.text))
    ids = [need(m, "id", kind=str) for m in need(a.body, "data", kind=list)]
    if ctx.model not in ids:
        raise Finding("the served model is not listed", expected=ctx.model, seen=quote(ids))
    return None


def check_greedy(ctx: Context) -> str | None:
    """Greedy completions equal the reference: token ids when named, else text."""
    compared_ids = 0
    for prompt in ctx.prompts:
        want = ctx.expected(prompt)
        body = ctx.body(prompt, logprobs=0, return_tokens_as_token_ids=True)
        a = ctx.client.post("/v1/completions", body)
        if a.status != 200:  # a server without logprobs: text only
            body = ctx.body(prompt)
            doc = ctx.complete(body)
        else:
            doc = need(a.body, kind=dict)
        text = _choice_text(doc)
        ctx.alone[prompt] = text
        ids = _token_ids(doc)
        if ids is not None:
            compared_ids += 1
            if ids != want.token_ids:
                raise _fail("greedy token ids differ from the reference", want.token_ids, ids, body)
        if text != want.text:
            raise _fail("greedy text differs from the reference", want.text, text, body)
    how = f"token ids compared for {compared_ids}/{len(ctx.prompts)} prompts, text for all"
    return how


def check_usage(ctx: Context) -> str | None:
    for prompt in ctx.prompts:
        want = ctx.expected(prompt)
        body = ctx.body(prompt)
        doc = ctx.complete(body)
        usage = need(doc, "usage", kind=dict)
        got = {
            k: need(usage, k, kind=int)
            for k in ("prompt_tokens", "completion_tokens", "total_tokens")
        }
        real = {
            "prompt_tokens": want.prompt_tokens,
            "completion_tokens": len(want.token_ids),
            "total_tokens": want.prompt_tokens + len(want.token_ids),
        }
        if got != real:
            raise _fail("usage does not count the real tokens", real, got, body)
    return None


def check_max_tokens(ctx: Context) -> str | None:
    limit = 3
    checked = 0
    for prompt in ctx.prompts:
        want = ctx.expected(prompt, limit)
        if want.finish_reason != "length":
            continue  # the reference stops earlier: not a test of max_tokens
        body = ctx.body(prompt, max_tokens=limit)
        doc = ctx.complete(body)
        reason = need(doc, "choices", 0, "finish_reason", kind=str)
        n = need(doc, "usage", "completion_tokens", kind=int)
        if reason != "length" or n != limit:
            raise _fail(
                f"max_tokens={limit} not respected",
                {"finish_reason": "length", "completion_tokens": limit},
                {"finish_reason": reason, "completion_tokens": n},
                body,
            )
        checked += 1
    if not checked:
        raise NotSupported("every reference output stopped within 3 tokens")
    return None


def check_stop_string(ctx: Context) -> str | None:
    checked = 0
    for prompt in ctx.prompts:
        text = ctx.expected(prompt).text
        if len(text) < 6 or not text[3:5].strip():
            continue
        stop = text[3:5]
        want = ctx.expected(prompt, stop=(stop,))
        body = ctx.body(prompt, stop=[stop])
        doc = ctx.complete(body)
        got = _choice_text(doc)
        reason = need(doc, "choices", 0, "finish_reason", kind=str)
        if stop in got:
            raise _fail(f"the stop string {stop!r} is in the output", want.text, got, body)
        if got != want.text or reason != "stop":
            raise _fail(
                "a stop string must end the output, excluded, with finish_reason 'stop'",
                {"text": want.text, "finish_reason": "stop"},
                {"text": got, "finish_reason": reason},
                body,
            )
        checked += 1
    if not checked:
        raise NotSupported("no reference output long enough to cut")
    return None


def _check_chunk(event: Any, i: int, body: dict[str, Any]) -> list[tuple[int, str, Any]]:
    """(index, text, finish_reason) of each choice of one completion chunk; the chunk's
    shape is checked on the way."""
    if not isinstance(event, dict) or event.get("object") != "text_completion":
        raise _fail(
            f"stream chunk {i} is not a text_completion chunk",
            "object: text_completion",
            event,
            body,
        )
    out = []
    for ch in need(event, "choices", kind=list):
        index = need(ch, "index", kind=int)
        text = need(ch, "text", kind=str)
        reason = ch.get("finish_reason") if isinstance(ch, dict) else None
        out.append((index, text, reason))
    return out


def check_stream(ctx: Context) -> str | None:
    for prompt in ctx.prompts[:3]:
        for stop in ((), (ctx.expected(prompt).text[2:4],)):
            if stop and not stop[0]:
                continue
            _check_one_stream(ctx, prompt, stop)
    return None


@dataclass(frozen=True)
class _Streamed:
    """What a stream said: the deltas joined, each chunk's finish_reason, the usage."""

    text: str
    reasons: list[object]
    usage: object


def _check_one_stream(ctx: Context, prompt: str, stop: tuple[str, ...]) -> None:
    """One streamed completion against the same request not streamed: the deltas make
    its text, only the last chunk has its finish_reason, and the usage is the same."""
    extra: dict[str, Any] = {"stop": list(stop)} if stop else {}
    full = ctx.complete(ctx.body(prompt, **extra))
    body = ctx.body(prompt, stream=True, stream_options={"include_usage": True}, **extra)
    got = _read_stream(ctx, body)
    want_text = _choice_text(full)
    if got.text != want_text:
        raise _fail("streamed deltas do not concatenate to the text", want_text, got.text, body)
    reasons, want_reason = got.reasons, full["choices"][0].get("finish_reason")
    if not reasons or reasons[-1] != want_reason:
        raise _fail("the last chunk's finish_reason differs", want_reason, reasons[-1:], body)
    if any(r is not None for r in reasons[:-1]):
        raise _fail("a chunk before the last has a finish_reason", None, reasons, body)
    if got.usage != full.get("usage"):
        raise _fail(
            "the stream's usage differs from the non-streamed usage",
            full.get("usage"),
            got.usage,
            body,
        )


def _read_stream(ctx: Context, body: dict[str, Any]) -> _Streamed:
    """Stream ``body``: a 200 that ends with ``data: [DONE]``, every chunk well formed."""
    s = ctx.client.stream("/v1/completions", body)
    if s.status != 200:
        raise _fail(f"streaming answered {s.status}", 200, s.status, body)
    if not s.done:
        raise _fail("the stream did not end with data: [DONE]", "[DONE]", "end of stream", body)
    parts: list[str] = []
    reasons: list[object] = []
    usage = None
    for i, event in enumerate(s.events):
        for _, text, reason in _check_chunk(event, i, body):
            parts.append(text)
            reasons.append(reason)
        if isinstance(event, dict) and event.get("usage"):
            usage = event["usage"]
    return _Streamed("".join(parts), reasons, usage)


def check_batch_invariance(ctx: Context) -> str | None:
    if not ctx.alone:
        for prompt in ctx.prompts:
            ctx.alone[prompt] = _choice_text(ctx.complete(ctx.body(prompt)))
    jobs = [p for p in ctx.prompts for _ in range(3)]

    def one(prompt: str) -> str:
        return _choice_text(ctx.complete(ctx.body(prompt)))

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        texts = list(pool.map(one, jobs))
    for prompt, text in zip(jobs, texts, strict=True):
        if text != ctx.alone[prompt]:
            raise _fail(
                f"greedy output under {len(jobs)} concurrent requests differs from alone",
                ctx.alone[prompt],
                text,
                ctx.body(prompt),
            )
    return f"{len(jobs)} concurrent requests"


def check_n(ctx: Context) -> str | None:
    body = ctx.body(ctx.prompts[0], n=3, temperature=1.0, seed=1234)
    doc = ctx.complete(body)
    choices = need(doc, "choices", kind=list)
    indices = sorted(need(c, "index", kind=int) for c in choices)
    if indices != [0, 1, 2]:
        raise _fail("n=3 must give choices 0, 1, 2", [0, 1, 2], indices, body)
    texts = {need(c, "text", kind=str) for c in choices}
    if len(texts) < 2:
        raise _fail("n=3 sampled choices are all the same text", "distinct samples", texts, body)
    return f"{len(texts)} distinct texts of 3"


def check_seed(ctx: Context) -> str | None:
    body = ctx.body(ctx.prompts[1 % len(ctx.prompts)], temperature=1.0, seed=42)
    first, second = _choice_text(ctx.complete(body)), _choice_text(ctx.complete(body))
    if first != second:
        raise _fail("the same seed gave different samples", first, second, body)
    return None


def check_invalid(ctx: Context) -> str | None:
    too_long = [1] * (ctx.reference.max_model_len + 16)
    cases: list[tuple[str, dict[str, Any] | bytes]] = [
        ("top_p > 1", ctx.body("Hello", top_p=2.0)),
        ("negative max_tokens", ctx.body("Hello", max_tokens=-1)),
        ("n = 0", ctx.body("Hello", n=0)),
        ("negative temperature", ctx.body("Hello", temperature=-1.0)),
        ("prompt longer than the context", ctx.body(too_long, max_tokens=1)),  # type: ignore[arg-type]
        ("wrong type", ctx.body("Hello", max_tokens="many")),
        ("missing prompt", {"model": ctx.model}),
        ("malformed JSON", b'{"model": "x", "prompt": '),
    ]
    for name, body in cases:
        if isinstance(body, bytes):
            a = ctx.client.post_raw("/v1/completions", body)
            shown: dict[str, Any] = {"raw": body.decode()}
        else:
            a, shown = ctx.client.post("/v1/completions", body), body
        if not 400 <= a.status < 500:
            raise _fail(
                f"invalid request ({name}) must answer 4xx",
                "4xx",
                f"{a.status} {quote(a.text)}",
                shown,
            )
    return f"{len(cases)} invalid requests"


def check_chat_stream(ctx: Context) -> str | None:
    messages = [{"role": "user", "content": ctx.prompts[0]}]
    body: dict[str, Any] = {
        "model": ctx.model,
        "messages": messages,
        "max_tokens": ctx.max_tokens,
        "temperature": 0,
    }
    a = ctx.client.post("/v1/chat/completions", body)
    if a.status in (400, 404, 405, 501):
        raise NotSupported(f"chat completions answered {a.status}")
    if a.status != 200:
        raise _fail("chat completions failed", 200, f"{a.status} {quote(a.text)}", body)
    content = need(a.body, "choices", 0, "message", "content", kind=str)
    s = ctx.client.stream("/v1/chat/completions", {**body, "stream": True})
    if s.status != 200 or not s.done:
        raise _fail("the chat stream did not complete", "200 and [DONE]", s.status, body)
    parts = []
    for event in s.events:
        for ch in need(event, "choices", kind=list):
            delta = need(ch, "delta", kind=dict)
            piece = delta.get("content")
            parts.append(piece if isinstance(piece, str) else "")
    if "".join(parts) != content:
        raise _fail(
            "chat stream deltas do not concatenate to the message", content, "".join(parts), body
        )
    return None


Check = Callable[[Context], "str | None"]

CHECKS: dict[str, Check] = {
    "models": check_models,
    "greedy": check_greedy,
    "usage": check_usage,
    "max_tokens": check_max_tokens,
    "stop_string": check_stop_string,
    "stream": check_stream,
    "batch_invariance": check_batch_invariance,
    "n": check_n,
    "seed": check_seed,
    "invalid_4xx": check_invalid,
    "chat_stream": check_chat_stream,
}
