"""KV layouts at one memory: how many requests a pool holds, what it finishes within
its SLOs, and whether the admission's block count is what the pool holds, when memory
per token is not a constant (``refserve kv-layouts``; the report is written by
:mod:`refserve.report.kv_layouts_report`).

**The memory model.** A model has ``L`` layers; a layout puts them into ``G`` groups of
equal layer count (as vLLM's hybrid allocator does), so one block holds ``block_size``
tokens of ``L/G`` layers and has the same bytes in every group. A memory that holds
``N`` dense blocks (``block_size`` tokens of all ``L`` layers each) therefore holds
``N * G`` blocks of a ``G``-group layout (:attr:`KVLayout.blocks_multiplier`). A
compressed layer that also keeps its last tokens raw has two groups over the same
layers (spec/groups.py), so the multiplier counts sets of layers, not groups. A
request takes from that one pool :func:`refserve.spec.groups.layout_blocks` of the
layout's groups: a full group a block per ``block_size`` stored tokens, a compressed
group a block per ``ratio * block_size``, a window group only the blocks its next query
reads. The plain pool (``kv_groups=()``) is one full group.

**Layouts are data.** A :class:`KVLayout` is a name, a description, the scheduler's
``kv_groups`` and the blocks multiplier; :func:`standard_layouts` is the experiment's
list (dense, hybrid 1:1, hybrid 5:1, compressed). Another layout is one more record
there.

**What a run measures** (one layout, one context length, the real scheduler on the
cost-model simulator, prefix caching off):

- :func:`run_capacity`: a closed loop with more requests in flight than the pool holds
  at their peak; the requests running at once (most, and the time-weighted mean over
  the steady state: from the first finish until nothing waits any more), under one of
  two admissions (:class:`CapacityAdmission`): ``reserve-peak``
  (:class:`ReservePeaks`: a request joins only if the peaks of those running and its
  own fit, one token at a time, and its first chunk's blocks are free: the memory alone
  sets the count) or the scheduler's own ``sequence`` admission (the new request's
  peak in chunks of the token budget must be free now, but the growth still owed to
  those running is not held back, so it can admit more and preempt later);
- on every step of it, :class:`BlockProbe`: the pool's used blocks against the sum over
  the running requests of ``layout_blocks`` at their last allocation (exact: what the
  admission and the pool both count) and at their KV length now (short by the window
  blocks that fall out of a window at the last computed positions, which the pool
  releases only at the request's next allocation);
- :func:`run_goodput`: an open-loop Poisson trace at ``load`` times the rate the cost
  model can prefill the prompts (the same arrivals for every layout), for the report to
  judge against its SLOs.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from refserve.core.config import Admission, SchedulerConfig
from refserve.core.cost import StepCost
from refserve.core.engine_core import StepRecord
from refserve.core.policy import DecodeFirst
from refserve.core.request import Request, StopParams
from refserve.core.scheduler import Scheduler
from refserve.errors import InvalidArgument
from refserve.sim.simulator import SimResult, simulate, simulate_closed_loop
from refserve.sim.workloads import arrival_times_ms
from refserve.spec.groups import GroupKind, KVGroup, layout_blocks, peak_blocks
from refserve.spec.snapshot import RequestStatus
from refserve.values import is_int, is_number

__all__ = [
    "DENSE",
    "FULL",
    "BlockGap",
    "BlockProbe",
    "CapacityAdmission",
    "KVLayout",
    "LayoutExperiment",
    "LoopFigures",
    "LoopRun",
    "ReservePeaks",
    "StepSample",
    "compressed_layout",
    "hybrid_layout",
    "run_capacity",
    "run_goodput",
    "standard_layouts",
]

FULL = KVGroup(GroupKind.FULL)
#: The most requests one run may build (a run's requests are built up front).
MAX_RUN_REQUESTS = 20_000


@dataclass(frozen=True)
class KVLayout:
    """A KV layout under a name: the scheduler's ``kv_groups`` (``()``: the plain pool)
    and the pool blocks one dense block's memory holds (its group count, when the
    groups have equal layer counts)."""

    name: str
    description: str
    kv_groups: tuple[KVGroup, ...]
    blocks_multiplier: int

    def __post_init__(self) -> None:
        name = self.name
        # The name keys the JSON, heads table columns and is picked from a comma list.
        if not isinstance(name, str) or not name or not name.isprintable() or "," in name:
            raise InvalidArgument(
                f"a layout's name must be printable text without commas, got {name!r}"
            )
        groups = self.kv_groups
        if not isinstance(groups, tuple) or not all(isinstance(g, KVGroup) for g in groups):
            raise InvalidArgument(f"layout {name}: kv_groups must be a tuple of KVGroup")
        if groups and groups[0].kind is not GroupKind.FULL:
            raise InvalidArgument(f"layout {name}: its first group must be full attention")
        if not is_int(self.blocks_multiplier) or self.blocks_multiplier < 1:
            raise InvalidArgument(
                f"layout {name}: blocks_multiplier must be an int >= 1, "
                f"got {self.blocks_multiplier!r}"
            )

    @property
    def groups(self) -> tuple[KVGroup, ...]:
        """The groups a request's blocks are counted over (the plain pool: one full)."""
        return self.kv_groups or (FULL,)

    def num_blocks(self, dense_blocks: int) -> int:
        """The pool's blocks in the memory of ``dense_blocks`` dense blocks."""
        return dense_blocks * self.blocks_multiplier

    def held(self, num_stored: int, num_new: int, block_size: int) -> int:
        """The blocks a request holds while it computes ``[num_stored, +num_new)``."""
        return layout_blocks(self.groups, num_stored, num_new, block_size)

    def peak(self, num_tokens: int, block_size: int, max_chunk: int = 1) -> int:
        """The most blocks a request of ``num_tokens`` tokens holds when it computes
        them in steps of at most ``max_chunk`` (one at a time by default: decoding)."""
        return peak_blocks(self.groups, num_tokens, block_size, max_chunk)

    def bound(self, dense_blocks: int, num_tokens: int, block_size: int) -> int:
        """The analytic capacity: requests of ``num_tokens`` tokens that fit at once,
        each at its peak: ``floor(blocks / peak)``."""
        return self.num_blocks(dense_blocks) // self.peak(num_tokens, block_size)

    def groups_text(self) -> str:
        """The groups in one line, e.g. ``full, window 1024 x5``."""
        parts: list[tuple[str, int]] = []
        for g in self.groups:
            text = (
                f"window {g.window}"
                if g.kind is GroupKind.WINDOW
                else f"compressed {g.ratio}:1"
                if g.kind is GroupKind.COMPRESSED
                else str(g.kind)
            )
            if parts and parts[-1][0] == text:
                parts[-1] = (text, parts[-1][1] + 1)
            else:
                parts.append((text, 1))
        return ", ".join(t if n == 1 else f"{t} x{n}" for t, n in parts)


