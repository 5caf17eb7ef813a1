"""The per-group block count (spec/groups.py: group_blocks, layout_blocks, peak_blocks)
against brute force, and the scheduler's uses of it (ref/core/capacity.py): the
capacity refusal, which counts a chunk's window blocks, and admission by ``prompt`` and
``sequence``, which must ask at least the blocks a request then holds.

The admission tests run the real scheduler (ref/core/scheduler.py) on the simulator
through ``EngineCore(check_invariants=True)``, with an executor that records the blocks
in use at every step.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refserve.core.capacity import (
    admission_blocks,
    exceeds_pool,
    never_fits,
    require_fit,
)
from refserve.core.config import Admission, SchedulerConfig
from refserve.core.cost import StepCost
from refserve.core.engine_core import EngineCore
from refserve.core.executor import StepOutput
from refserve.core.inputs import ModelInputs
from refserve.core.plan import StepPlan
from refserve.core.prefill import chunk
from refserve.core.request import FinishReason, Request, StopParams
from refserve.core.scheduler import Scheduler
from refserve.errors import ExceedsCapacity
from refserve.kv.groups import GroupedPool
from refserve.sim.simulator import SimExecutor
from refserve.spec.arith import blocks_needed
from refserve.spec.groups import (
    GroupKind,
    KVGroup,
    group_blocks,
    held_places,
    layout_blocks,
    peak_blocks,
    window_start,
)

FULL = KVGroup(GroupKind.FULL)
MAX_LEN = 64


def window(w: int) -> KVGroup:
    return KVGroup(GroupKind.WINDOW, w)


layouts = st.lists(st.integers(1, 40), min_size=1, max_size=3).map(
    lambda ws: (FULL, *(window(w) for w in ws))
)
block_sizes = st.integers(1, 16)


def brute_group_blocks(group: KVGroup, num_stored: int, num_new: int, bs: int) -> int:
    """The blocks holding a position the group's queries over ``[num_stored, +num_new)``
    read or write: ``[0, end)`` in a full group, ``[window_start, end)`` in a window."""
    end = num_stored + num_new
    lo = 0 if group.kind is GroupKind.FULL else window_start(num_stored, group.window)
    return len({p // bs for p in range(lo, end)})


def brute_peak(groups: Sequence[KVGroup], num_tokens: int, bs: int, chunk: int = 1) -> int:
    """The most any step of at most ``chunk`` tokens holds, over every start."""
    return max(
        layout_blocks(groups, start, n, bs)
        for start in range(num_tokens)
        for n in range(1, min(chunk, num_tokens - start) + 1)
    )


# ------------------------------------------------------------------ the counts
@given(st.integers(1, 40), block_sizes, st.integers(1, 200), st.integers(2, 4))
def test_held_places_are_the_blocks_the_next_query_reads(
    w: int, bs: int, stored: int, ratio: int
) -> None:
    """What a swap moves (``held_places``): in a window group, the blocks holding a
    stored position the query at ``stored`` reads, and the partial block its own token
    goes into (with a window of 1 it reads no stored position), by brute force; in
    every group, as many as ``group_blocks`` counts after computing ``stored`` tokens."""
    g = window(w)
    read = {p // bs for p in range(window_start(stored, w), stored)}
    partial = {stored // bs} if stored % bs else set()
    assert set(held_places(g, stored, bs)) == read | partial
    for group in (FULL, g, KVGroup(GroupKind.COMPRESSED, ratio=ratio)):
        assert len(held_places(group, stored, bs)) == group_blocks(group, stored, 0, bs)
    assert held_places(FULL, stored, bs) == range(blocks_needed(stored, bs))


@settings(max_examples=300, deadline=None)
@given(layouts, block_sizes, st.integers(1, 300))
def test_peak_blocks_is_the_largest_layout_over_every_position(
    groups: tuple[KVGroup, ...], bs: int, n: int
) -> None:
    assert peak_blocks(groups, n, bs) == brute_peak(groups, n, bs)


@settings(max_examples=300, deadline=None)
@given(layouts, block_sizes, st.integers(1, 120), st.integers(1, 80))
def test_peak_blocks_with_chunks_is_the_largest_step_of_at_most_a_chunk(
    groups: tuple[KVGroup, ...], bs: int, n: int, chunk_size: int
) -> None:
    """Every start and every step length up to the chunk, against the count that reads
    only the steps a block before the last full chunk."""
    assert peak_blocks(groups, n, bs, chunk_size) == brute_peak(groups, n, bs, chunk_size)


@given(block_sizes, st.integers(0, 200), st.integers(0, 200))
def test_a_full_group_holds_a_block_for_every_stored_token(bs: int, stored: int, new: int) -> None:
    assert group_blocks(FULL, stored, new, bs) == blocks_needed(stored + new, bs)


@given(st.integers(1, 40), block_sizes, st.integers(0, 200), st.integers(1, 64))
def test_a_window_group_holds_the_blocks_its_queries_read(
    w: int, bs: int, stored: int, new: int
) -> None:
    g = window(w)
    assert group_blocks(g, stored, new, bs) == brute_group_blocks(g, stored, new, bs)
    assert group_blocks(FULL, stored, new, bs) == brute_group_blocks(FULL, stored, new, bs)


@given(layouts, block_sizes, st.integers(0, 200), st.integers(1, 64))
def test_layout_blocks_is_the_sum_over_groups(
    groups: tuple[KVGroup, ...], bs: int, stored: int, new: int
) -> None:
    expected = sum(brute_group_blocks(g, stored, new, bs) for g in groups)
    assert layout_blocks(groups, stored, new, bs) == expected


# ------------------------------------------------------------ capacity refusal
def config(
    groups: tuple[KVGroup, ...],
    bs: int,
    num_blocks: int,
    *,
    chunked: bool = True,
    admission: Admission = Admission.FIRST_CHUNK,
    budget: int = MAX_LEN,
) -> SchedulerConfig:
    return SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=4,
        block_size=bs,
        num_blocks=num_blocks,
        max_model_len=MAX_LEN,
        enable_chunked_prefill=chunked,
        admission=admission,
        kv_groups=groups,
    )


@given(layouts, st.integers(1, 8), st.integers(1, 60), st.integers(1, 40), st.booleans())
def test_the_capacity_refusal_counts_every_group(
    groups: tuple[KVGroup, ...], bs: int, n: int, num_blocks: int, chunked: bool
) -> None:
    """A request's steps hold at most a budget of tokens each (the whole prompt when
    chunked prefill is off, which the budget bounds too): it needs the peak of such
    steps. One group is the plain pool's rule."""
    cfg = config(groups, bs, num_blocks, chunked=chunked)
    need = peak_blocks(groups, n, bs, cfg.max_num_batched_tokens)
    if len(groups) == 1:
        need = blocks_needed(n, bs)
        assert never_fits(cfg, n) == exceeds_pool(n, bs, num_blocks)
    assert never_fits(cfg, n) == (need > num_blocks)
    if need > num_blocks:
        with pytest.raises(ExceedsCapacity) as e:
            require_fit(cfg, "r", n)
        assert (e.value.needed, e.value.num_blocks) == (need, num_blocks)
    else:
        require_fit(cfg, "r", n)


