"""Admission: which waiting prompts join the batch, with how many tokens, and when.

The token budget is shared in order down to the last token; a new prompt needs its
growth headroom in free blocks (``Admission``); a cached prefix counts the blocks its hit
revives; without chunked prefill a prompt is admitted only whole; after a configured
wait a starving prompt gets the prefill reserve (docs/ARCHITECTURE.md, examples 2d, 2e).
"""

from __future__ import annotations

from typing import Any

import pytest
from harness import SMALL_CONFIG, commit_step, decoding_scheduler, make_request, plan_entry

from refserve.core.config import Admission, SchedulerConfig
from refserve.core.plan import StepPlan
from refserve.core.request import Request, StopParams
from refserve.core.scheduler import Scheduler
from refserve.spec.snapshot import RequestStatus as S
from tests.harness import reference_loop


# ------------------------------------------------------------------ the token budget
@pytest.mark.mutation_kill
def test_admission_shares_the_budget_in_order_down_to_the_last_token() -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=8, max_num_seqs=8, block_size=4, num_blocks=32, max_model_len=64
    )
    sched = Scheduler(cfg)
    for i, rid in enumerate("abcd"):
        sched.add_request(make_request(rid, 3, 4, base=10 * i))
    plan, _ = commit_step(sched)
    assert plan.admitted == ("a", "b", "c") and plan.num_new_tokens == (3, 3, 2)
    plan, _ = commit_step(sched)  # 2 decodes + c's last token: 5 left for d
    assert plan.request_ids == ("a", "b", "c", "d") and plan.num_new_tokens == (1, 1, 1, 3)
    sched2 = decoding_scheduler(cfg, *(make_request(f"r{i}", 1, 9, base=10 * i) for i in range(7)))
    sched2.add_request(make_request("x", 1, 2, base=99))
    plan, _ = commit_step(sched2)  # seven decodes leave exactly one token
    assert plan.admitted == ("x",) and plan_entry(plan, "x") == (0, 1, True, True, 0)


@pytest.mark.mutation_kill
def test_a_prefill_that_does_not_fit_lets_a_later_one_run() -> None:
    # Without chunked prefill a resumed turn must fit whole: a (4 tokens to go) does not
    # fit the 3 tokens five decodes leave, but b (2 to go) behind it does.
    cfg = SchedulerConfig(
        max_num_batched_tokens=8,
        max_num_seqs=8,
        block_size=4,
        num_blocks=32,
        enable_chunked_prefill=False,
    )
    sched = decoding_scheduler(
        cfg, *(make_request(rid, 1, 6, base=10 * i) for i, rid in enumerate("abcdefg"))
    )
    sched.pause("a")
    sched.pause("b")
    sched.resume("a", [1, 2, 3], StopParams(1))
    sched.resume("b", [1], StopParams(1))
    plan, _ = commit_step(sched)
    assert plan.request_ids == ("c", "d", "e", "f", "g", "b")
    assert plan_entry(plan, "b") == (1, 2, True, True, 0)


@pytest.mark.mutation_kill
def test_a_running_prefill_that_gets_no_blocks_leaves_its_tokens_to_admission() -> None:
    """A chunk that is not placed takes nothing from the step's prefill budget: ``p``
    (re-admitted after a preemption) cannot get the blocks of its next chunk and keeps
    running, and the prompt queued behind it is admitted whole with the 5 tokens the
    decode leaves."""
    cfg = SchedulerConfig(
        max_num_batched_tokens=6,
        max_num_seqs=4,
        block_size=2,
        num_blocks=8,
        enable_prefix_caching=False,
    )
    sched = reference_loop(Scheduler(cfg))
    sched.add_request(make_request("d", 2, 50))
    sched.add_request(make_request("p", 12, 5, base=100))
    plans = []
    for step in range(6):
        if step == 4:
            sched.add_request(make_request("w", 2, 5, base=500))
        plans.append(commit_step(sched)[0])
    assert plans[3].preempted == ("p",)  # d's growth took p's blocks
    plan = plans[5]
    assert plan.request_ids == ("d", "w") and plan.preempted == () and not plan.finished
    assert plan_entry(plan, "w") == (0, 2, True, True, 0)
    assert sched.requests["p"].status is S.PREFILLING


