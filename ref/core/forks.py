"""n > 1 sampling by fork: a sibling of a request that has just sampled its first token
(docs/ARCHITECTURE.md, "Vocabulary": fork).

An extension of the core: ``Scheduler.fork`` asks :func:`fork_child` for the child and
places it (sharing the parent's blocks, or waiting to recompute); the pool's part is
``refserve.kv.forks.fork`` and copy-on-write. Nothing else in the core knows about forks.
"""

from __future__ import annotations

from refserve.core.request import Request, StopParams
from refserve.errors import InvalidArgument
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
