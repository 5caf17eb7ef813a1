"""Every call into someone else's adapter goes through :func:`call`: bounded and contained.

An adapter under test may hang, raise anything, or return garbage. The suite must report
each of these as a finding of the scenario and go on (docs/CONFORMANCE.md, "A harness
the engine cannot take down"). :func:`call` runs one adapter call with a time limit
(SIGALRM on the main thread, so a Python-level hang is interrupted where it spins) and
turns any exception into an :class:`AdapterCallError` naming the call; the declared
outcomes of the protocol (``NotSupported``, ``Rejected``, ``NoSpace``) pass through
unchanged because they are answers, not faults.

A hang that a signal cannot interrupt (a native loop holding the GIL) is the last line's
job: :class:`Watchdog` ends the process after a grace period, once the caller's
``on_stuck`` has written what it can.
"""

from __future__ import annotations

import signal
import threading
import time
import traceback
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import TypeVar

DEFAULT_CALL_TIMEOUT = 5.0
"""Seconds one adapter call may take (``--call-timeout``); the engines under test answer
one scheduling call in milliseconds."""

T = TypeVar("T")


class AdapterCallError(Exception):
    """An adapter call raised an exception the protocol does not define, or timed out."""

    def __init__(self, what: str, detail: str, *, timed_out: bool = False) -> None:
        super().__init__(f"{what} {detail}")
        self.what = what
        self.detail = detail
        self.timed_out = timed_out


class _Timeout(BaseException):
    """Raised inside the adapter by the alarm; a BaseException so that an adapter's own
    ``except Exception`` cannot swallow it."""


def describe(e: BaseException) -> str:
    """``raised Type: message at file.py:line`` (the innermost frame), one line."""
    text = traceback.format_exception_only(type(e), e)[-1].strip()
    if len(text) > 300:
        text = text[:297] + "..."
    tb = traceback.extract_tb(e.__traceback__) if e.__traceback__ else []
    where = f" at {tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno}" if tb else ""
    return f"raised {text}{where}"


def _alarm_usable() -> bool:
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


_current: tuple[str, float, float] | None = None
"""The guarded call in progress: (what, start time, its timeout); read by the Watchdog."""


def current_call() -> tuple[str, float, float] | None:
    return _current


def call(
    what: str,
    fn: Callable[[], T],
    timeout: float = DEFAULT_CALL_TIMEOUT,
    passthrough: tuple[type[BaseException], ...] = (),
) -> T:
    """Run ``fn()``; raise :class:`AdapterCallError` if it raises (other than
    ``passthrough``) or runs past ``timeout`` seconds (``0`` or less: no limit)."""
    global _current
    use_alarm = timeout > 0 and _alarm_usable()
    old_handler: object = None
    outer = _current
    _current = (what, time.monotonic(), timeout)
    if use_alarm:

        def on_alarm(signum: int, frame: FrameType | None) -> None:
            raise _Timeout

        old_handler = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        return fn()
    except _Timeout:
        raise AdapterCallError(
            what, f"did not return within {timeout:g} s", timed_out=True
        ) from None
    except passthrough:
        raise
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # the adapter may raise anything, SystemExit included
        raise AdapterCallError(what, describe(e)) from e
    finally:
        _current = outer
        if use_alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old_handler)  # type: ignore[arg-type]


class Watchdog:
    """Ends the process when a guarded call outlives its timeout by ``grace`` seconds.

    The alarm of :func:`call` interrupts Python code; a call blocked in native code that
    releases the GIL (a C-level wait, a socket, a lock without timeout taken in C) is not
    interrupted. The watchdog thread then calls ``on_stuck(what)``, which writes the
    report with the finding and returns the exit code, and ends the process with it: a
    partial report and a clear line beat a hang. (Native code that spins holding the GIL
    stops every thread, this one too; nothing in-process can end that.)
    """

    def __init__(self, grace: float, on_stuck: Callable[[str], int]) -> None:
        self.grace = grace
        self.on_stuck = on_stuck
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="conformance-watchdog")
        self._thread.daemon = True

    def __enter__(self) -> Watchdog:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()

    def _watch(self) -> None:
        import os

        while not self._stop.wait(0.25):
            cur = _current
            if cur is None or cur[2] <= 0:
                continue
            what, start, timeout = cur
            if time.monotonic() - start > timeout + self.grace:
                os._exit(self.on_stuck(what))
