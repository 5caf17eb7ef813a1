"""refserve serve under hostile or unlucky clients: disconnects free blocks at once, a
full queue answers 429, bad requests answer 400 naming the field while a running request
is untouched, the API key guards everything but /health, bodies are bounded, SIGTERM
drains and exits 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from serve_helpers import MODEL, TIMEOUT_S, client, sse_events, start

from refserve.engine.llm_engine import LLMEngine
from refserve.serve.server import ServerThread

LONG = 300  # output tokens of a request that is still running while the test probes


@pytest.fixture(scope="module")
def narrow() -> Iterator[ServerThread]:
    """One running slot and one waiting slot: easy to fill."""
    handle = start(max_num_seqs=1, max_waiting=1, api_key=None)
    yield handle
    handle.stop()


def _pool(handle: ServerThread) -> tuple[int, int, int]:
    """(free blocks, live requests, in-flight sinks), read on the engine thread."""
    loop = handle.server.loop

    def read() -> tuple[int, int, int]:
        e = loop.engine
        return e.scheduler.pool.num_free_blocks, len(e.scheduler.requests), loop.num_in_flight

    return loop.run_sync(read).result(timeout=TIMEOUT_S)


def _wait_for(pred: Any, timeout_s: float = 10.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.02)
    return False


def _body(**kw: object) -> dict[str, object]:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": LONG, "temperature": 0, **kw}


def test_disconnect_aborts_and_frees_blocks(narrow: ServerThread) -> None:
    free_before, live_before, _ = _pool(narrow)
    assert live_before == 0
    aborted = _aborted(narrow)
    with httpx.stream(
        "POST",
        f"{narrow.base_url}/v1/completions",
        json=_body(stream=True, prompt="x" * 100),
        timeout=TIMEOUT_S,
    ) as r:
        events = sse_events(r)
        next(events), next(events)  # the request is running, its blocks are taken
        free_mid, live_mid, _ = _pool(narrow)
        assert live_mid == 1 and free_mid < free_before
    # The client closed the connection mid-stream.
    assert _wait_for(lambda: _pool(narrow) == (free_before, 0, 0)), _pool(narrow)
    assert _aborted(narrow) == aborted + 1


def _aborted(handle: ServerThread) -> float:
    """``vllm:request_success_total{finished_reason="abort"}`` from /metrics."""
    text = httpx.get(f"{handle.base_url}/metrics", timeout=TIMEOUT_S).text
    for line in text.splitlines():
        if line.startswith("vllm:request_success_total{") and 'finished_reason="abort"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_non_streaming_disconnect_aborts_too(narrow: ServerThread) -> None:
    free_before, _, _ = _pool(narrow)
    aborted = _aborted(narrow)
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(f"{narrow.base_url}/v1/completions", json=_body(max_tokens=1500), timeout=0.5)
    assert _wait_for(lambda: _pool(narrow) == (free_before, 0, 0)), _pool(narrow)
    assert _aborted(narrow) == aborted + 1  # aborted, not run to its 1500 tokens


def _running_stream(
    handle: ServerThread, result: dict[str, Any], started: threading.Event | None = None
) -> threading.Thread:
    """A long streaming request in the background; its text lands in ``result``;
    ``started`` is set when its first event arrived."""

    def run() -> None:
        with httpx.stream(
            "POST", f"{handle.base_url}/v1/completions", json=_body(stream=True), timeout=TIMEOUT_S
        ) as r:
            parts, reason = [], None
            for e in sse_events(r):
                if started is not None:
                    started.set()
                for ch in e["choices"]:
                    parts.append(ch["text"])
                    reason = ch["finish_reason"] or reason
            result["text"], result["reason"] = "".join(parts), reason

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_full_queue_answers_429(narrow: ServerThread) -> None:
    result: dict[str, Any] = {}
    running = _running_stream(narrow, result)
    assert _wait_for(lambda: _pool(narrow)[1] == 1)
    url = f"{narrow.base_url}/v1/completions"
    waiting = threading.Thread(
        target=lambda: httpx.post(url, json=_body(max_tokens=2), timeout=TIMEOUT_S), daemon=True
    )
    waiting.start()
    assert _wait_for(lambda: _pool(narrow)[1] == 2)
    r = httpx.post(url, json=_body(max_tokens=2), timeout=TIMEOUT_S)
    assert r.status_code == 429
    assert r.json()["error"]["type"] == "rate_limit_error"
    assert "wait" in r.json()["error"]["message"]
    running.join(TIMEOUT_S)
    waiting.join(TIMEOUT_S)
    assert result["reason"] == "length"


BAD_REQUESTS: list[tuple[str, object, str | None]] = [
    ("top_p", _body(top_p=2), "top_p"),
    ("n", _body(n=0), "n"),
    ("temperature tiny", _body(temperature=1e-7), "temperature"),
    ("temperature type", _body(temperature="hot"), "temperature"),
    ("max_tokens", _body(max_tokens=0), "max_tokens"),
    ("stop type", _body(stop=[1, 2]), "stop"),
    ("seed", _body(seed=-1), "seed"),
    ("penalty", _body(presence_penalty=1.0), "presence_penalty"),
    ("prompt too long", _body(prompt="x" * 5000, max_tokens=1), "prompt"),
    ("max_tokens over context", _body(max_tokens=100_000), "max_tokens"),
    ("token id out of vocab", _body(prompt=[1, 99999]), "prompt"),
    ("missing prompt", {"model": MODEL}, "prompt"),
    ("empty prompt", _body(prompt=""), "prompt"),
    ("not an object", [1, 2], None),
]


@pytest.mark.parametrize(
    ("case", "body", "param"), BAD_REQUESTS, ids=[c for c, _, _ in BAD_REQUESTS]
)
def test_bad_request_answers_400_naming_the_field(
    server: ServerThread, case: str, body: object, param: str | None
) -> None:
    r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=TIMEOUT_S)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == 400
    if param is not None:
        assert err["param"] is not None and err["param"].split(".")[0] == param, err


def test_bad_requests_leave_a_running_request_untouched(
    server: ServerThread, reference: LLMEngine
) -> None:
    from refserve.model.sampler import SamplingParams

    result: dict[str, Any] = {}
    running = _running_stream(server, result)
    assert _wait_for(lambda: server.server.loop.num_in_flight == 1)
    url = f"{server.base_url}/v1/completions"
    headers = {"content-type": "application/json"}
    malformed = httpx.post(url, content=b'{"model": "tiny", "prompt": ', headers=headers)
    assert malformed.status_code == 400 and "JSON" in malformed.json()["error"]["message"]
    for _, body, _ in BAD_REQUESTS:
        assert httpx.post(url, json=body, timeout=TIMEOUT_S).status_code == 400
    unknown = httpx.post(url, json=_body(model="gpt-4"), timeout=TIMEOUT_S)
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"
    running.join(TIMEOUT_S)
    (want,) = reference.generate(["Hello"], SamplingParams(max_tokens=LONG))
    assert (
        result["text"] == want.outputs[0].text and result["reason"] == want.outputs[0].finish_reason
    )


def test_api_key_and_body_bound() -> None:
    handle = start(api_key="s3cret", max_body_bytes=4096)
    try:
        base = handle.base_url
        assert httpx.get(f"{base}/health", timeout=TIMEOUT_S).status_code == 200
        for path in ("/v1/models", "/metrics"):
            r = httpx.get(f"{base}{path}", timeout=TIMEOUT_S)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            wrong = {"Authorization": "Bearer s3crex"}
            assert httpx.get(f"{base}{path}", headers=wrong, timeout=TIMEOUT_S).status_code == 401
        assert client(handle, api_key="s3cret").models.list().data[0].id == MODEL
        ok = {"Authorization": "Bearer s3cret"}
        r = httpx.post(
            f"{base}/v1/completions", json=_body(prompt="x" * 5000), headers=ok, timeout=TIMEOUT_S
        )
        assert r.status_code == 413

        def chunked() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
            yield b'{"model": "tiny", "prompt": "'
            yield b"x" * 5000
            yield b'"}'

        r = httpx.post(f"{base}/v1/completions", content=chunked(), headers=ok, timeout=TIMEOUT_S)
        assert r.status_code == 413 and "4096" in r.json()["error"]["message"]
        r = httpx.get(f"{base}/v1/nothing", headers=ok, timeout=TIMEOUT_S)
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    finally:
        handle.stop()


def test_sigterm_drains_and_exits_0() -> None:
    """The real command in a subprocess: a stream in flight when SIGTERM arrives still
    finishes (finish_reason length), then the process exits 0."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [
        sys.executable,
        "-m",
        "refserve.cli.main",
        "--debug",
        "serve",
        "--model",
        MODEL,
        "--port",
        "0",
    ]
    proc = subprocess.Popen(
        [*cmd, "--num-blocks", "64", "--drain-timeout", "20", "--torch-threads", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # "refserve: serving 'tiny' on http://127.0.0.1:P/v1"
        assert "serving" in line, line
        base = line.split(" on ")[1].strip().removesuffix("/v1")
        result: dict[str, Any] = {}
        holder = type("H", (), {"base_url": base})()
        started = threading.Event()
        stream = _running_stream(holder, result, started)  # type: ignore[arg-type]
        assert started.wait(TIMEOUT_S)  # the stream is under way
        proc.send_signal(signal.SIGTERM)
        stream.join(TIMEOUT_S)
        assert proc.wait(timeout=TIMEOUT_S) == 0
        assert result.get("reason") == "length", proc.stdout.read()
        assert "drained" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
