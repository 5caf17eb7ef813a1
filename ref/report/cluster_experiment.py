"""``refserve compare --cluster``: routing and migration policies over N simulated
replicas (docs/CLUSTER.md, "The experiment").

Every run is :class:`~refserve.cluster.sim.ClusterSim`: the real router, the global prefix
index fed by cache events, migration through ``refserve.core.transit``, a seeded link.

**SLOs from the cost model** ``a + b*P + c*D`` (default ``2 + 0.5P + D``), with
``D_REF = 32`` decodes as the reference batch:

- TBT SLO = ``TBT_MULTIPLE`` (3) x the decode-only step of the reference batch,
  ``3 * (a + c*32)`` = 102 ms: a mixed step may cost up to three decode-only steps;
- the default token budget is the largest multiple of the block size whose mixed step
  ``a + b*B + c*D_REF`` stays within the TBT SLO (128 with the defaults); the budget
  sweep runs 64 to 512 around it, so 256 and 512 break the TBT SLO on every mixing step;
- TTFT SLO = the TBT SLO + ``TTFT_PREFILL_MULTIPLE`` (2) x the prompt's own prefill
  time ``b*P`` (a long prompt is not failed for being long; 4,096 tokens: 4.2 s).

A request is **good** when it finished, met both; **attainment** is the share of good
requests, **goodput** the attainment times the offered rate. The **knee** of a policy is
the first per-replica rate of the sweep (at ``KNEE_REPLICAS`` replicas) whose
attainment falls below 0.9, and **its cause** what the failing requests there failed on
(TTFT or TBT) with the queueing delay and preemptions behind it.

**Sizing** (so the whole run takes under 5 minutes on 2 cores): token lengths divided by
16 (scale 16: one simulated token stands for 16 real ones), per replica 1,024 blocks of
16 tokens (16,384 simulated tokens, ~256K real) and 64 seats; the traces are generated
per replica and scaled with the replica count (``TraceSpec.per_replica``): the rate and
the request count are both multiplied by N, so every N sees the same per-replica load.

**Prefill/decode disaggregation** (docs/DISAGG.md, "The experiment"): on the chat, long
and mixed traces at ``PD_LOADS``, ``PD_CONFIGS`` on ``PD_REPLICAS`` replicas routed by
``PD_ROUTER``: colocated, 2P2D, 2P2D with deflection (the TTFT and TBT SLOs above), each
summarized with its TTFT breakdown (:class:`PDPoint`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TextIO

from refserve.cluster.disagg import Deflection, Roles, TTFTBound
from refserve.cluster.sim import ClusterResult, LinkModel, MigrationPolicy, simulate_cluster
from refserve.cluster.sim_pd import TTFTBreakdown, breakdowns
from refserve.core.config import SchedulerConfig
from refserve.core.cost import StepCost
from refserve.core.request_metrics import RequestMetrics
from refserve.errors import InvalidArgument
from refserve.sim.metrics import percentile
from refserve.sim.workloads import (
    Workload,
    agent_sessions,
    from_records,
    long_prompt_records,
    merge_records,
    short_chat_records,
)
from refserve.spec.arith import full_blocks

SCALE = 16.0
D_REF = 32
TBT_MULTIPLE = 3.0
TTFT_PREFILL_MULTIPLE = 2.0
KNEE_REPLICAS = 4
KNEE_BELOW = 0.9
REPLICA_COUNTS = (1, 2, 4, 8)
BUDGETS = (64, 128, 256, 512)
LOAD_MULTIPLIERS = (0.5, 1.0, 1.5, 2.0, 3.0)
#: ``--quick``: two loads and two budgets (a smoke run in seconds).
QUICK_LOADS = (1.0, 2.0)
QUICK_BUDGETS = (128, 512)
BASE = SchedulerConfig(max_num_seqs=64, block_size=16, num_blocks=1024)
#: Loads (x one replica's) of the disaggregation runs; ``--quick``: the heavier alone.
PD_LOADS = (1.0, 2.0)
QUICK_PD_LOADS = (2.0,)
#: A jittery link: 1 GB/s, 2 ms latency, exponential jitter of mean 50 ms.
JITTERY = LinkModel(gb_per_s=1.0, latency_ms=2.0, jitter_ms=50.0)


@dataclass(frozen=True)
class ClusterSlo:
    """The SLOs derived from a cost model (module doc)."""

    tbt_ms: float
    ttft_per_token_ms: float
    budget: int

    @staticmethod
    def of(cost: StepCost, block_size: int = BASE.block_size) -> ClusterSlo:
        decode_step = cost.a + cost.c * D_REF
        tbt = TBT_MULTIPLE * decode_step
        room = (tbt - decode_step) / cost.b if cost.b else float(1 << 20)
        budget = max(block_size, full_blocks(int(room), block_size) * block_size)
        return ClusterSlo(tbt, TTFT_PREFILL_MULTIPLE * cost.b, budget)

    def ttft_limit_ms(self, num_prompt_tokens: int) -> float:
        return self.tbt_ms + self.ttft_per_token_ms * num_prompt_tokens

    def ttft_met(self, m: RequestMetrics) -> bool:
        return m.ttft_ms is not None and m.ttft_ms <= self.ttft_limit_ms(m.num_prompt_tokens)

    def tbt_met(self, m: RequestMetrics) -> bool:
        return all(g <= self.tbt_ms for g in m.itl_ms)

    def good(self, m: RequestMetrics) -> bool:
        return m.finish_reason in ("stop", "length") and self.ttft_met(m) and self.tbt_met(m)


# ------------------------------------------------------------------ traces
def _chat_records(n: int, rate: float, seed: int) -> list[dict[str, object]]:
    """Short chat from 8 applications, each with its own 2K-token system prompt: a
    shared prefix per application, so where a request lands decides what it reuses."""
    apps = 8
    out: list[dict[str, object]] = []
    for g in range(apps):
        k = n // apps + (1 if g < n % apps else 0)
        if k:
            recs = short_chat_records(
                k, rate / apps, seed=seed * 1000 + g, scale=SCALE, system_prompt_len=2048
            )
            out += [{**r, "tenant": f"app{g}"} for r in recs]
    return [dict(r) for r in merge_records(out)]


def _chat(rate: float, n: int, seed: int) -> Workload:
    # Parsed an application at a time (one trace's token limit bounds each, not the
    # whole: 100k requests at 64 replicas, tests/bench/test_cluster_bench.py).
    apps = 8
    reqs = []
    for g in range(apps):
        k = n // apps + (1 if g < n % apps else 0)
        if k:
            recs = short_chat_records(
                k, rate / apps, seed=seed * 1000 + g, scale=SCALE, system_prompt_len=2048
            )
            reqs += from_records([{**r, "tenant": f"app{g}"} for r in recs])
    return Workload("chat", tuple(sorted(reqs, key=lambda t: (t.arrival_ms, t.id))))


def _long(rate: float, n: int, seed: int) -> Workload:
    recs = long_prompt_records(n, rate, seed=seed, scale=SCALE)
    return Workload("long", tuple(from_records(recs)))


def _mixed(rate: float, n: int, seed: int) -> Workload:
    n_long = max(1, round(n * 0.05))
    chat = _chat_records(n - n_long, rate * 0.95, seed)
    long = long_prompt_records(n_long, rate * 0.05, seed=seed + 1, scale=SCALE)
    return Workload("mixed", tuple(from_records(merge_records(chat, long))))


def _agent(rate: float, n: int, seed: int) -> Workload:
    sessions = agent_sessions(n, rate, seed=seed, scale=SCALE, num_prefixes=4)
    return Workload("agent", sessions=tuple(sessions))


@dataclass(frozen=True)
class TraceSpec:
    """A trace generated per replica: ``rate`` and ``num`` at one replica, both times N."""

    name: str
    description: str
    unit: str
    rate: float
    num: int
    build: Callable[[float, int, int], Workload]

    def workload(self, replicas: int, load: float, seed: int) -> Workload:
        return self.build(self.rate * load * replicas, max(1, round(self.num * replicas)), seed)


TRACES: tuple[TraceSpec, ...] = (
    TraceSpec(
        "chat",
        "short chat: 8 applications, each a 2K system prompt; prompt ~1K, output ~128",
        "req/s",
        8.0,
        48,
        _chat,
    ),
    TraceSpec("long", "long prompt: ~64K, output ~128", "req/s", 0.25, 6, _long),
    TraceSpec("mixed", "the chat stream with 5 % long prompts mixed in", "req/s", 3.0, 48, _mixed),
    TraceSpec(
        "agent",
        "agent sessions: 4 agents' ~80K prefixes, 3-6 turns of +1K, tool waits 0.1-10 s",
        "sessions/s",
        0.5,
        5,
        _agent,
    ),
)


# ------------------------------------------------------------------ policies
@dataclass(frozen=True)
class ClusterPolicy:
    name: str
    router: str
    migration: MigrationPolicy | None = None


SPLIT_MIN_TOKENS = 1024
POLICIES: tuple[ClusterPolicy, ...] = (
    ClusterPolicy("round_robin", "round_robin"),
    ClusterPolicy("least_loaded", "least_loaded"),
    ClusterPolicy("prefix_aware", "prefix_aware"),
    ClusterPolicy(
        "prefix_aware+migration", "prefix_aware", MigrationPolicy(pressure=True, rebalance=True)
    ),
    ClusterPolicy(
        "prefix_aware+migration+split",
        "prefix_aware",
        MigrationPolicy(pressure=True, rebalance=True, split_min_tokens=SPLIT_MIN_TOKENS),
    ),
)


# ------------------------------------------------------------------ one point
@dataclass(frozen=True)
class Point:
    """One run, summarized."""

    trace: str
    policy: str
    replicas: int
    load: float
    budget: int
    link: str
    offered_per_s: float
    num_requests: int
    attainment: float
    goodput_per_s: float
    ttft_p50_ms: float | None
    ttft_p95_ms: float | None
    ttft_p99_ms: float | None
    tbt_p99_ms: float | None
    ttft_fail: int
    tbt_fail: int
    queue_mean_ms: float | None
    preemptions: int
    prefix_hit_tokens: int
    routed_hit_tokens: int
    migrations: int
    bytes_moved: int
    transfer_gaps: int  # moves whose transfer made a gap between two tokens
    transfer_spikes: int  # of those, gaps above the TBT SLO
    transfer_gap_max_ms: float | None
    early_transfers: int  # moves before the request's first token (they add to its TTFT)
    early_transfer_max_ms: float | None
    rejected: int
    wall_s: float


def _offered_per_s(reqs: Sequence[RequestMetrics]) -> float:
    """Requests over the span of their arrivals (a session's turns counted as they came)."""
    arrivals = [m.arrival_ms for m in reqs]
    span_s = (max(arrivals) - min(arrivals)) / 1e3 if len(reqs) > 1 else 0.0
    return len(reqs) / span_s if span_s > 0 else float(len(reqs))


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _transfer_times(res: ClusterResult) -> tuple[list[float], list[float]]:
    """Per move: the gap it made between two of its request's tokens, or (moved before
    the first token) its transfer time, which adds to the TTFT."""
    by_id = {m.request_id: m for m in res.requests}
    gaps: list[float] = []
    early: list[float] = []
    for mv in res.moves:
        times = by_id[mv.request_id].token_times_ms
        before = [t for t in times if t <= mv.depart_ms]
        after = [t for t in times if t >= mv.land_ms]
        if before and after:
            gaps.append(after[0] - before[-1])
        elif not before:
            early.append(mv.transfer_ms)
    return gaps, early


def summarize(
    res: ClusterResult,
    slo: ClusterSlo,
    *,
    trace: str,
    policy: str,
    replicas: int,
    load: float,
    budget: int,
    link: str,
    wall_s: float,
) -> Point:
    reqs = res.requests
    offered = _offered_per_s(reqs)
    good = sum(slo.good(m) for m in reqs)
    attainment = good / len(reqs) if reqs else 1.0
    ttfts = [m.ttft_ms for m in reqs if m.ttft_ms is not None]
    itls = [x for m in reqs for x in m.itl_ms]
    queues = [m.queue_ms for m in reqs if m.queue_ms is not None]
    gaps, early = _transfer_times(res)
    return Point(
        trace=trace,
        policy=policy,
        replicas=replicas,
        load=load,
        budget=budget,
        link=link,
        offered_per_s=offered,
        num_requests=len(reqs),
        attainment=attainment,
        goodput_per_s=attainment * offered,
        ttft_p50_ms=percentile(ttfts, 50),
        ttft_p95_ms=percentile(ttfts, 95),
        ttft_p99_ms=percentile(ttfts, 99),
        tbt_p99_ms=percentile(itls, 99),
        ttft_fail=sum(not slo.ttft_met(m) for m in reqs),
        tbt_fail=sum(not slo.tbt_met(m) for m in reqs),
        queue_mean_ms=_mean(queues),
        preemptions=res.num_preemptions,
        prefix_hit_tokens=res.cached_tokens,
        routed_hit_tokens=res.routed_hit_tokens,
        migrations=len(res.moves),
        bytes_moved=res.bytes_moved,
        transfer_gaps=len(gaps),
        transfer_spikes=sum(g > slo.tbt_ms for g in gaps),
        transfer_gap_max_ms=max(gaps, default=None),
        early_transfers=len(early),
        early_transfer_max_ms=max(early, default=None),
        rejected=len(res.rejected),
        wall_s=wall_s,
    )


@dataclass(frozen=True)
class ClusterOptions:
    traces: tuple[TraceSpec, ...] = TRACES
    policies: tuple[ClusterPolicy, ...] = POLICIES
    replicas: tuple[int, ...] = REPLICA_COUNTS
    loads: tuple[float, ...] = LOAD_MULTIPLIERS
    budgets: tuple[int, ...] = BUDGETS
    cost: StepCost = dataclasses.field(default_factory=StepCost)
    seed: int = 0
    pd_loads: tuple[float, ...] = PD_LOADS

    def __post_init__(self) -> None:
        if not (self.traces and self.policies and self.replicas and self.loads and self.budgets):
            raise InvalidArgument(
                "compare --cluster: no trace, policy, replica count, load or budget to run"
            )
        if any(n < 1 for n in self.replicas):
            raise InvalidArgument(f"replica counts must be >= 1, got {self.replicas}")


@dataclass(frozen=True)
class ClusterExperiment:
    slo: ClusterSlo
    options: ClusterOptions
    grid: tuple[Point, ...]  # every trace x policy x replica count, at load 1
    knee: tuple[Point, ...]  # every trace x policy x load, at KNEE_REPLICAS
    budgets: tuple[Point, ...]  # every trace x budget x {round_robin, prefix_aware}
    jitter: tuple[Point, ...]  # long and mixed, migration with and without split, links
    wall_s: float
    pd: tuple[PDPoint, ...] = ()  # chat, long, mixed x PD_CONFIGS x pd_loads


def run_point(
    spec: TraceSpec,
    policy: ClusterPolicy,
    replicas: int,
    load: float,
    slo: ClusterSlo,
    opts: ClusterOptions,
    *,
    budget: int | None = None,
    link: LinkModel | None = None,
    link_name: str = "default",
) -> Point:
    b = budget if budget is not None else slo.budget
    config = dataclasses.replace(BASE, max_num_batched_tokens=b)
    w = spec.workload(replicas, load, opts.seed)
    started = time.perf_counter()
    res = simulate_cluster(
        w,
        replicas,
        config,
        opts.cost,
        policy.router,
        migration=policy.migration,
        link=link,
        seed=opts.seed,
    )
    if len(res.requests) != w.num_requests:
        raise AssertionError(f"{spec.name}: {w.num_requests - len(res.requests)} requests lost")
    return summarize(
        res,
        slo,
        trace=spec.name,
        policy=policy.name,
        replicas=replicas,
        load=load,
        budget=b,
        link=link_name,
        wall_s=time.perf_counter() - started,
    )


def _jitter_runs(opts: ClusterOptions, slo: ClusterSlo, replicas: int) -> list[Point]:
    """Long and mixed at 1.5x load, every migrating policy, the default and the jittery
    link."""
    movers = [p for p in opts.policies if p.migration is not None]
    return [
        run_point(spec, pol, replicas, 1.5, slo, opts, link=link, link_name=name)
        for spec in opts.traces
        if spec.name in ("long", "mixed")
        for pol in movers
        for name, link in (("default", None), ("jittery", JITTERY))
    ]


def run_cluster_experiment(opts: ClusterOptions, stream: TextIO | None = None) -> ClusterExperiment:
    """The four parts of the experiment (module doc), in order."""
    started = time.perf_counter()
    slo = ClusterSlo.of(opts.cost, BASE.block_size)

    def say(text: str) -> None:
        if stream is not None:
            print(f"[{time.perf_counter() - started:6.1f}s] {text}", file=stream, flush=True)

    # Runs shared by two parts (the grid's knee_n point at load 1 and the default
    # budget) run once.
    done: dict[tuple[str, str, int, float, int], Point] = {}

    def point(spec: TraceSpec, pol: ClusterPolicy, n: int, load: float, budget: int) -> Point:
        key = (spec.name, pol.name, n, load, budget)
        if key not in done:
            done[key] = run_point(spec, pol, n, load, slo, opts, budget=budget)
        return done[key]

    grid = [
        point(spec, pol, n, 1.0, slo.budget)
        for spec in opts.traces
        for pol in opts.policies
        for n in opts.replicas
    ]
    say("grid done")
    knee_n = KNEE_REPLICAS if KNEE_REPLICAS in opts.replicas else max(opts.replicas)
    knee = [
        point(spec, pol, knee_n, load, slo.budget)
        for spec in opts.traces
        for pol in opts.policies
        for load in opts.loads
    ]
    say("load sweep done")
    chosen = [p for p in opts.policies if p.name in ("round_robin", "prefix_aware")]
    budgets = [
        point(spec, pol, knee_n, 1.0, b)
        for spec in opts.traces
        for pol in chosen or opts.policies[:1]
        for b in opts.budgets
    ]
    say("budget sweep done")
    jitter = _jitter_runs(opts, slo, knee_n)
    say("jittery-link runs done")
    pd = _pd_runs(opts, slo)
    say("prefill/decode runs done")
    return ClusterExperiment(
        slo,
        opts,
        tuple(grid),
        tuple(knee),
        tuple(budgets),
        tuple(jitter),
        time.perf_counter() - started,
        tuple(pd),
    )


# ------------------------------------------------------------------ prefill/decode
@dataclass(frozen=True)
class PDConfig:
    """One of the equal-capacity configurations of the disaggregation runs."""

    name: str
    roles: str | None  # None: every replica colocated
    deflect: bool = False


PD_REPLICAS = 4
PD_ROUTER = "slo_aware"
PD_TRACES = ("chat", "long", "mixed")
PD_CONFIGS = (
    PDConfig("4 colocated", None),
    PDConfig("2P2D", "2P2D"),
    PDConfig("2P2D+deflect", "2P2D", deflect=True),
)


@dataclass(frozen=True)
class PDPoint:
    """One disaggregation run, summarized. ``tail_*``: the means over the requests whose
    TTFT is at least the P95 TTFT (the P95 tail), TTFT split into queueing and prefill
    execution (a handoff's transfer is never in it: the first token streams from the
    prefill replica); ``second_*``: the same for the time to the second token, split
    into the TTFT (itself queueing and prefill execution), the transfer to the decode
    replica and the wait there."""

    trace: str
    config: str
    load: float
    num_requests: int
    offered_per_s: float
    attainment: float
    goodput_per_s: float
    ttft_p95_ms: float | None
    tbt_p99_ms: float | None
    tail_ttft_ms: float | None
    tail_queueing_ms: float | None
    tail_prefill_ms: float | None
    tail_transfer_ms: float
    second_p95_ms: float | None
    second_tail_ms: float | None
    second_tail_ttft_ms: float | None
    second_tail_queueing_ms: float | None
    second_tail_prefill_ms: float | None
    second_tail_transfer_ms: float | None
    second_tail_wait_ms: float | None
    handoffs: int
    kept: int
    deflected: int
    landing_waits: int
    wall_s: float


def _tail_means(
    rows: Sequence[TTFTBreakdown], key: Callable[[TTFTBreakdown], float | None]
) -> list[TTFTBreakdown]:
    """The rows whose ``key`` is at least its P95."""
    vals = [v for r in rows if (v := key(r)) is not None]
    p95 = percentile(vals, 95)
    if p95 is None:
        return []
    return [r for r in rows if (v := key(r)) is not None and v >= p95]


def _avg(
    rows: Sequence[TTFTBreakdown], key: Callable[[TTFTBreakdown], float | None]
) -> float | None:
    vals = [v for r in rows if (v := key(r)) is not None]
    return _mean(vals)


def summarize_pd(
    res: ClusterResult, slo: ClusterSlo, *, trace: str, config: str, load: float, wall_s: float
) -> PDPoint:
    reqs = res.requests
    offered = _offered_per_s(reqs)
    attainment = sum(slo.good(m) for m in reqs) / len(reqs) if reqs else 1.0
    rows = breakdowns(reqs, res.pd)
    tail = _tail_means(rows, lambda r: r.ttft_ms)
    second = _tail_means(rows, lambda r: r.second_token_ms)
    pd = res.pd
    return PDPoint(
        trace=trace,
        config=config,
        load=load,
        num_requests=len(reqs),
        offered_per_s=offered,
        attainment=attainment,
        goodput_per_s=attainment * offered,
        ttft_p95_ms=percentile([r.ttft_ms for r in rows], 95),
        tbt_p99_ms=percentile([x for m in reqs for x in m.itl_ms], 99),
        tail_ttft_ms=_avg(tail, lambda r: r.ttft_ms),
        tail_queueing_ms=_avg(tail, lambda r: r.queueing_ms),
        tail_prefill_ms=_avg(tail, lambda r: r.prefill_ms),
        tail_transfer_ms=0.0,
        second_p95_ms=percentile([v for r in rows if (v := r.second_token_ms) is not None], 95),
        second_tail_ms=_avg(second, lambda r: r.second_token_ms),
        second_tail_ttft_ms=_avg(second, lambda r: r.ttft_ms),
        second_tail_queueing_ms=_avg(second, lambda r: r.queueing_ms),
        second_tail_prefill_ms=_avg(second, lambda r: r.prefill_ms),
        second_tail_transfer_ms=_avg(second, lambda r: r.transfer_ms),
        second_tail_wait_ms=_avg(second, lambda r: r.decode_wait_ms),
        handoffs=0 if pd is None else len(pd.handoffs),
        kept=0 if pd is None else len(pd.kept),
        deflected=0 if pd is None else len(pd.deflected),
        landing_waits=0 if pd is None else pd.landing_waits,
        wall_s=wall_s,
    )


def run_pd_point(
    spec: TraceSpec, pdc: PDConfig, load: float, slo: ClusterSlo, opts: ClusterOptions
) -> PDPoint:
    """One configuration on ``PD_REPLICAS`` replicas, routed by ``PD_ROUTER``; with
    deflection, a request's TTFT SLO and the TBT SLO are the experiment's."""
    config = dataclasses.replace(BASE, max_num_batched_tokens=slo.budget)
    w = spec.workload(PD_REPLICAS, load, opts.seed)
    roles = None if pdc.roles is None else Roles.parse(pdc.roles, PD_REPLICAS)
    deflection = (
        Deflection(TTFTBound(slo.tbt_ms, slo.ttft_per_token_ms), slo.tbt_ms)
        if pdc.deflect
        else None
    )
    started = time.perf_counter()
    res = simulate_cluster(
        w,
        PD_REPLICAS,
        config,
        opts.cost,
        PD_ROUTER,
        seed=opts.seed,
        roles=roles,
        deflection=deflection,
    )
    if len(res.requests) != w.num_requests:
        raise AssertionError(f"{spec.name}: {w.num_requests - len(res.requests)} requests lost")
    return summarize_pd(
        res,
        slo,
        trace=spec.name,
        config=pdc.name,
        load=load,
        wall_s=time.perf_counter() - started,
    )


def _pd_runs(opts: ClusterOptions, slo: ClusterSlo) -> list[PDPoint]:
    return [
        run_pd_point(spec, pdc, load, slo, opts)
        for spec in opts.traces
        if spec.name in PD_TRACES
        for load in opts.pd_loads
        for pdc in PD_CONFIGS
    ]


# ------------------------------------------------------------------ analysis
def capacity_load(points: Sequence[Point]) -> float | None:
    """The highest load below the knee (the last swept load before the first one under
    KNEE_BELOW): the policy's goodput capacity; None if even the lowest load fails."""
    best: float | None = None
    for p in sorted(points, key=lambda p: p.load):
        if p.attainment < KNEE_BELOW:
            break
        best = p.load
    return best


def knee_load(points: Sequence[Point]) -> float | None:
    """The first load (in sweep order) whose attainment falls below KNEE_BELOW."""
    for p in sorted(points, key=lambda p: p.load):
        if p.attainment < KNEE_BELOW:
            return p.load
    return None


def knee_cause(p: Point) -> str:
    """What the failing requests at a knee failed on, and what was behind it."""
    parts = [
        f"{p.ttft_fail} of {p.num_requests} missed TTFT, {p.tbt_fail} missed TBT",
    ]
    if p.queue_mean_ms is not None:
        parts.append(f"mean queueing {p.queue_mean_ms:.0f} ms")
    if p.preemptions:
        parts.append(f"{p.preemptions} preemptions")
    if p.transfer_spikes:
        parts.append(f"{p.transfer_spikes} transfer gaps above the TBT SLO")
    return "; ".join(parts)


def goodput_gain(
    points: Sequence[Point], policy: str, baseline: str = "round_robin"
) -> float | None:
    """The largest goodput ratio of ``policy`` over ``baseline`` across the points they
    share (same trace, replicas, load, budget, link); None without a common point."""
    base = {
        (p.trace, p.replicas, p.load, p.budget, p.link): p for p in points if p.policy == baseline
    }
    best: float | None = None
    for p in points:
        if p.policy != policy:
            continue
        b = base.get((p.trace, p.replicas, p.load, p.budget, p.link))
        if b is None or b.goodput_per_s <= 0:
            continue
        ratio = p.goodput_per_s / b.goodput_per_s
        if not math.isfinite(ratio):
            continue
        best = ratio if best is None else max(best, ratio)
    return best
