"""``refserve serve --policy mlfq``: the real command, its MLFQ options parsed by the
shared scheduler options. With one seat, a short request arriving while a long one
streams displaces it (the long one has sunk below the level the short one joins) and
finishes first; both keep their greedy tokens, and ``/metrics`` counts the preemption.
The server listens on loopback, serves two requests and is stopped by the test."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from typing import Any

import httpx
from serve_helpers import MODEL, TIMEOUT_S, stream_completion

from refserve.engine.llm_engine import LLMEngine
from refserve.model.sampler import SamplingParams

LONG, SHORT = "The quick brown fox", "Hello"


def _greedy(prompt: str, max_tokens: int) -> str:
    engine = LLMEngine(MODEL)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    (result,) = engine.generate([prompt], params)
    return result.outputs[0].text


def test_a_short_request_displaces_a_long_one_and_finishes_first() -> None:
    cmd = [sys.executable, "-m", "refserve.cli.main", "serve", "--model", MODEL]
    cmd += ["--host", "127.0.0.1", "--port", "0", "--torch-threads", "1"]
    cmd += ["--num-blocks", "64", "--num-host-blocks", "64", "--max-num-seqs", "1"]
    cmd += ["--policy", "mlfq", "--mlfq-queues", "3", "--mlfq-quantum-ms", "4"]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert " on http://127.0.0.1:" in line, line
        base = line.split(" on ")[1].strip().removesuffix("/v1")
        done: list[str] = []
        results: dict[str, dict[str, Any]] = {}
        streaming = threading.Event()
        tokens = [0]

        def on_long(e: dict[str, Any]) -> None:
            tokens[0] += 1
            if tokens[0] == 8:  # well past level 0's quantum: it has sunk
                streaming.set()

        def run(name: str, prompt: str, n: int, on_event: Any) -> None:
            results[name] = stream_completion(base, prompt, n, on_event)
            done.append(name)

        long = threading.Thread(target=run, args=("long", LONG, 200, on_long), daemon=True)
        long.start()
        assert streaming.wait(TIMEOUT_S)
        run("short", SHORT, 3, lambda e: None)
        long.join(TIMEOUT_S)
        assert done == ["short", "long"]
        assert results["short"]["text"] == _greedy(SHORT, 3)
        assert results["long"]["text"] == _greedy(LONG, 200)
        metrics = httpx.get(f"{base}/metrics", timeout=TIMEOUT_S).text
        preempted = [
            float(x.rsplit(" ", 1)[1])
            for x in metrics.splitlines()
            if x.startswith("vllm:num_preemptions_total")
        ]
        assert preempted and preempted[0] >= 1, metrics
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
