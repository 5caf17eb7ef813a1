"""When a streamed request passed the server's own checkpoints (``GET /debug/requests``).

The simulator replays a request from its arrival at the scheduler to the step that
produced its token; what lies around that, the server measures here, per request, on its
own clock (``perf_counter`` seconds): ``received_s`` when the handler began (the body
already parsed), ``queued_s`` when the prompt was tokenized and handed to the engine
side, ``added_s`` when the engine's thread added it (after the step in progress, if
any, and the thread's wake-up), ``submitted_s`` when the handler knew it was added,
``first_output_s`` when the handler took its first token off the queue, and the
engine's own TTFT (``engine_ttft_ms``: from the add to the end of the forward that
produced the token), under the client's own name
for it when it sent one (the ``X-Request-Id`` header, :data:`CLIENT_ID_HEADER`: the
server's request ids are its own, so this is how a client finds its requests here).
``bench-serve --fit`` turns
these into the per-request overheads it models (ref/serve/fit.py); the HTTP time outside
the handler is what the client's TTFT has beyond ``first_output_s - received_s``.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from dataclasses import dataclass

#: How many request timings the ring keeps.
REQUEST_RING = 20_000
#: The header a client names its request by (kept as given, at most :data:`MAX_CLIENT_ID`
#: characters).
CLIENT_ID_HEADER = "x-request-id"
MAX_CLIENT_ID = 200
MAX_TOKENS = 256


@dataclass(frozen=True)
class RequestTiming:
    index: int
    received_s: float
    queued_s: float
    submitted_s: float
    first_output_s: float
    engine_ttft_ms: float
    client_id: str | None = None
    #: The engine's token times (ms after its first token) and the handler's (ms after it
    #: took the first), at most :data:`MAX_TOKENS` each: where token gaps stretch.
    engine_token_ms: tuple[float, ...] = ()
    handler_token_ms: tuple[float, ...] = ()
    added_s: float | None = None

    @property
    def front_ms(self) -> float:
        """The handler's own work before the engine side sees the request."""
        return (self.queued_s - self.received_s) * 1e3

    @property
    def server_ttft_ms(self) -> float:
        return (self.first_output_s - self.received_s) * 1e3

    @property
    def handoff_ms(self) -> float:
        """From the step that produced the first token to the handler holding it: what the
        server's TTFT has beyond the tokenizing, the wait to be added and the engine's
        TTFT (at least 0)."""
        if self.added_s is not None:
            return max(0.0, (self.first_output_s - self.added_s) * 1e3 - self.engine_ttft_ms)
        wait_ms = (self.submitted_s - self.queued_s) * 1e3
        return max(0.0, self.server_ttft_ms - self.front_ms - wait_ms - self.engine_ttft_ms)

    @property
    def add_wait_ms(self) -> float | None:
        """From handing the request to the engine side to its thread adding it: the step
        in progress, if any, and the thread's wake-up."""
        return None if self.added_s is None else (self.added_s - self.queued_s) * 1e3


class RequestTimings:
    """A bounded ring of :class:`RequestTiming`, written from the event loop, read by
    the debug endpoint (a lock: the ring is also read while it is written)."""

    def __init__(self, maxlen: int = REQUEST_RING) -> None:
        self._ring: deque[RequestTiming] = deque(maxlen=maxlen)
        self._counter = itertools.count()
        self._lock = threading.Lock()

    def add(
        self,
        received_s: float,
        queued_s: float,
        submitted_s: float,
        first_output_s: float,
        engine_ttft_ms: float,
        client_id: str | None = None,
        engine_token_ms: tuple[float, ...] = (),
        handler_token_ms: tuple[float, ...] = (),
        added_s: float | None = None,
    ) -> None:
        with self._lock:
            self._ring.append(
                RequestTiming(
                    next(self._counter),
                    received_s,
                    queued_s,
                    submitted_s,
                    first_output_s,
                    engine_ttft_ms,
                    None if client_id is None else client_id[:MAX_CLIENT_ID],
                    engine_token_ms[:MAX_TOKENS],
                    handler_token_ms[:MAX_TOKENS],
                    added_s,
                )
            )

    def since(self, index: int) -> list[RequestTiming]:
        with self._lock:
            return [t for t in self._ring if t.index >= index]

    def last_index(self) -> int:
        with self._lock:
            return self._ring[-1].index if self._ring else -1
