"""One instance's guarded line to its adapter, and the findings it writes down.

Every adapter call of a run goes through :meth:`Probe.call`
(:func:`refserve.conformance.guard.call`: a time limit, any exception contained), every
record it returns is validated (:mod:`refserve.conformance.validate`) before a checker
reads it, and every checker runs through :meth:`Probe.checked`: a hang, a raise or a
malformed record becomes a PROGRESS finding naming the call and ends the run
(:class:`RunStopped`), never a crash of the suite.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

from refserve.conformance import validate
from refserve.conformance.adapter import EngineAdapter, NotSupported
from refserve.conformance.guard import AdapterCallError, call, describe
from refserve.conformance.run_result import Finding, RunResult
from refserve.spec.snapshot import EngineSnapshot
from refserve.spec.violation import Invariant, Violation, violation

T = TypeVar("T")


class RunStopped(Exception):
    """Ends a run early: the finding (or the not-supported reason) is already recorded."""


class Probe:
    """The adapter of one instance, its calls guarded, and where its findings go:
    ``res`` (shared by the instances of one run) under the instance's ``label``."""

    def __init__(
        self, adapter: EngineAdapter, res: RunResult, call_timeout: float, label: str = ""
    ) -> None:
        self.a = adapter
        self.res = res
        self.timeout = call_timeout
        self.label = label
        self.latest: EngineSnapshot | None = None
        """The last snapshot taken (a migration run's cluster snapshot reads it)."""

    def where(self, phase: str) -> str:
        """``phase``, with the instance named in a run of several (``step on B``)."""
        return f"{phase} on {self.label}" if self.label else phase

    def engine_label(self) -> dict[str, str]:
        """The trace's ``engine`` key in a run of several instances (none alone)."""
        return {"engine": self.label} if self.label else {}

    def fail(
        self,
        inv: Invariant,
        step: int,
        phase: str,
        subject: str,
        msg: str,
        expected: object = "",
        seen: object = "",
    ) -> None:
        f = Finding(violation(inv, subject, msg, expected, seen), step, self.where(phase))
        self.res.findings.append(f)

    def not_quiesced(self, step: int, limit: int, live: Iterable[str]) -> None:
        """PROGRESS: requests still live after the run's step limit."""
        self.fail(
            Invariant.PROGRESS,
            step,
            "step",
            "run",
            f"did not quiesce within {limit} steps",
            "quiescence",
            f"{sorted(live)} still live",
        )

    def record(self, vs: list[Violation], step: int, phase: str) -> None:
        self.res.findings.extend(Finding(v, step, self.where(phase)) for v in vs)

    def call(
        self,
        step: int,
        phase: str,
        what: str,
        fn: Callable[[], T],
        passthrough: tuple[type[BaseException], ...] = (),
    ) -> T:
        """One guarded adapter call: a fault becomes a PROGRESS finding naming the call
        and ends the run; ``NotSupported`` ends it as not supported."""
        try:
            return call(what, fn, self.timeout, (NotSupported, *passthrough))
        except NotSupported as e:
            self.res.not_supported = f"{what}: {e}"
            raise RunStopped from None
        except AdapterCallError as e:
            self.fail(Invariant.PROGRESS, step, phase, "engine", str(e))
            raise RunStopped from None

    def malformed(self, step: int, phase: str, what: str, problems: list[str]) -> None:
        """A record the adapter returned does not have the protocol's shape."""
        if not problems:
            return
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        self.fail(
            Invariant.PROGRESS,
            step,
            phase,
            "adapter",
            f"{what} returned a malformed record: {problems[0]}{more}",
        )
        raise RunStopped

    def snapshot(self, step: int, phase: str) -> EngineSnapshot:
        snap = self.call(step, phase, "snapshot()", self.a.snapshot)
        self.malformed(step, phase, "snapshot()", validate.check_engine_snapshot(snap))
        self.latest = snap
        return snap

    def checked(self, step: int, phase: str, fn: Callable[[], list[Violation]]) -> None:
        """Run a checker; a checker failing on the adapter's data is a finding too (data
        that passed validation but breaks an assumption no engine should break)."""
        try:
            vs = fn()
        except Exception as e:
            self.fail(
                Invariant.PROGRESS,
                step,
                phase,
                "adapter",
                f"the checkers could not read the adapter's records: {describe(e)}",
            )
            raise RunStopped from None
        self.record(vs, step, phase)


__all__ = ["Probe", "RunStopped"]
