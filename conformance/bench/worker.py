"""The worker side of ``make bench-peers``: one process per engine, in the engine's venv.

The driver (:mod:`refserve.conformance.bench.peers`) talks to a worker over JSON lines. The worker
answers every message with one line on its original stdout; anything an engine prints
goes to stderr instead (file descriptor 1 is pointed at 2), so it can never corrupt the
protocol. Messages:

* (on start, unasked) ``{"ok": true, "engine": NAME, "includes": TEXT, "phases": [...]}``
  or ``{"ok": false, "error": ...}`` when the engine cannot be imported;
* ``{"cmd": "setup", "n": N, "prefix_caching": B}``: build the engine with N requests
  prefilled and decoding; ``{"ok": true, "setup_s": S}``, or ``{"ok": false,
  "unsupported": WHY}`` for a configuration the engine does not have;
* ``{"cmd": "steps", "key": KEY, "steps": K}``: K timed decode steps;
  ``{"ok": true, "times_ns": [[phase ns, ...], ...]}``;
* ``{"cmd": "pool_setup", "prefix_caching": B, "hashing": H}``: build the engine's block
  pool alone (``POOL_BLOCKS`` blocks; with caching, every free block cached first);
  ``{"ok": true, "setup_s": S}``, or ``unsupported``;
* ``{"cmd": "pool_rounds", "key": KEY, "rounds": R}``: R timed rounds, each allocating
  ``POOL_K`` fresh blocks (with caching: hashing and indexing each full block) and freeing
  them; ``{"ok": true, "times_ns": [[ns], ...]}``;
* ``{"cmd": "drop", "key": KEY}``: forget that configuration (then a full collection);
* ``{"cmd": "quit"}``.

An exception of the engine is an answer (``{"ok": false, "error": "Type: message at
file:line"}``), never a traceback on the driver's screen.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any, Protocol, TextIO

from refserve.conformance.bench.workload import Shape, pool_key
from refserve.conformance.guard import describe


class Unsupported(Exception):
    """The engine has no such configuration (e.g. prefix caching off on nano-vllm)."""


class BenchEngine(Protocol):
    """One engine's side of the benchmark."""

    @property
    def name(self) -> str:
        """Engine name and version."""
        ...

    @property
    def includes(self) -> str:
        """Exactly what one timed step includes, in words."""
        ...

    @property
    def phases(self) -> tuple[str, ...]:
        """The timed phases of one step, in order."""
        ...

    def setup(self, shape: Shape) -> object:
        """A fresh engine with ``shape.n`` requests prefilled and decoding (untimed)."""
        ...

    def step(self, state: object) -> tuple[int, ...]:
        """One decode step of every request; nanoseconds per phase."""
        ...


class PoolBench(Protocol):
    """An engine's block pool alone (optional: a worker without it answers unsupported)."""

    @property
    def pool_includes(self) -> str:
        """Exactly what one timed pool round includes, in words."""
        ...

    def pool_setup(self, prefix_caching: bool, hashing: str) -> object:
        """A fresh pool of ``POOL_BLOCKS`` blocks (untimed); raises :class:`Unsupported`
        for a hashing the engine does not have."""
        ...

    def pool_round(self, state: object) -> int:
        """Allocate ``POOL_K`` fresh blocks and free them; nanoseconds."""
        ...


def _send(out: TextIO, msg: dict[str, Any]) -> None:
    out.write(json.dumps(msg) + "\n")
    out.flush()


def handle(engine: BenchEngine, states: dict[str, object], msg: dict[str, Any]) -> dict[str, Any]:
    """The answer to one message (``quit`` is handled by :func:`serve`)."""
    cmd = msg.get("cmd")
    try:
        if cmd == "setup":
            shape = Shape(int(msg["n"]), bool(msg["prefix_caching"]))
            t0 = time.perf_counter()
            states[shape.key] = engine.setup(shape)
            setup_s = round(time.perf_counter() - t0, 3)
            gc.collect()  # the setup's garbage is not charged to the first timed steps
            return {"ok": True, "setup_s": setup_s}
        if cmd == "steps":
            state = states[str(msg["key"])]
            times = [list(engine.step(state)) for _ in range(int(msg["steps"]))]
            return {"ok": True, "times_ns": times}
        if cmd == "pool_setup":
            return _pool_setup(engine, states, msg)
        if cmd == "pool_rounds":
            pool_state = states[str(msg["key"])]
            bench = _pool_bench(engine)
            return {
                "ok": True,
                "times_ns": [[bench.pool_round(pool_state)] for _ in range(int(msg["rounds"]))],
            }
        if cmd == "drop":
            states.pop(str(msg["key"]), None)
            gc.collect()
            return {"ok": True}
        return {"ok": False, "error": f"unknown command {cmd!r}"}
    except Unsupported as e:
        return {"ok": False, "unsupported": str(e)}
    except Exception as e:  # the engine's own failure is an answer, not a crash
        return {"ok": False, "error": describe(e)}


def _pool_bench(engine: BenchEngine) -> PoolBench:
    if not hasattr(engine, "pool_round"):
        raise Unsupported("this worker has no block-pool benchmark")
    return engine  # type: ignore[return-value]  # checked just above


def _pool_setup(
    engine: BenchEngine, states: dict[str, object], msg: dict[str, Any]
) -> dict[str, Any]:
    bench = _pool_bench(engine)
    caching, hashing = bool(msg["prefix_caching"]), str(msg["hashing"])
    t0 = time.perf_counter()
    states[pool_key(caching, hashing)] = bench.pool_setup(caching, hashing)
    setup_s = round(time.perf_counter() - t0, 3)
    gc.collect()
    return {"ok": True, "setup_s": setup_s}


def serve(make_engine: Callable[[], BenchEngine]) -> int:
    """Run the worker loop on stdin / stdout until ``quit`` or end of input."""
    out = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)  # an engine's prints and warnings go to stderr, not into the protocol
    sys.stdout = sys.stderr
    try:
        engine = make_engine()
        hello = {
            "ok": True,
            "engine": engine.name,
            "includes": engine.includes,
            "phases": list(engine.phases),
            "pool_includes": str(getattr(engine, "pool_includes", "")),
            "python": sys.version.split()[0],
            # The CPUs this worker may run on: one when the run pins its workers.
            "cpus": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [],
        }
    except Exception as e:  # ImportError of the engine, a wrong version...
        _send(out, {"ok": False, "error": describe(e)})
        return 1
    _send(out, hello)
    states: dict[str, object] = {}
    for line in sys.stdin:
        try:
            msg = json.loads(line)
        except json.JSONDecodeError as e:
            _send(out, {"ok": False, "error": f"bad message: {e}"})
            continue
        if not isinstance(msg, dict):
            _send(out, {"ok": False, "error": "bad message: not an object"})
            continue
        if msg.get("cmd") == "quit":
            _send(out, {"ok": True})
            return 0
        _send(out, handle(engine, states, msg))
    return 0
