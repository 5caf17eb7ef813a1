"""``refserve compare``: scheduler policies over example 3's traces and a request-rate sweep.

The experiment of docs/ARCHITECTURE.md, example 3: the same traces (short chat, long prompt,
agent multi-turn, plus a chat stream with a few long prompts mixed in), a fixed request-rate
sweep, and several scheduling policies; report P50/P95/P99 TTFT, P99 TBT, tokens/s, goodput,
rejections and preemptions, and find where goodput bends as the rate rises.

Everything runs on the cost-model simulator (same scheduler and engine core as the real
engine). Choices, all overridable from the command line:

- **Cost model**: example 2's ``2 + 0.5P + D`` ms. With the default ``--scale 16`` one
  simulated token stands for 16 real ones, so 0.5 ms per simulated prefill token is about
  31 us per real token: roughly an 8B model on one H100/H200-class GPU. Decode and the
  fixed per-step term are teaching numbers, not a fit; every time in the report is the
  simulator's virtual ms on this model.
- **Scale**: token lengths are divided by ``--scale`` (see :mod:`ref.sim.workloads`); times
  (arrivals, tool waits) are not.
- **Engine**: token budget 512, block 16, 4096 KV blocks (65,536 simulated tokens, about
  1M real tokens at scale 16), at most 256 running requests.
- **SLOs** (per request, both must hold for goodput): TTFT <= ``ttft_base_ms +
  ttft_per_token_ms * prompt_tokens`` (default 500 ms + 1 ms per prompt token: twice the
  cost model's prefill time plus half a second, so a long prompt is not failed for being
  long), and TBT: every gap between two consecutive tokens <= ``tbt_ms`` (default 100 ms,
  an interactive reading pace of 10 tokens/s). A step with a full 512-token prefill chunk
  takes ~258 ms, so the TBT SLO binds and ``slo-aware`` (which sizes chunks to it) is
  exercised; at 300 ms no step came near it and ``slo-aware`` never cut a chunk.
- **Goodput**: ``goodput = SLO attainment x offered rate`` (requests/s that meet both SLOs;
  never above the offered rate); also output tokens/s of requests that meet them. For
  agent sessions the offered request rate is measured (turns / span of their arrivals):
  a turn arrives only after its predecessor finished plus the tool wait. The
  **knee** of a policy is the first swept rate whose attainment (goodput / offered) falls
  below ``--knee`` (0.9).

Policies are a list of :class:`NamedPolicy`; add one by appending to :data:`POLICIES`. A
policy that needs a :class:`~ref.core.config.SchedulerConfig` field this checkout lacks is
skipped and named in the report. ``slo-aware`` uses SLO-aware chunk sizing with the
simulator's cost model as the iteration model.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO, TypeVar

from ref.cli.main import MAX_BLOCKS, MAX_TOKENS, ArgumentParser, finite_float, int_at_most, run_cli
from ref.core.config import PolicyName, SchedulerConfig
from ref.core.cost import StepCost
from ref.core.engine_core import StepRecord
from ref.core.scheduler import Scheduler
from ref.core.swap import PreemptionMode, SwapCost
from ref.errors import InvalidArgument
from ref.files import atomic_write_text, check_output_dir, shown
from ref.report.plots import BarGroup, Point, grouped_bar_chart_png, line_chart_png
from ref.sim.metrics import RequestMetrics, RunMetrics, jain_index, percentile
from ref.sim.simulator import simulate
from ref.sim.trace import load_trace
from ref.sim.workloads import (
    Workload,
    agent_sessions,
    from_records,
    long_prompt,
    long_prompt_records,
    merge_records,
    short_chat,
    short_chat_records,
)

DEFAULT_COST = "2+0.5P+D"
DEFAULT_SCALE = 16.0
STOP_BELOW = 0.5
BASE_CONFIG = SchedulerConfig(
    max_num_batched_tokens=512, max_num_seqs=256, block_size=16, num_blocks=4096
)
# Limits of the options, checked before anything is built. Scale 1
# is example 3's real lengths; below it a session would outgrow what the simulator replays
# in reasonable time. A run's requests (sessions) are built in memory up front.
MIN_SCALE, MAX_SCALE = 1.0, 65536.0
MAX_RATE = 10_000.0
MAX_REQUESTS = 100_000
MAX_SLO_MS = 1e9


# ------------------------------------------------------------------------ SLOs
@dataclass(frozen=True)
class Slo:
    """Per-request service level: both must hold for a request to count as goodput."""

    ttft_base_ms: float = 500.0
    ttft_per_token_ms: float = 1.0
    tbt_ms: float = 100.0

    def ttft_limit_ms(self, num_prompt_tokens: int) -> float:
        return self.ttft_base_ms + self.ttft_per_token_ms * num_prompt_tokens

    def met(self, m: RequestMetrics) -> bool:
        """Finished normally, first token in time, and no gap between tokens too long."""
        if m.finish_reason not in ("stop", "length"):
            return False
        return self.ttft_met(m) and self.tbt_met(m)

    def ttft_met(self, m: RequestMetrics) -> bool:
        return m.ttft_ms is not None and m.ttft_ms <= self.ttft_limit_ms(m.num_prompt_tokens)

    def tbt_met(self, m: RequestMetrics) -> bool:
        return all(gap <= self.tbt_ms for gap in m.itl_ms)


# ------------------------------------------------------------------------ policies
@dataclass(frozen=True)
class NamedPolicy:
    """A scheduler configuration under a name.

    ``configure(base, max_len, slo, cost)`` returns the config for a workload whose
    longest sequence is ``max_len`` tokens on a simulator with step cost ``cost``.
    ``requires`` names SchedulerConfig fields the policy needs; without them it is
    skipped (and the report says so).
    """

    name: str
    description: str
    configure: Callable[[SchedulerConfig, int, Slo, StepCost], SchedulerConfig]
    requires: tuple[str, ...] = ()

    def available(self) -> bool:
        have = {f.name for f in dataclasses.fields(SchedulerConfig)}
        return all(r in have for r in self.requires)


def _fcfs(base: SchedulerConfig, max_len: int, slo: Slo, cost: StepCost) -> SchedulerConfig:
    # Without chunking a prompt must fit in one step: the budget grows to the longest
    # sequence, as vLLM sets max_num_batched_tokens = max_model_len without chunking.
    return dataclasses.replace(
        base,
        enable_chunked_prefill=False,
        enable_prefix_caching=False,
        max_num_batched_tokens=max(base.max_num_batched_tokens, max_len + 1),
    )


def _static(base: SchedulerConfig, max_len: int, slo: Slo, cost: StepCost) -> SchedulerConfig:
    return dataclasses.replace(_fcfs(base, max_len, slo, cost), policy=PolicyName.STATIC)


def _chunked(base: SchedulerConfig, max_len: int, slo: Slo, cost: StepCost) -> SchedulerConfig:
    return dataclasses.replace(base, enable_chunked_prefill=True, enable_prefix_caching=False)


def _prefix_aware(base: SchedulerConfig, max_len: int, slo: Slo, cost: StepCost) -> SchedulerConfig:
    return dataclasses.replace(base, enable_chunked_prefill=True, enable_prefix_caching=True)


def _reserve(base: SchedulerConfig, max_len: int, slo: Slo, cost: StepCost) -> SchedulerConfig:
    return dataclasses.replace(
        _prefix_aware(base, max_len, slo, cost),
        prefill_reserve_tokens=max(1, base.max_num_batched_tokens // 8),
    )


def _slo_aware(base: SchedulerConfig, max_len: int, slo: Slo, cost: StepCost) -> SchedulerConfig:
    # The simulator's own cost model is the iteration model (in the real engine it would
    # be fitted from recorded steps: ref.core.cost.fit_step_cost).
    return dataclasses.replace(
        _prefix_aware(base, max_len, slo, cost), tbt_slo_ms=slo.tbt_ms, step_cost=cost
    )


POLICIES: tuple[NamedPolicy, ...] = (
    NamedPolicy(
        "static",
        "static batching: a new batch only when the whole previous one finished; whole "
        "prompts, no prefix cache",
        _static,
    ),
    NamedPolicy(
        "fcfs",
        "continuous batching, FCFS admission, whole prompts in one step (chunked prefill "
        "off), no prefix cache: a long prompt stalls every decode for its whole prefill",
        _fcfs,
    ),
    NamedPolicy(
        "chunked",
        "decode-first with chunked prefill (budget 512), no prefix cache",
        _chunked,
    ),
    NamedPolicy(
        "prefix-aware",
        "decode-first, chunked prefill and the prefix cache on",
        _prefix_aware,
    ),
    NamedPolicy(
        "reserve",
        "prefix-aware plus example 2d's starvation fix: 1/8 of the budget reserved for a "
        "prefill that waited 8 steps",
        _reserve,
    ),
    NamedPolicy(
        "slo-aware",
        "prefix-aware plus SLO-aware chunk sizing: prefill chunks shrink so the predicted "
        "step keeps the tightest decode within the TBT SLO",
        _slo_aware,
        requires=("tbt_slo_ms", "step_cost"),
    ),
)


# ------------------------------------------------------------------------ traces
@dataclass(frozen=True)
class TraceSpec:
    """A workload family swept over rates: ``build(rate, n, scale, seed)``."""

    name: str
    description: str
    rate_unit: str
    num: int
    quick_num: int
    rates: tuple[float, ...]
    quick_rates: tuple[float, ...]
    build: Callable[[float, int, float, int], Workload]
    # At least ``rate * min_window_s`` units, so arrivals last long enough for the load
    # to be sustained (an agent session lives ~10 s: 48 sessions at 16/s would all start
    # within 3 s and the system would never see 16 sessions/s in steady state).
    min_window_s: float = 0.0

    def num_units(self, rate: float, num: int | None, quick: bool) -> int:
        if num is not None:
            return num
        if quick:
            return self.quick_num
        return max(self.num, math.ceil(rate * self.min_window_s))


def _chat(rate: float, n: int, scale: float, seed: int) -> Workload:
    return Workload("chat", tuple(short_chat(n, rate, seed=seed, scale=scale)))


def _long(rate: float, n: int, scale: float, seed: int) -> Workload:
    return Workload("long", tuple(long_prompt(n, rate, seed=seed, scale=scale)))


def _mixed(rate: float, n: int, scale: float, seed: int) -> Workload:
    n_long = max(1, round(n * 0.05))
    # Two tenants, so fairness asks whether the long prompts cost the chat users.
    chat = [
        {**r, "tenant": "chat"}
        for r in short_chat_records(n - n_long, rate * 0.95, seed=seed, scale=scale)
    ]
    long = [
        {**r, "tenant": "long"}
        for r in long_prompt_records(n_long, rate * 0.05, seed=seed + 1, scale=scale)
    ]
    return Workload("mixed", tuple(from_records(merge_records(chat, long))))


def _agent(rate: float, n: int, scale: float, seed: int) -> Workload:
    # Each session is its own tenant: fairness across sessions of one shared prefix.
    sessions = agent_sessions(n, rate, seed=seed, scale=scale)
    return Workload(
        "agent", sessions=tuple(dataclasses.replace(s, tenant=s.session_id) for s in sessions)
    )


TRACES: tuple[TraceSpec, ...] = (
    TraceSpec(
        "chat",
        "short chat: prompt ~1K (+-50 %), output ~128 (+-50 %), Poisson arrivals",
        "req/s",
        200,
        24,
        (4, 8, 12, 16, 20, 24, 28, 32),
        (4, 24),
        _chat,
    ),
    TraceSpec(
        "long",
        "long prompt: prompt ~64K (+-25 %), output ~128 (+-25 %), Poisson arrivals",
        "req/s",
        40,
        6,
        (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6),
        (0.1, 0.6),
        _long,
    ),
    TraceSpec(
        "mixed",
        "chat with 5 % long prompts mixed in (head-of-line blocking), Poisson arrivals",
        "req/s",
        200,
        24,
        (0.5, 1, 2, 3, 4, 6, 8),
        (1, 6),
        _mixed,
    ),
    TraceSpec(
        "agent",
        "agent sessions: ~80K shared prefix, 3-6 turns of +1K tokens and ~128 outputs, "
        "tool waits log-uniform 0.1-10 s; Poisson session starts",
        "sessions/s",
        48,
        4,
        (0.05, 0.1, 0.2, 0.5, 1, 2, 4, 8, 12, 16),
        (0.1, 2),
        _agent,
        min_window_s=20.0,
    ),
)


# ------------------------------------------------------------------------ limits
# A step counts as KV-bound when it preempted or ran with at least this share of the
# pool in use: admission stalls on free blocks before the pool is literally full.
KV_FULL = 0.95
# The binding limit must hold in at least this share of steps to be named as a knee's
# cause; below it no limit saturated and the SLO failed on step time alone.
BOUND_FLOOR = 0.2
NO_LIMIT = "none: step time"


@dataclass(frozen=True)
class LimitFractions:
    """Share of a run's steps spent at each engine limit (0 to 1 each).

    ``token_budget``: the step computed the whole token budget; ``max_seqs``: it ran
    ``max_num_seqs`` requests; ``kv_blocks``: it preempted or had ``KV_FULL`` of the pool
    in use; ``swap``: it moved KV over the host link.
    """

    token_budget: float = 0.0
    max_seqs: float = 0.0
    kv_blocks: float = 0.0
    swap: float = 0.0

    def cause(self, floor: float = BOUND_FLOOR) -> str:
        """The limit that bound most often, or :data:`NO_LIMIT` when none reached ``floor``.

        Ties go to the scarcer resource first (KV, swap, sequences, then the budget):
        a step at the budget that also preempted was stopped by memory.
        """
        named = (
            ("KV blocks", self.kv_blocks),
            ("swap bandwidth", self.swap),
            ("max sequences", self.max_seqs),
            ("token budget", self.token_budget),
        )
        name, share = max(named, key=lambda x: x[1])
        return name if share >= floor else NO_LIMIT


def limit_fractions(steps: Sequence[StepRecord], config: SchedulerConfig) -> LimitFractions:
    """Measure :class:`LimitFractions` from a run's step records."""
    if not steps:
        return LimitFractions()
    n = len(steps)
    kv_full = KV_FULL * config.num_blocks
    return LimitFractions(
        token_budget=sum(
            1 for s in steps if sum(t for _, t in s.tokens) >= config.max_num_batched_tokens
        )
        / n,
        max_seqs=sum(1 for s in steps if len(s.tokens) >= config.max_num_seqs) / n,
        kv_blocks=sum(1 for s in steps if s.plan.preempted or s.kv_blocks_used >= kv_full) / n,
        swap=sum(1 for s in steps if s.plan.swap_out or s.plan.swap_in) / n,
    )