DENSE = KVLayout("dense", "every layer full attention: the plain pool", (), 1)


def hybrid_layout(windows: int, window: int) -> KVLayout:
    """One full-attention group and ``windows`` sliding-window groups of ``window``
    tokens, equal layer counts: ``windows + 1`` times the dense blocks."""
    if not is_int(windows) or windows < 1:
        raise InvalidArgument(f"a hybrid layout needs windows >= 1, got {windows!r}")
    if not is_int(window) or window < 1:
        raise InvalidArgument(f"a hybrid layout needs a window >= 1 token, got {window!r}")
    share = f"{windows} of every {windows + 1}"
    return KVLayout(
        f"hybrid-{windows}:1",
        f"{share} layers a sliding window of {window} tokens, the rest full attention",
        (FULL, *(KVGroup(GroupKind.WINDOW, window),) * windows),
        windows + 1,
    )


def compressed_layout(ratio: int, window: int) -> KVLayout:
    """Half the layers full attention, half compressed: one K/V entry per ``ratio``
    tokens, every entry kept, and the last ``window`` tokens raw. The raw tail is a
    window group of its own over the same layers as the compressed group (spec/groups.py),
    so the layout has three groups over two equal sets of layers: twice the dense
    blocks, not three times."""
    if not is_int(ratio) or ratio < 2:
        raise InvalidArgument(f"a compressed layout needs a ratio >= 2, got {ratio!r}")
    if not is_int(window) or window < 1:
        raise InvalidArgument(f"a compressed layout needs a window >= 1 token, got {window!r}")
    return KVLayout(
        f"compressed-r{ratio}",
        f"half the layers full attention; the other half keep one K/V entry per {ratio} "
        f"tokens and their last {window} tokens raw",
        (FULL, KVGroup(GroupKind.COMPRESSED, ratio=ratio), KVGroup(GroupKind.WINDOW, window)),
        2,
    )


