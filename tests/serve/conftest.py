"""Fixtures of the server tests: refserve serve in a background thread on a free
loopback port (``ServerThread``), stopped (drained) when the fixture ends.

Every server here binds 127.0.0.1 port 0, serves a bounded number of requests and is
stopped by its fixture; every client call has a timeout.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import uvicorn
from fastapi import FastAPI

# The transformers oracle of the engine tests (tests/engine/hf_oracle.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

from serve_helpers import MODEL, start

from refserve.core.config import SchedulerConfig
from refserve.engine.llm_engine import LLMEngine
from refserve.serve.server import ServerThread, bind


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Every engine here (the servers' and the references) on one torch thread, put back
    after. torch's OpenMP workers spin while they wait: with two engines in one process
    on a shared 2-core machine, a 300-token reference run went from 1.5 s to 20 s."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    handle = start()
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def reference() -> LLMEngine:
    """The same model in-process: what the server must answer."""
    return LLMEngine(MODEL, scheduler_config=SchedulerConfig(block_size=16, num_blocks=128))


@pytest.fixture
def hanging() -> Iterator[str]:
    """A server whose every endpoint but /v1/models sleeps for an hour."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    @app.post("/v1/completions")
    async def never() -> None:
        await asyncio.sleep(3600)

    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30.0
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the hanging server did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(10)
    sock.close()
