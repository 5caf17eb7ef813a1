"""The rate sweep of ``refserve compare`` (docs/ARCHITECTURE.md, example 3): every trace at
each of its rates under every policy, one simulator run per point, with a progress bar.

Everything runs on the cost-model simulator (the same scheduler and engine core as the
real engine). A policy far past its knee stops being swept (``STOP_BELOW``): overloaded
runs are the slow ones and add nothing to the report.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from refserve.core.config import SchedulerConfig
from refserve.core.cost import StepCost
from refserve.core.mlfq import SkipJoinMlfq
from refserve.core.request_metrics import RequestMetrics
from refserve.core.scheduler import Scheduler
from refserve.core.swap import SwapTraffic
from refserve.report.analysis import (
    PointResult,
    knee_cause,
    knee_rate,
    limit_fractions,
    tenant_fairness,
)
from refserve.report.policies import NamedPolicy, PolicyContext, Slo
from refserve.report.workload_specs import TraceSpec
from refserve.sim.metrics import RunMetrics, percentile
from refserve.sim.simulator import SimResult
from refserve.sim.workloads import Workload

DEFAULT_COST = "2+0.5P+D"
DEFAULT_SCALE = 16.0
STOP_BELOW = 0.5
BASE_CONFIG = SchedulerConfig(
    max_num_batched_tokens=128, max_num_seqs=256, block_size=16, num_blocks=4096
)


class Progress:
    """A tqdm bar on a stream (stderr), labelled with the run in progress."""

    def __init__(self, total: int, stream: TextIO, *, enabled: bool = True) -> None:
        from tqdm import tqdm

        # Not a terminal (a log, CI): an update every 30 s, not a wall of carriage returns.
        self.bar = tqdm(
            total=total,
            file=stream,
            unit="run",
            disable=not enabled,
            mininterval=0.2 if stream.isatty() else 30.0,
            dynamic_ncols=True,
        )

    def advance(self, label: str) -> None:
        self.bar.set_postfix_str(label, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


@dataclass(frozen=True)
class CompareOptions:
    """One comparison, as the command line asked for it: what to sweep, on which engine
    and cost model, judged by which SLO, and where the report goes."""

    out: Path
    traces: tuple[TraceSpec, ...]
    policies: tuple[NamedPolicy, ...]
    rates: tuple[float, ...] | None  # None: each trace's own sweep
    quick: bool
    scale: float
    seed: int
    cost: StepCost
    slo: Slo
    base: SchedulerConfig
    knee: float
    num: int | None
    # Stop sweeping a policy on a trace after this many rates in a row with SLO attainment
    # below ``STOP_BELOW``: it is far past its knee and overloaded runs are the slow ones.
    stop_after: int | None = 2


@dataclass(frozen=True)
class PlannedTrace:
    """A workload family and the rates it is swept at, ascending."""

    spec: TraceSpec
    rates: tuple[float, ...]


@dataclass(frozen=True)
class SweepPoint:
    """One run of the sweep: a family's workload built at ``rate``, under ``policy``."""

    spec: TraceSpec
    workload: Workload
    policy: NamedPolicy
    rate: float

    @property
    def label(self) -> str:
        return f"{self.spec.name} {self.policy.name} @ {self.rate:g} {self.spec.rate_unit}"


@dataclass(frozen=True)
class TraceSweep:
    """One family's runs, and where each policy stopped early (policy -> first rate not run)."""

    points: tuple[PointResult, ...]
    stopped: dict[str, float]