def tenant_fairness(reqs: Sequence[RequestMetrics], slo: Slo) -> float | None:
    """Jain's index over per-tenant SLO attainment (each tenant's goodput normalized by
    its own offered requests); None with fewer than two tenants."""
    tenants: dict[str, list[bool]] = {}
    for m in reqs:
        tenants.setdefault(m.tenant, []).append(slo.met(m))
    if len(tenants) < 2:
        return None
    return jain_index([sum(v) / len(v) for v in tenants.values()])


# ------------------------------------------------------------------------ one run
@dataclass(frozen=True)
class PointResult:
    trace: str
    policy: str
    rate: float
    offered_rps: float
    num_requests: int
    num_finished: int
    ttft_p50_ms: float | None
    ttft_p95_ms: float | None
    ttft_p99_ms: float | None
    tbt_p99_ms: float | None
    output_tokens_per_s: float
    slo_attainment: float
    goodput_rps: float
    goodput_tokens_per_s: float
    rejected: int
    preemptions: int
    cached_tokens: int
    prefix_hit_rate: float
    makespan_ms: float
    num_steps: int
    wall_s: float
    num_tenants: int = 1
    fairness: float | None = None  # Jain's index over tenants' SLO attainment
    rejection_rate: float = 0.0  # did not finish normally / requests
    capacity_rate: float = 0.0  # finished "capacity" (could never fit: an OOM) / requests
    limits: LimitFractions = LimitFractions()
    # Shares of requests that missed each SLO (a request may miss both): when no engine
    # limit bound, these say whether queueing (TTFT) or long steps (TBT) broke the SLO.
    ttft_miss_rate: float = 0.0
    tbt_miss_rate: float = 0.0

    def cause(self) -> str:
        """The limit that bound in this run; failing that, the SLO missed most."""
        cause = self.limits.cause()
        if cause != NO_LIMIT or self.ttft_miss_rate == self.tbt_miss_rate == 0:
            return cause
        return (
            f"{NO_LIMIT} (TBT)"
            if self.tbt_miss_rate >= self.ttft_miss_rate
            else (f"{NO_LIMIT} (TTFT)")
        )


