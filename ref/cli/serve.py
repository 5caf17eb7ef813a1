"""``refserve serve``: the OpenAI-compatible HTTP server (:mod:`ref.serve`).

Wired into ``ref/cli/main.py`` (``add_serve_parser``); the scheduler's options come from
:mod:`ref.cli.config_args`, as ``simulate``'s do. Everything is checked before the
model is built: the options, the API key, the address (bound before the model loads, so
a port in use is one error line, not a traceback after a minute of loading). Binds
127.0.0.1 unless ``--host`` says otherwise. SIGTERM drains and exits 0; Ctrl-C drains
and exits 130.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from ref.cli.args import (
    add_command,
    add_device_args,
    add_speculative_args,
    check_device_args,
    finite_float,
    int_at_most,
    proposer_from_args,
)
from ref.cli.config_args import add_config_args, config_from_args
from ref.errors import InvalidArgument

#: The environment variable read when ``--api-key`` is not given.
API_KEY_ENV = "REFSERVE_API_KEY"
MAX_WAITING_DEFAULT = 256


def add_serve_parser(sub: Any) -> argparse.ArgumentParser:
    p = add_command(sub, "serve", "serve a model over the OpenAI HTTP API (FastAPI + uvicorn)")
    p.add_argument(
        "--model",
        default="tiny-trained",
        help="'tiny-trained' (default), 'tiny' (random weights) or a local HF checkpoint dir",
    )
    p.add_argument("--served-model-name", help="the name clients send (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument(
        "--port",
        type=int_at_most(65535, lo=0),
        default=8000,
        help="port to listen on; 0: any free one (default %(default)s)",
    )
    p.add_argument(
        "--api-key",
        help=f"require 'Authorization: Bearer KEY' on every endpoint but /health "
        f"(default: ${API_KEY_ENV} if set)",
    )
    p.add_argument(
        "--max-waiting",
        type=int_at_most(1 << 20, lo=1),
        default=MAX_WAITING_DEFAULT,
        help="queued requests beyond this answer 429 (default %(default)s)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int_at_most(1 << 30, lo=1024),
        default=4 << 20,
        metavar="BYTES",
        help="a request body larger than this answers 413 (default %(default)s; 1024 to "
        f"{1 << 30})",
    )
    p.add_argument(
        "--drain-timeout",
        type=finite_float(0, 3600),
        default=30.0,
        metavar="SECONDS",
        help="time in-flight requests get to finish after SIGTERM, then they are aborted "
        "(default %(default)s; at most 3600)",
    )
    p.add_argument(
        "--torch-threads",
        type=int_at_most(1024, lo=1),
        default=max(1, (os.cpu_count() or 2) - 1),
        help="torch intra-op threads of the engine (default: one core less than the "
        "machine's, left to the HTTP side: spinning torch workers starve it otherwise)",
    )
    add_device_args(p)
    add_speculative_args(p)
    add_config_args(p)
    p.set_defaults(func=run_serve, num_blocks=1024, max_model_len=1 << 20)
    return p


def _api_key(given: str | None) -> str | None:
    key = given if given is not None else os.environ.get(API_KEY_ENV)
    if key is None:
        return None
    if not key or not key.isprintable() or not key.isascii() or " " in key:
        raise InvalidArgument(
            "--api-key: must be non-empty printable ASCII without spaces (it travels in an "
            "HTTP header)"
        )
    return key


def run_serve(args: argparse.Namespace) -> int:
    check_device_args(args)
    key = _api_key(args.api_key)
    config = replace(config_from_args(args), max_waiting=args.max_waiting)
    name = args.served_model_name or str(args.model)

    from ref.serve.server import bind

    sock = bind(args.host, args.port)  # before the model loads: a busy port fails fast
    from ref.engine.llm_engine import LLMEngine
    from ref.serve.app import ServeSettings
    from ref.serve.server import build_server, serve_forever

    engine = LLMEngine(
        args.model,
        scheduler_config=config,
        attention_backend=args.attention_backend,
        device=args.device,
        check_invariants=args.check,
        proposer=proposer_from_args(args),
    )
    settings = ServeSettings(
        model_name=name,
        api_key=key,
        max_body_bytes=args.max_body_bytes,
        drain_timeout_s=args.drain_timeout,
    )
    model_dir = Path(args.model) if Path(args.model).is_dir() else None
    server = build_server(engine, settings, model_dir=model_dir, torch_threads=args.torch_threads)
    host, port = sock.getsockname()[:2]
    print(f"refserve: serving {name!r} on http://{host}:{port}/v1", flush=True)
    serve_forever(server, sock)
    print("refserve: drained, exiting", flush=True)
    return 0
