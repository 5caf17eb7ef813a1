"""The bulk decode path: an attachment (a ``DecodeStrategy``, ref/core/hooks.py) that plans
and commits every running decode of a steady step at once, from the persistent batch's
arrays (ref/core/batch.py), entering Python only for the requests that need a block or
finish. It plans exactly what the loop's per-request path plans and commits exactly what
its commit does: tests/scheduler/test_fast_path.py holds the two to the same trace
(docs/ARCHITECTURE.md, "The persistent batch").
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import compress

import numpy as np

from refserve.core.batch import Ints, PersistentBatch
from refserve.core.hooks import CommittedDecodes
from refserve.core.outcome import Outcome
from refserve.core.plan import StepPlan
from refserve.core.request import FinishReason, Request, finish_reason
from refserve.core.step_build import StepBuild
from refserve.kv import BlockPool


class BulkDecodes:
    """Every decode of a step in one pool call and one vector commit."""

    def __init__(self, batch: PersistentBatch, pool: BlockPool, max_len: int) -> None:
        self.batch = batch
        self.pool = pool
        self.max_len = max_len

    def plan_decodes(self, step: StepBuild) -> bool:
        """Every running decode in one pool call, when nobody needs preempting: exactly
        what the loop's per-request path (``Planner._decode_each``) would plan. False
        (nothing planned) otherwise.

        The persistent batch (ref/core/batch.py) knows each request's KV length, last
        token and block state, so only the requests that need a block enter Python."""
        batch = self.batch
        assert len(step.running) == len(batch), "the batch mirrors the running list"
        batch.sync_tables(self.pool)
        rows = batch.decode_rows(step.budget - step.reserve)
        if rows is None:
            return False
        slots = rows.slots
        caching = self.pool.enable_prefix_caching
        fills = batch.fills_block(rows) if caching else []
        filled = batch.filled_blocks(rows, fills) if caching else None
        growing = batch.needs_block(rows, self.pool)
        tokens = batch.last_token[rows.at].tolist()
        run = batch.decode_run(rows, self.pool)
        growth = self.pool.append_decodes(run, tokens, growing, fills, filled)
        if growth is None:
            return False
        batch.grew(rows, growing, growth)
        step.copies.extend(growth.copies)
        step.plan.add_decodes(rows, rows.positions.tolist())
        step.bulk_ids = rows.request_ids
        step.decoded = rows.requests
        step.budget -= len(slots)
        return True

    def commit_decodes(
        self,
        plan: StepPlan,
        tokens: Ints,
        now_ms: float,
        finish: Callable[[Request, int, FinishReason], Outcome],
    ) -> CommittedDecodes:
        """The bulk decodes, in one vector pass of the persistent batch that enters Python
        only for those that finish (their reason from the same rules,
        :func:`finish_reason`): the ids and tokens of those that run on, and the
        outcomes of those that finished."""
        rows = plan.decode_rows
        if rows is None:
            return CommittedDecodes((), tokens, [])
        ending = self.batch.commit_decodes(rows, tokens, now_ms)
        if not ending:
            return CommittedDecodes(rows.request_ids, tokens, [])
        outcomes = []
        for i in ending:
            r = rows.requests[i]
            token = int(tokens[i])
            reason = finish_reason(r, token, self.max_len)
            assert reason is not None, f"the batch finished {r.request_id!r} without cause"
            outcomes.append(finish(r, token, reason))
        running_on = np.ones(len(tokens), dtype=np.bool_)
        running_on[ending] = False
        on = list(compress(rows.request_ids, running_on.tolist()))
        return CommittedDecodes(on, tokens[running_on], outcomes)
