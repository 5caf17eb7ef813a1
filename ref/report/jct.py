"""Job completion time (arrival to finish) in ``refserve compare``: the skip-join MLFQ
against FCFS and the decode-first policies, and its two ablations, read from the sweep's
figures (docs/GUIDE.md, "The policy comparison").

Each comparison is made at one rate per trace, on the same workload: the highest swept
rate at which every policy compared was run (a policy far past its knee stops being
swept, so a higher rate may lack one of them). A policy "beats" another when its JCT
percentile is lower by more than :data:`TIE` (relative); otherwise the two tie.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from refserve.report.analysis import PointResult
from refserve.report.sweep import SweepResult

MLFQ = "mlfq"
NO_SKIP_JOIN = "mlfq-no-skip-join"
RECOMPUTE = "mlfq-recompute"
#: The policies MLFQ is held against: FCFS and the decode-first ones.
BASELINES = ("fcfs", "chunked", "prefix-aware")
#: The policies of the JCT tables, in column order (those the sweep ran).
JCT_POLICIES = (*BASELINES, MLFQ, NO_SKIP_JOIN, RECOMPUTE)
#: Relative JCT difference below which two policies tie.
TIE = 0.01


@dataclass(frozen=True)
class JctPair:
    """Two policies' JCT P50 and P95 on one trace at one rate (ms)."""

    trace: str
    rate: float
    policy: str
    other: str
    p50_ms: float
    other_p50_ms: float
    p95_ms: float
    other_p95_ms: float

    @staticmethod
    def _verdict(mine: float, theirs: float) -> str:
        if abs(mine - theirs) <= TIE * max(mine, theirs):
            return "tie"
        return "better" if mine < theirs else "worse"

    @property
    def p50(self) -> str:
        """``policy``'s P50 against ``other``'s: better, worse or tie."""
        return self._verdict(self.p50_ms, self.other_p50_ms)

    @property
    def p95(self) -> str:
        return self._verdict(self.p95_ms, self.other_p95_ms)


@dataclass(frozen=True)
class Ablation:
    """What one MLFQ ingredient is worth on one trace: the ablated policy's JCT against
    full mlfq's, and the ingredient's share of mlfq's gain over prefix-aware (None when
    mlfq has no gain there to share)."""

    pair: JctPair  # mlfq against the ablated policy
    share_p50: float | None
    share_p95: float | None


@dataclass(frozen=True)
class JctFindings:
    """Per trace: MLFQ against each baseline, and the two ablations."""

    versus: tuple[JctPair, ...]
    skip_join: tuple[Ablation, ...]
    proactive_swap: tuple[Ablation, ...]

    def beats(self, other: str, which: str) -> list[str]:
        """The traces where mlfq's JCT ``which`` (p50 or p95) is lower than ``other``'s."""
        return [p.trace for p in self.versus if p.other == other and getattr(p, which) == "better"]


def common_rate(sweep: SweepResult, trace: str, policies: Sequence[str]) -> float | None:
    """The highest rate at which every one of ``policies`` was run on ``trace``."""
    rates: set[float] | None = None
    for name in policies:
        ran = {p.rate for p in sweep.runs_of(trace, name) if p.jct_p50_ms is not None}
        rates = ran if rates is None else rates & ran
    return max(rates) if rates else None


def _at(sweep: SweepResult, trace: str, policy: str, rate: float) -> PointResult:
    return next(p for p in sweep.runs_of(trace, policy) if p.rate == rate)


def _pair(sweep: SweepResult, trace: str, mine: str, other: str) -> JctPair | None:
    rate = common_rate(sweep, trace, (mine, other))
    if rate is None:
        return None
    a, b = _at(sweep, trace, mine, rate), _at(sweep, trace, other, rate)
    assert a.jct_p50_ms is not None and a.jct_p95_ms is not None
    assert b.jct_p50_ms is not None and b.jct_p95_ms is not None
    return JctPair(trace, rate, mine, other, a.jct_p50_ms, b.jct_p50_ms, a.jct_p95_ms, b.jct_p95_ms)


def _share(ingredient: float, whole: float) -> float | None:
    """The ingredient's part of a gain, when there is a gain to share."""
    return ingredient / whole if whole > 0 else None


def _ablation(sweep: SweepResult, trace: str, ablated: str) -> Ablation | None:
    """At the highest rate where mlfq, ``ablated`` and prefix-aware all ran."""
    names = (MLFQ, ablated, "prefix-aware")
    rate = common_rate(sweep, trace, names)
    if rate is None:
        return None
    full, without, base = (_at(sweep, trace, n, rate) for n in names)
    jcts = [(x.jct_p50_ms, x.jct_p95_ms) for x in (full, without, base)]
    (f50, f95), (w50, w95), (b50, b95) = jcts
    assert None not in (f50, f95, w50, w95, b50, b95)
    assert f50 is not None and f95 is not None and w50 is not None and w95 is not None
    assert b50 is not None and b95 is not None
    return Ablation(
        JctPair(trace, rate, MLFQ, ablated, f50, w50, f95, w95),
        share_p50=_share(w50 - f50, b50 - f50),
        share_p95=_share(w95 - f95, b95 - f95),
    )


def jct_findings(sweep: SweepResult) -> JctFindings | None:
    """MLFQ against the baselines and its ablations on every trace; None when the sweep
    did not run mlfq."""
    names = {p.name for p in sweep.policies}
    if MLFQ not in names:
        return None
    traces = [t.spec.name for t in sweep.plan]
    versus = [
        pair
        for t in traces
        for other in BASELINES
        if other in names and (pair := _pair(sweep, t, MLFQ, other)) is not None
    ]

    def ablations(ablated: str) -> tuple[Ablation, ...]:
        if ablated not in names or "prefix-aware" not in names:
            return ()
        found = (_ablation(sweep, t, ablated) for t in traces)
        return tuple(a for a in found if a is not None)

    return JctFindings(tuple(versus), ablations(NO_SKIP_JOIN), ablations(RECOMPUTE))