def test_a_long_chunk_is_counted_by_the_capacity_refusal() -> None:
    """40 tokens in blocks of 4 with a window of 4: one at a time they peak at 13
    blocks, but a chunk of all 40 holds 20. With a budget of 64 the refusal asks for
    20 and a pool of 20 runs it; with a budget of 8 the chunks are short, it asks 15."""
    groups = (FULL, window(4))
    assert peak_blocks(groups, 44, 4) == 13 and layout_blocks(groups, 0, 40, 4) == 20
    request = Request("a", list(range(1, 41)), StopParams(4, ignore_eos=True))
    assert never_fits(config(groups, 4, 19), 40) and not never_fits(config(groups, 4, 20), 40)
    used, finished = run_alone(config(groups, 4, 20), request)
    assert finished is FinishReason.LENGTH and max(used) == 20
    short = config(groups, 4, 15, budget=8)
    assert peak_blocks(groups, 44, 4, 8) == 15 and not never_fits(short, 44)
    again = Request("b", request.prompt_token_ids, request.stop)
    used, finished = run_alone(short, again)
    assert finished is FinishReason.LENGTH and max(used) <= 15


# ------------------------------------------------------------------ admission
class UsageRecorder(SimExecutor):
    """The simulator, recording the blocks in use while each step runs (every
    allocation of the step made) and the requests each step preempted."""

    def __init__(self, sched: Scheduler) -> None:
        super().__init__(StepCost(), sched.requests, block_size=sched.config.block_size)
        self.sched = sched
        self.used: list[int] = []
        self.preempted: list[str] = []
        self.admitted: list[tuple[str, ...]] = []

    def execute(self, plan: StepPlan, inputs: ModelInputs | None) -> StepOutput:
        self.used.append(self.sched.pool.num_used_blocks)
        self.preempted.extend(plan.preempted)
        self.admitted.append(plan.admitted)
        return super().execute(plan, inputs)


