"""Running the app: the engine, its loop, uvicorn on a bound socket.

:func:`build_server` builds everything from an engine; :func:`serve_forever` runs it in
the calling (main) thread with SIGTERM draining; :class:`ServerThread` runs it in a
background thread on a free loopback port (the tests, the overlap measurement).

The socket is bound here, not by uvicorn, so that port 0 (any free port) works and the
real port is known before the first request: nothing polls for a port to open up.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from refserve.engine.llm_engine import LLMEngine
from refserve.errors import InvalidArgument
from refserve.serve.app import Guard, ServeSettings, create_app
from refserve.serve.chat import ChatTemplate, load_chat_template
from refserve.serve.cluster_loop import ClusterLoop
from refserve.serve.loop import EngineLoop, ServingLoop
from refserve.serve.metrics import ServerMetrics


@dataclass
class Server:
    """An app over a loop, and the uvicorn server that will run it (``engine``: None
    for a cluster, whose engines are its replicas')."""

    engine: LLMEngine | None
    loop: ServingLoop
    app: Guard
    settings: ServeSettings
    uvicorn: uvicorn.Server


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket; a port in use or a host that is not local is an error."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise InvalidArgument(f"--host {host} --port {port}: cannot bind: {e.strerror}") from None
    sock.listen(512)
    sock.set_inheritable(True)
    return sock


def build_server(
    engine: LLMEngine,
    settings: ServeSettings,
    *,
    model_dir: Path | None = None,
    chat_template: ChatTemplate | None = None,
    torch_threads: int | None = None,
) -> Server:
    metrics = ServerMetrics(settings.model_name)
    loop = EngineLoop(engine, metrics, torch_threads=torch_threads)
    template = chat_template if chat_template is not None else load_chat_template(model_dir)
    app = create_app(loop, settings, template, metrics)
    return Server(engine, loop, app, settings, _uvicorn(app, settings))


def build_cluster_server(
    loop: ClusterLoop,
    settings: ServeSettings,
    *,
    model_dir: Path | None = None,
    chat_template: ChatTemplate | None = None,
) -> Server:
    """The same app over a cluster of replicas (ref/serve/cluster_loop.py); ``/metrics``
    is the loop's :class:`~refserve.serve.metrics.ClusterServeMetrics` (empty if it has none)."""
    template = chat_template if chat_template is not None else load_chat_template(model_dir)
    app = create_app(loop, settings, template, loop.metrics)
    return Server(None, loop, app, settings, _uvicorn(app, settings))


def _uvicorn(app: Guard, settings: ServeSettings) -> uvicorn.Server:
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        lifespan="on",
        # uvicorn waits this long for in-flight responses after SIGTERM, then cancels
        # them (their requests are aborted); the lifespan's drain follows.
        timeout_graceful_shutdown=max(1, int(settings.drain_timeout_s)),
    )
    return uvicorn.Server(config)


def serve_forever(server: Server, sock: socket.socket) -> None:
    """Serve until SIGTERM or SIGINT, then drain and return (SIGINT: KeyboardInterrupt
    after the drain, so the CLI exits 130; SIGTERM: a normal return, exit 0)."""
    # uvicorn handles both signals while it runs, and when it is done it re-raises the
    # captured signal with the handler that was there before: a no-op for SIGTERM (a
    # drained server exits 0), Python's default for SIGINT (KeyboardInterrupt).
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        server.uvicorn.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)
        server.loop.shutdown(0.0)  # no-op after the lifespan drained it


class ServerThread:
    """The server on a free loopback port in a background thread; a context manager
    that stops it (drain included) on exit."""

    def __init__(self, server: Server, host: str = "127.0.0.1", port: int = 0) -> None:
        self.server = server
        self.sock = bind(host, port)
        self.port: int = self.sock.getsockname()[1]
        self.base_url = f"http://{host}:{self.port}"
        self._thread = threading.Thread(
            target=server.uvicorn.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    def start(self, timeout_s: float = 30.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        self.server.uvicorn.should_exit = True
        self._thread.join(timeout=timeout_s)
        self.server.loop.shutdown(0.0)
        with contextlib.suppress(OSError):
            self.sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