def run_point(
    spec: TraceSpec,
    workload: Workload,
    policy: NamedPolicy,
    rate: float,
    base: SchedulerConfig,
    cost: StepCost,
    slo: Slo,
) -> PointResult:
    """Run one workload under one policy and summarize it."""
    started = time.perf_counter()
    config = policy.configure(base, workload.max_len, slo, cost)
    # Steps are kept: which limit bound is read from them (then they are dropped).
    result = workload.run(Scheduler(config), cost, keep_steps=True)
    reqs = [RequestMetrics.of(r) for r in result.requests]
    run = RunMetrics.of(reqs, result.makespan_ms)
    met = [m for m in reqs if slo.met(m)]
    n = workload.num_requests
    offered = rate
    if workload.sessions:
        # A turn arrives only after the previous one finished and its tool wait, so the
        # offered request rate is measured: turns over the span of their arrivals.
        arrivals = [r.arrival_ms for r in result.requests]
        span_s = (max(arrivals) - min(arrivals)) / 1e3 if arrivals else 0.0
        offered = n / span_s if span_s > 0 else rate
    attainment = len(met) / n if n else 0.0
    secs = result.makespan_ms / 1e3 if result.makespan_ms > 0 else math.inf
    prompt_tokens = sum(m.num_prompt_tokens for m in reqs)
    finished = sum(1 for m in reqs if m.finish_reason in ("stop", "length"))
    return PointResult(
        trace=spec.name,
        policy=policy.name,
        rate=rate,
        offered_rps=offered,
        num_requests=n,
        num_finished=sum(1 for m in reqs if m.finish_reason in ("stop", "length")),
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
        rejected=n - sum(1 for m in reqs if m.finish_reason in ("stop", "length")),
        preemptions=run.num_preemptions,
        cached_tokens=run.num_cached_tokens,
        prefix_hit_rate=run.num_cached_tokens / prompt_tokens if prompt_tokens else 0.0,
        makespan_ms=result.makespan_ms,
        num_steps=result.num_steps,
        wall_s=time.perf_counter() - started,
        num_tenants=len({m.tenant for m in reqs}),
        fairness=tenant_fairness(reqs, slo),
        rejection_rate=(n - finished) / n if n else 0.0,
        capacity_rate=sum(1 for m in reqs if m.finish_reason == "capacity") / n if n else 0.0,
        limits=limit_fractions(result.steps, config),
        ttft_miss_rate=sum(1 for m in reqs if not slo.ttft_met(m)) / n if n else 0.0,
        tbt_miss_rate=sum(1 for m in reqs if not slo.tbt_met(m)) / n if n else 0.0,
    )


