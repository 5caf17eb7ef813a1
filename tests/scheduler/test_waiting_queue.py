"""The incremental waiting queue (ref/core/waiting.py) against the order it replaced.

The reference is the scheduler's former list: sorted by seq, a requeued request inserted
ahead of its equal-seq siblings, read through the policy's full sort. Random histories
of arrivals, requeues (same seq, later queued step), forks (a seq shared), removals and
steps must give the same admission order, arrival order and overdue set at every point,
for decode-first with and without aging and for tenant-fair with changing credits.
The last section pins the order the scheduler itself requeues a preempted or resumed
turn in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from harness import commit_step, decoding_scheduler, make_request
from hypothesis import given
from hypothesis import strategies as st

from refserve.core.config import SchedulerConfig
from refserve.core.policy import DecodeFirst, TenantFair
from refserve.core.request import Request, StopParams
from refserve.core.swap import KVRetention
from refserve.core.waiting import WaitingQueue

TENANTS = ("a", "b", "c")


@dataclass
class Mirror:
    """The queue under test and the former list, fed the same history."""

    queue: WaitingQueue
    reference: list[Request] = field(default_factory=list)
    out: list[Request] = field(default_factory=list)  # removed, may come back
    step: int = 0
    next_seq: int = 0

    def add(self, r: Request) -> None:
        r.queued_step = self.step
        i = 0
        while i < len(self.reference) and self.reference[i].seq < r.seq:
            i += 1
        self.reference.insert(i, r)
        self.queue.add(r)

    def remove(self, r: Request) -> None:
        self.reference.remove(r)
        self.queue.remove(r)
        self.out.append(r)


def _new(m: Mirror, priority: int, tenant: str, arrival_ms: float, seq: int | None) -> Request:
    r = Request(
        f"r{len(m.reference) + len(m.out)}-{m.next_seq}",
        [1],
        StopParams(1),
        arrival_ms=arrival_ms,
        priority=priority,
        tenant=tenant,
    )
    if seq is None:
        seq, m.next_seq = m.next_seq, m.next_seq + 1
    r.seq = seq
    return r


OPS = st.lists(
    st.tuples(
        st.sampled_from(("arrive", "arrive", "fork", "remove", "requeue", "step", "step")),
        st.integers(0, 3),  # priority
        st.sampled_from(TENANTS),
        st.integers(0, 50),  # arrival ms, and which request an op picks
    ),
    max_size=60,
)


def _run(m: Mirror, ops: list[tuple[str, int, str, int]], check: object) -> None:
    for op, priority, tenant, x in ops:
        if op == "arrive":
            m.add(_new(m, priority, tenant, float(x), None))
        elif op == "fork" and m.reference:
            parent = m.reference[x % len(m.reference)]
            child = _new(m, parent.priority, parent.tenant, parent.arrival_ms, parent.seq)
            child.admitted_ms = 0.0  # a fork's parent was admitted: it never times out
            m.add(child)
        elif op == "remove" and m.reference:
            m.remove(m.reference[x % len(m.reference)])
        elif op == "requeue" and m.out:
            r = m.out.pop(x % len(m.out))
            r.admitted_ms = 0.0  # preempted after running: admitted once
            m.add(r)
        elif op == "step":
            m.step += 1 + x % 3
        assert callable(check)
        check()


@given(st.integers(0, 4), OPS)
def test_decode_first_order_matches_the_full_sort(aging: int, ops: list) -> None:  # type: ignore[type-arg]
    policy = DecodeFirst(aging)
    m = Mirror(policy.waiting_queue(track_arrivals=True))

    def check() -> None:
        assert list(m.queue) == m.reference and len(m.queue) == len(m.reference)
        lazy = list(policy.waiting_order(m.queue, m.step))
        assert lazy == policy.waiting_order(m.reference, m.step)
        for now, timeout in ((30.0, 10.0), (10.0, 10.0), (3.0, 2.0), (60.0, 0.0), (5.0, 100.0)):
            expected = [
                r for r in m.reference if r.admitted_ms is None and now - r.arrival_ms > timeout
            ]
            assert m.queue.overdue(now, timeout) == expected

    _run(m, ops, check)


@given(
    st.integers(0, 3),
    OPS,
    st.lists(st.dictionaries(st.sampled_from(TENANTS), st.integers(-8, 8)), min_size=1),
)
def test_tenant_fair_order_matches_the_full_sort(
    aging: int,
    ops: list,  # type: ignore[type-arg]
    credits: list[dict[str, int]],
) -> None:
    policy = TenantFair({"a": 2.0}, quantum=4, aging_steps=aging)
    m = Mirror(policy.waiting_queue(track_arrivals=False))
    turn = iter(credits * (len(ops) + 1))

    def check() -> None:
        policy.credit = {t: float(c) for t, c in next(turn).items()}
        lazy = list(policy.waiting_order(m.queue, m.step))
        assert lazy == policy.waiting_order(m.reference, m.step)

    _run(m, ops, check)


def test_reading_the_head_reads_only_the_head() -> None:
    # Admission stops at the first request that does not fit: reading k requests of a
    # long queue must not touch the rest (here: a generator, so nothing is sorted).
    policy = DecodeFirst()
    queue = policy.waiting_queue(track_arrivals=False)
    requests = [Request(f"r{i}", [1], StopParams(1)) for i in range(10_000)]
    for i, r in enumerate(requests):
        r.seq = i
        queue.add(r)
    order = iter(policy.waiting_order(queue, 0))
    assert [next(order) for _ in range(3)] == requests[:3]
    for r in requests[:5000]:
        queue.remove(r)  # admitted from the head: stale entries leave at once
    assert len(queue._heaps[next(iter(queue._heaps))].entries) == 5000
    assert next(iter(policy.waiting_order(queue, 0))) is requests[5000]


ARRIVALS = st.lists(
    st.tuples(
        st.sampled_from(("arrive", "arrive", "arrive", "step", "remove")),
        st.integers(0, 3),
        st.sampled_from(TENANTS),
        st.integers(0, 50),
    ),
    min_size=3,
    max_size=30,
)


@given(ARRIVALS, st.lists(st.booleans(), min_size=1))
def test_a_skipped_tenant_is_read_no_further(ops: list, skip_after: list[bool]) -> None:  # type: ignore[type-arg]
    # Tenant-fair skips a tenant at its running cap for the rest of the pass: the reader
    # then gives the full order less that tenant's later requests.
    policy = TenantFair({"b": 3.0}, quantum=4, aging_steps=2)
    m = Mirror(policy.waiting_queue(track_arrivals=False))
    _run(m, ops, lambda: None)
    policy.credit = {"a": 5.0, "c": -3.0}
    got, decisions = [], iter(skip_after)
    reader = m.queue.ordered(m.step, policy._tenant_rank)
    for r in reader:
        got.append(r)
        if next(decisions, False):
            reader.skip_tenant(r.tenant)
    want, skipped, decisions = [], set(), iter(skip_after)
    for r in policy.waiting_order(m.reference, m.step):
        if r.tenant in skipped:
            continue
        want.append(r)
        if next(decisions, False):
            skipped.add(r.tenant)
    assert got == want


# ------------------------------------------------------------------ requeue order in the scheduler
@pytest.mark.mutation_kill
def test_a_requeued_turn_waits_in_arrival_order() -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=16,
        max_num_seqs=1,
        block_size=4,
        num_blocks=32,
        max_model_len=64,
        prefill_reserve_tokens=1,
    )
    sched = decoding_scheduler(cfg, make_request("a", 3))
    for i, rid in enumerate("bcd"):
        sched.add_request(make_request(rid, 3, base=10 * (i + 1)))
    sched.pause("a", KVRetention.DROP)
    commit_step(sched)  # b takes the free running slot
    assert [r.request_id for r in sched.running] == ["b"]
    sched.resume("a", [1], StopParams(2))
    assert [r.request_id for r in sched.waiting] == ["a", "c", "d"]
    sched.pause("b", KVRetention.DROP)
    sched.resume("b", [1], StopParams(2))
    assert [r.request_id for r in sched.waiting] == ["a", "b", "c", "d"]
    assert [r.seq for r in sched.waiting] == [0, 1, 2, 3]
    plan, _ = commit_step(sched)
    assert plan.admitted == ("a",)


@pytest.mark.mutation_kill
def test_a_requeued_turn_goes_behind_every_earlier_arrival() -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=16, max_num_seqs=1, block_size=4, num_blocks=32, max_model_len=64
    )
    sched = decoding_scheduler(cfg, make_request("x", 3))
    sched.add_request(make_request("y", 3, base=10))
    sched.add_request(make_request("z", 3, base=20))
    sched.add_request(make_request("w", 3, base=30, priority=-1))  # more important: admitted first
    sched.abort("x")
    commit_step(sched)
    assert [r.request_id for r in sched.running] == ["w"]
    sched.pause("w", KVRetention.DROP)
    sched.resume("w", [1], StopParams(2))
    assert [r.request_id for r in sched.waiting] == ["y", "z", "w"]
