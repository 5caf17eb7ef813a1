"""The cost-model simulator: a virtual clock and an executor that samples fake tokens.

The scheduler and engine core are the same ones that drive the real model; only this
executor differs. Requests that arrive during a step join at the next step boundary.

Three ways to replay a workload, all on the same engine core and executor:

- :func:`simulate`: open loop, each request arrives at its ``arrival_ms``.
- :func:`simulate_closed_loop`: a fixed number of requests in flight; the next one is
  released the moment one finishes (its ``arrival_ms`` becomes the release time).
- :func:`simulate_sessions`: multi-turn sessions whose turn k+1 is built from turn k's
  prompt and outputs plus the turn's new tokens and arrives ``tool_wait_ms`` after turn k
  finishes (agent sessions); optionally with at most ``concurrency`` sessions
  active at once.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from refserve.core.cost import StepCost
from refserve.core.engine_core import EngineCore, StepRecord
from refserve.core.executor import NoKVMemory, StepOutput
from refserve.core.inputs import ModelInputs
from refserve.core.plan import StepPlan
from refserve.core.request import FinishReason, Request, StopParams
from refserve.core.scheduler import Scheduler
from refserve.core.swap import SwapCost, SwapTraffic
from refserve.errors import InvalidArgument, RefserveError
from refserve.sim.noise import StepNoise
from refserve.spec.snapshot import RequestStatus
from refserve.values import is_int, is_number

VOCAB = 32000
#: Told each step's record right after it commits (``on_step`` of the replays): the
#: scheduler and its pool then show the step done and the finished requests freed.
StepObserver = Callable[[StepRecord], None]

#: The default step cap of every replay (``refserve simulate --max-steps``): a workload
#: that cannot finish (a request that never fits, a policy that starves one) ends with
#: :class:`StepLimitReached` instead of running forever.
DEFAULT_MAX_STEPS = 1_000_000


def default_max_steps(requests: Iterable[Request]) -> int:
    """The step cap of :func:`simulate` when none is given: the larger of
    :data:`DEFAULT_MAX_STEPS` and the trace's tokens (prompts plus output limits).

    A fixed cap would stop a large trace that is still progressing (a million requests
    arriving one by one take more than a million steps); a step that makes progress
    computes at least one of those tokens, so a run without preemptions that needs more
    steps than that is not progressing. The floor keeps small traces' cap as it was.
    """
    tokens = sum(r.num_tokens + r.stop.max_tokens for r in requests)
    return max(DEFAULT_MAX_STEPS, tokens)


def fake_token(request_seq: int, position: int) -> int:
    """A deterministic token id; the same request and position always give the same one."""
    return (request_seq * 1_000_003 + position * 7_919 + 17) % VOCAB


@dataclass(frozen=True)
class SimSpeculation:
    """Speculative decoding on the simulator (docs/SPECULATIVE.md, "Simulator"): each
    step, every decoding request is proposed the scheduler's ``num_speculative_tokens``
    drafts, and each draft is accepted with probability ``acceptance_rate`` up to the
    first rejection (a truncated geometric count, drawn from a generator seeded by the
    request and its length, so a replay is deterministic). The drafts are the tokens the
    request will sample anyway: speculation changes when tokens come, never which."""

    acceptance_rate: float

    def __post_init__(self) -> None:
        rate = self.acceptance_rate
        if not is_number(rate) or not 0 <= rate <= 1:
            raise InvalidArgument(f"acceptance_rate must be a number in [0, 1], got {rate!r}")

    def accepted(self, request_seq: int, position: int, num_drafts: int) -> int:
        """How many of ``num_drafts`` drafts at ``position`` the target accepts."""
        rng = random.Random(request_seq * 1_000_003 + position)
        n = 0
        while n < num_drafts and rng.random() < self.acceptance_rate:
            n += 1
        return n


class SimExecutor(NoKVMemory):
    """Fake tokens and a step time from the cost model.

    With a ``swap`` cost model, the step's swap traffic adds its copy time: one
    ``copy_ms`` per direction that moves blocks, serialized with the compute (a
    conservative model; an engine that overlaps copies with compute hides part of it).

    With ``speculation`` it also stands in for the proposer: when a step commits, it
    proposes the next step's drafts to the ``scheduler`` (:class:`SimSpeculation`), and
    a verification token costs what a prefill token costs (``b``).

    With ``noise`` (ref/sim/noise.py) each step's compute time is multiplied by a factor
    drawn from it (seeded per ``noise_stream``: each replica of a cluster its own).
    """

    needs_inputs = False

    def __init__(
        self,
        cost: StepCost,
        requests: Mapping[str, Request],
        *,
        swap: SwapCost | None = None,
        block_size: int = 16,
        speculation: SimSpeculation | None = None,
        scheduler: Scheduler | None = None,
        noise: StepNoise | None = None,
        noise_stream: str = "",
    ) -> None:
        if speculation is not None and scheduler is None:
            raise InvalidArgument("SimExecutor: speculation needs the scheduler to propose to")
        self.cost = cost
        self._requests = requests
        self.swap = swap
        self.block_size = block_size
        self.speculation = speculation
        self._scheduler = scheduler
        self._noise = None if noise is None else noise.sampler(noise_stream)
        self._gap = None if noise is None else noise.gap_sampler(noise_stream)

    def after_step_ms(self) -> float:
        """The serving loop's time after a step before the next can start (the cost's
        ``g``, or a gap drawn from ``noise``): the clock moves on by it, the step's
        tokens are stamped before it."""
        return self._gap() if self._gap is not None else self.cost.g

    def commit(self) -> None:
        """The step committed: propose the next step's drafts (with ``speculation``)."""
        sched, spec = self._scheduler, self.speculation
        if spec is None or sched is None or not sched.config.num_speculative_tokens:
            return
        k = sched.config.num_speculative_tokens
        for r in sched.running:
            if r.status is RequestStatus.DECODING:
                n = r.num_tokens
                sched.propose(r.request_id, [fake_token(r.seq, n + j) for j in range(k)])

    def execute(self, plan: StepPlan, inputs: ModelInputs | None) -> StepOutput:
        reqs = self._requests
        sampled = {
            rid: fake_token(reqs[rid].seq, len(reqs[rid].token_ids))
            for rid, samples in zip(plan.request_ids, plan.samples, strict=True)
            if samples
        }
        accepted: dict[str, int] = {}
        verify_tokens = 0
        if plan.drafts:
            assert self.speculation is not None, "drafts without a speculation model"
            for rid, drafts in plan.drafts.items():
                r = reqs[rid]
                a = self.speculation.accepted(r.seq, r.num_tokens, len(drafts))
                accepted[rid] = a
                sampled[rid] = fake_token(r.seq, r.num_tokens + a)
                verify_tokens += len(drafts)
        kv_read = 0
        if self.cost.e:
            kv_read = sum(
                s + n
                for s, n, p in zip(plan.starts, plan.num_new_tokens, plan.is_prefill, strict=True)
                if not p
            )
        ms = self.cost.step_ms(
            plan.num_prefill_tokens + verify_tokens, plan.num_decode_requests, kv_read
        )
        if self._noise is not None:
            ms *= self._noise(plan.num_prefill_tokens + verify_tokens > 0)
        if self.swap is not None:
            for moved in (plan.swap_out, plan.swap_in):
                if moved:
                    ms += self.swap.copy_ms(len(moved) * self.block_size)
        return StepOutput(sampled, ms, accepted=accepted)


