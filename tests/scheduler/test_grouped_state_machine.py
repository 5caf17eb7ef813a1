"""Hypothesis state machine: the scheduler over a hybrid model's KV layer groups.

A ``Scheduler`` with ``kv_groups`` of one full attention group and one or two sliding
window groups (windows mostly not a multiple of the block size), tiny pools (so
preemption and the capacity refusal both happen), in most configurations a host pool
with preemption by swap (``swap``, ``auto`` or ``recompute``), prefix caching on and
prompts that share prefixes (so hits, with window blocks skipped, happen), in some
configurations speculative drafts (``Scheduler.propose`` before a step: the request's
next tokens up to a drawn point, then drawn tokens, so some are rejected), driven by
arrivals, checked steps, aborts and n > 1 forks. Every step goes through
``EngineCore(check_invariants=True)`` (the engine's own TOKEN, BLOCK, KVLEN, POS, CAP,
PREFIX and PROGRESS over every group's tables); on top, this machine checks the layer
group rules of spec/groups.py, which the engine's checks do not state:

* inside every step, once the scheduler has allocated (the executor runs then):
  ``check_groups`` on the pool's ``grouped_snapshot()``, and ``check_window_held`` for
  every scheduled request, from the KV length its chunk starts at (``plan.starts``) with
  the prefix-cache hit it was admitted with in this step (``plan.num_new_cached_tokens``);
* a fake K/V memory written in every group (slot -> token id, through each group's own
  table; the swap-out copies to a fake host memory, the swap-in copies back and the
  copy-on-write copies applied first, in the executor's order; a verification's drafts
  written too, and each rejected draft's slot then poisoned in every group, so a block or
  a cache entry kept over it reads wrong): each scheduled request
  reads its own tokens wherever its chunk's queries read, a full group from position 0
  and a window group from ``window_start``; after each step every live table, every
  swapped request's host table and every prefix-cache entry reads back the tokens it
  claims;
* the host pool (spec/host.py ``check_host`` with the layout): a swapped request's host
  table holds, in every group, exactly the blocks its next query reads;
* capacity: the blocks in use never exceed ``num_blocks``; a request refused as never
  fitting (``ExceedsCapacity``, or finished with reason ``capacity``) needs more than
  the pool by spec/groups.py's count (``peak_blocks``), and one accepted needs no more.

``GroupedMlfqMachine`` runs the same machine under the skip-join MLFQ policy (its
displacements and headroom swap-outs count every group's blocks) and checks its own
rules (spec/mlfq.py) after every step and abort too.

The planted bugs at the end (a window block released one token early, a hit taken
without a window block its query reads, a group left out of a free, a swap-out that
leaves a request's last window block uncopied, a swap whose window places start one
block late on both sides, a truncation of rejected drafts that cuts the first group's
table only, or keeps a window group's cache entries over them) are each caught by these
same checks (the last by the engine's PREFIX check first), in fixed scenarios. A
tool wait on the host (``pause`` with retention ``host``) goes through the same swaps,
checked the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from refserve.core.config import Admission, PolicyName, SchedulerConfig
from refserve.core.cost import StepCost
from refserve.core.engine_core import EngineCore, InvariantViolation
from refserve.core.executor import StepOutput
from refserve.core.inputs import ModelInputs
from refserve.core.mlfq import SkipJoinMlfq
from refserve.core.mlfq_settings import MlfqSettings
from refserve.core.plan import StepPlan
from refserve.core.request import FinishReason, Request, StopParams
from refserve.core.scheduler import Scheduler
from refserve.core.swap import KVRetention, PreemptionMode, SwapCost
from refserve.errors import ExceedsCapacity
from refserve.kv import PrefixHit
from refserve.kv import groups as groups_module
from refserve.kv import host_pool as host_pool_module
from refserve.kv import truncation as truncation_module
from refserve.kv.groups import GroupBlocks, GroupedHit, GroupedPool
from refserve.kv.host_pool import HostPool
from refserve.kv.pool import BlockCopy, BlockPool
from refserve.kv.tables import BlockTable
from refserve.sim.simulator import SimExecutor, fake_token
from refserve.spec.groups import (
    GROUP_TABLES,
    NULL_BLOCK,
    PREFIX_COMPLETE,
    WINDOW_EARLY,
    GroupKind,
    KVGroup,
    check_groups,
    check_window_held,
    held_places,
    peak_blocks,
    window_start,
)
from refserve.spec.host import check_host
from refserve.spec.mlfq import check_mlfq
from refserve.spec.snapshot import RequestStatus
from refserve.spec.violation import Violation

FULL = KVGroup(GroupKind.FULL)
COST = StepCost(a=1.0, b=0.5, c=1.0)
# ``auto`` swaps a victim of more than 4 tokens (2 * 1 ms of copy latency against 0.5 ms
# a token of recompute; the bytes cost next to nothing).
SWAP_COST = SwapCost(kv_bytes_per_token=1_000, latency_ms=1.0, iteration=COST)
MAX_LIVE = 6
# A GroupRuleBroken's name for a fake memory that read back other tokens (or capacity).
MEMORY = "memory"
POISONED = -1  # a rejected draft's slot in the fake memory: never a token id


def window(w: int) -> KVGroup:
    return KVGroup(GroupKind.WINDOW, w)


class GroupRuleBroken(AssertionError):
    """A layer group rule (spec/groups.py) or the fake memory's read-back failed; the
    message names every rule broken."""

    def __init__(self, where: str, violations: Sequence[Violation], errors: Sequence[str]) -> None:
        lines = [f"{v.rule or v.invariant}: {v}" for v in violations] + list(errors)
        super().__init__(f"{where}:\n  " + "\n  ".join(lines))
        self.rules = {v.rule for v in violations} | ({MEMORY} if errors else set())


def needs_blocks(config: SchedulerConfig, num_tokens: int) -> int:
    """The blocks ``num_tokens`` tokens of KV need at once, by spec/groups.py: the peak
    of steps of at most the token budget (which bounds a whole prompt without chunked
    prefill too)."""
    budget = config.max_num_batched_tokens
    return peak_blocks(config.kv_groups, max(1, num_tokens), config.block_size, budget)


def grouped_pool(sched: Scheduler) -> GroupedPool:
    pool = sched.pool
    assert isinstance(pool, GroupedPool), "a grouped config builds a GroupedPool"
    return pool


class GroupCheckingExecutor(SimExecutor):
    """The simulator's tokens and step times, with the layer group checks run where the
    step's allocations stand (inside ``execute``) and a fake K/V memory per group."""

    def __init__(self, sched: Scheduler) -> None:
        super().__init__(COST, sched.requests, block_size=sched.config.block_size)
        self.sched = sched
        self.memory: dict[int, int] = {}  # slot -> token id; block ids are unique over groups
        self.host_memory: dict[int, int] = {}  # host slot -> token id
        self.on_plan: Callable[[StepPlan], None] | None = None

    def execute(self, plan: StepPlan, inputs: ModelInputs | None) -> StepOutput:
        pool = grouped_pool(self.sched)
        snap = pool.grouped_snapshot()
        found = check_groups(snap)
        for rid, start, cached in zip(
            plan.request_ids, plan.starts, plan.num_new_cached_tokens, strict=True
        ):
            found += check_window_held(snap, rid, start, cached)
        errors = self._capacity_errors()
        bs = self.block_size
        # The executor's order (ref/core/plan.py): swap-outs, swap-ins, copy-on-write.
        copy_blocks(self.memory, self.host_memory, plan.swap_out, bs)
        copy_blocks(self.host_memory, self.memory, plan.swap_in, bs)
        copy_blocks(self.memory, self.memory, plan.copies, bs)
        for rid, start, n in zip(plan.request_ids, plan.starts, plan.num_new_tokens, strict=True):
            tokens = [*self.sched.requests[rid].token_ids, *plan.drafts.get(rid, ())]
            for g, table in enumerate(pool.block_tables(rid)):
                # What this chunk's queries read before its own positions.
                errors += self._readback(rid, g, table, tokens, first_read(pool, g, start), start)
                for p in range(start, start + n):
                    b = table[p // bs]
                    if b == NULL_BLOCK:
                        errors.append(f"{rid} group {g}: position {p} written to a null place")
                    else:
                        self.memory[b * bs + p % bs] = tokens[p]
        if found or errors:
            raise GroupRuleBroken(f"step {plan.step_index}", found, errors)
        if self.on_plan is not None:
            self.on_plan(plan)
        if not plan.drafts:
            return super().execute(plan, inputs)
        out = super().execute(replace(plan, drafts={}), inputs)
        sampled, accepted = dict(out.sampled), self._verify(plan)
        for rid, a in accepted.items():
            r = self.sched.requests[rid]
            sampled[rid] = fake_token(r.seq, r.num_tokens + a)  # the target's own token
        return replace(out, sampled=sampled, accepted=accepted)

    def _verify(self, plan: StepPlan) -> dict[str, int]:
        """Each verification's accepted drafts: those equal to the tokens the request
        samples anyway (the simulator's), up to the first that is not; the rejected
        drafts' slots are poisoned in every group (their K/V is not the sequence's)."""
        pool = grouped_pool(self.sched)
        bs = self.block_size
        accepted: dict[str, int] = {}
        for rid, drafts in plan.drafts.items():
            r = self.sched.requests[rid]
            a = 0
            while a < len(drafts) and drafts[a] == fake_token(r.seq, r.num_tokens + a):
                a += 1
            accepted[rid] = a
            for table in pool.block_tables(rid):
                for p in range(r.num_tokens + a, r.num_tokens + len(drafts)):
                    self.memory[table[p // bs] * bs + p % bs] = POISONED
        return accepted

    def _capacity_errors(self) -> list[str]:
        pool = grouped_pool(self.sched)
        tables = pool.grouped_snapshot().tables
        held = {b for t in tables for b in t.table.block_table} - {NULL_BLOCK}
        used = pool.num_used_blocks
        if used > pool.num_blocks or len(held) > used:
            return [f"blocks in use {used}, held {len(held)}, pool {pool.num_blocks}"]
        return []

    def _readback(
        self,
        rid: str,
        g: int,
        table: Sequence[int],
        tokens: Sequence[int],
        lo: int,
        hi: int,
        memory: dict[int, int] | None = None,
    ) -> list[str]:
        """``rid``'s table in group ``g`` reads its own tokens at positions ``[lo, hi)``
        (in the device memory, or ``memory``)."""
        bs = self.block_size
        mem = self.memory if memory is None else memory
        where = "" if memory is None else " on the host"
        out: list[str] = []
        for p in range(lo, hi):
            b = table[p // bs] if p // bs < len(table) else NULL_BLOCK
            got = None if b == NULL_BLOCK else mem.get(b * bs + p % bs)
            if got != tokens[p]:
                out.append(
                    f"{rid} group {g}{where}: position {p} (block {b}) reads {got}, not {tokens[p]}"
                )
        return out

    def after_step_errors(self) -> list[str]:
        """Every live table reads back its tokens where its next query reads, and every
        prefix-cache entry the tokens its key was made from."""
        pool = grouped_pool(self.sched)
        snap = pool.grouped_snapshot()
        bs = self.block_size
        out: list[str] = []
        for gt in snap.tables:
            t = gt.table
            lo = first_read(pool, gt.group, t.num_stored)
            out += self._readback(
                t.request_id, gt.group, t.block_table, t.token_ids, lo, t.num_stored
            )
        host = self.sched.host
        if host.num_blocks:  # a swapped request's KV, where its next query will read it
            for gt in host.grouped_snapshot().tables:
                t = gt.table
                lo = first_read(pool, gt.group, t.num_stored)
                out += self._readback(
                    t.request_id, gt.group, t.block_table, t.token_ids, lo, t.num_stored,
                    self.host_memory,
                )  # fmt: skip
        for e in snap.pool.cache_entries:
            got = tuple(self.memory.get(e.block_id * bs + off) for off in range(bs))
            if got != e.token_ids:
                out.append(f"cache entry of block {e.block_id} reads {got}, not {e.token_ids}")
        return out + self._capacity_errors()


def copy_blocks(
    src: dict[int, int], dst: dict[int, int], copies: Sequence[BlockCopy], block_size: int
) -> None:
    """Whole-block copies between fake memories (slot -> token id), every source read
    before any destination is written (as the executor's gather, then scatter)."""
    read = [[src.get(c.src * block_size + off) for off in range(block_size)] for c in copies]
    for c, values in zip(copies, read, strict=True):
        for off, v in enumerate(values):
            if v is None:
                dst.pop(c.dst * block_size + off, None)
            else:
                dst[c.dst * block_size + off] = v


def first_read(pool: GroupedPool, group: int, num_tokens: int) -> int:
    """The first position the query at ``num_tokens`` reads in ``group`` (spec's count)."""
    g = pool.groups[group]
    return 0 if g.kind is GroupKind.FULL else window_start(num_tokens, g.window)


def check_after_step(executor: GroupCheckingExecutor, where: str) -> None:
    sched = executor.sched
    snap = grouped_pool(sched).grouped_snapshot()
    found = check_groups(snap) + check_host(sched.snapshot(), groups=sched.config.kv_groups)
    errors = executor.after_step_errors()
    if found or errors:
        raise GroupRuleBroken(where, found, errors)


def check_capacity_finishes(sched: Scheduler) -> int:
    """A request the step finished with reason ``capacity`` can never fit; how many."""
    cfg = sched.config
    finished = [r for r in sched.retired if r.finish_reason is FinishReason.CAPACITY]
    for r in finished:
        need = needs_blocks(cfg, r.num_tokens)
        assert need > cfg.num_blocks, (
            f"{r.request_id} finished for capacity with {r.num_tokens} tokens, which "
            f"need {need} of {cfg.num_blocks} blocks"
        )
    return len(finished)


# ------------------------------------------------------------------ the machine
class GroupedMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.next_id = 0
        self.clock = 0.0
        self.prefixes: list[list[int]] = []

    @initialize(data=st.data())
    def setup(self, data: st.DataObject) -> None:
        d = data.draw
        bs = d(st.integers(2, 4), label="block_size")
        windows = d(st.lists(st.integers(1, 10), min_size=1, max_size=2), label="windows")
        groups = (FULL, *(window(w) for w in windows))
        chunked = d(st.sampled_from([True, True, True, False]), label="chunked")
        # Without chunked prefill the budget caps a request's length (config.max_len).
        budget = d(st.integers(bs, 16), label="budget") if chunked else 40
        # Mostly a host pool (sometimes too small for a victim), swapping victims.
        host = d(st.sampled_from([0, 4, 12, 24, 24, 48]), label="num_host_blocks")
        modes = [PreemptionMode.SWAP, PreemptionMode.SWAP, PreemptionMode.AUTO]
        mode = d(st.sampled_from(modes), label="mode") if host else PreemptionMode.RECOMPUTE
        self.config = SchedulerConfig(
            max_num_batched_tokens=budget,
            max_num_seqs=d(st.integers(1, 4), label="max_num_seqs"),
            block_size=bs,
            num_blocks=d(st.integers(6, 24), label="num_blocks"),
            max_model_len=40,
            enable_prefix_caching=True,
            enable_chunked_prefill=chunked,
            align_chunks_to_blocks=d(st.booleans(), label="align"),
            admission=d(
                st.sampled_from(
                    [Admission.FIRST_CHUNK] * 2 + [Admission.PROMPT, Admission.SEQUENCE]
                ),
                label="admission",
            ),
            kv_groups=groups,
            num_host_blocks=host,
            preemption_mode=mode,
            swap_cost=SWAP_COST,
            num_speculative_tokens=d(st.sampled_from([0, 0, 1, 2, 4]), label="k"),
            **self._policy(data),
        )
        self.prefixes = [
            d(st.lists(st.integers(1, 3), min_size=bs, max_size=4 * bs), label="prefix")
            for _ in range(2)
        ]
        self.sched = Scheduler(self.config)
        self.executor = GroupCheckingExecutor(self.sched)
        self.executor.on_plan = self._label
        self.core = EngineCore(self.sched, self.executor, check_invariants=True)

    def _policy(self, data: st.DataObject) -> dict[str, Any]:
        """The scheduling policy's config fields (none: the default policy)."""
        return {}

    def _label(self, plan: StepPlan) -> None:
        if plan.preempted:
            event("a preemption")
        if plan.copies:
            event("a copy-on-write copy")
        host = self.sched.host
        for rid in plan.swapped_out:
            event("a swap-out")
            if host.table(rid).groups[1].first:
                event("a swap-out that leaves a window group's earlier blocks")
        if plan.swapped_in:
            event("a swap-in")
        pool = grouped_pool(self.sched)
        for rid, drafts in plan.drafts.items():
            r = self.sched.requests[rid]
            right = [fake_token(r.seq, r.num_tokens + j) for j in range(len(drafts))]
            event("a verification with a rejected draft" if list(drafts) != right else
                  "a verification with every draft accepted")  # fmt: skip
            if any(NULL_BLOCK in t for t in pool.block_tables(rid)[1:]):
                event("a verification whose window group holds null places")
        for rid, cached in zip(plan.request_ids, plan.num_new_cached_tokens, strict=True):
            windows = pool.block_tables(rid)[1:]
            if any(NULL_BLOCK in t for t in windows):
                event("a window group holds null places")
            if cached:
                event("a prefix hit")
                if any(t[:1] == (NULL_BLOCK,) for t in windows):
                    event("a prefix hit that skips window blocks")

    # ------------------------------------------------------------------ rules
    @rule(
        which=st.integers(0, 1),
        shared=st.integers(0, 16),
        tail=st.lists(st.integers(1, 3), max_size=8),
        max_tokens=st.integers(1, 10),
    )
    def add(self, which: int, shared: int, tail: list[int], max_tokens: int) -> None:
        if len(self.sched.requests) >= MAX_LIVE:
            return
        prompt = self.prefixes[which][:shared] + tail or [1]
        rid = f"r{self.next_id}"
        self.next_id += 1
        r = Request(rid, prompt, StopParams(max_tokens, ignore_eos=True), arrival_ms=self.clock)
        need = needs_blocks(self.config, len(prompt))
        try:
            self.sched.add_request(r)
        except ExceedsCapacity:
            event("a request that can never fit is refused")
            assert need > self.config.num_blocks, (
                f"{rid} refused: {len(prompt)} tokens need {need} of "
                f"{self.config.num_blocks} blocks"
            )
            return
        assert need <= self.config.num_blocks, f"{rid} accepted but needs {need} blocks"

    @rule(n=st.integers(1, 4), data=st.data())
    def step(self, n: int, data: st.DataObject) -> None:
        for _ in range(n):
            if not self.sched.has_unfinished:
                return
            self._one_step(data)

    def _propose(self, data: st.DataObject) -> None:
        """Drafts for some decoding requests: the tokens each samples anyway up to a
        drawn point, then drawn tokens (rejected, unless one happens to match)."""
        k = self.config.num_speculative_tokens
        for r in list(self.sched.running) if k else []:
            if r.status is not RequestStatus.DECODING:
                continue
            n = data.draw(st.integers(0, k), label="drafts")
            right = data.draw(st.integers(0, n), label="right drafts")
            wrong = data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n), label="drawn")
            good = [fake_token(r.seq, r.num_tokens + j) for j in range(right)]
            self.sched.propose(r.request_id, [*good, *wrong][:n])

    def _one_step(self, data: st.DataObject | None = None) -> None:
        if data is not None:
            self._propose(data)
        rec = self.core.step(self.clock)
        self.clock = rec.end_ms
        if check_capacity_finishes(self.sched):
            event("a request finished with reason capacity")
        check_after_step(self.executor, f"after step {rec.plan.step_index}")

    @precondition(lambda self: bool(self.sched.requests))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.sched.requests)), label="abort")
        self.sched.abort(rid, self.clock)
        check_after_step(self.executor, f"after aborting {rid}")

    def _parents(self) -> list[str]:
        return sorted(
            rid
            for rid, r in self.sched.requests.items()
            if r.status is RequestStatus.DECODING and r.num_output_tokens == 1
        )

    @precondition(lambda self: bool(self._parents()))
    @rule(data=st.data(), first=st.integers(1, 3), max_tokens=st.integers(2, 8))
    def fork(self, data: st.DataObject, first: int, max_tokens: int) -> None:
        parent = data.draw(st.sampled_from(self._parents()), label="parent")
        rid = f"r{self.next_id}"
        self.next_id += 1
        child = self.sched.fork(parent, rid, first, StopParams(max_tokens, ignore_eos=True))
        event(f"a fork that {child.status.value}")
        if check_capacity_finishes(self.sched):
            event("a fork that can never fit finished with reason capacity")
        check_after_step(self.executor, f"after forking {rid} off {parent}")

    @invariant()
    def used_within_pool(self) -> None:
        if hasattr(self, "sched"):  # invariants run before the initialize rule too
            assert self.sched.pool.num_used_blocks <= self.config.num_blocks

    def teardown(self) -> None:
        if not hasattr(self, "sched"):
            return
        limit = 400
        while self.sched.has_unfinished and limit:
            self._one_step()
            limit -= 1
        assert not self.sched.has_unfinished, "the drain did not finish"
        snap = grouped_pool(self.sched).grouped_snapshot()
        assert snap.tables == () and self.sched.pool.num_free_blocks == self.config.num_blocks
        assert self.sched.host.num_free_blocks == self.config.num_host_blocks


GroupedMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_grouped_state_machine = GroupedMachine.TestCase


class GroupedMlfqMachine(GroupedMachine):
    """The same machine under the skip-join MLFQ (``policy="mlfq"``, ref/core/mlfq.py),
    whose displacements and headroom swap-outs count every group's blocks: on top of
    every check above, spec/mlfq.py's rules (starvation bound, no thrash, the queues'
    conservation) on the policy's snapshot after every step and abort."""

    def _policy(self, data: st.DataObject) -> dict[str, Any]:
        d = data.draw
        settings_ = MlfqSettings(
            num_queues=d(st.integers(1, 4), label="num_queues"),
            base_quantum_ms=d(st.sampled_from([2.0, 4.0, 8.0]), label="base_quantum_ms"),
            quantum_growth=d(st.sampled_from([1.0, 2.0, 4.0]), label="growth"),
            starvation_steps=d(st.integers(1, 12), label="starvation_steps"),
            skip_join=d(st.booleans(), label="skip_join"),
            proactive_swap=d(st.booleans(), label="proactive_swap"),
            cost=COST,
        )
        return {"policy": PolicyName.MLFQ, "mlfq": settings_}

    def _one_step(self, data: st.DataObject | None = None) -> None:
        super()._one_step(data)
        policy = self._mlfq()
        for d in policy.last_displaced:
            event(f"displaced for {d.reason}")
        for c in policy.last_choices:
            if c.to_host:
                event("a displaced request's K/V went to the host")

    def _mlfq(self) -> SkipJoinMlfq:
        policy = self.sched.policy
        assert isinstance(policy, SkipJoinMlfq)
        return policy

    @invariant()
    def mlfq_rules_hold(self) -> None:
        if not hasattr(self, "sched"):
            return
        sched = self.sched
        bad = check_mlfq(self._mlfq().snapshot(sched.requests, sched.running, sched.step_index))
        assert not bad, "\n".join(map(str, bad))


GroupedMlfqMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_grouped_mlfq_state_machine = GroupedMlfqMachine.TestCase


# ---------------------------------------------------------------------- planted bugs
# Fixed scenarios, so each is fast and cannot flake: blocks of 4, a full group and a
# window of 6 (not a multiple of the block size: the window starts inside a block).
BS = 4
PLANTED = SchedulerConfig(
    max_num_batched_tokens=16,
    max_num_seqs=2,
    block_size=BS,
    num_blocks=16,
    max_model_len=32,
    kv_groups=(FULL, window(6)),
)


def request(rid: str, prompt: Sequence[int], max_tokens: int) -> Request:
    return Request(rid, list(prompt), StopParams(max_tokens, ignore_eos=True))


# Two requests that outgrow 10 blocks together: the later one is swapped out (its window
# group's blocks from the one holding window_start on) and back in once the first ends.
SWAPPING = replace(PLANTED, num_blocks=10, num_host_blocks=16, preemption_mode="swap")


def rules_found(
    arrivals: Sequence[tuple[int, Request]],
    limit: int = 60,
    config: SchedulerConfig = PLANTED,
    seen: list[StepPlan] | None = None,
    propose: Callable[[Scheduler], None] | None = None,
) -> set[str]:
    """Run requests arriving at the given steps on a scheduler over ``config`` with the
    machine's checks; the layer group rules they found (empty: none, and every request
    finished; ``seen`` gets the plans; ``propose`` is called before each step). An
    engine check that fails first is reported by its invariant and rules, with the
    group rules of the state it failed in."""
    sched = Scheduler(config)
    executor = GroupCheckingExecutor(sched)
    if seen is not None:
        executor.on_plan = seen.append
    core = EngineCore(sched, executor, check_invariants=True)
    clock = 0.0
    try:
        for i in range(limit):
            for at, r in arrivals:
                if at == i:
                    sched.add_request(r)
            if sched.has_unfinished:
                if propose is not None:
                    propose(sched)
                clock = core.step(clock).end_ms
                check_capacity_finishes(sched)
                check_after_step(executor, f"after step {i}")
    except GroupRuleBroken as e:
        return e.rules
    except InvariantViolation as e:
        found = check_groups(grouped_pool(sched).grouped_snapshot())
        engine = {str(v.invariant) for v in e.violations} | {v.rule for v in e.violations}
        return engine - {""} | {v.rule for v in found}
    assert not sched.has_unfinished, "the scenario did not finish"
    assert all(r.finish_reason is FinishReason.LENGTH for _, r in arrivals)
    return set()


