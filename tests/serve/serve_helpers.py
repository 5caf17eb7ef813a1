"""Helpers of the server tests (imported by conftest and the test modules)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai

from ref.core.config import SchedulerConfig
from ref.engine.llm_engine import LLMEngine
from ref.serve.app import ServeSettings
from ref.serve.server import ServerThread, build_server

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