def standard_layouts(window: int, ratio: int = 4) -> tuple[KVLayout, ...]:
    """The experiment's layouts, the baseline (dense) first."""
    return (
        DENSE,
        hybrid_layout(1, window),
        hybrid_layout(5, window),
        compressed_layout(ratio, window),
    )


class CapacityAdmission(StrEnum):
    """Who decides, in a capacity run, when a waiting request joins (module doc)."""

    RESERVE_PEAK = "reserve-peak"
    SEQUENCE = "sequence"


@dataclass(frozen=True)
class LayoutExperiment:
    """The experiment's sizes, one settings record for every run (the module doc).

    ``dense_blocks``: the memory, in dense blocks; ``contexts``: the prompt lengths;
    ``capacity_budget``: the capacity runs' token budget, large enough that prefill does
    not cap how many run; ``goodput_budget``: the goodput runs' (a step with a full chunk
    stays within a TBT SLO); ``load``: the goodput runs' arrival rate as a share of the
    rate the cost model prefills the prompts at (``load / (b * context)`` per ms).
    """

    layouts: tuple[KVLayout, ...]
    contexts: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384, 32768)
    output_len: int = 128
    block_size: int = 16
    dense_blocks: int = 4608
    cost: StepCost = field(default_factory=lambda: StepCost(5.0, 0.03, 0.1))
    capacity_budget: int = 8192
    goodput_budget: int = 2048
    max_num_seqs: int = 1024
    load: float = 0.6
    goodput_requests: int = 100
    seed: int = 0

    def __post_init__(self) -> None:
        for name in (
            "output_len",
            "block_size",
            "dense_blocks",
            "capacity_budget",
            "goodput_budget",
            "max_num_seqs",
            "goodput_requests",
        ):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise InvalidArgument(f"{name} must be an int >= 1, got {value!r}")
        if not is_int(self.seed):
            raise InvalidArgument(f"seed must be an int, got {self.seed!r}")
        if not is_number(self.load) or not 0 < self.load <= 10:
            raise InvalidArgument(f"load must be a number in (0, 10], got {self.load!r}")
        if not isinstance(self.cost, StepCost) or not self.cost.b > 0:
            raise InvalidArgument(
                f"cost must be a StepCost that charges prefill tokens (b > 0), got {self.cost}"
            )
        self._check_layouts()
        self._check_contexts()

    def _check_layouts(self) -> None:
        layouts = self.layouts
        if not isinstance(layouts, tuple) or not layouts:
            raise InvalidArgument("layouts must be a non-empty tuple of KVLayout")
        if not all(isinstance(x, KVLayout) for x in layouts):
            raise InvalidArgument("layouts must be a non-empty tuple of KVLayout")
        names = [x.name for x in layouts]
        if len(set(names)) != len(names):
            raise InvalidArgument(f"layouts: a name is given twice in {', '.join(names)}")

    def _check_contexts(self) -> None:
        contexts = self.contexts
        if not isinstance(contexts, tuple) or not contexts:
            raise InvalidArgument("contexts must be a non-empty tuple of prompt lengths")
        for c in contexts:
            if not is_int(c) or c < 1:
                raise InvalidArgument(f"contexts: a prompt length must be an int >= 1, got {c!r}")
        if len(set(contexts)) != len(contexts):
            raise InvalidArgument(f"contexts: a length is given twice in {contexts}")
        for layout in self.layouts:
            for c in contexts:
                peak = layout.peak(c + self.output_len, self.block_size)
                blocks = layout.num_blocks(self.dense_blocks)
                if peak > blocks:
                    raise InvalidArgument(
                        f"context {c} + output {self.output_len} needs {peak} blocks in "
                        f"layout {layout.name}, whose pool has {blocks}: raise dense_blocks"
                    )
                for budget in (self.capacity_budget, self.goodput_budget):
                    chunked = layout.peak(c + self.output_len, self.block_size, budget)
                    if chunked > blocks:
                        raise InvalidArgument(
                            f"context {c}: in chunks of {budget} tokens a request holds up "
                            f"to {chunked} blocks in layout {layout.name}, whose pool has "
                            f"{blocks}: raise dense_blocks or lower the budget"
                        )
                if self.capacity_requests(layout, c) > MAX_RUN_REQUESTS:
                    raise InvalidArgument(
                        f"context {c} in layout {layout.name} would run "
                        f"{self.capacity_requests(layout, c):,} requests; at most "
                        f"{MAX_RUN_REQUESTS:,} (lower dense_blocks)"
                    )

    # ------------------------------------------------------------------ the runs' sizes
    @property
    def baseline(self) -> KVLayout:
        """The layout every ratio is taken against (the first)."""
        return self.layouts[0]

    def bound(self, layout: KVLayout, context: int) -> int:
        return layout.bound(self.dense_blocks, context + self.output_len, self.block_size)

    def chunk_peak(self, layout: KVLayout, context: int) -> int:
        """A capacity run's request's peak in chunks of the token budget: what the
        scheduler's capacity refusal and whole-request admission count (a window group
        holds a chunk's every block while it computes)."""
        n = context + self.output_len
        return layout.peak(n, self.block_size, self.capacity_budget)

    def chunk_bound(self, layout: KVLayout, context: int) -> int:
        """The requests that run at once when the newest must find its chunked peak
        free beside the others at their peak (one token at a time), as the scheduler's
        sequence admission asks: ``floor((blocks - chunked peak) / peak) + 1``, at most
        :meth:`bound`."""
        blocks = layout.num_blocks(self.dense_blocks)
        peak = layout.peak(context + self.output_len, self.block_size)
        room = (blocks - self.chunk_peak(layout, context)) // peak + 1
        return min(self.bound(layout, context), room)

    def concurrency(self, layout: KVLayout, context: int) -> int:
        """Requests in flight in a capacity run: the bound and a quarter more (at least
        four), so a request always waits for the memory."""
        bound = self.bound(layout, context)
        return bound + max(4, math.ceil(bound / 4))

    def capacity_requests(self, layout: KVLayout, context: int) -> int:
        """Requests a capacity run releases: twice its concurrency."""
        return 2 * self.concurrency(layout, context)

    def rate_rps(self, context: int) -> float:
        """The goodput runs' arrival rate: ``load`` of the prompts' prefill rate."""
        return self.load / (self.cost.b * context / 1e3)

    def config(
        self, layout: KVLayout, budget: int, admission: Admission = Admission.SEQUENCE
    ) -> SchedulerConfig:
        """The scheduler of one run: ``layout`` in the experiment's memory, the whole
        sequence admitted at once unless told otherwise, prefix caching off (no two
        runs share K/V)."""
        return SchedulerConfig(
            max_num_batched_tokens=budget,
            max_num_seqs=self.max_num_seqs,
            block_size=self.block_size,
            num_blocks=layout.num_blocks(self.dense_blocks),
            enable_prefix_caching=False,
            admission=admission,
            kv_groups=layout.kv_groups,
        )

    def requests(self, context: int, arrivals_ms: list[float]) -> list[Request]:
        """One request per arrival, each a prompt of ``context`` seeded tokens (the
        same for all: with prefix caching off no token is looked up) and
        ``output_len`` outputs."""
        rng = random.Random(f"kv-layouts:{self.seed}:{context}")
        prompt = [rng.randrange(256, 32000) for _ in range(context)]
        stop = StopParams(max_tokens=self.output_len, ignore_eos=True)
        return [
            Request(f"c{context}-{i}", list(prompt), stop, arrival_ms=t)
            for i, t in enumerate(arrivals_ms)
        ]


