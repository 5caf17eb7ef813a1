"""Speculative decoding's part of the scheduler (docs/SPECULATIVE.md): the drafts proposed
for the next step, and what a verification keeps at commit.

An extension of the core step: the scheduler holds one :class:`Proposals`, the planner
reads it when it plans decodes (``Planner._drafts``: which drafts fit the budget and the
free blocks), and the commit hands each verification to :func:`keep_verified`. Without
proposals the step never enters this module.
"""

from __future__ import annotations

from collections.abc import Sequence

from refserve.core.request import FinishReason, Request, finish_reason
from refserve.errors import InvalidArgument
from refserve.kv import BlockPool, truncate
from refserve.spec.snapshot import RequestStatus


class Proposals:
    """Drafts for decoding requests' next step, by request id, at most ``limit`` each
    (``num_speculative_tokens``). They hold for one step (:meth:`clear` at commit); the
    planner verifies only those of requests decoding in the step, so the drafts of a
    request that left the running batch (paused, aborted, migrated) go unused."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.drafts: dict[str, tuple[int, ...]] = {}

    def propose(self, r: Request, running: bool, draft_token_ids: Sequence[int]) -> None:
        """Drafts for ``r`` (``running``: it is in the running batch), checked; an empty
        sequence withdraws them. A typed error changes nothing."""
        rid = r.request_id
        drafts = tuple(draft_token_ids)
        if len(drafts) > self.limit:
            raise InvalidArgument(
                f"propose: {len(drafts)} drafts for {rid!r}; num_speculative_tokens is {self.limit}"
            )
        if drafts and (r.status is not RequestStatus.DECODING or not running):
            raise InvalidArgument(
                f"propose: request {rid!r} is not running in decode (status {r.status})"
            )
        for t in drafts:
            if type(t) is not int or t < 0:
                raise InvalidArgument(f"propose: bad draft token {t!r} for {rid!r}")
        if drafts:
            self.drafts[rid] = drafts
        else:
            self.drafts.pop(rid, None)

    def clear(self) -> None:
        if self.drafts:
            self.drafts = {}


def keep_verified(
    r: Request,
    drafts: tuple[int, ...],
    accepted: int,
    token: int,
    now_ms: float,
    pool: BlockPool,
    max_len: int,
) -> tuple[tuple[int, ...], FinishReason | None]:
    """A verification's outcome (docs/SPECULATIVE.md, "Rejected drafts"): the accepted
    drafts and the target's ``token`` join ``r`` one by one, each checked for a stop
    (:func:`refserve.core.request.finish_reason`), as that many plain steps would
    have; then the K/V of the rejected drafts is dropped (the blocks that held only them
    go back to the pool), so the KV covers all but the last token, as after a plain step
    (KVLEN). Returns the tokens kept and why ``r`` finished, if it did."""
    kept: list[int] = []
    reason: FinishReason | None  # the loop runs at least once: the target's token
    for t in (*drafts[:accepted], token):
        r.token_ids.append(t)
        r.token_times_ms.append(now_ms)
        kept.append(t)
        reason = finish_reason(r, t, max_len)
        if reason is not None:
            break
    r.num_computed_tokens = r.num_tokens - 1
    # Even for a request that stops here: a freed block keeps its cache entry, and none
    # may cover a rejected draft.
    truncate(pool, r.request_id, r.num_computed_tokens)
    return tuple(kept), reason