class _Steps:
    """The steps of a replay: every record with ``keep``, else only the counts a result
    needs, so a long replay's memory does not grow with its steps (a record holds the
    step's plan: about 100 bytes per scheduled request)."""

    def __init__(self, keep: bool) -> None:
        self.keep = keep
        self.records: list[StepRecord] = []
        self.count = 0
        # SwapTraffic.of over every plan, summed as the steps go
        self.swapped_out = self.swapped_in = self.blocks_out = self.blocks_in = 0

    def add(self, record: StepRecord) -> None:
        self.count += 1
        if self.keep:
            self.records.append(record)
        p = record.plan
        self.swapped_out += len(p.swapped_out)
        self.swapped_in += len(p.swapped_in)
        self.blocks_out += len(p.swap_out)
        self.blocks_in += len(p.swap_in)

    def swap(self, bytes_per_block: int) -> SwapTraffic:
        return SwapTraffic(
            self.swapped_out, self.swapped_in, self.blocks_out, self.blocks_in, bytes_per_block
        )


def _result(
    scheduler: Scheduler, everyone: Sequence[Request], steps: _Steps, span: float
) -> SimResult:
    cfg = scheduler.config
    swap = None
    if cfg.num_host_blocks:
        per_block = cfg.swap_cost.kv_bytes_per_token * cfg.block_size if cfg.swap_cost else 0
        swap = steps.swap(per_block)
    return SimResult(tuple(everyone), tuple(steps.records), span, swap, steps.count)