class ReservePeaks(DecodeFirst):
    """Decode-first, admitting a waiting request only when the peaks of the running
    requests and its own (:meth:`KVLayout.peak` of prompt plus ``max_tokens``) fit the
    pool together: the memory alone sets how many run, and the count never passes
    :meth:`KVLayout.bound` for requests of one length."""

    def __init__(self, layout: KVLayout, num_blocks: int, block_size: int) -> None:
        super().__init__()
        self._layout = layout
        self._num_blocks = num_blocks
        self._block_size = block_size
        self._peaks: dict[int, int] = {}  # tokens -> peak blocks, one length per run

    def peak_of(self, r: Request) -> int:
        n = r.num_prompt_tokens + r.stop.max_tokens
        peak = self._peaks.get(n)
        if peak is None:
            peak = self._peaks[n] = self._layout.peak(n, self._block_size)
        return peak

    def may_admit(self, request: Request, running: Sequence[Request]) -> bool:
        reserved = sum(self.peak_of(r) for r in running)
        return reserved + self.peak_of(request) <= self._num_blocks


@dataclass(frozen=True)
class StepSample:
    """The scheduler after one committed step: its requests, the pool's used blocks and
    the two sums of ``layout_blocks`` over the running requests (the module doc)."""

    step_index: int
    start_ms: float
    end_ms: float
    running: int
    decoding: int
    waiting: int
    finished: int  # requests that finished in this step
    used_blocks: int
    estimate_blocks: int  # at each running request's last allocation
    estimate_now_blocks: int  # at each running request's KV length now