@dataclass(frozen=True)
class SweepResult:
    """Every run of the sweep, in run order, and what it left out."""

    plan: tuple[PlannedTrace, ...]
    policies: tuple[NamedPolicy, ...]  # the policies run
    skipped: tuple[NamedPolicy, ...]  # the policies this checkout's SchedulerConfig cannot express
    points: tuple[PointResult, ...]
    stopped: dict[str, dict[str, float]]  # trace -> policy -> first rate not run

    def runs_of(self, trace: str, policy: str) -> list[PointResult]:
        """One policy's sweep of one trace, in run (ascending rate) order."""
        return [x for x in self.points if x.trace == trace and x.policy == policy]

    def knees(self, threshold: float) -> dict[str, dict[str, float | None]]:
        """Trace -> policy -> its knee rate (:func:`~refserve.report.analysis.knee_rate`)."""
        return {
            t.spec.name: {
                p.name: knee_rate(self.runs_of(t.spec.name, p.name), threshold)
                for p in self.policies
            }
            for t in self.plan
        }

    def knee_causes(self, threshold: float) -> dict[str, dict[str, str | None]]:
        """Trace -> policy -> the limit that bound at its knee
        (:func:`~refserve.report.analysis.knee_cause`)."""
        return {
            t.spec.name: {
                p.name: knee_cause(self.runs_of(t.spec.name, p.name), threshold)
                for p in self.policies
            }
            for t in self.plan
        }


def plan_sweep(opts: CompareOptions) -> tuple[PlannedTrace, ...]:
    """Each trace with the rates it is swept at: ``--rates`` or its own (quick) sweep."""
    return tuple(
        PlannedTrace(spec, tuple(sorted(spec.rates_to_sweep(opts.rates, opts.quick))))
        for spec in opts.traces
    )


def run_sweep(opts: CompareOptions, stream: TextIO, *, progress: bool = True) -> SweepResult:
    """Run every planned point (the progress bar on ``stream``); write nothing."""
    active = tuple(p for p in opts.policies if p.available())
    skipped = tuple(p for p in opts.policies if not p.available())
    plan = plan_sweep(opts)
    bar = Progress(sum(len(t.rates) for t in plan) * len(active), stream, enabled=progress)
    points: list[PointResult] = []
    stopped: dict[str, dict[str, float]] = {}
    for planned in plan:
        swept = _sweep_trace(opts, planned, active, bar)
        points += swept.points
        if swept.stopped:
            stopped[planned.spec.name] = swept.stopped
    bar.close()
    return SweepResult(plan, active, skipped, tuple(points), stopped)


def _sweep_trace(
    opts: CompareOptions,
    planned: PlannedTrace,
    policies: Sequence[NamedPolicy],
    bar: Progress,
) -> TraceSweep:
    """One family at each of its rates (one workload per rate, shared by the policies);
    a policy is dropped after ``opts.stop_after`` rates in a row below ``STOP_BELOW``."""
    spec = planned.spec
    points: list[PointResult] = []
    stopped: dict[str, float] = {}
    bad_in_a_row = dict.fromkeys((p.name for p in policies), 0)
    for rate in planned.rates:
        n = spec.num_units(rate, opts.num, opts.quick)
        workload = spec.build(rate, n, opts.scale, opts.seed)
        for policy in policies:
            at = SweepPoint(spec, workload, policy, rate)
            stop_after = None if spec.sweep_every_rate else opts.stop_after
            if stop_after is not None and bad_in_a_row[policy.name] >= stop_after:
                stopped.setdefault(policy.name, rate)
                bar.advance(at.label + " (skipped: past its knee)")
                continue
            point = run_point(opts, at)
            points.append(point)
            bad = point.slo_attainment < STOP_BELOW
            bad_in_a_row[policy.name] = bad_in_a_row[policy.name] + 1 if bad else 0
            bar.advance(at.label)
    return TraceSweep(tuple(points), stopped)


# ------------------------------------------------------------------------ one run
def _finished_normally(m: RequestMetrics) -> bool:
    return m.finish_reason in ("stop", "length")


def _jcts(reqs: Sequence[RequestMetrics]) -> list[float]:
    """Job completion times (arrival to finish) of the requests that finished normally."""
    return [j for m in reqs if _finished_normally(m) and (j := m.jct_ms) is not None]


def _share(count: int, total: int) -> float:
    """``count / total``, 0 for an empty run."""
    return count / total if total else 0.0


def _offered_rps(at: SweepPoint, result: SimResult) -> float:
    """The request rate offered: the swept rate, except for sessions, whose turns arrive
    only after the previous one finished and its tool wait: then it is measured, turns
    over the span of their arrivals."""
    if not at.workload.sessions:
        return at.rate
    arrivals = [r.arrival_ms for r in result.requests]
    span_s = (max(arrivals) - min(arrivals)) / 1e3 if arrivals else 0.0
    return at.workload.num_requests / span_s if span_s > 0 else at.rate