def _sim_executor(
    scheduler: Scheduler,
    cost: StepCost,
    speculation: SimSpeculation | None = None,
    noise: StepNoise | None = None,
) -> SimExecutor:
    cfg = scheduler.config
    return SimExecutor(
        cost,
        scheduler.requests,
        swap=cfg.swap_cost,
        block_size=cfg.block_size,
        speculation=speculation,
        scheduler=scheduler,
        noise=noise,
    )


@dataclass(frozen=True)
class SimResult:
    requests: tuple[Request, ...]  # every request, in arrival order, with its timeline
    steps: tuple[StepRecord, ...]  # every step; empty when the replay ran keep_steps=False
    makespan_ms: float
    swap: SwapTraffic | None = None  # host-link traffic, when the scheduler has a host pool
    num_steps: int = 0  # steps run (kept or not)

    def __post_init__(self) -> None:
        assert not self.steps or len(self.steps) == self.num_steps, "steps kept are all steps"


class StepLimitReached(RefserveError):
    """A replay ran ``max_steps`` steps with requests still unfinished.

    ``partial`` is the result so far (every request, finished or not, and every step run),
    so a caller can still write what happened.
    """

    def __init__(self, max_steps: int, partial: SimResult) -> None:
        left = sum(1 for r in partial.requests if not r.is_done)
        super().__init__(
            f"the simulation did not finish within max_steps={max_steps} steps; "
            f"{left} of {len(partial.requests)} requests unfinished"
        )
        self.max_steps = max_steps
        self.partial = partial


def _check_max_steps(max_steps: int) -> None:
    if not is_int(max_steps) or max_steps < 1:
        raise InvalidArgument(f"max_steps must be an int >= 1, got {max_steps!r}")


def _check_time(at_ms: float, what: str) -> None:
    # A NaN or infinite time would stall the idle jump (``clock = next arrival``) forever:
    # every comparison with NaN is false, so nothing is ever admitted.
    if not math.isfinite(at_ms):
        raise InvalidArgument(f"{what} must be a finite time in ms, got {at_ms}")


def simulate(
    scheduler: Scheduler,
    arrivals: Iterable[Request],
    cost: StepCost,
    *,
    check_invariants: bool = False,
    max_steps: int | None = None,
    keep_steps: bool = True,
    speculation: SimSpeculation | None = None,
    noise: StepNoise | None = None,
    on_step: StepObserver | None = None,
) -> SimResult:
    """Run every request to completion on a virtual clock; return timelines and steps.

    Raises :class:`StepLimitReached` (holding the partial result) after ``max_steps``
    steps (default: :func:`default_max_steps` of the arrivals), and
    :class:`InvalidArgument` for an arrival time that is not finite. With
    ``keep_steps=False`` the result has no step records, only their count and swap
    totals: memory then grows with the requests, not with the steps. ``on_step`` is
    told every step's record as it commits (a probe of the scheduler's state per step).
    """
    pending = list(arrivals)
    if max_steps is None:
        max_steps = default_max_steps(pending)
    _check_max_steps(max_steps)
    for r in pending:
        _check_time(r.arrival_ms, f"request {r.request_id!r} arrival_ms")
    pending.sort(key=lambda r: r.arrival_ms)
    everyone = list(pending)
    executor = _sim_executor(scheduler, cost, speculation, noise)
    core = EngineCore(scheduler, executor, check_invariants=check_invariants)
    clock = 0.0
    steps = _Steps(keep_steps)
    i = 0
    while i < len(pending) or scheduler.has_unfinished:
        while i < len(pending) and pending[i].arrival_ms <= clock:
            scheduler.add_request(pending[i])
            i += 1
        if not scheduler.has_unfinished:
            # Idle until the next arrival: finite (checked above) and later than the clock
            # (else the loop above admitted it), so each idle turn admits a request.
            clock = pending[i].arrival_ms
            continue
        if steps.count >= max_steps:
            start = min((r.arrival_ms for r in everyone), default=0.0)
            raise StepLimitReached(max_steps, _result(scheduler, everyone, steps, clock - start))
        record = core.step(clock)
        steps.add(record)
        if on_step is not None:
            on_step(record)
        clock = record.end_ms + executor.after_step_ms()
    start = min((r.arrival_ms for r in everyone), default=0.0)
    return _result(scheduler, everyone, steps, clock - start)


