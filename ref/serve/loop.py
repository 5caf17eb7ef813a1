"""The engine in its own thread, and the hand-off between it and the asyncio side.

:class:`LLMEngine` is single-threaded and stepped by its caller. The server gives it one
thread of its own (:class:`EngineLoop`) that owns it outright: every touch of the engine
(adding a request, aborting one, reading the pool) is a command the thread runs between
two steps, so nothing else ever sees the engine mid-step and no lock is held across a
forward. The asyncio side never waits on a model step: it enqueues a command and awaits
a future, and each output reaches the request's :class:`asyncio.Queue` through
``loop.call_soon_threadsafe``. While requests are runnable the thread steps back to back,
draining the command queue without blocking between steps; when none is, it blocks on the
command queue.

Per-step timings (:class:`StepTiming`) are kept in a bounded ring: the gap between the
end of one step and the start of the next, when the engine had work throughout, is the
loop's overhead (commands, output hand-off, the GIL shared with the HTTP side): the
overlap figure (ref/serve/overlap.py). The ring is also what ``GET /debug/steps`` shows.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from refserve.core.config import SchedulerConfig
from refserve.engine.llm_engine import LLMEngine, RequestOutput
from refserve.errors import RefserveError, UnknownRequest
from refserve.model.sampler import SamplingParams
from refserve.model.tokenizer import Tokenizer
from refserve.serve.metrics import ServerMetrics

T = TypeVar("T")

log = logging.getLogger("refserve.serve")

#: How many step timings the ring keeps (a few minutes of steps at a few ms each).
STEP_RING = 20_000
#: How long an idle engine thread blocks on the command queue before it looks at its
#: stop flag again.
IDLE_POLL_S = 0.05


def command_for(
    fn: Callable[[], T], on_error: Callable[[BaseException], None] | None = None
) -> tuple[Callable[[], None], concurrent.futures.Future[T]]:
    """``fn`` as a command for a loop's thread, and the future of its result: a command
    whose future was cancelled does not run, and an exception of ``fn`` (after
    ``on_error`` saw it) goes to the future, never lost."""
    fut: concurrent.futures.Future[T] = concurrent.futures.Future()

    def command() -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn())
        except BaseException as e:  # handed to the awaiting side
            if on_error is not None:
                on_error(e)
            fut.set_exception(e)

    return command, fut


def stop_thread(stop: threading.Event, thread: threading.Thread) -> None:
    """Ask a loop's thread to stop and wait for it a bounded time (not from itself)."""
    stop.set()
    if thread.is_alive() and thread is not threading.current_thread():
        thread.join(timeout=5.0)


class ServerDraining(RefserveError):
    """The server is shutting down and admits no new request."""


class EngineFailed(RefserveError):
    """A step raised: the request was aborted (the error is in the message)."""


@dataclass(frozen=True)
class StepTiming:
    """One engine step as the loop saw it (``perf_counter`` seconds).

    ``gap_ms`` is the time since the previous step ended, set only when the loop went
    from that step to this one without idling (work was waiting all along).
    """

    index: int
    start_s: float
    end_s: float
    num_prefill_tokens: int
    num_decodes: int
    num_outputs: int
    gap_ms: float | None