class BlockProbe:
    """The simulator's ``on_step`` observer of one run: a :class:`StepSample` per step.

    A request's last allocation is the plan entry that last scheduled it: positions
    ``[start, start + n)``, before which each window group released what its window no
    longer reads. A request that is running holds exactly ``layout_blocks(start, n)``.
    """

    def __init__(self, scheduler: Scheduler, layout: KVLayout) -> None:
        self._scheduler = scheduler
        self._layout = layout
        self._block_size = scheduler.config.block_size
        self._last: dict[str, tuple[int, int]] = {}
        self.samples: list[StepSample] = []

    def __call__(self, record: StepRecord) -> None:
        plan = record.plan
        for rid, start, n in zip(plan.request_ids, plan.starts, plan.num_new_tokens, strict=True):
            self._last[rid] = (start, n)
        sched, layout, bs = self._scheduler, self._layout, self._block_size
        running = sched.running
        held = now = decoding = 0
        for r in running:
            start, n = self._last[r.request_id]
            held += layout.held(start, n, bs)
            now += layout.held(r.num_computed_tokens, 0, bs)
            decoding += r.status is RequestStatus.DECODING
        finished = record.outcome.finished
        for rid in finished:
            self._last.pop(rid, None)
        self.samples.append(
            StepSample(
                step_index=record.step_index,
                start_ms=record.start_ms,
                end_ms=record.end_ms,
                running=len(running),
                decoding=decoding,
                waiting=len(sched.requests) - len(running),
                finished=len(finished),
                used_blocks=sched.pool.num_used_blocks,
                estimate_blocks=held,
                estimate_now_blocks=now,
            )
        )


@dataclass(frozen=True)
class BlockGap:
    """The pool's used blocks less an estimate, over a run's steps."""

    max_gap: int
    min_gap: int
    mean_gap: float

    @classmethod
    def of(cls, gaps: Sequence[int]) -> BlockGap:
        if not gaps:
            return cls(0, 0, 0.0)
        return cls(max(gaps), min(gaps), sum(gaps) / len(gaps))


