"""Speculative decoding's part of the scheduler (docs/SPECULATIVE.md): the drafts proposed
for the next step, and what a verification keeps at commit.

An attachment: :class:`Proposals` is the spine's proposal source
(ref/core/hooks.py ``ProposalSource``). The planner asks it for a decode's drafts
(:meth:`Proposals.drafts_for`: which fit the budget and the free blocks) and the commit
hands it each verification (:func:`keep_verified`). Without proposals the step never
enters this module; ``Scheduler.propose`` (ref/core/scheduler.py) takes them.
"""

from __future__ import annotations

from collections.abc import Sequence

from refserve.core.request import FinishReason, Request, finish_reason
from refserve.errors import InvalidArgument
from refserve.kv import BlockPool, truncate
from refserve.kv.groups import GroupedPool
from refserve.spec.snapshot import RequestStatus


class Proposals:
    """Drafts for decoding requests' next step, by request id, at most ``limit`` each
    (``num_speculative_tokens``). They hold for one step (:meth:`clear` at commit); the
    planner verifies only those of requests decoding in the step, so the drafts of a
    request that left the running batch (paused, aborted, migrated) go unused."""

    def __init__(self, limit: int, pool: BlockPool, max_len: int) -> None:
        self.limit = limit
        self.pool = pool
        self.max_len = max_len
        self.drafts: dict[str, tuple[int, ...]] = {}
        # The most blocks one decode takes: one in each layer group of a grouped pool.
        self.per_decode = len(pool.groups) if isinstance(pool, GroupedPool) else 1

    def any(self) -> bool:
        return bool(self.drafts)

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

    def drafts_for(self, r: Request, budget_left: int, later: int) -> tuple[int, ...]:
        """The drafts ``r`` verifies this step: its proposal cut to what it may still
        emit (a verification emits up to one token more than its drafts) and to the
        ``budget_left`` tokens of the step, and dropped unless the free blocks cover
        their slots and still one block for each of the ``later`` decodes (one in each
        layer group of a grouped pool): a draft never costs a decode its place
        (docs/SPECULATIVE.md, "Scheduling")."""
        drafts = self.drafts.get(r.request_id, ())
        room = min(r.stop.max_tokens - r.num_output_tokens, self.max_len - r.num_tokens)
        cut = draft_count(len(drafts), room, budget_left)
        if not cut:
            return ()
        need = self.pool.blocks_to_allocate(r.request_id, 1 + cut)
        return drafts[:cut] if need + later * self.per_decode <= self.pool.num_free_blocks else ()

    def keep(
        self, r: Request, drafts: tuple[int, ...], accepted: int, token: int, now_ms: float
    ) -> tuple[tuple[int, ...], FinishReason | None]:
        return keep_verified(r, drafts, accepted, token, now_ms, self.pool, self.max_len)


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


def draft_count(num_proposed: int, room: int, budget_left: int) -> int:
    """Drafts a decode may verify this step: ``num_proposed`` cut so the verification
    (its drafts plus the bonus token, docs/SPECULATIVE.md "Scheduling") stays within the
    ``room`` tokens the request may still emit (KVLEN: outputs never exceed
    ``max_tokens`` / ``max_model_len``) and the ``budget_left`` tokens of the step's
    budget (TOKEN); docs/ARCHITECTURE.md, "Verification practice".

    The contract: never more drafts than proposed; any kept fit both limits with their
    bonus token; and the cut is the largest such (one more draft would break a limit).

    pre: num_proposed >= 0
    post: 0 <= __return__ <= num_proposed
    post: __return__ == 0 or (__return__ + 1 <= room and __return__ + 1 <= budget_left)
    post: __return__ == num_proposed or __return__ + 2 > room or __return__ + 2 > budget_left
    """
    return max(min(num_proposed, room - 1, budget_left - 1), 0)
