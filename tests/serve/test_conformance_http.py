"""``refserve conformance-http`` passes on ``refserve serve`` and finds each deliberately
broken server (the real app wrapped by a middleware that breaks one thing), and a server
that never answers is a bounded finding, not a hang."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

import pytest
from serve_helpers import MODEL, start

from refserve.cli.main import main
from refserve.serve.server import ServerThread

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Fix = Callable[[int, dict[str, Any], dict[str, Any]], tuple[int, dict[str, Any]]]


class Rewrite:
    """ASGI middleware: every JSON answer goes through ``fix(status, request, answer)``;
    streams pass untouched."""

    def __init__(self, app: Any, fix: Fix) -> None:
        self.app, self.fix = app, fix

    async def __call__(
        self, scope: Scope, receive: Callable[[], Awaitable[Message]], send: Any
    ) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = bytearray()

        async def tap() -> Message:
            m = await receive()
            request.extend(m.get("body", b""))
            return m

        start_msg: dict[str, Any] = {}
        body = bytearray()

        async def capture(m: Message) -> None:
            if m["type"] == "http.response.start":
                ctype = dict(m.get("headers", [])).get(b"content-type", b"")
                if not ctype.startswith(b"application/json"):
                    start_msg["pass"] = True
                    await send(m)
                    return
                start_msg.update(m)
                return
            if start_msg.get("pass") or m["type"] != "http.response.body":
                await send(m)
                return
            body.extend(m.get("body", b""))
            if m.get("more_body"):
                return
            try:
                req = json.loads(request) if request else {}
            except ValueError:
                req = {}
            status, doc = self.fix(
                start_msg["status"], req if isinstance(req, dict) else {}, json.loads(body)
            )
            data = json.dumps(doc).encode()
            headers = [(k, v) for k, v in start_msg["headers"] if k != b"content-length"]
            headers.append((b"content-length", str(len(data)).encode()))
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": data})

        await self.app(scope, tap, capture)


def miscount_usage(
    status: int, req: dict[str, Any], doc: dict[str, Any]
) -> tuple[int, dict[str, Any]]:
    if isinstance(doc.get("usage"), dict):
        doc["usage"]["completion_tokens"] += 1
        doc["usage"]["total_tokens"] += 1
    return status, doc


def leak_stop(status: int, req: dict[str, Any], doc: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    for ch in doc.get("choices", []):
        if ch.get("finish_reason") == "stop" and isinstance(ch.get("stop_reason"), str):
            ch["text"] += ch["stop_reason"]
    return status, doc


def crash_on_bad_input(
    status: int, req: dict[str, Any], doc: dict[str, Any]
) -> tuple[int, dict[str, Any]]:
    return (500 if status == 400 else status), doc


def _broken(fix: Fix) -> ServerThread:
    return start(wrap=lambda app: Rewrite(app, fix))


def _run(
    base_url: str, tmp_path: Path, *checks: str, timeout: float = 30.0
) -> tuple[int, dict[str, Any]]:
    out = tmp_path / "report.json"
    argv = [
        "conformance-http",
        "--base-url",
        base_url,
        "--model",
        MODEL,
        "--json",
        str(out),
        "--markdown",
        str(tmp_path / "report.md"),
        "--timeout",
        str(timeout),
    ]
    if checks:
        argv += ["--checks", *checks]
    code = main(argv)
    doc = json.loads(out.read_text())
    assert (tmp_path / "report.md").read_text().startswith("# conformance-http")
    return code, doc


def _status(doc: dict[str, Any]) -> dict[str, str]:
    return {r["check"]: r["status"] for r in doc["results"]}


def test_passes_on_refserve_serve(server: ServerThread, tmp_path: Path) -> None:
    code, doc = _run(server.base_url, tmp_path)
    assert code == 0, doc
    assert doc["format"] == "refserve-conformance-http" and doc["complete"]
    assert set(_status(doc).values()) == {"pass"}
    assert len(doc["results"]) == 11


@pytest.mark.parametrize(
    ("fix", "failing", "passing"),
    [
        (miscount_usage, "usage", "greedy"),
        (leak_stop, "stop_string", "greedy"),
        (crash_on_bad_input, "invalid_4xx", "seed"),
    ],
    ids=["miscounts-usage", "leaks-stop-string", "500-on-bad-input"],
)
def test_finds_the_broken_server(tmp_path: Path, fix: Fix, failing: str, passing: str) -> None:
    handle = _broken(fix)
    try:
        code, doc = _run(handle.base_url, tmp_path, failing, passing)
    finally:
        handle.stop()
    assert code == 1
    assert _status(doc) == {failing: "fail", passing: "pass"}
    (failure,) = [r["failure"] for r in doc["results"] if r["status"] == "fail"]
    assert failure["message"] and failure["request"] is not None


def test_a_hanging_server_is_a_bounded_finding(hanging: str, tmp_path: Path) -> None:
    t0 = time.monotonic()
    code, doc = _run(hanging, tmp_path, "models", "greedy", "stream", timeout=0.5)
    assert time.monotonic() - t0 < 20
    assert code == 1
    assert _status(doc) == {"models": "pass", "greedy": "fail", "stream": "fail"}
    assert all("within 0.5 s" in r["failure"]["message"] for r in doc["results"] if "failure" in r)