@dataclass(frozen=True)
class LoopFigures:
    """One capacity run's figures (the steady state: from the step where the first
    request finished to the last step after which a request still waited; the whole run
    if that is empty). Means are weighted by each step's duration."""

    admission: str
    max_running: int
    mean_running: float
    max_decoding: int
    preemptions: int
    throughput_rps: float  # requests finished per second of the steady state
    mean_used_fraction: float  # of the pool's blocks, over the steady state
    num_steps: int
    steady_steps: int
    gap: BlockGap  # used blocks less the estimate at the last allocation
    gap_now: BlockGap  # used blocks less the estimate at the KV length now

    @classmethod
    def of(
        cls,
        admission: CapacityAdmission,
        samples: Sequence[StepSample],
        num_blocks: int,
        preemptions: int,
    ) -> LoopFigures:
        steady = steady_state(samples)
        weights = [s.end_ms - s.start_ms for s in steady]
        if not sum(weights) > 0:
            weights = [1.0] * len(steady)
        total = sum(weights)
        span_s = (steady[-1].end_ms - steady[0].start_ms) / 1e3 if steady else 0.0
        finished = sum(s.finished for s in steady)
        return cls(
            admission=str(admission),
            max_running=max((s.running for s in samples), default=0),
            mean_running=sum(w * s.running for w, s in zip(weights, steady, strict=True)) / total
            if steady
            else 0.0,
            max_decoding=max((s.decoding for s in samples), default=0),
            preemptions=preemptions,
            throughput_rps=finished / span_s if span_s > 0 else 0.0,
            mean_used_fraction=sum(w * s.used_blocks for w, s in zip(weights, steady, strict=True))
            / total
            / num_blocks
            if steady
            else 0.0,
            num_steps=len(samples),
            steady_steps=len(steady),
            gap=BlockGap.of([s.used_blocks - s.estimate_blocks for s in samples]),
            gap_now=BlockGap.of([s.used_blocks - s.estimate_now_blocks for s in samples]),
        )


def steady_state(samples: Sequence[StepSample]) -> Sequence[StepSample]:
    """The steps from the first finish to the last one after which a request waited;
    all of them when that span is empty."""
    first = next((i for i, s in enumerate(samples) if s.finished), None)
    last = next((i for i in range(len(samples) - 1, -1, -1) if samples[i].waiting), None)
    if first is None or last is None or first > last:
        return samples
    return samples[first : last + 1]


@dataclass(frozen=True)
class LoopRun:
    """A capacity run: its figures and every step's sample."""

    figures: LoopFigures
    samples: tuple[StepSample, ...]


def run_capacity(
    exp: LayoutExperiment, layout: KVLayout, context: int, admission: CapacityAdmission
) -> LoopRun:
    """The closed loop of one layout and context length (module doc)."""
    _check_point(exp, layout, context)
    try:
        admission = CapacityAdmission(admission)
    except ValueError:
        allowed = ", ".join(a.value for a in CapacityAdmission)
        raise InvalidArgument(f"admission must be one of {allowed}, got {admission!r}") from None
    reserve = admission is CapacityAdmission.RESERVE_PEAK
    # Under the reservation the scheduler asks only for the first chunk's blocks: its
    # own whole-request rule would ask each new request's chunked peak on top.
    config = exp.config(
        layout, exp.capacity_budget, Admission.FIRST_CHUNK if reserve else Admission.SEQUENCE
    )
    policy = ReservePeaks(layout, config.num_blocks, config.block_size) if reserve else None
    scheduler = Scheduler(config, policy)
    probe = BlockProbe(scheduler, layout)
    n = exp.capacity_requests(layout, context)
    result = simulate_closed_loop(
        scheduler,
        exp.requests(context, [0.0] * n),
        exp.cost,
        concurrency=exp.concurrency(layout, context),
        keep_steps=False,
        on_step=probe,
    )
    preemptions = sum(r.num_preemptions for r in result.requests)
    figures = LoopFigures.of(admission, probe.samples, config.num_blocks, preemptions)
    return LoopRun(figures, tuple(probe.samples))


def run_goodput(exp: LayoutExperiment, layout: KVLayout, context: int) -> SimResult:
    """The open loop of one layout and context length: ``goodput_requests`` Poisson
    arrivals at :meth:`LayoutExperiment.rate_rps` (seeded: every layout gets the same)."""
    _check_point(exp, layout, context)
    arrivals = arrival_times_ms(exp.goodput_requests, exp.rate_rps(context), seed=exp.seed)
    scheduler = Scheduler(exp.config(layout, exp.goodput_budget))
    return simulate(scheduler, exp.requests(context, arrivals), exp.cost, keep_steps=False)


def _check_point(exp: LayoutExperiment, layout: KVLayout, context: int) -> None:
    if layout not in exp.layouts:
        raise InvalidArgument(f"layout {layout.name!r} is not one of the experiment's")
    if context not in exp.contexts:
        raise InvalidArgument(f"context {context!r} is not one of the experiment's")