@dataclass
class OutputSink:
    """Where one request's outputs go: its asyncio queue, in the server's event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]
    n: int
    finished: int = 0
    delivered: int = 0  # outputs handed to the client so far (a cluster restarts none-yet ones)

    def put(self, item: RequestOutput | BaseException) -> None:
        with contextlib.suppress(RuntimeError):  # the event loop closed: nobody listens
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


@dataclass(frozen=True)
class Submission:
    """An admitted request: its id and the queue its outputs arrive on, and when the
    engine side added it (``perf_counter`` seconds; None if not known)."""

    request_id: str
    queue: asyncio.Queue[RequestOutput | BaseException]
    n: int
    added_s: float | None = None


class ServingLoop(Protocol):
    """What the app needs of the engine side: :class:`EngineLoop` (one engine) or
    :class:`~refserve.serve.cluster_loop.ClusterLoop` (replicas behind a router)."""

    timings: deque[StepTiming]

    @property
    def alive(self) -> bool: ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def scheduler_config(self) -> SchedulerConfig: ...

    def start(self) -> None: ...

    def stop_admitting(self) -> None: ...

    def shutdown(self, timeout_s: float) -> None: ...

    async def submit(
        self, prompt: Sequence[int], params: SamplingParams, request_id: str
    ) -> Submission: ...

    def abort(self, request_id: str) -> None: ...


class EngineLoop:
    """Owns an :class:`LLMEngine` in a dedicated thread (module doc)."""

    def __init__(
        self,
        engine: LLMEngine,
        metrics: ServerMetrics | None = None,
        *,
        torch_threads: int | None = None,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.torch_threads = torch_threads
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._sinks: dict[str, OutputSink] = {}
        self._stop = threading.Event()
        self._admitting = True
        self._thread = threading.Thread(target=self._run, name="refserve-engine", daemon=True)
        self.timings: deque[StepTiming] = deque(maxlen=STEP_RING)
        self._step_index = 0
        self.failure: BaseException | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def num_in_flight(self) -> int:
        return len(self._sinks)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def scheduler_config(self) -> SchedulerConfig:
        return self.engine.scheduler.config

    def stop_admitting(self) -> None:
        self._admitting = False

    def shutdown(self, timeout_s: float) -> None:
        """Stop admitting, let in-flight requests finish for up to ``timeout_s``, abort the
        rest (their clients get ``finish_reason`` ``abort``), and stop the thread."""
        self.stop_admitting()
        deadline = time.monotonic() + timeout_s
        while self._sinks and self.alive and time.monotonic() < deadline:
            time.sleep(0.01)
        if self.alive:
            done = self.run_sync(self._abort_all)
            with contextlib.suppress(concurrent.futures.TimeoutError):
                done.result(timeout=5.0)
            # Let the aborts' final outputs go out (the next step delivers them).
            end = time.monotonic() + 2.0
            while self._sinks and self.alive and time.monotonic() < end:
                time.sleep(0.01)
        stop_thread(self._stop, self._thread)

    # ------------------------------------------------------------------ commands
    def run_sync(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run ``fn`` on the engine thread between two steps; its result as a future."""
        command, fut = command_for(fn)
        if self._stop.is_set() or not self.alive:
            fut.set_exception(ServerDraining("the engine loop is stopped"))
            return fut
        self._commands.put(command)
        return fut

    async def call(self, fn: Callable[[], T]) -> T:
        """:meth:`run_sync` awaited from the event loop."""
        return await asyncio.wrap_future(self.run_sync(fn))

    async def submit(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        request_id: str,
    ) -> Submission:
        """Add a request on the engine thread; raise its typed error (bad params, a prompt
        too long, a full queue) if the engine refuses it. Nothing running is affected."""
        if not self._admitting:
            raise ServerDraining("the server is shutting down")
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        sink = OutputSink(loop, q, params.n)

        def add() -> tuple[str, float]:
            if not self._admitting:
                raise ServerDraining("the server is shutting down")
            rid = self.engine.add_request(list(prompt), params, request_id=request_id)
            self._sinks[rid] = sink  # before any step: no output can be missed
            return rid, time.perf_counter()

        rid, added = await self.call(add)
        return Submission(rid, q, params.n, added)

    def abort(self, request_id: str) -> None:
        """Abort a request if it is still live (a client went away); non-blocking."""

        def command() -> None:
            with contextlib.suppress(UnknownRequest):
                self.engine.abort(request_id)

        if self.alive:
            self._commands.put(command)

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        prev_end: float | None = None
        # torch's intra-op thread count is process-wide: set for the loop's life, then put
        # back (a server started inside a test process must not change its neighbours).
        # Why fewer threads than cores: torch's OpenMP workers spin while they wait, and
        # with every core taken the HTTP thread starved (a 300-token stream went from 1 s
        # to 26 s on a loaded 2-core machine).
        threads_before = torch.get_num_threads()
        if self.torch_threads is not None:
            torch.set_num_threads(self.torch_threads)
        try:
            while not self._stop.is_set():
                idled = self._run_commands(block=not self.engine.has_runnable)
                if idled:
                    prev_end = None
                if not self.engine.has_runnable:
                    continue
                prev_end = self._one_step(prev_end)
        except BaseException as e:  # the loop itself broke: fail every request loudly
            log.exception("engine loop failed")
            self.failure = e
            self._fail_all(EngineFailed(f"engine loop failed: {type(e).__name__}: {e}"))
            raise
        finally:
            torch.set_num_threads(threads_before)

    def _run_commands(self, *, block: bool) -> bool:
        """Run the queued commands; with ``block``, wait for one first. True when the
        loop idled (waited for a command)."""
        idled = False
        if block:
            idled = True
            try:
                self._commands.get(timeout=IDLE_POLL_S)()
            except queue.Empty:
                return True
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return idled
            command()

    def _one_step(self, prev_end: float | None) -> float:
        start = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as e:
            # A failed step was rolled back (ref/core/engine_core.py); its requests cannot
            # be trusted to make progress, so they end, with the reason, and the loop goes on.
            log.exception("engine step failed")
            live = list(self._sinks)
            self._fail_all(EngineFailed(f"engine step failed: {type(e).__name__}: {e}"))
            self._abort_all(live)
            return time.perf_counter()
        end = time.perf_counter()
        records = self.engine.steps
        record = records[-1] if records else None
        # The engine keeps every StepRecord for in-process callers; a server runs for days.
        records.clear()
        self.timings.append(
            StepTiming(
                index=self._step_index,
                start_s=start,
                end_s=end,
                num_prefill_tokens=record.num_prefill_tokens if record else 0,
                num_decodes=record.num_decodes if record else 0,
                num_outputs=len(outputs),
                gap_ms=None if prev_end is None else (start - prev_end) * 1e3,
            )
        )
        self._step_index += 1
        self._dispatch(outputs)
        if self.metrics is not None:
            self.metrics.after_step(self.engine, outputs)
        # The next gap counts from the step's end: handing its outputs over (and the
        # figures) is the loop's time between two steps, not the step's.
        return end

    def _dispatch(self, outputs: Sequence[RequestOutput]) -> None:
        for o in outputs:
            sink = self._sinks.get(o.request_id)
            if sink is None:
                continue
            sink.put(o)
            if o.finished:
                sink.finished += 1
                if sink.finished >= sink.n:
                    del self._sinks[o.request_id]

    def _abort_all(self, request_ids: Sequence[str] | None = None) -> None:
        for rid in list(self._sinks) if request_ids is None else request_ids:
            with contextlib.suppress(UnknownRequest):
                self.engine.abort(rid)

    def _fail_all(self, error: BaseException) -> None:
        for sink in self._sinks.values():
            sink.put(error)
        self._sinks.clear()


def gap_summary(timings: Sequence[StepTiming]) -> dict[str, float | int]:
    """Percentiles (ms) of the gaps between back-to-back steps, and the step times."""
    gaps = sorted(t.gap_ms for t in timings if t.gap_ms is not None)
    steps = sorted((t.end_s - t.start_s) * 1e3 for t in timings)

    def pct(xs: list[float], q: float) -> float:
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")

    return {
        "num_steps": len(timings),
        "num_gaps": len(gaps),
        "gap_p50_ms": pct(gaps, 0.5),
        "gap_p99_ms": pct(gaps, 0.99),
        "gap_mean_ms": sum(gaps) / len(gaps) if gaps else float("nan"),
        "step_p50_ms": pct(steps, 0.5),
        "step_mean_ms": sum(steps) / len(steps) if steps else float("nan"),
    }