def knee_point(points: Sequence[PointResult], threshold: float) -> PointResult | None:
    """The run at the first swept rate whose goodput / offered falls below ``threshold``."""
    for p in sorted(points, key=lambda p: p.rate):
        if p.slo_attainment < threshold:
            return p
    return None


def knee_rate(points: Sequence[PointResult], threshold: float) -> float | None:
    """The first swept rate whose goodput / offered falls below ``threshold``."""
    p = knee_point(points, threshold)
    return None if p is None else p.rate


def knee_cause(points: Sequence[PointResult], threshold: float) -> str | None:
    """The limit that bound at the knee (None: no knee in the sweep)."""
    p = knee_point(points, threshold)
    return None if p is None else p.cause()


# ------------------------------------------------------------------------ recompute vs swap
# README's memory-pressure experiment: a 7B-like model (512 KiB of KV per token), a pool
# small enough that 12 long requests preempt each other. At 25 GB/s the round trip
# (0.042 ms/token) is cheaper than recomputing (0.07 ms/token); at 8 GB/s (0.131) dearer.
SWAP_TRACE = "memory_pressure"
SWAP_COST = "7+0.07P+0.05D"
SWAP_KV_BYTES_PER_TOKEN = 512 * 1024
SWAP_HOST_BLOCKS = 4096
SWAP_LINKS_GB_PER_S = (25.0, 8.0)
SWAP_CONFIG = SchedulerConfig(max_num_batched_tokens=2048, block_size=16, num_blocks=700)


@dataclass(frozen=True)
class SwapResult:
    """One preemption mode on the memory-pressure trace (times in virtual ms)."""

    mode: str
    link_gb_per_s: float | None  # None: recompute, no host link used
    makespan_ms: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    e2e_p99_ms: float | None
    preemptions: int
    swapped_out: int  # requests whose KV went to the host

    @property
    def label(self) -> str:
        return (
            self.mode if self.link_gb_per_s is None else f"{self.mode} {self.link_gb_per_s:g} GB/s"
        )


def run_swap_comparison() -> list[SwapResult]:
    """The same trace under recompute, swap and auto preemption at two link speeds."""
    cost = StepCost.parse(SWAP_COST)
    trace = load_trace(SWAP_TRACE)
    runs: list[tuple[PreemptionMode, float | None]] = [(PreemptionMode.RECOMPUTE, None)]
    runs += [
        (m, g) for g in SWAP_LINKS_GB_PER_S for m in (PreemptionMode.SWAP, PreemptionMode.AUTO)
    ]
    out: list[SwapResult] = []
    for mode, link in runs:
        cfg = SWAP_CONFIG
        if link is not None:
            cfg = dataclasses.replace(
                cfg,
                preemption_mode=mode,
                num_host_blocks=SWAP_HOST_BLOCKS,
                swap_cost=SwapCost(SWAP_KV_BYTES_PER_TOKEN, link, iteration=cost),
            )
        result = simulate(Scheduler(cfg), [t.to_request() for t in trace], cost, keep_steps=False)
        reqs = [RequestMetrics.of(r) for r in result.requests]
        run = RunMetrics.of(reqs, result.makespan_ms)
        e2es = [e for m in reqs if (e := m.e2e_ms) is not None]
        out.append(
            SwapResult(
                mode=mode.value,
                link_gb_per_s=link,
                makespan_ms=result.makespan_ms,
                ttft_p50_ms=run.ttft_ms["p50"],
                ttft_p99_ms=run.ttft_ms["p99"],
                itl_p50_ms=run.itl_ms["p50"],
                itl_p99_ms=run.itl_ms["p99"],
                e2e_p99_ms=percentile(e2es, 99),
                preemptions=run.num_preemptions,
                swapped_out=0 if result.swap is None else result.swap.num_swapped_out,
            )
        )
    return out