@dataclass(frozen=True)
class _Moves:
    """What a run's policy displaced (None: not the MLFQ policy) and what crossed the
    host link (zero without a host pool)."""

    displaced: int | None
    headroom_swaps: int | None
    swapped_out: int
    blocks_out: int
    blocks_in: int
    bytes_moved: int

    @staticmethod
    def of(scheduler: Scheduler, result: SimResult) -> _Moves:
        policy = scheduler.policy
        mlfq = policy if isinstance(policy, SkipJoinMlfq) else None
        swap = result.swap or SwapTraffic(0, 0, 0, 0, 0)
        return _Moves(
            None if mlfq is None else mlfq.num_displaced,
            None if mlfq is None else mlfq.num_headroom_swaps,
            swap.num_swapped_out,
            swap.blocks_out,
            swap.blocks_in,
            swap.bytes_out + swap.bytes_in,
        )


def run_point(opts: CompareOptions, at: SweepPoint) -> PointResult:
    """Run one workload under one policy and summarize it."""
    started = time.perf_counter()
    slo = opts.slo
    config = at.policy.configure(
        at.spec.config(opts.base),
        PolicyContext(at.workload.max_len, slo, opts.cost, opts.scale),
    )
    scheduler = Scheduler(config)
    # Steps are kept: which limit bound is read from them (then they are dropped).
    result = at.workload.run(
        scheduler, opts.cost, keep_steps=True, speculation=at.policy.speculation
    )
    moves = _Moves.of(scheduler, result)
    reqs = [RequestMetrics.of(r) for r in result.requests]
    run = RunMetrics.of(reqs, result.makespan_ms)
    met = [m for m in reqs if slo.met(m)]
    n = at.workload.num_requests
    offered = _offered_rps(at, result)
    attainment = _share(len(met), n)
    secs = result.makespan_ms / 1e3 if result.makespan_ms > 0 else math.inf
    prompt_tokens = sum(m.num_prompt_tokens for m in reqs)
    finished = sum(map(_finished_normally, reqs))
    jcts = _jcts(reqs)
    return PointResult(
        trace=at.spec.name,
        policy=at.policy.name,
        rate=at.rate,
        offered_rps=offered,
        num_requests=n,
        num_finished=finished,
        ttft_p50_ms=run.ttft_ms["p50"],
        ttft_p95_ms=run.ttft_ms["p95"],
        ttft_p99_ms=run.ttft_ms["p99"],
        tbt_p99_ms=percentile([x for m in reqs for x in m.itl_ms], 99),
        output_tokens_per_s=run.output_tokens_per_s,
        slo_attainment=attainment,
        goodput_rps=attainment * offered,
        goodput_tokens_per_s=sum(m.num_output_tokens for m in met) / secs,
        # Requests that did not finish normally: capacity or timeout finishes (none of
        # these policies sets a queue bound or timeout), or one never released.
        rejected=n - finished,
        preemptions=run.num_preemptions,
        cached_tokens=run.num_cached_tokens,
        prefix_hit_rate=_share(run.num_cached_tokens, prompt_tokens),
        makespan_ms=result.makespan_ms,
        num_steps=result.num_steps,
        wall_s=time.perf_counter() - started,
        num_tenants=len({m.tenant for m in reqs}),
        fairness=tenant_fairness(reqs, slo),
        rejection_rate=_share(n - finished, n),
        capacity_rate=_share(sum(m.finish_reason == "capacity" for m in reqs), n),
        limits=limit_fractions(result.steps, config),
        ttft_miss_rate=_share(sum(not slo.ttft_met(m) for m in reqs), n),
        tbt_miss_rate=_share(sum(not slo.tbt_met(m) for m in reqs), n),
        jct_p50_ms=percentile(jcts, 50),
        jct_p95_ms=percentile(jcts, 95),
        displaced=moves.displaced,
        headroom_swaps=moves.headroom_swaps,
        swapped_out=moves.swapped_out,
        swap_blocks_out=moves.blocks_out,
        swap_blocks_in=moves.blocks_in,
        swap_bytes=moves.bytes_moved,
    )
