"""A defensive HTTP client for the checks: every call bounded in time, every answer read
as untrusted JSON. Whatever goes wrong (a timeout, a refused connection, a body that is not
JSON, a field missing or of the wrong type) raises :class:`Finding` with the request that
caused it, which the runner records as a failure of the check in progress."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

#: The most bytes of a server answer quoted in a finding.
QUOTE_CHARS = 300


class Finding(Exception):
    """A check failed: what was expected, what was seen, and the request."""

    def __init__(
        self,
        message: str,
        *,
        expected: object = None,
        seen: object = None,
        request: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.expected = expected
        self.seen = seen
        self.request = request


def quote(value: object) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= QUOTE_CHARS else text[: QUOTE_CHARS - 3] + "..."


@dataclass
class Answer:
    status: int
    body: Any  # parsed JSON, or None when the body was not JSON
    text: str


@dataclass
class Stream:
    """A server-sent-event stream: its events (parsed JSON) and whether ``[DONE]`` came."""

    status: int
    events: list[Any] = field(default_factory=list)
    done: bool = False


class ServerClient:
    def __init__(self, base_url: str, *, timeout_s: float, api_key: str | None = None) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._http = httpx.Client(
            base_url=self.base_url, timeout=httpx.Timeout(timeout_s), headers=headers
        )

    def close(self) -> None:
        self._http.close()

    def get(self, path: str) -> Answer:
        return self._call("GET", path, None)

    def post(self, path: str, body: dict[str, Any]) -> Answer:
        return self._call("POST", path, body)

    def post_raw(self, path: str, content: bytes) -> Answer:
        try:
            r = self._http.post(path, content=content, headers={"content-type": "application/json"})
        except httpx.HTTPError as e:
            raise Finding(f"POST {path} (raw body): {type(e).__name__}: {e}") from None
        return _answer(r)

    def _call(self, method: str, path: str, body: dict[str, Any] | None) -> Answer:
        try:
            r = self._http.request(method, path, json=body)
        except httpx.TimeoutException:
            raise Finding(
                f"{method} {path}: no answer within {self.timeout_s:g} s", request=body
            ) from None
        except httpx.HTTPError as e:
            raise Finding(f"{method} {path}: {type(e).__name__}: {e}", request=body) from None
        return _answer(r)

    def stream(self, path: str, body: dict[str, Any]) -> Stream:
        """POST and read the server-sent events up to ``[DONE]`` (bounded in time: the
        whole stream, not just each read)."""
        out: Stream
        try:
            with self._http.stream("POST", path, json=body) as r:
                out = Stream(r.status_code)
                if r.status_code != 200:
                    r.read()
                    return out
                for event in _events(r.iter_lines(), body):
                    if event is None:
                        out.done = True
                        break
                    out.events.append(event)
        except httpx.TimeoutException:
            raise Finding(
                f"POST {path} (stream): no complete stream within {self.timeout_s:g} s",
                request=body,
            ) from None
        except httpx.HTTPError as e:
            raise Finding(f"POST {path} (stream): {type(e).__name__}: {e}", request=body) from None
        return out


def _answer(r: httpx.Response) -> Answer:
    text = r.text
    try:
        body = json.loads(text) if text else None
    except ValueError:
        body = None
    return Answer(r.status_code, body, text)


def _events(lines: Iterator[str], request: dict[str, Any]) -> Iterator[Any]:
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            yield None
            return
        try:
            yield json.loads(data)
        except ValueError:
            raise Finding("a stream event is not JSON", seen=quote(data), request=request) from None


def need(doc: Any, *path: str | int, kind: type | tuple[type, ...] = object) -> Any:
    """``doc[path...]``, of type ``kind``, or a :class:`Finding` naming the path."""
    at: Any = doc
    where = "body"
    for key in path:
        where += f"[{key!r}]" if isinstance(key, str) else f"[{key}]"
        ok = (isinstance(key, str) and isinstance(at, dict) and key in at) or (
            isinstance(key, int) and isinstance(at, list) and -len(at) <= key < len(at)
        )
        if not ok:
            raise Finding(f"the answer has no {where}", seen=quote(doc))
        at = at[key]
    if not isinstance(at, kind) or (kind is int and isinstance(at, bool)):
        raise Finding(
            f"{where} is {type(at).__name__}, expected {getattr(kind, '__name__', kind)}",
            seen=quote(at),
        )
    return at
