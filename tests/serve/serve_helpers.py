"""Helpers of the server tests (imported by conftest and the test modules)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import openai

from refserve.cluster import InProcessReplica, Replica, Router
from refserve.cluster.disagg import Deflection, Roles
from refserve.core.config import SchedulerConfig
from refserve.engine.llm_engine import LLMEngine
from refserve.model.tokenizer import Tokenizer
from refserve.serve.app import ServeSettings
from refserve.serve.cluster_loop import ClusterLoop, ReplicaFactory
from refserve.serve.metrics import ClusterServeMetrics
from refserve.serve.server import ServerThread, build_cluster_server, build_server

MODEL = "tiny"
TIMEOUT_S = 30.0
PROMPTS = ["Hello", "The quick brown fox", "Count to four.", "a" * 40, "zz"]


def start(
    *,
    api_key: str | None = None,
    max_waiting: int = 64,
    max_num_seqs: int = 16,
    num_blocks: int = 128,
    model: str | Path = MODEL,
    name: str = MODEL,
    max_body_bytes: int = 1 << 20,
    wrap: Callable[[Any], Any] | None = None,
) -> ServerThread:
    """A server on a free loopback port, started; the caller stops it. ``wrap`` wraps
    the ASGI app (a deliberately broken server around the real one)."""
    engine = LLMEngine(
        model,
        scheduler_config=SchedulerConfig(
            block_size=16,
            num_blocks=num_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=256,
            max_waiting=max_waiting,
        ),
    )
    settings = ServeSettings(
        name, api_key=api_key, max_body_bytes=max_body_bytes, drain_timeout_s=5.0
    )
    # torch's thread count is left alone: conftest runs this directory on one thread.
    server = build_server(engine, settings)
    if wrap is not None:  # before start: uvicorn loads config.app when it runs
        server.uvicorn.config.app = wrap(server.uvicorn.config.app)
    return ServerThread(server).start()


def client(handle: ServerThread, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{handle.base_url}/v1", api_key=api_key, timeout=TIMEOUT_S, max_retries=0
    )


def sse_events(response: httpx.Response) -> Iterator[dict[str, Any]]:
    """The JSON events of a server-sent-event stream, up to ``[DONE]``."""
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        if data == "[DONE]":
            return
        yield json.loads(data)


def cluster_config(max_waiting: int = 64) -> SchedulerConfig:
    """The scheduler of :func:`start`'s engine, publishing its cache events (a replica)."""
    return SchedulerConfig(
        block_size=16,
        num_blocks=128,
        max_num_seqs=16,
        max_num_batched_tokens=256,
        max_waiting=max_waiting,
        cache_events=True,
    )


def start_cluster(
    replicas: Sequence[Replica],
    *,
    router: str = "round_robin",
    name: str = MODEL,
    tokenizer: Tokenizer | None = None,
    max_model_len: int | None = None,
    restart: ReplicaFactory | None = None,
    max_restarts: int = 0,
    roles: Roles | None = None,
    deflection: Deflection | None = None,
) -> ServerThread:
    """A cluster server (ref/serve/cluster_loop.py) over ``replicas`` on a free loopback
    port, started; the caller stops it. The tokenizer and context are the first
    replica's engine's unless given (a Ray replica has none here); ``restart`` and
    ``max_restarts`` are the loop's (a dead replica replaced), ``roles`` and
    ``deflection`` too (prefill/decode disaggregation)."""
    first = replicas[0]
    if tokenizer is None or max_model_len is None:
        assert isinstance(first, InProcessReplica)
        tokenizer, max_model_len = first.engine.tokenizer, first.engine.max_model_len
    loop = ClusterLoop(
        replicas,
        Router(router),
        tokenizer=tokenizer,
        max_model_len=max_model_len,
        scheduler_config=cluster_config(),
        metrics=ClusterServeMetrics(name),
        restart=restart,
        max_restarts=max_restarts,
        roles=roles,
        deflection=deflection,
    )
    server = build_cluster_server(loop, ServeSettings(name, drain_timeout_s=5.0))
    return ServerThread(server).start()


def cluster_loop(handle: ServerThread) -> ClusterLoop:
    loop = handle.server.loop
    assert isinstance(loop, ClusterLoop)
    return loop


def stream_completion(
    base_url: str, prompt: str, max_tokens: int, on_event: Callable[[dict[str, Any]], None]
) -> dict[str, Any]:
    """A greedy streamed completion; ``on_event`` sees each event as it arrives. Its
    request id, text, finish reason and any error event."""
    body = {
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": True,
    }  # fmt: skip
    out: dict[str, Any] = {"text": "", "reason": None, "error": None, "id": None}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=TIMEOUT_S) as r:
        for e in sse_events(r):
            on_event(e)
            if "error" in e:
                out["error"] = e["error"]
                continue
            out["id"] = e["id"]
            for ch in e["choices"]:
                out["text"] += ch["text"]
                out["reason"] = ch["finish_reason"] or out["reason"]
    return out


def metric(handle: ServerThread, name: str, **labels: str) -> float:
    """One sample of ``/metrics`` (0.0 when absent)."""
    text = httpx.get(f"{handle.base_url}/metrics", timeout=TIMEOUT_S).text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        key, value = line.rsplit(" ", 1)
        sample, _, rest = key.partition("{")
        got = ",".join(sorted(rest.rstrip("}").split(","))) if rest else ""
        if sample == name and got == want:
            return float(value)
    return 0.0