@pytest.mark.mutation_kill
@pytest.mark.parametrize(("prompt", "admitted"), [(2, True), (3, False)])
def test_without_chunked_prefill_a_prompt_is_admitted_only_whole(
    prompt: int, admitted: bool
) -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=8,
        max_num_seqs=8,
        block_size=4,
        num_blocks=32,
        enable_chunked_prefill=False,
    )
    sched = decoding_scheduler(cfg, *(make_request(f"d{i}", 1, 6, base=10 * i) for i in range(6)))
    sched.add_request(make_request("x", prompt, 2, base=100))
    plan, _ = commit_step(sched)  # six decodes leave 2 tokens
    assert plan.admitted == (("x",) if admitted else ())
    assert plan.num_scheduled_tokens == 6 + (prompt if admitted else 0)


# ------------------------------------------------------------------ growth headroom
def _admits_beside_a_decode(
    admission: Admission,
    num_blocks: int,
    *,
    budget: int = 16,
    caching: bool = True,
    cached_prefix: bool = False,
    prompt: int = 10,
    watermark: int = 0,
) -> bool:
    """Whether ``x`` (``prompt`` tokens, max_tokens 6) is admitted next to a running
    one-block decode; with ``cached_prefix`` its first 8 tokens are cached and free."""
    cfg = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=4,
        block_size=4,
        num_blocks=num_blocks,
        max_model_len=64,
        admission=admission,
        enable_prefix_caching=caching,
        watermark_blocks=watermark,
    )
    sched = Scheduler(cfg)
    sched.add_request(Request("r0", [500], StopParams(3, ignore_eos=True)))
    if cached_prefix:
        sched.add_request(
            make_request("c", 8, 1)
        )  # finishes at once; its 2 full blocks stay cached
    plan, _ = commit_step(sched)
    assert sched.requests["r0"].status is S.DECODING and sched.pool.num_used_blocks == 1
    sched.add_request(make_request("x", prompt, 6))
    plan, _ = commit_step(sched)
    assert plan.request_ids[0] == "r0"
    if cached_prefix and plan.admitted:
        assert plan_entry(plan, "x")[4] == 8
    return plan.admitted == ("x",)


@pytest.mark.mutation_kill
@pytest.mark.parametrize(
    ("admission", "kw", "blocks"),
    [
        # The whole sequence, 10 + 6 tokens: 4 blocks, counting the 2 cached free blocks
        # the hit takes back out of the free queue.
        (Admission.SEQUENCE, {"cached_prefix": True}, 4),
        (Admission.SEQUENCE, {"caching": False}, 4),
        # The whole prompt (12 tokens, 3 blocks) although only a 4-token chunk fits.
        (Admission.PROMPT, {"budget": 5, "prompt": 12}, 3),
        (Admission.FIRST_CHUNK, {"budget": 5, "prompt": 4}, 1),
        (Admission.FIRST_CHUNK, {"cached_prefix": True}, 3),
        # The watermark keeps 2 blocks back for the running decode's growth.
        (Admission.FIRST_CHUNK, {"budget": 5, "prompt": 4, "watermark": 2}, 3),
    ],
)
def test_admission_needs_exactly_its_headroom_in_free_blocks(
    admission: Admission, kw: dict[str, Any], blocks: int
) -> None:
    # The decode holds one block; the rest of the pool is free.
    assert _admits_beside_a_decode(admission, blocks + 1, **kw)
    assert not _admits_beside_a_decode(admission, blocks, **kw)


# ------------------------------------------------------------------ cached prefixes
def _lone_admission(num_blocks: int) -> StepPlan:
    """``x`` hits 2 cached free blocks while a paused request holds 2 and nothing runs."""
    cfg = SchedulerConfig(
        max_num_batched_tokens=16, max_num_seqs=4, block_size=4, num_blocks=num_blocks
    )
    sched = Scheduler(cfg)
    sched.add_request(make_request("a", 5, 4, base=100))
    sched.add_request(make_request("c", 8, 1))
    commit_step(sched)
    sched.pause("a")  # keeps its 2 blocks; c's 2 blocks are free and cached
    sched.add_request(make_request("x", 10, 2))
    plan, _ = commit_step(sched)
    return plan


@pytest.mark.mutation_kill
def test_a_lone_admission_counts_the_cached_blocks_its_hit_revives() -> None:
    # x needs its 2 cached blocks back plus 1 fresh block for tokens 8 and 9: with 4
    # blocks only reclaiming the paused request's KV makes room, with 5 it fits as is.
    plan = _lone_admission(4)
    assert plan.dropped == ("a",) and plan.admitted == ("x",)
    plan = _lone_admission(5)
    assert plan.dropped == () and plan.admitted == ("x",)
    assert plan_entry(plan, "x") == (8, 2, True, True, 8)