# ----------------------------------------------------------------- closed loop, sessions
@dataclass(frozen=True)
class SessionTurn:
    """One turn of a session.

    ``new_token_ids`` are appended to the previous turn's prompt and outputs (for the
    first turn they are the whole prompt); ``tool_wait_ms`` is the pause between the
    previous turn's last token and this turn's arrival (ignored for the first turn).
    """

    new_token_ids: tuple[int, ...]
    output_len: int
    tool_wait_ms: float = 0.0


@dataclass(frozen=True)
class Session:
    """A multi-turn conversation; its turns run one after another, never overlapping."""

    session_id: str
    start_ms: float
    turns: tuple[SessionTurn, ...]
    priority: int = 0
    tenant: str = "default"
    # Request ids are ``<session_id>/t<k>``; False: a one-turn session's request is
    # named ``session_id`` itself (a plain request replayed alongside sessions).
    turn_ids: bool = True

    def turn_id(self, k: int) -> str:
        return f"{self.session_id}/t{k}" if self.turn_ids else self.session_id

    def turn_request(self, k: int, previous: Request | None, at_ms: float) -> Request:
        """Turn ``k`` as a request arriving at ``at_ms``: the previous turn's whole
        sequence (prompt and output, when there was one) then the turn's new tokens."""
        turn = self.turns[k]
        head = previous.token_ids if previous is not None else []
        return Request(
            self.turn_id(k),
            [*head, *turn.new_token_ids],
            StopParams(max_tokens=turn.output_len, ignore_eos=True),
            arrival_ms=at_ms,
            priority=self.priority,
            tenant=self.tenant,
        )


@dataclass
class _Job:
    """A unit the closed loop counts: a single request or a whole session."""

    session: Session | None
    request: Request | None  # a ready-made single request (no session)
    next_turn: int = 0
    previous: Request | None = None


@dataclass(order=True)
class _Release:
    at_ms: float
    order: int
    job: _Job = field(compare=False)


def simulate_closed_loop(
    scheduler: Scheduler,
    requests: Iterable[Request],
    cost: StepCost,
    *,
    concurrency: int,
    check_invariants: bool = False,
    max_steps: int = DEFAULT_MAX_STEPS,
    keep_steps: bool = True,
    speculation: SimSpeculation | None = None,
    on_step: StepObserver | None = None,
) -> SimResult:
    """Keep ``concurrency`` requests in flight; release the next (in list order) as one ends.

    The first ``concurrency`` requests are released at time 0; each later one at the step
    boundary where a request finishes. A request's ``arrival_ms`` is overwritten with its
    release time, so TTFT is measured from the moment the client sent it. ``on_step`` as
    for :func:`simulate`.
    """
    jobs = [_Job(None, r) for r in requests]
    return _replay(
        scheduler,
        jobs,
        cost,
        concurrency,
        check_invariants,
        max_steps,
        keep_steps,
        speculation,
        on_step,
    )


def simulate_sessions(
    scheduler: Scheduler,
    sessions: Iterable[Session],
    cost: StepCost,
    *,
    concurrency: int | None = None,
    check_invariants: bool = False,
    max_steps: int = DEFAULT_MAX_STEPS,
    keep_steps: bool = True,
    speculation: SimSpeculation | None = None,
) -> SimResult:
    """Replay multi-turn sessions; turn k+1 arrives ``tool_wait_ms`` after turn k finishes.

    Turn k+1's prompt is turn k's prompt, then its sampled outputs, then the turn's new
    tokens, so with prefix caching on the resumed prefix is found in the cache. Without
    ``concurrency`` each session starts at its ``start_ms`` (open loop over sessions);
    with it, at most that many sessions are active and the next (in ``start_ms`` order)
    starts when one ends. A turn that does not finish normally (capacity) ends its session.
    """
    ordered = sorted(sessions, key=lambda s: s.start_ms)
    for s in ordered:
        if not s.turns:
            raise InvalidArgument(f"session {s.session_id!r} has no turns")
    jobs = [_Job(s, None) for s in ordered]
    return _replay(
        scheduler, jobs, cost, concurrency, check_invariants, max_steps, keep_steps, speculation
    )


