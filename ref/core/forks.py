"""n > 1 sampling by fork: a sibling of a request that has just sampled its first token
(docs/ARCHITECTURE.md, "Vocabulary": fork).

An attachment: ``Scheduler.fork`` (ref/core/scheduler.py) calls :func:`fork`, which asks
:func:`fork_child` for the child and places it through the loop's public surface
(sharing the parent's blocks, or waiting to recompute); the pool's part is
``refserve.kv.forks.fork`` and copy-on-write. The spine knows nothing about forks.
"""

from __future__ import annotations

from refserve.core.capacity import never_fits
from refserve.core.loop import SchedulerLoop
from refserve.core.request import FinishReason, Request, StopParams
from refserve.errors import DuplicateRequest, InvalidArgument, UnknownRequest
from refserve.kv import fork as fork_blocks
from refserve.spec.snapshot import RequestStatus


def fork_child(parent: Request, child_id: str, first_token: int, stop: StopParams) -> Request:
    """The child of ``parent`` (decoding, exactly one token sampled): the parent's prompt
    and its own ``first_token`` (drawn from the same logits), sampled under ``stop``, in
    decode, in the parent's arrival place, with the parent's metrics so far. A typed
    error for a parent in another state or a bad token."""
    if parent.status is not RequestStatus.DECODING or parent.num_output_tokens != 1:
        raise InvalidArgument(
            f"fork: parent {parent.request_id!r} must be decoding with exactly one sampled "
            f"token (status {parent.status}, {parent.num_output_tokens} sampled)"
        )
    if type(first_token) is not int or first_token < 0:
        raise InvalidArgument(f"fork: bad first token {first_token!r} for {child_id!r}")
    if stop.max_tokens < 2 or stop.is_stop(first_token):
        # Its first token already ends it: a live child would sample past its stop.
        raise InvalidArgument(
            f"fork: child {child_id!r} is finished by its first token {first_token} "
            f"(max_tokens {stop.max_tokens}, or a stop token); it needs no fork"
        )
    child = Request(
        child_id,
        list(parent.prompt_token_ids),
        stop,
        arrival_ms=parent.arrival_ms,
        priority=parent.priority,
        tenant=parent.tenant,
        namespace=parent.namespace,
    )
    child.token_ids.append(first_token)
    child.seq = parent.seq  # siblings keep the parent's place in arrival order
    child.admitted_ms = parent.admitted_ms
    child.token_times_ms = list(parent.token_times_ms)
    child.transition(RequestStatus.DECODING)
    return child


def fork(
    sched: SchedulerLoop, parent_id: str, child_id: str, first_token: int, stop: StopParams
) -> Request:
    """``Scheduler.fork`` (ref/core/scheduler.py has the contract): the child joins the
    running batch sharing the parent's blocks, or waits like a recompute victim."""
    sched.require_boundary("fork")
    parent = sched.requests.get(parent_id)
    if parent is None:
        raise UnknownRequest(parent_id, "fork")
    if child_id in sched.requests:
        raise DuplicateRequest(child_id, "fork")
    child = fork_child(parent, child_id, first_token, stop)
    sched.requests[child_id] = child
    if len(sched.running) < sched.config.max_num_seqs:
        fork_blocks(sched.pool, parent_id, child_id)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        sched.enter_batch(child, prefilling=False)
        return child
    child.transition(RequestStatus.PREEMPTED)
    if never_fits(sched.config, child.num_tokens):
        # Waiting means recomputing all its tokens later, and they can never fit.
        sched.retire(child, RequestStatus.FINISHED, FinishReason.CAPACITY, sched.plan_start_ms)
    else:
        sched.requeue(child)
    return child