def engine(cfg: SchedulerConfig) -> tuple[Scheduler, UsageRecorder, EngineCore]:
    sched = Scheduler(cfg)
    recorder = UsageRecorder(sched)
    return sched, recorder, EngineCore(sched, recorder, check_invariants=True)


def run_alone(cfg: SchedulerConfig, r: Request) -> tuple[list[int], FinishReason | None]:
    """``r`` alone on a scheduler over ``cfg``: the blocks in use at each step and how it
    finished (None: refused as never fitting)."""
    sched, recorder, core = engine(cfg)
    try:
        sched.add_request(r)
    except ExceedsCapacity:
        return [], None
    clock = 0.0
    for _ in range(200):
        if not sched.has_unfinished:
            break
        clock = core.step(clock).end_ms
    assert not sched.has_unfinished and recorder.preempted == []  # alone: no victim
    return recorder.used, r.finish_reason


def first_admission_blocks(cfg: SchedulerConfig, r: Request) -> int:
    """What admission asks of an empty pool for ``r`` (no hit): its first chunk's
    blocks and, by ``cfg.admission``, the growth it must find room for."""
    pool = GroupedPool(cfg.num_blocks, cfg.block_size, cfg.kv_groups)
    n = chunk(cfg, r.num_tokens, cfg.max_num_batched_tokens, 0)
    return admission_blocks(cfg, pool, r, n, None)


grouped = st.lists(st.integers(1, 12), min_size=1, max_size=2).map(
    lambda ws: (FULL, *(window(w) for w in ws))
)


@settings(max_examples=60, deadline=None)
@given(grouped, st.integers(2, 4), st.integers(1, 40), st.integers(1, 12), st.integers(4, 32))
def test_sequence_admission_asks_the_blocks_the_request_then_holds(
    groups: tuple[KVGroup, ...], bs: int, prompt: int, max_tokens: int, budget: int
) -> None:
    """Admission by ``sequence`` asks the peak of prompt plus ``max_tokens`` in steps of
    the budget: run alone in a pool of exactly that many blocks the request finishes,
    never holding more, and without preemption. In a pool one block smaller than the
    most it held, it is refused or finishes for capacity (the count can fail)."""
    r = Request("a", list(range(1, prompt + 1)), StopParams(max_tokens, ignore_eos=True))
    cfg = config(groups, bs, 10_000, admission=Admission.SEQUENCE, budget=max(budget, bs))
    asked = first_admission_blocks(cfg, r)
    budget = cfg.max_num_batched_tokens
    assert asked == peak_blocks(groups, prompt + max_tokens, bs, budget)
    used, finished = run_alone(config(groups, bs, asked, budget=budget), r)
    assert finished is FinishReason.LENGTH and max(used) <= asked
    again = Request("b", r.prompt_token_ids, r.stop)
    _, finished = run_alone(config(groups, bs, max(used) - 1, budget=budget), again)
    assert finished in (None, FinishReason.CAPACITY)