def _replay(
    scheduler: Scheduler,
    jobs: Sequence[_Job],
    cost: StepCost,
    concurrency: int | None,
    check_invariants: bool,
    max_steps: int,
    keep_steps: bool,
    speculation: SimSpeculation | None,
    on_step: StepObserver | None = None,
) -> SimResult:
    if concurrency is not None and concurrency < 1:
        raise InvalidArgument(f"concurrency must be >= 1, got {concurrency}")
    _check_max_steps(max_steps)
    executor = _sim_executor(scheduler, cost, speculation)
    core = EngineCore(scheduler, executor, check_invariants=check_invariants)
    releases = _Releases()
    queued = iter(jobs)
    if concurrency is None:
        for job in queued:
            releases.push(job, _start_ms(job))
    else:
        for _, job in zip(range(concurrency), queued, strict=False):
            releases.push(job, 0.0)
    # Closed loop: a finished job lets the next queued one in.
    waiting = queued if concurrency is not None else None
    in_flight: dict[str, _Job] = {}  # request id -> the job it belongs to
    everyone: list[Request] = []
    clock = 0.0 if concurrency is not None else releases.first_ms(default=0.0)
    steps = _Steps(keep_steps)
    while releases or scheduler.has_unfinished:
        for rel in releases.due(clock):
            r = _next_request(rel.job, rel.at_ms)
            scheduler.add_request(r)
            in_flight[r.request_id] = rel.job
            everyone.append(r)
        if not scheduler.has_unfinished:
            clock = releases.first_ms()  # idle until the next release (finite: checked)
            continue
        if steps.count >= max_steps:
            raise StepLimitReached(max_steps, _replay_result(scheduler, everyone, steps, clock))
        record = core.step(clock)
        steps.add(record)
        if on_step is not None:
            on_step(record)
        clock = record.end_ms + executor.after_step_ms()
        for rid in record.outcome.finished:
            _after_finish(in_flight.pop(rid), rid, clock, releases, waiting)
    return _replay_result(scheduler, everyone, steps, clock)


class _Releases:
    """Jobs waiting for their next request to be released, earliest first (ties: in the
    order they were pushed)."""

    def __init__(self) -> None:
        self._heap: list[_Release] = []
        self._order = 0

    def __bool__(self) -> bool:
        return bool(self._heap)

    def push(self, job: _Job, at_ms: float) -> None:
        # Session starts and tool waits come from the caller: a NaN one would stall the
        # idle jump of the replay forever.
        _check_time(at_ms, f"release time of {_job_name(job)}")
        heapq.heappush(self._heap, _Release(at_ms, self._order, job))
        self._order += 1

    def first_ms(self, default: float | None = None) -> float:
        """The earliest release time (``default`` when none is left)."""
        if not self._heap:
            assert default is not None, "no release left"
            return default
        return self._heap[0].at_ms

    def due(self, clock: float) -> Iterator[_Release]:
        """Pop, earliest first, every release at or before ``clock``."""
        while self._heap and self._heap[0].at_ms <= clock:
            yield heapq.heappop(self._heap)


def _after_finish(
    job: _Job, rid: str, clock: float, releases: _Releases, waiting: Iterator[_Job] | None
) -> None:
    """A job's request ``rid`` finished at ``clock``: release its session's next turn
    after the tool wait; else, in closed loop (``waiting``), let the next job in. A turn
    that did not finish normally (capacity) ends its session."""
    done = job.previous
    assert done is not None and done.request_id == rid
    s = job.session
    more = (
        s is not None
        and job.next_turn < len(s.turns)
        and done.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    )
    if more:
        assert s is not None
        releases.push(job, clock + s.turns[job.next_turn].tool_wait_ms)
    elif waiting is not None:
        nxt = next(waiting, None)
        if nxt is not None:
            releases.push(nxt, clock)


def _replay_result(
    scheduler: Scheduler, everyone: list[Request], steps: _Steps, clock: float
) -> SimResult:
    """The result so far, requests in arrival order, times from the first arrival."""
    everyone.sort(key=lambda r: (r.arrival_ms, r.seq))
    start = min((r.arrival_ms for r in everyone), default=0.0)
    return _result(scheduler, everyone, steps, clock - start)


def _job_name(job: _Job) -> str:
    if job.session is not None:
        return f"session {job.session.session_id!r}"
    assert job.request is not None
    return f"request {job.request.request_id!r}"


def _start_ms(job: _Job) -> float:
    if job.session is not None:
        return job.session.start_ms
    assert job.request is not None
    return job.request.arrival_ms


def _next_request(job: _Job, at_ms: float) -> Request:
    """The job's next request, arriving at ``at_ms``."""
    if job.session is None:
        assert job.request is not None
        r = job.request
        r.arrival_ms = at_ms
        job.previous = r
        return r
    k = job.next_turn
    r = job.session.turn_request(k, job.previous, at_ms)
    job.next_turn = k + 1
    job.previous = r
    return r
