"""Job completion time (arrival to finish) in ``refserve compare``: the skip-join MLFQ
against FCFS and the decode-first policies, and its two ablations, read from the sweep's
figures (docs/GUIDE.md, "The policy comparison").

Each comparison is made at one rate per trace, on the same workload: the highest swept
rate at which every policy compared was run (a policy far past its knee stops being
swept, so a higher rate may lack one of them). A policy "beats" another when its JCT
percentile is lower by more than :data:`TIE` (relative); otherwise the two tie.

A trace on a server of its own (``heavy-tight``: few seats, a small KV pool, where mlfq
displaces and swaps) is also compared at every rate (:class:`RateFindings`): mlfq
against FCFS and prefix-aware, both ablations, and what each mlfq policy did there
(:class:`MlfqActivity`: its displacements, preemptions and host-link traffic).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from refserve.core.swap import SwapCost
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
#: The policies MLFQ is held against at every rate of a constrained-server trace.
RATE_BASELINES = ("fcfs", "prefix-aware")
#: The MLFQ policies whose moves are counted.
MLFQ_POLICIES = (MLFQ, NO_SKIP_JOIN, RECOMPUTE)


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
class MlfqActivity:
    """What one mlfq policy did in one run: the requests it displaced (of them, those
    moved out for the running requests' headroom), every preemption (its displacements
    and the engine's own for want of a block), and the host-link traffic."""

    policy: str
    displaced: int
    headroom_swaps: int
    preemptions: int
    swapped_out: int
    swap_blocks_out: int
    swap_blocks_in: int
    swap_bytes: int

    @staticmethod
    def of(p: PointResult) -> MlfqActivity:
        return MlfqActivity(
            p.policy,
            p.displaced or 0,
            p.headroom_swaps or 0,
            p.preemptions,
            p.swapped_out,
            p.swap_blocks_out,
            p.swap_blocks_in,
            p.swap_bytes,
        )


@dataclass(frozen=True)
class RateFindings:
    """On a trace with its own server, at one rate: mlfq against each of
    :data:`RATE_BASELINES` that ran there, the two ablations (None where one of the three
    policies did not run), and each mlfq policy's moves."""

    trace: str
    rate: float
    versus: tuple[JctPair, ...]
    skip_join: Ablation | None
    proactive_swap: Ablation | None
    activity: tuple[MlfqActivity, ...]

    def against(self, other: str) -> JctPair | None:
        return next((p for p in self.versus if p.other == other), None)


@dataclass(frozen=True)
class LinkPrice:
    """Per simulated token: a round trip of its K/V over the mlfq policies' host link,
    and recomputing it (the cost model's prefill time per token), in ms."""

    round_trip_ms: float
    recompute_ms: float

    @staticmethod
    def of(cost: SwapCost) -> LinkPrice:
        return LinkPrice(cost.swap_ms(1), cost.recompute_ms(1))


@dataclass(frozen=True)
class JctFindings:
    """Per trace: MLFQ against each baseline, and the two ablations; rate by rate on the
    traces with a server of their own."""

    versus: tuple[JctPair, ...]
    skip_join: tuple[Ablation, ...]
    proactive_swap: tuple[Ablation, ...]
    per_rate: tuple[RateFindings, ...] = ()
    link: LinkPrice | None = None  # what moving K/V costs against recomputing it

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


def _ran(sweep: SweepResult, trace: str, policy: str, rate: float) -> bool:
    """``policy`` ran ``trace`` at ``rate`` and finished requests (a JCT to compare)."""
    return any(p.rate == rate and p.jct_p50_ms is not None for p in sweep.runs_of(trace, policy))


def _pair(
    sweep: SweepResult, trace: str, mine: str, other: str, rate: float | None = None
) -> JctPair | None:
    """At ``rate``, or at the highest rate where both ran; None where they did not."""
    if rate is None:
        rate = common_rate(sweep, trace, (mine, other))
    if rate is None or not (_ran(sweep, trace, mine, rate) and _ran(sweep, trace, other, rate)):
        return None
    a, b = _at(sweep, trace, mine, rate), _at(sweep, trace, other, rate)
    assert a.jct_p50_ms is not None and a.jct_p95_ms is not None
    assert b.jct_p50_ms is not None and b.jct_p95_ms is not None
    return JctPair(trace, rate, mine, other, a.jct_p50_ms, b.jct_p50_ms, a.jct_p95_ms, b.jct_p95_ms)


def _share(ingredient: float, whole: float) -> float | None:
    """The ingredient's part of a gain, when there is a gain to share."""
    return ingredient / whole if whole > 0 else None


def _ablation(
    sweep: SweepResult, trace: str, ablated: str, rate: float | None = None
) -> Ablation | None:
    """At ``rate``, or at the highest rate where mlfq, ``ablated`` and prefix-aware all
    ran; None where one of them did not."""
    names = (MLFQ, ablated, "prefix-aware")
    if rate is None:
        rate = common_rate(sweep, trace, names)
    if rate is None or not all(_ran(sweep, trace, n, rate) for n in names):
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


def jct_findings(sweep: SweepResult, swap_cost: SwapCost | None = None) -> JctFindings | None:
    """MLFQ against the baselines and its ablations on every trace; None when the sweep
    did not run mlfq. ``swap_cost``: the mlfq policies' host link, for the price of a
    swap against a recompute."""
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

    per_rate = tuple(
        _rate_findings(sweep, t.spec.name, rate, names)
        for t in sweep.plan
        if t.spec.server is not None
        for rate in t.rates
        if _ran(sweep, t.spec.name, MLFQ, rate)
    )
    return JctFindings(
        tuple(versus),
        ablations(NO_SKIP_JOIN),
        ablations(RECOMPUTE),
        per_rate,
        None if swap_cost is None else LinkPrice.of(swap_cost),
    )


def _rate_findings(sweep: SweepResult, trace: str, rate: float, names: set[str]) -> RateFindings:
    versus = (_pair(sweep, trace, MLFQ, other, rate) for other in RATE_BASELINES if other in names)
    return RateFindings(
        trace,
        rate,
        tuple(p for p in versus if p is not None),
        _ablation(sweep, trace, NO_SKIP_JOIN, rate),
        _ablation(sweep, trace, RECOMPUTE, rate),
        tuple(
            MlfqActivity.of(_at(sweep, trace, n, rate))
            for n in MLFQ_POLICIES
            if n in names and any(p.rate == rate for p in sweep.runs_of(trace, n))
        ),
    )
