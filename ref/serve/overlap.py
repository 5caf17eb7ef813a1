"""The overlap figure: the gap between consecutive engine steps (the end of
one to the start of the next, while work is waiting) in three set-ups on the same
workload (``clients`` requests of ``max_tokens`` tokens, greedy, all at once):

- ``plain``: :class:`LLMEngine` stepped back to back by a Python loop, no server;
- ``server, non-streaming``: ``refserve serve`` in this process, the same requests over
  HTTP with ``stream: false`` (outputs are handed to the event loop, nothing is sent until
  the end);
- ``server, streaming``: the same with ``stream: true``: every step's tokens become SSE
  events while the engine steps on.

The gap is what the engine thread spends between forwards: the loop's commands, handing
outputs to the event loop, and waiting for the GIL while the HTTP side runs. Run:
``python -m refserve.serve.overlap [--clients 32] [--max-tokens 64] [--model tiny-trained]``.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Sequence
from typing import Any

import httpx
import torch

from refserve.core.config import SchedulerConfig
from refserve.engine.llm_engine import LLMEngine
from refserve.model.sampler import SamplingParams
from refserve.serve.app import ServeSettings
from refserve.serve.loop import StepTiming, gap_summary
from refserve.serve.server import ServerThread, build_server


def _engine(model: str) -> LLMEngine:
    return LLMEngine(model, scheduler_config=SchedulerConfig(num_blocks=1024, max_num_seqs=256))


def _prompts(clients: int) -> list[str]:
    return [f"Count to {i % 9 + 2}. The little fox ran to the park {i}." for i in range(clients)]


def plain(model: str, clients: int, max_tokens: int) -> dict[str, float | int]:
    engine = _engine(model)
    for p in _prompts(clients):
        engine.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    timings: list[StepTiming] = []
    prev: float | None = None
    while engine.has_unfinished:
        start = time.perf_counter()
        engine.step()
        end = time.perf_counter()
        gap = None if prev is None else (start - prev) * 1e3
        timings.append(StepTiming(len(timings), start, end, 0, 0, 0, gap))
        prev = end
    return gap_summary(timings)


async def _clients(base: str, model: str, clients: int, max_tokens: int, stream: bool) -> None:
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:

        async def one(prompt: str) -> None:
            body: dict[str, Any] = {
                "model": model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": stream,
            }
            if stream:
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    async for _ in r.aiter_lines():
                        pass
            else:
                (await client.post("/v1/completions", json=body)).raise_for_status()

        await asyncio.gather(*(one(p) for p in _prompts(clients)))


def served(model: str, clients: int, max_tokens: int, stream: bool) -> dict[str, float | int]:
    server = build_server(_engine(model), ServeSettings(model))
    with ServerThread(server) as handle:
        server.loop.timings.clear()
        asyncio.run(_clients(handle.base_url, model, clients, max_tokens, stream))
        timings = list(server.loop.timings)
    return gap_summary(timings)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m refserve.serve.overlap", description=__doc__)
    p.add_argument("--model", default="tiny-trained")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--torch-threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.torch_threads)
    rows = [
        ("plain engine loop", plain(args.model, args.clients, args.max_tokens)),
        (
            "server, non-streaming",
            served(args.model, args.clients, args.max_tokens, stream=False),
        ),
        ("server, streaming", served(args.model, args.clients, args.max_tokens, stream=True)),
    ]
    print(
        f"{args.clients} requests x {args.max_tokens} tokens, {args.model}, "
        f"torch threads {args.torch_threads}\n"
    )
    print("| set-up | steps | gap P50 ms | gap P99 ms | gap mean ms | step P50 ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, s in rows:
        print(
            f"| {name} | {s['num_steps']} | {s['gap_p50_ms']:.3f} | {s['gap_p99_ms']:.3f} "
            f"| {s['gap_mean_ms']:.3f} | {s['step_p50_ms']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
