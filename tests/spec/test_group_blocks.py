"""The per-group block count (spec/groups.py: group_blocks, layout_blocks, peak_blocks)
against brute force, and the scheduler's uses of it (ref/core/capacity.py): the
capacity refusal, the chunk limit that keeps a request within its peak, and admission
by ``prompt`` and ``sequence``, which must ask exactly the blocks a request then holds.

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
    chunk_limit,
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
    layout_blocks,
    most_new_tokens,
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


def brute_peak(groups: Sequence[KVGroup], num_tokens: int, bs: int) -> int:
    return max(layout_blocks(groups, n, 1, bs) for n in range(num_tokens))


# ------------------------------------------------------------------ the counts
@settings(max_examples=300, deadline=None)
@given(layouts, block_sizes, st.integers(1, 300))
def test_peak_blocks_is_the_largest_layout_over_every_position(
    groups: tuple[KVGroup, ...], bs: int, n: int
) -> None:
    assert peak_blocks(groups, n, bs) == brute_peak(groups, n, bs)


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


@given(layouts, block_sizes, st.integers(0, 200), st.integers(0, 60))
def test_most_new_tokens_is_the_longest_step_within_a_block_limit(
    groups: tuple[KVGroup, ...], bs: int, stored: int, limit: int
) -> None:
    """The largest ``n`` within the limit (a layout's blocks grow with ``n``), or below
    1 when not one token fits."""
    n = most_new_tokens(groups, stored, limit, bs)
    if n >= 1:
        assert layout_blocks(groups, stored, n, bs) <= limit
        assert layout_blocks(groups, stored, n + 1, bs) > limit
    else:
        assert layout_blocks(groups, stored, 1, bs) > limit


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
    """Chunked, a request's tokens may be computed one at a time: it needs their peak.
    Without chunked prefill a prompt or a recompute takes every token in one step: every
    group's blocks for all of them at once. One group is the plain pool's rule."""
    cfg = config(groups, bs, num_blocks, chunked=chunked)
    need = peak_blocks(groups, n, bs) if chunked else layout_blocks(groups, 0, n, bs)
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


@given(layouts, block_sizes, st.integers(1, 200), st.data())
def test_the_chunk_limit_is_the_longest_chunk_within_the_peak(
    groups: tuple[KVGroup, ...], bs: int, num_tokens: int, data: st.DataObject
) -> None:
    computed = data.draw(st.integers(0, num_tokens - 1), label="computed")
    cfg = config(groups, bs, 10_000)
    limit = chunk_limit(cfg, computed, num_tokens)
    peak = peak_blocks(groups, num_tokens, bs)
    assert limit >= 1
    assert layout_blocks(groups, computed, limit, bs) <= peak
    assert layout_blocks(groups, computed, limit + 1, bs) > peak
    remaining = num_tokens - computed
    n = chunk(cfg, remaining, MAX_LEN, computed)
    assert n == min(remaining, MAX_LEN, limit)


def test_a_long_prompt_is_cut_to_its_peak_in_a_pool_of_its_peak() -> None:
    """The case that made a request the refusal accepted unable to run: 40 tokens in
    blocks of 4 with a window of 4 peak at 13 blocks, but one chunk of all 40 holds 20.
    The chunks are cut so the request never holds more than 13, and it finishes."""
    groups = (FULL, window(4))
    assert peak_blocks(groups, 44, 4) == 13 and layout_blocks(groups, 0, 40, 4) == 20
    cfg = config(groups, 4, 13)
    used, finished = run_alone(
        cfg, Request("a", list(range(1, 41)), StopParams(4, ignore_eos=True))
    )
    assert finished is FinishReason.LENGTH and max(used) == 13


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
    """Admission by ``sequence`` asks the peak of prompt plus ``max_tokens``: run alone in
    a pool of exactly that many blocks the request finishes, holding at most that many,
    and at its most exactly the peak of the tokens it computes (all but its last
    sample). One block fewer than that and it is refused or finishes for capacity."""
    r = Request("a", list(range(1, prompt + 1)), StopParams(max_tokens, ignore_eos=True))
    cfg = config(groups, bs, 10_000, admission=Admission.SEQUENCE, budget=max(budget, bs))
    asked = first_admission_blocks(cfg, r)
    assert asked == peak_blocks(groups, prompt + max_tokens, bs)
    computed = peak_blocks(groups, prompt + max_tokens - 1, bs)
    used, finished = run_alone(config(groups, bs, asked, budget=cfg.max_num_batched_tokens), r)
    assert finished is FinishReason.LENGTH and max(used) == computed <= asked
    again = Request("b", r.prompt_token_ids, r.stop)
    short = config(groups, bs, computed - 1, budget=cfg.max_num_batched_tokens)
    _, finished = run_alone(short, again)
    assert finished in (None, FinishReason.CAPACITY)


@settings(max_examples=60, deadline=None)
@given(grouped, st.integers(2, 4), st.integers(1, 40), st.integers(4, 32))
def test_prompt_admission_asks_the_blocks_the_prompt_then_holds(
    groups: tuple[KVGroup, ...], bs: int, prompt: int, budget: int
) -> None:
    """Admission by ``prompt`` asks the prompt's peak: exactly what a one-token request
    holds at its most; in a pool one block smaller it is refused."""
    r = Request("a", list(range(1, prompt + 1)), StopParams(1, ignore_eos=True))
    cfg = config(groups, bs, 10_000, admission=Admission.PROMPT, budget=max(budget, bs))
    asked = first_admission_blocks(cfg, r)
    assert asked == peak_blocks(groups, prompt, bs)
    used, finished = run_alone(config(groups, bs, asked, budget=cfg.max_num_batched_tokens), r)
    assert finished is FinishReason.LENGTH and max(used) == asked
    again = Request("b", r.prompt_token_ids, r.stop)
    _, finished = run_alone(config(groups, bs, asked - 1, budget=cfg.max_num_batched_tokens), again)
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
    asked = peak_blocks(groups, prompt + max_tokens, bs)
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
    x_peak = peak_blocks(groups, bs + x_tokens, bs)
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