@settings(max_examples=60, deadline=None)
@given(grouped, st.integers(2, 4), st.integers(1, 40), st.integers(4, 32))
def test_prompt_admission_asks_the_blocks_the_prompt_then_holds(
    groups: tuple[KVGroup, ...], bs: int, prompt: int, budget: int
) -> None:
    """Admission by ``prompt`` asks the prompt's peak in steps of the budget, which is
    what the capacity refusal asks too: in a pool of that many the request finishes
    holding no more; in a pool one block smaller it is refused."""
    r = Request("a", list(range(1, prompt + 1)), StopParams(1, ignore_eos=True))
    cfg = config(groups, bs, 10_000, admission=Admission.PROMPT, budget=max(budget, bs))
    asked = first_admission_blocks(cfg, r)
    budget = cfg.max_num_batched_tokens
    assert asked == peak_blocks(groups, prompt, bs, budget)
    used, finished = run_alone(config(groups, bs, asked, budget=budget), r)
    assert finished is FinishReason.LENGTH and max(used) <= asked
    again = Request("b", r.prompt_token_ids, r.stop)
    _, finished = run_alone(config(groups, bs, asked - 1, budget=budget), again)
    assert finished is None


@settings(max_examples=40, deadline=None)
@given(grouped, st.integers(2, 4), st.integers(1, 30), st.integers(2, 10), st.integers(1, 4))
def test_sequence_admission_next_to_a_decode_is_exact_and_needs_no_preemption(
    groups: tuple[KVGroup, ...], bs: int, prompt: int, max_tokens: int, arrives: int
) -> None:
    """``x`` (a prompt of one block) decodes; ``b`` arrives after ``arrives`` steps. In the
    step that could admit it, ``x`` holds ``layout_blocks`` of its one new token; with
    exactly ``x``'s holding plus what admission asks, ``b`` is admitted then, and one
    block fewer it waits. In a pool of both peaks, neither is ever preempted."""
    x_tokens = 1 + arrives + 4  # x still decodes in the step that admits b
    # Step 0 computes x's prompt, step j its position bs + j - 1.
    held_x = layout_blocks(groups, bs + arrives - 1, 1, bs)
    b_prompt = list(range(100, 100 + prompt))
    asked = peak_blocks(groups, prompt + max_tokens, bs, MAX_LEN)
    for spare, admitted in ((0, True), (-1, False)):
        num_blocks = held_x + asked + spare
        if never_fits(config(groups, bs, num_blocks), prompt):
            continue
        cfg = config(groups, bs, num_blocks, admission=Admission.SEQUENCE, budget=MAX_LEN)
        sched, recorder, core = engine(cfg)
        sched.add_request(
            Request("x", list(range(1, bs + 1)), StopParams(x_tokens, ignore_eos=True))
        )
        clock = 0.0
        for _ in range(arrives):
            clock = core.step(clock).end_ms
        sched.add_request(Request("b", b_prompt, StopParams(max_tokens, ignore_eos=True)))
        core.step(clock)
        assert ("b" in recorder.admitted[-1]) is admitted, (spare, recorder.used)
    # Room for both peaks: nothing is ever preempted and both finish.
    x_peak = peak_blocks(groups, bs + x_tokens, bs, MAX_LEN)
    cfg = config(groups, bs, x_peak + asked, admission=Admission.SEQUENCE, budget=MAX_LEN)
    sched, recorder, core = engine(cfg)
    x = Request("x", list(range(1, bs + 1)), StopParams(x_tokens, ignore_eos=True))
    b = Request("b", b_prompt, StopParams(max_tokens, ignore_eos=True))
    sched.add_request(x)
    clock = 0.0
    for step in range(200):
        if step == arrives:
            sched.add_request(b)
        if step >= arrives and not sched.has_unfinished:
            break
        clock = core.step(clock).end_ms
    assert recorder.preempted == []
    assert x.finish_reason is FinishReason.LENGTH and b.finish_reason is FinishReason.LENGTH