# ------------------------------------------------------------------------ progress
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


# ------------------------------------------------------------------------ the sweep
@dataclass(frozen=True)
class CompareOptions:
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


def run_compare(
    opts: CompareOptions, stream: TextIO, *, progress: bool = True
) -> dict[str, object]:
    """Run the sweep, write ``report.md``, ``report.json`` and the PNG plots; return the JSON."""
    active = [p for p in opts.policies if p.available()]
    skipped = [p for p in opts.policies if not p.available()]
    plan: list[tuple[TraceSpec, tuple[float, ...]]] = []
    for spec in opts.traces:
        rates = opts.rates or (spec.quick_rates if opts.quick else spec.rates)
        plan.append((spec, tuple(sorted(rates))))
    bar = Progress(sum(len(r) for _, r in plan) * len(active), stream, enabled=progress)
    started = time.perf_counter()
    points: list[PointResult] = []
    stopped: dict[str, dict[str, float]] = {}  # trace -> policy -> first rate not run
    for spec, rates in plan:
        bad_in_a_row = dict.fromkeys((p.name for p in active), 0)
        for rate in rates:
            n = spec.num_units(rate, opts.num, opts.quick)
            workload = spec.build(rate, n, opts.scale, opts.seed)
            for policy in active:
                label = f"{spec.name} {policy.name} @ {rate:g} {spec.rate_unit}"
                if opts.stop_after is not None and bad_in_a_row[policy.name] >= opts.stop_after:
                    stopped.setdefault(spec.name, {}).setdefault(policy.name, rate)
                    bar.advance(label + " (skipped: past its knee)")
                    continue
                point = run_point(spec, workload, policy, rate, opts.base, opts.cost, opts.slo)
                points.append(point)
                bad = point.slo_attainment < STOP_BELOW
                bad_in_a_row[policy.name] = bad_in_a_row[policy.name] + 1 if bad else 0
                bar.advance(label)
    bar.close()
    swap = run_swap_comparison()
    wall = time.perf_counter() - started
    check_output_dir(opts.out, "--out")  # checked before the sweep too; it may have gone
    plots = _write_plots(opts, plan, active, points, swap)
    knees = {
        spec.name: {
            p.name: knee_rate(
                [x for x in points if x.trace == spec.name and x.policy == p.name], opts.knee
            )
            for p in active
        }
        for spec, _ in plan
    }
    causes = {
        spec.name: {
            p.name: knee_cause(
                [x for x in points if x.trace == spec.name and x.policy == p.name], opts.knee
            )
            for p in active
        }
        for spec, _ in plan
    }
    report: dict[str, object] = {
        "settings": {
            "cost_model": str(opts.cost),
            "scale": opts.scale,
            "seed": opts.seed,
            "quick": opts.quick,
            "knee_threshold": opts.knee,
            "slo": dataclasses.asdict(opts.slo),
            "base_config": {
                k: v if isinstance(v, int | float | bool) else str(v)
                for k, v in dataclasses.asdict(opts.base).items()
            },
            "wall_s": round(wall, 3),
        },
        "traces": [
            {
                "name": s.name,
                "description": s.description,
                "rate_unit": s.rate_unit,
                "rates": list(r),
            }
            for s, r in plan
        ],
        "policies": [{"name": p.name, "description": p.description} for p in active],
        "skipped_policies": [
            {"name": p.name, "needs": list(p.requires), "description": p.description}
            for p in skipped
        ],
        "knees": knees,
        "knee_causes": causes,
        "stopped_early": stopped,
        "plots": plots,
        "points": [dataclasses.asdict(p) for p in points],
        "swap_vs_recompute": {
            "trace": SWAP_TRACE,
            "cost_model": SWAP_COST,
            "kv_bytes_per_token": SWAP_KV_BYTES_PER_TOKEN,
            "num_blocks": SWAP_CONFIG.num_blocks,
            "runs": [dataclasses.asdict(r) for r in swap],
        },
    }
    # Each file goes to a temporary name first: Ctrl-C never leaves half of one. Strict
    # JSON (allow_nan=False): a non-finite number is a bug to report, not a file to write.
    atomic_write_text(
        opts.out / "report.json", json.dumps(report, indent=2, allow_nan=False) + "\n", "--out"
    )
    atomic_write_text(
        opts.out / "report.md",
        render_markdown(
            opts, plan, active, skipped, points, knees, plots, wall, stopped, causes, swap
        ),
        "--out",
    )
    return report


def _write_plots(
    opts: CompareOptions,
    plan: Sequence[tuple[TraceSpec, tuple[float, ...]]],
    policies: Sequence[NamedPolicy],
    points: Sequence[PointResult],
    swap: Sequence[SwapResult],
) -> dict[str, dict[str, str]]:
    plots: dict[str, dict[str, str]] = {}
    for spec, _ in plan:
        mine = [p for p in points if p.trace == spec.name]

        def series(
            get: Callable[[PointResult], float | None], mine: list[PointResult] = mine
        ) -> dict[str, list[Point]]:
            return {
                pol.name: [(p.rate, get(p)) for p in mine if p.policy == pol.name]
                for pol in policies
            }

        offered: list[Point] = sorted({(p.rate, p.offered_rps) for p in mine})
        swept = [p.rate for p in mine]
        log_x = bool(swept) and max(swept) / min(swept) >= 50
        names = {"goodput": f"goodput_{spec.name}.png", "ttft_p99": f"ttft_p99_{spec.name}.png"}
        line_chart_png(
            opts.out / names["goodput"],
            f"{spec.name}: goodput (both SLOs met) vs offered rate",
            f"rate ({spec.rate_unit})",
            "goodput (req/s)",
            series(lambda p: p.goodput_rps),
            log_x=log_x,
            reference=offered,
            reference_label="offered (req/s)",
        )
        line_chart_png(
            opts.out / names["ttft_p99"],
            f"{spec.name}: P99 TTFT vs offered rate",
            f"rate ({spec.rate_unit})",
            "P99 TTFT (ms)",
            series(lambda p: p.ttft_p99_ms),
            log_y=True,
            log_x=log_x,
        )
        plots[spec.name] = names
    if swap:
        name = "swap_vs_recompute.png"
        grouped_bar_chart_png(
            opts.out / name,
            f"recompute vs swap on {SWAP_TRACE} (cost {SWAP_COST} ms)",
            "preemption mode (host link)",
            "latency (virtual ms, log scale)",
            [
                BarGroup(
                    r.label,
                    {
                        "TTFT p99": r.ttft_p99_ms,
                        "ITL p50": r.itl_p50_ms,
                        "ITL p99": r.itl_p99_ms,
                        "E2E p99": r.e2e_p99_ms,
                    },
                )
                for r in swap
            ],
            log_y=True,
        )
        plots["swap"] = {"latency": name}
    return plots