@pytest.mark.mutation_kill
def test_without_prefix_caching_nothing_is_cached_or_reused() -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=16,
        max_num_seqs=4,
        block_size=4,
        num_blocks=16,
        enable_prefix_caching=False,
    )
    sched = Scheduler(cfg)
    sched.add_request(make_request("a", 9, 1))
    commit_step(sched)
    assert sched.pool.snapshot().cache_entries == ()
    sched.add_request(make_request("b", 9, 1))
    plan, _ = commit_step(sched)
    assert plan_entry(plan, "b") == (0, 9, True, True, 0)


# ------------------------------------------------------------------ prefill reserve
@pytest.mark.mutation_kill
@pytest.mark.parametrize("fast_decode", [True, False])
def test_the_prefill_reserve_starts_after_the_configured_wait(fast_decode: bool) -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=4,
        max_num_seqs=8,
        block_size=4,
        num_blocks=32,
        max_model_len=64,
        prefill_reserve_tokens=2,
        prefill_reserve_after_steps=2,
    )
    sched = (
        Scheduler(cfg) if fast_decode else reference_loop(Scheduler(cfg))
    )  # bulk path or per-request loop
    for i in range(4):
        sched.add_request(make_request(f"d{i}", 1, 50, base=10 * i))
    commit_step(sched)  # four one-token prompts fill the budget and start decoding
    sched.add_request(make_request("p", 9, 2, base=100))  # queued at step 1
    grants: list[tuple[str, ...]] = []
    for _ in range(7):
        plan, _ = commit_step(sched)
        grants.append(
            tuple(f"{r}:{n}" for r, n in zip(plan.request_ids, plan.num_new_tokens, strict=True))
        )
    decodes4 = ("d0:1", "d1:1", "d2:1", "d3:1")
    # p starves for two steps, then the reserve gives it 2 tokens; each grant restarts
    # the count.
    assert grants == [
        decodes4,
        decodes4,
        ("d0:1", "d1:1", "p:2"),
        decodes4,
        ("d0:1", "d1:1", "p:2"),
        decodes4,
        ("d0:1", "d1:1", "p:2"),
    ]


@pytest.mark.mutation_kill
@pytest.mark.parametrize("fast_decode", [True, False])
def test_no_reserve_is_held_back_when_no_prompt_waits(fast_decode: bool) -> None:
    """With nothing left to prefill, the reserve must not shrink the decodes' budget."""
    cfg = SchedulerConfig(
        max_num_batched_tokens=4,
        max_num_seqs=8,
        block_size=4,
        num_blocks=32,
        max_model_len=64,
        prefill_reserve_tokens=2,
        prefill_reserve_after_steps=0,
    )
    sched = Scheduler(cfg) if fast_decode else reference_loop(Scheduler(cfg))
    for i in range(4):
        sched.add_request(make_request(f"d{i}", 1, 50, base=10 * i))
    commit_step(sched)  # four one-token prompts: no prefill work is left after this step
    for _ in range(3):
        plan, _ = commit_step(sched)
        assert plan.request_ids == ("d0", "d1", "d2", "d3")


@pytest.mark.mutation_kill
def test_a_resumed_turn_counts_for_the_prefill_reserve() -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=4,
        max_num_seqs=8,
        block_size=4,
        num_blocks=32,
        max_model_len=64,
        prefill_reserve_tokens=2,
        prefill_reserve_after_steps=1,
    )
    sched = Scheduler(cfg)
    for i in range(4):
        sched.add_request(make_request(f"d{i}", 1, 50, base=10 * i))
    commit_step(sched)
    sched.pause("d0")
    sched.resume("d0", [5, 6, 7], StopParams(1))  # 1 + 3 tokens to prefill, in place
    plan, _ = commit_step(sched)  # not starving yet: the three decodes come first
    assert plan.request_ids == ("d1", "d2", "d3", "d0")
    assert plan.num_new_tokens == (1, 1, 1, 1)
    plan, _ = commit_step(sched)  # waited a step since its last grant: the reserve applies
    assert plan.request_ids == ("d1", "d2", "d0") and plan.num_new_tokens == (1, 1, 2)


# ------------------------------------------------------------------ add_request
@pytest.mark.mutation_kill
def test_add_request_stamps_arrival_order_and_queue_step() -> None:
    sched = decoding_scheduler(SMALL_CONFIG, make_request("a", 3))
    assert sched.step_index == 1
    b, c = make_request("b", 3, base=10), make_request("c", 3, base=20)
    sched.add_request(b)
    sched.add_request(c)
    assert (b.seq, c.seq) == (1, 2) and b.queued_step == c.queued_step == 1
    assert sched.requests["b"] is b and sched.waiting == [b, c]