@contextmanager
def planted(name: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Plant bug ``name`` in GroupedPool for the body (the test reaches into the
    pool's own methods: that is where each bug would live)."""
    if name == "early":
        honest_first = GroupedPool.first_read_block

        def first_read_block(self: GroupedPool, group: int, num_tokens: int) -> int:
            # One block further whenever the window starts inside a block: the block
            # holding the window's first positions goes back while its query reads it.
            first = honest_first(self, group, num_tokens)
            g = self.groups[group]
            if g.kind is GroupKind.WINDOW and window_start(num_tokens, g.window) % BS:
                return first + 1
            return first

        monkeypatch.setattr(GroupedPool, "first_read_block", first_read_block)
    elif name == "incomplete-hit":
        honest_lookup = GroupedPool.lookup

        def lookup(self: GroupedPool, *args: object, **kwargs: object) -> GroupedHit:
            # Each window group's hit skips one more block, one its query reads, and
            # the pool takes such a hit unchecked.
            hit = honest_lookup(self, *args, **kwargs)  # type: ignore[arg-type]
            hits = [hit.hits[0]] + [
                PrefixHit(h.root_key, h.block_ids[1:], h.keys, BS, h.num_skipped + 1)
                if h.block_ids
                else h
                for h in hit.hits[1:]
            ]
            return GroupedHit.of(hits)

        monkeypatch.setattr(GroupedPool, "lookup", lookup)
        monkeypatch.setattr(GroupedPool, "_check_hit", lambda *args: None)
    elif name == "leaky-free":

        def free(self: GroupedPool, request_id: str) -> None:
            for pool in self.pools[:-1]:  # the last group keeps its table
                BlockPool.free(pool, request_id)

        monkeypatch.setattr(GroupedPool, "free", free)
    elif name == "uncopied-window-block":
        honest_swap_out = HostPool.swap_out_groups

        def swap_out_groups(
            self: HostPool,
            request_id: str,
            device: Sequence[GroupBlocks],
            num_stored: int,
            token_ids: Sequence[int],
        ) -> tuple[BlockCopy, ...]:
            # The host table is right, but the copy of each window group's last block
            # (the most recent tokens) is left out of the swap-out.
            copies = honest_swap_out(self, request_id, device, num_stored, token_ids)
            last = {d.block_ids[-1] for d in device[1:] if d.block_ids}
            return tuple(c for c in copies if c.src not in last)

        monkeypatch.setattr(HostPool, "swap_out_groups", swap_out_groups)
    elif name == "short-window-swap":

        def short(group: KVGroup, num_stored: int, block_size: int) -> range:
            # The pool and the host agree on a window group's swapped places starting
            # one block late: the block holding window_start neither leaves nor returns.
            places = held_places(group, num_stored, block_size)
            if group.kind is GroupKind.WINDOW and places:
                return range(places.start + 1, places.stop)
            return places

        monkeypatch.setattr(groups_module, "held_places", short)
        monkeypatch.setattr(host_pool_module, "held_places", short)
    elif name == "first-group-truncation":

        def first_only(pool: GroupedPool, request_id: str, num_stored: int) -> list[int]:
            # Rejected drafts cut from the first group's table only: the window group
            # keeps their positions, and the block that held only them.
            table = pool.tables.table(request_id, "truncate")
            return truncation_module._cut(pool, request_id, table, num_stored)

        monkeypatch.setattr(truncation_module, "_truncate_groups", first_only)
    elif name == "window-keeps-draft-entries":
        honest_cut = truncation_module._cut

        def cut(pool: BlockPool, request_id: str, table: BlockTable, num_stored: int) -> list[int]:
            # A later group's blocks that held a rejected draft keep their cache entries.
            if isinstance(pool, GroupedPool):  # the first group
                return honest_cut(pool, request_id, table, num_stored)
            index = pool.prefix_index
            setattr(index, "forget", lambda blocks: None)  # noqa: B010
            try:
                return honest_cut(pool, request_id, table, num_stored)
            finally:
                delattr(index, "forget")

        monkeypatch.setattr(truncation_module, "_cut", cut)
    else:
        raise AssertionError(f"no planted bug {name!r}")
    yield
    monkeypatch.undo()


Scenario = Callable[[], list[tuple[int, Request]]]


def decode() -> list[tuple[int, Request]]:
    """Decoding from 8 to 16 tokens: the query at 10 reads from position 5, in block 1."""
    return [(0, request("a", range(1, 9), 8))]


def hit() -> list[tuple[int, Request]]:
    """b's 13-token prompt starts with a's 12 tokens, cached once a finished: a hit of 12
    whose window group needs blocks 1 and 2 (the query at 12 reads from 7)."""
    return [(0, request("a", range(1, 13), 1)), (3, request("b", [*range(1, 13), 99], 2))]


# Drafts of up to 3 tokens: a's first two right, the third wrong, so each verification
# keeps the verified token and 2 drafts and rejects 1.
SPECULATING = replace(PLANTED, num_speculative_tokens=3)


def two_right_one_wrong(sched: Scheduler) -> None:
    for r in sched.running:
        if r.status is RequestStatus.DECODING:
            right = [fake_token(r.seq, r.num_tokens + j) for j in range(2)]
            sched.propose(r.request_id, [*right, 0])


def speculate() -> list[tuple[int, Request]]:
    """A 9-token prompt decoding 8 tokens, verifying drafts from 9 and from 12 (the
    second fills block 3, cached, then rejects its last position, 15)."""
    return [(0, request("a", range(1, 10), 8))]


def swap() -> list[tuple[int, Request]]:
    """a and b, 8-token prompts decoding 12 tokens each, outgrow ``SWAPPING``'s 10 blocks
    on their first decode: b is swapped out with 8 tokens (full places 0 and 1, window
    places 0 and 1: the query at 8 reads from 3), and back in once a finished."""
    return [(0, request("a", range(1, 9), 12)), (0, request("b", range(40, 48), 12))]


@pytest.mark.parametrize(
    ("bug", "scenario", "rule", "config"),
    [
        ("early", decode, WINDOW_EARLY, PLANTED),
        ("incomplete-hit", hit, PREFIX_COMPLETE, PLANTED),
        ("leaky-free", decode, GROUP_TABLES, PLANTED),
        ("uncopied-window-block", swap, MEMORY, SWAPPING),
        ("short-window-swap", swap, WINDOW_EARLY, SWAPPING),
        ("first-group-truncation", speculate, GROUP_TABLES, SPECULATING),
        # The engine's PREFIX check: a cached window block no longer full in its table.
        ("window-keeps-draft-entries", speculate, "PREFIX", SPECULATING),
    ],
)
def test_the_checks_find_the_planted_bug(
    bug: str,
    scenario: Scenario,
    rule: str,
    config: SchedulerConfig,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    propose = two_right_one_wrong if config.num_speculative_tokens else None
    sound = rules_found(scenario(), config=config, propose=propose)
    assert sound == set(), "the scenario is sound without the bug"
    with planted(bug, monkeypatch):
        found = rules_found(scenario(), config=config, propose=propose)
    assert rule in found, found


def test_the_speculating_scenario_rejects_drafts_with_window_blocks_released() -> None:
    """What the first-group-truncation bug needs: a's two verifications, at 9 and 12,
    each keep 2 of 3 drafts. The first allocates positions 9 to 12 after releasing the
    window group's block 0 (wholly before position 4), and keeps 12 tokens: block 3
    held only the rejected position 12 and goes back in both groups, and the released
    place stays null."""
    plans: list[StepPlan] = []
    held: list[tuple[tuple[int, ...], ...]] = []

    def propose(sched: Scheduler) -> None:
        if sched.pool.has_request("a"):
            held.append(grouped_pool(sched).block_tables("a"))
        two_right_one_wrong(sched)

    assert rules_found(speculate(), config=SPECULATING, seen=plans, propose=propose) == set()
    verifying = [(p.starts[0], p.num_new_tokens[0], len(p.drafts["a"])) for p in plans if p.drafts]
    assert verifying == [(9, 4, 3), (12, 4, 3)]
    full, win = held[1]  # after the first verification
    assert (len(full), len(win), win[0]) == (3, 3, NULL_BLOCK)


def test_the_swap_scenario_swaps_every_group_out_and_back_in() -> None:
    """What the uncopied-window-block bug needs: b swapped out with both groups' blocks
    (4 host blocks: 2 full, 2 window), and swapped back in."""
    plans: list[StepPlan] = []
    assert rules_found(swap(), config=SWAPPING, seen=plans) == set()
    out = [(p.swapped_out, len(p.swap_out)) for p in plans if p.swapped_out]
    assert out[:1] == [(("b",), 4)]
    assert [p.swapped_in for p in plans if p.swapped_in][:1] == [("b",)]
    assert not any(p.preempted and not p.swapped_out for p in plans)  # no recompute


@pytest.mark.parametrize("bug", ["", "uncopied-window-block"])
def test_a_tool_wait_on_the_host_swaps_every_group(
    bug: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``pause`` with retention ``host`` on a grouped pool: the next step moves the
    turn's blocks its next query reads in every group to the host (the window group's
    from the one holding window_start on), ``resume`` queues it SWAPPED, and the step
    after swaps it back in; the machine's checks hold at every step. With the swap-out
    leaving the window group's last block uncopied, the host memory reads it wrong."""
    cfg = replace(PLANTED, num_host_blocks=16)
    sched = Scheduler(cfg)
    executor = GroupCheckingExecutor(sched)
    plans: list[StepPlan] = []
    executor.on_plan = plans.append
    core = EngineCore(sched, executor, check_invariants=True)
    agent = request("agent", range(1, 12), 4)
    sched.add_request(agent)
    sched.add_request(request("other", range(50, 56), 12))
    clock = 0.0

    def step() -> None:
        nonlocal clock
        clock = core.step(clock).end_ms
        check_after_step(executor, f"after step {sched.step_index}")

    while agent.num_output_tokens < 2:
        step()
    kv = agent.num_computed_tokens
    assert kv == 12
    assert sched.pause("agent", KVRetention.HOST) is KVRetention.HOST
    with planted(bug, monkeypatch) if bug else nullcontext():
        if bug:
            with pytest.raises(GroupRuleBroken) as e:
                step()
            assert MEMORY in e.value.rules and "agent group 1 on the host" in str(e.value)
            return
        step()
    assert plans[-1].swapped_out == ("agent",) and not sched.pool.has_request("agent")
    # The query at 12 reads from 7: window places 1 and 2, the first place left behind.
    assert [(g.group, g.first, len(g.block_ids)) for g in sched.host.table("agent").groups] == [
        (0, 0, 3),
        (1, 1, 2),
    ]
    sched.resume("agent", [90, 91, 92], StopParams(3, ignore_eos=True))
    assert agent.status is RequestStatus.SWAPPED
    step()
    assert plans[-1].swapped_in == ("agent",) and agent.num_computed_tokens == kv + 4
    while sched.has_unfinished:
        step()
    assert agent.finish_reason is FinishReason.LENGTH
    assert sched.host.num_free_blocks == cfg.num_host_blocks


def test_the_hit_scenario_takes_a_hit_that_skips_a_window_block() -> None:
    """What the incomplete-hit bug needs: b admitted on a's 12 cached tokens, its window
    table skipping block 0 only."""
    sched = Scheduler(PLANTED)
    executor = GroupCheckingExecutor(sched)
    core = EngineCore(sched, executor, check_invariants=True)
    seen: list[tuple[str, int, tuple[int, ...]]] = []

    def record(plan: StepPlan) -> None:
        for rid, cached in zip(plan.request_ids, plan.num_new_cached_tokens, strict=True):
            if cached:
                seen.append((rid, cached, grouped_pool(sched).block_tables(rid)[1]))

    executor.on_plan = record
    clock = 0.0
    arrivals = hit()
    for i in range(20):
        for at, r in arrivals:
            if at == i:
                sched.add_request(r)
        if sched.has_unfinished:
            clock = core.step(clock).end_ms
    assert [(rid, cached, table[:2].count(NULL_BLOCK)) for rid, cached, table in seen] == [
        ("b", 12, 1)
    ]