# ------------------------------------------------------------------------ markdown
def _knee_text(knee: float | None, rates: Sequence[float]) -> str:
    """``> max`` when no swept rate fell below, ``<= min`` when already the first did."""
    if knee is None:
        return f"> {max(rates):g}"
    return f"<= {knee:g}" if knee == min(rates) else f"{knee:g}"


def _f(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def render_markdown(
    opts: CompareOptions,
    plan: Sequence[tuple[TraceSpec, tuple[float, ...]]],
    policies: Sequence[NamedPolicy],
    skipped: Sequence[NamedPolicy],
    points: Sequence[PointResult],
    knees: dict[str, dict[str, float | None]],
    plots: dict[str, dict[str, str]],
    wall_s: float,
    stopped: dict[str, dict[str, float]] | None = None,
    causes: dict[str, dict[str, str | None]] | None = None,
    swap: Sequence[SwapResult] = (),
) -> str:
    slo = opts.slo
    base = opts.base
    lines = [
        "# refserve compare: scheduling policies over example 3's traces",
        "",
        f"Simulator, cost model `{opts.cost}` ms per step (P prefill tokens, D decodes), "
        f"token lengths divided by {opts.scale:g} (scale), seed {opts.seed}"
        f"{', quick run' if opts.quick else ''}; {len(points)} runs in {wall_s:.1f} s.",
        f"Engine: token budget {base.max_num_batched_tokens}, block {base.block_size}, "
        f"{base.num_blocks} KV blocks, max {base.max_num_seqs} running requests. "
        "Times are the simulator's virtual ms.",
        "",
        f"SLOs per request: TTFT <= {slo.ttft_base_ms:g} ms + {slo.ttft_per_token_ms:g} ms "
        f"x prompt tokens; every gap between tokens (TBT) <= {slo.tbt_ms:g} ms. "
        "**Goodput** = requests/s meeting both (= SLO attainment x offered rate; for agent "
        "sessions the offered request rate is measured: turns over the span of their "
        "arrivals, since a turn waits for its predecessor and the tool). "
        f"**Knee**: the first swept rate where goodput / offered < {opts.knee:g}.",
        "",
        "## Policies",
        "",
    ]
    lines += [f"- **{p.name}**: {p.description}" for p in policies]
    for p in skipped:
        lines.append(
            f"- ~~{p.name}~~ skipped: this checkout's SchedulerConfig has no "
            f"{', '.join(p.requires)} ({p.description})"
        )
    lines += ["", f"## Knee rates (first rate where goodput / offered < {opts.knee:g})", ""]
    head = "| trace | unit | " + " | ".join(p.name for p in policies) + " |"
    lines += [head, "|" + "---|" * (len(policies) + 2)]
    for spec, rates in plan:
        cells = []
        for p in policies:
            k = knees[spec.name][p.name]
            cells.append(_knee_text(k, rates))
        lines.append(f"| {spec.name} | {spec.rate_unit} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Summary",
        "",
        "Per trace and policy: the knee and **what limits it** (the engine limit that "
        "bound in the most steps of the run at the knee rate: token budget, max sequences, "
        f"KV blocks (a preemption or >= {KV_FULL:.0%} of the pool in use) or swap "
        f"bandwidth; `{NO_LIMIT}` when none bound in {BOUND_FLOOR:.0%} of steps, i.e. the "
        "SLO failed on how long steps take, not on a full resource, with the SLO missed "
        "by more requests in brackets: TBT, a prefill chunk made the step too long for "
        "the decodes in it; TTFT, prompts queued behind others' prefill), the highest swept "
        "rate still at or above the threshold, the peak goodput over the sweep, P99 TTFT / "
        "P99 TBT at the last good rate, tenant fairness at the knee (or the highest rate "
        "run when there is none), and the share of requests "
        "over the whole sweep that did not finish normally (rejected or capacity / OOM).",
        "",
        "| trace | policy | knee | knee cause | last good rate | peak goodput req/s (at rate) | "
        "P99 TTFT ms | P99 TBT ms | fairness at knee | rejected / OOM | preemptions |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for spec, rates in plan:
        for pol in policies:
            row = sorted(
                (x for x in points if x.trace == spec.name and x.policy == pol.name),
                key=lambda x: x.rate,
            )
            k = knees[spec.name][pol.name]
            good = [x for x in row if k is None or x.rate < k]
            last = good[-1] if good else None
            peak = max(row, key=lambda x: x.goodput_rps)
            cause = (causes or {}).get(spec.name, {}).get(pol.name)
            asked = sum(x.num_requests for x in row)
            failed = sum(x.rejected for x in row)
            oom = sum(round(x.capacity_rate * x.num_requests) for x in row)
            # Fairness where it is tested: at the knee (or the top of the sweep).
            strained = next((x for x in row if x.rate == k), row[-1])
            lines.append(
                f"| {spec.name} | {pol.name} | "
                f"{_knee_text(k, rates)} | {cause or '-'} | "
                f"{'-' if last is None else f'{last.rate:g}'} | "
                f"{peak.goodput_rps:.2f} ({peak.rate:g}) | "
                f"{_f(None if last is None else last.ttft_p99_ms)} | "
                f"{_f(None if last is None else last.tbt_p99_ms)} | "
                f"{_f(strained.fairness, 2)} | "
                f"{_pct(failed / max(asked, 1))} / {_pct(oom / max(asked, 1))} | "
                f"{sum(x.preemptions for x in row)} |"
            )
    for spec, _ in plan:
        mine = [p for p in points if p.trace == spec.name]
        lines += [
            "",
            f"## {spec.name}",
            "",
            spec.description + ".",
            "",
            f"![goodput vs rate, {spec.name}]({plots[spec.name]['goodput']}) "
            f"![P99 TTFT vs rate, {spec.name}]({plots[spec.name]['ttft_p99']})",
            "",
            f"| policy | rate ({spec.rate_unit}) | offered req/s | TTFT p50 | p95 | p99 ms | "
            "TBT p99 ms | out tok/s | SLO met | goodput req/s | fairness | rejected | OOM | "
            "preempted | prefix hit | steps at budget / max seqs / KV full |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for pol in policies:
            for r in sorted((x for x in mine if x.policy == pol.name), key=lambda x: x.rate):
                lines.append(
                    f"| {pol.name} | {r.rate:g} | {r.offered_rps:.2f} | {_f(r.ttft_p50_ms)} | "
                    f"{_f(r.ttft_p95_ms)} | {_f(r.ttft_p99_ms)} | {_f(r.tbt_p99_ms)} | "
                    f"{r.output_tokens_per_s:,.0f} | {100 * r.slo_attainment:.0f} % | "
                    f"{r.goodput_rps:.2f} | {_f(r.fairness, 2)} | {r.rejected} | "
                    f"{_pct(r.capacity_rate)} | {r.preemptions} | "
                    f"{100 * r.prefix_hit_rate:.0f} % | {_pct(r.limits.token_budget)} / "
                    f"{_pct(r.limits.max_seqs)} / {_pct(r.limits.kv_blocks)} |"
                )
    lines += [
        "",
        "Rows stop where a policy had SLO attainment below "
        f"{STOP_BELOW:.0%} at {opts.stop_after} rates in a row (far past its knee; "
        "`--full-sweep` runs them all)"
        + (
            ": "
            + "; ".join(
                f"{t} {p} from {r:g}" for t, per in (stopped or {}).items() for p, r in per.items()
            )
            if stopped
            else ""
        )
        + ".",
        "",
        "Rejected: requests that did not finish normally (capacity or timeout finishes; "
        "none of these policies sets a queue bound or timeout); OOM: the share that "
        "finished `capacity` (could never fit in the pool). Prefix hit: prompt tokens "
        "found in the prefix cache / all prompt tokens. Fairness: Jain's index over the "
        "tenants' SLO attainment (1 = every tenant equally served, 1/n = one tenant gets "
        "all); mixed has two tenants (chat, long), agent one per session, chat and long "
        "a single one (-).",
        "",
    ]
    lines += _swap_markdown(swap, plots)
    return "\n".join(lines)


def _pct(x: float) -> str:
    return f"{100 * x:.0f} %"


def _swap_markdown(swap: Sequence[SwapResult], plots: dict[str, dict[str, str]]) -> list[str]:
    if not swap:
        return []
    base = swap[0]
    lines = [
        "## Recompute vs swap",
        "",
        f"Trace `{SWAP_TRACE}` (12 requests of 600-1600 prompt and 200-500 output tokens), "
        f"a {SWAP_CONFIG.num_blocks}-block pool, cost `{SWAP_COST}` ms per step, "
        f"{SWAP_KV_BYTES_PER_TOKEN // 1024} KiB of KV per token (a 7B-like model), "
        f"{SWAP_HOST_BLOCKS} host blocks; `auto` swaps only when the round trip is "
        "cheaper than recomputing. Real token lengths (no scale).",
        "",
        f"![recompute vs swap]({plots['swap']['latency']})",
        "",
        "| mode | makespan ms (vs recompute) | TTFT p50 | p99 ms | ITL p50 | p99 ms | "
        "E2E p99 ms | preemptions | swapped out |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in swap:
        lines.append(
            f"| {r.label} | {r.makespan_ms:,.0f} ({r.makespan_ms / base.makespan_ms:.3f}x) | "
            f"{_f(r.ttft_p50_ms)} | {_f(r.ttft_p99_ms)} | {_f(r.itl_p50_ms)} | "
            f"{_f(r.itl_p99_ms)} | {_f(r.e2e_p99_ms)} | {r.preemptions} | {r.swapped_out} |"
        )
    lines.append("")
    return lines


# ------------------------------------------------------------------------ CLI
def _float_list(text: str) -> tuple[float, ...]:
    try:
        rates = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected numbers like 1,2,4; got {text[:60]!r}"
        ) from None
    if not rates or any(not (0 < r <= MAX_RATE) for r in rates):
        raise argparse.ArgumentTypeError(
            f"rates must be finite numbers > 0 and <= {MAX_RATE:g}; got {text[:60]!r}"
        )
    return rates


def _names(text: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(","))
    if not all(names):
        raise argparse.ArgumentTypeError(f"expected names like a,b; got {text[:60]!r}")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"a name is given twice in {text[:60]!r}")
    return names


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="refserve compare",
        description="Compare scheduling policies over example 3's traces and a rate sweep "
        "on the simulator; writes DIR/report.md, DIR/report.json and PNG plots.",
    )
    ms = finite_float(0, MAX_SLO_MS)
    p.add_argument("--out", type=Path, default=Path("compare-report"), help="output folder")
    p.add_argument(
        "--rates",
        type=_float_list,
        help=f"rates to sweep for every trace (default: per trace; each <= {MAX_RATE:g})",
    )
    p.add_argument("--quick", action="store_true", help="few requests and rates (seconds)")
    p.add_argument("--traces", type=_names, help=f"subset of {','.join(t.name for t in TRACES)}")
    p.add_argument(
        "--policies", type=_names, help=f"subset of {','.join(x.name for x in POLICIES)}"
    )
    p.add_argument(
        "--requests",
        type=int_at_most(MAX_REQUESTS),
        help=f"requests (sessions for agent) per run (at most {MAX_REQUESTS:,})",
    )
    p.add_argument(
        "--scale",
        type=finite_float(MIN_SCALE, MAX_SCALE),
        default=DEFAULT_SCALE,
        help=f"divide token lengths ({MIN_SCALE:g} to {MAX_SCALE:g}; 1 = example 3's lengths)",
    )
    p.add_argument("--seed", type=int_at_most((1 << 63) - 1, lo=-(1 << 63)), default=0)
    p.add_argument("--cost", default=DEFAULT_COST, help="step cost in ms, e.g. '2+0.5P+D'")
    p.add_argument("--ttft-slo-ms", type=ms, default=Slo.ttft_base_ms)
    p.add_argument("--ttft-slo-per-token-ms", type=ms, default=Slo.ttft_per_token_ms)
    p.add_argument(
        "--tbt-slo-ms", type=finite_float(0, MAX_SLO_MS, lo_open=True), default=Slo.tbt_ms
    )
    p.add_argument(
        "--knee",
        type=finite_float(0, 1, lo_open=True),
        default=0.9,
        help="goodput/offered threshold, in (0, 1]",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int_at_most(MAX_TOKENS),
        default=BASE_CONFIG.max_num_batched_tokens,
    )
    p.add_argument("--num-blocks", type=int_at_most(MAX_BLOCKS), default=BASE_CONFIG.num_blocks)
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument(
        "--full-sweep", action="store_true", help="run every rate even far past a policy's knee"
    )
    return p


_T = TypeVar("_T")


def _pick(
    what: str, names: tuple[str, ...] | None, items: tuple[_T, ...], name_of: Callable[[_T], str]
) -> tuple[_T, ...]:
    if names is None:
        return items
    by_name = {name_of(i): i for i in items}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise InvalidArgument(
            f"unknown {what} {', '.join(unknown)}; choose from {', '.join(by_name)}"
        )
    return tuple(by_name[n] for n in names)


def compare_options(argv: list[str]) -> tuple[CompareOptions, bool]:
    """Parse and check the command line: the options and whether to show progress.
    Nothing is built or written yet (the output folder is created if missing, and
    refused if it cannot hold the report)."""
    args = _parser().parse_args(argv)
    if args.requests is not None and args.requests < 1:
        raise InvalidArgument(f"--requests must be >= 1, got {args.requests}")
    opts = CompareOptions(
        out=args.out,
        traces=_pick("trace", args.traces, TRACES, lambda t: t.name),
        policies=_pick("policy", args.policies, POLICIES, lambda p: p.name),
        rates=args.rates,
        quick=args.quick,
        scale=args.scale,
        seed=args.seed,
        cost=StepCost.parse(args.cost),
        slo=Slo(args.ttft_slo_ms, args.ttft_slo_per_token_ms, args.tbt_slo_ms),
        base=dataclasses.replace(
            BASE_CONFIG,
            max_num_batched_tokens=args.max_num_batched_tokens,
            num_blocks=args.num_blocks,
        ),
        knee=args.knee,
        num=args.requests,
        stop_after=None if args.full_sweep else 2,
    )
    # A rate's request count grows with the rate (agent: rate x 20 s); bound it before
    # any workload is built.
    for spec in opts.traces:
        for rate in opts.rates or (spec.quick_rates if opts.quick else spec.rates):
            n = spec.num_units(rate, opts.num, opts.quick)
            if n > MAX_REQUESTS:
                raise InvalidArgument(
                    f"--rates {rate:g} asks for {n:,} {spec.name} requests in one run; at "
                    f"most {MAX_REQUESTS:,}"
                )
    check_output_dir(opts.out, "--out")
    return opts, not args.no_progress


def compare_cli(argv: list[str]) -> int:
    """``refserve compare ...``: typed errors propagate to :func:`ref.cli.main.run_cli`."""
    opts, progress = compare_options(argv)
    report = run_compare(opts, sys.stderr, progress=progress)
    print(f"wrote {shown(opts.out / 'report.md')} and {shown(opts.out / 'report.json')}")
    plots = report["plots"]
    assert isinstance(plots, dict)
    charts = [name for per in plots.values() for name in per.values()]
    print(f"  {len(charts)} PNG charts in {shown(opts.out)}: {', '.join(charts)}")
    knees, traces = report["knees"], report["traces"]
    assert isinstance(knees, dict) and isinstance(traces, list)
    for t in traces:
        per_policy = knees[t["name"]]
        text = ", ".join(f"{n} {_knee_text(k, t['rates'])}" for n, k in per_policy.items())
        print(f"  knee ({t['name']}, {t['rate_unit']}): {text}")
    return 0


def compare_main(argv: list[str]) -> int:
    """``refserve compare [--out DIR] [--rates R1,R2,...] [--quick] ...``; returns an exit code."""
    debug = "--debug" in argv
    return run_cli(lambda: compare_cli([a for a in argv if a != "--debug"]), debug=debug)


if __name__ == "__main__":
    raise SystemExit(compare_main(sys.argv[1:]))
