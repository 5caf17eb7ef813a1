"""The bulk decode path: an attachment (a ``DecodeStrategy``, ref/core/hooks.py) that plans
and commits every running decode of a steady step at once, from the persistent batch's
arrays (ref/core/batch.py), entering Python only for the requests that need a block or
finish. It plans exactly what the loop's per-request path plans and commits exactly what
its commit does: tests/scheduler/test_fast_path.py holds the two to the same trace
(docs/ARCHITECTURE.md, "The persistent batch").
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from itertools import compress, repeat

import numpy as np
import numpy.typing as npt

from refserve.core.batch import DecodeRows, Ints, PersistentBatch
from refserve.core.hooks import CommittedDecodes
from refserve.core.inputs import ModelInputs
from refserve.core.outcome import Outcome
from refserve.core.plan import StepPlan
from refserve.core.request import FinishReason, Request, finish_reason
from refserve.core.step_build import StepBuild
from refserve.kv import BlockPool, DecodeGrowth, DecodeRun
from refserve.spec.arith import (
    block_offset_rows,
    fills_block_rows,
    logical_block_rows,
    reaches_length_rows,
    slot_of_rows,
    starts_block_rows,
)


class BulkBatch(PersistentBatch):
    """The persistent batch with the bulk step: the decoding rows of a step, their
    blocks and their commit as vector operations over the batch's arrays, and the
    executor's inputs of a step of bulk decodes only."""

    def sync_tables(self, pool: BlockPool) -> None:
        """Rewrite the block-table rows the pool changed since the last sync (every row
        after a rollback, which may have shrunk any table)."""
        changed, everything = pool.take_changed()
        slots = self._slot
        for rid in slots if everything else changed:
            slot = slots.get(rid)
            if slot is not None:
                self._load_table(slot, rid, pool)

    @property
    def order(self) -> Ints:
        """Slots in running order."""
        if self._order_array is None:
            order = self._order_array = np.array(self._order, dtype=np.int64)
            n = len(order)
            consecutive = n > 0 and bool((order == np.arange(order[0], order[0] + n)).all())
            self._order_start = int(order[0]) if consecutive else None
        return self._order_array

    def all_decoding(self) -> bool:
        if self._all_decoding is None:
            self._all_decoding = bool(self.decoding[self.order].all())
        return self._all_decoding

    def width(self) -> int:
        """Blocks in the longest running table (the executor's block-table width)."""
        if self._width is None:
            order = self.order
            self._width = int(self.num_blocks[order].max()) if len(order) else 0
        return self._width

    def decode_rows(self, limit: int) -> DecodeRows | None:
        """The first ``limit`` decoding requests in running order (None if none)."""
        order = self.order
        k = min(limit, len(order))
        if k <= 0:
            return None
        start = self._order_start
        if self.all_decoding() and k == len(order):  # the steady state: the lists themselves
            self._lists_lent = True
            lists = (self.requests, self._ids, self._token_lists, self._time_lists)
            slots = order
        elif self.all_decoding() or self.decoding[order[:k]].all():  # slices, no Python
            lists = (self.requests[:k], self._ids[:k], self._token_lists[:k], self._time_lists[:k])
            slots = order[:k]
        else:
            found = np.flatnonzero(self.decoding[order])[:limit]
            if not len(found):
                return None
            pos = found.tolist()
            lists = (
                [self.requests[i] for i in pos],
                [self._ids[i] for i in pos],
                [self._token_lists[i] for i in pos],
                [self._time_lists[i] for i in pos],
            )
            slots = order[found]
            start = None
        at: Ints | slice = slots if start is None else slice(start, start + len(slots))
        positions = self.num_computed[at].copy()  # a slice alone would be a view
        offsets = block_offset_rows(positions, self.block_size)
        return DecodeRows(slots, at, positions, offsets, *lists)

    def decode_run(self, rows: DecodeRows, pool: BlockPool) -> DecodeRun:
        """The pool's tables of ``rows`` (:class:`~refserve.kv.DecodeRun`); for the whole
        running order, kept from step to step while the pool says it is current."""
        whole = rows.request_ids is self._ids
        run = self._run
        if whole and run is not None and run.is_current():
            return run
        run = DecodeRun(pool, rows.request_ids)
        if whole:
            self._run = run
        return run

    def needs_block(self, rows: DecodeRows, pool: BlockPool) -> list[int]:
        """Indices into ``rows`` whose next token starts a new block or lands in a shared
        last block (copy-on-write); the others append to a private block with room."""
        needs = starts_block_rows(rows.offsets)
        if not self._may_share:  # no fork shares a last block: the usual case
            return _indices(needs)
        tail = self.shared_tail[rows.at]
        for i in _indices(tail & ~needs):
            slot = int(rows.slots[i])
            last = int(self.block_table[slot, self.num_blocks[slot] - 1])
            if pool.ref_count(last) > 1:
                needs[i] = True
            else:
                self.shared_tail[slot] = False  # the sibling copied away
        return _indices(needs)

    def grew(self, rows: DecodeRows, growing: list[int], growth: DecodeGrowth) -> None:
        """Write back what the pool did to the rows that needed a block: each table's
        new last block (a fresh one, or a private copy) and its length."""
        if not growing:
            return
        slots = rows.slots[growing]
        lengths = np.array(growth.lengths, dtype=np.int64)
        longest = max(growth.lengths)
        if longest > self.block_table.shape[1]:
            self._grow(len(self.num_computed), max(2 * self.block_table.shape[1], longest))
        self.block_table[slots, lengths - 1] = growth.tails
        self.num_blocks[slots] = lengths
        if self._may_share:
            self.shared_tail[slots] = False  # a fresh block or a private copy
        if self._width is not None:
            self._width = max(self._width, longest)

    def fills_block(self, rows: DecodeRows) -> list[int]:
        """Indices into ``rows`` whose next token fills its block (prefix caching)."""
        return _indices(fills_block_rows(rows.offsets, self.block_size))

    def filled_blocks(self, rows: DecodeRows, fills: list[int]) -> list[list[int]]:
        """The tokens of the blocks that ``fills`` (indices into ``rows``) complete: each
        such row's last ``block_size`` tokens. A decoding request's token list ends with
        the token this step writes at its KV length (KVLEN), and that token ends its
        block. (The pool hashes the blocks from these, ``DecodeRun.append_decodes``: a
        slice per filling row, nothing written per row.)"""
        bs = self.block_size
        lists = rows.token_lists
        return [lists[j][-bs:] for j in fills]

    def commit_decodes(self, rows: DecodeRows, tokens: Ints, now_ms: float) -> list[int]:
        """Append one sampled token to each row's request, KV length + 1 (KVLEN); return
        the indices into ``rows`` that finish: a stop id, or the length limit."""
        at = rows.at
        computed = rows.positions + 1  # KV lengths are unchanged since the plan
        self.num_computed[at] = computed
        self.last_token[at] = tokens
        _consume(map(list.append, rows.token_lists, tokens.tolist()))
        _consume(map(list.append, rows.time_lists, repeat(now_ms)))
        _consume(map(setattr, rows.requests, repeat("num_computed_tokens"), computed.tolist()))
        stop_ids = self.stop_ids
        if stop_ids.shape[1] == 1:  # one stop id or none per request: no broadcast
            stopped = stop_ids[at, 0] == tokens
        else:
            stopped = (stop_ids[at] == tokens[:, None]).any(axis=1)
        return _indices(stopped | reaches_length_rows(computed, self.kv_limit[at]))

    def inputs(self, plan: StepPlan) -> ModelInputs | None:
        """A step of bulk decodes only (None for any other): one token for each row,
        every array a vector op over the batch's arrays: the token is the row's last, its
        position the KV length, its slot read from the persistent block table (padding
        zero, never read). Every array is a copy: the executor gets nothing that the
        batch changes later."""
        rows = plan.decode_rows
        if rows is None or len(rows.slots) != len(plan.request_ids):
            return None
        batch = self
        slots, at = rows.slots, rows.at
        k = len(slots)
        positions = rows.positions
        table = batch.block_table
        # Whole rows: the longest running table; a prefix of them: the longest among it.
        width = batch.width() if k == len(batch) else int(batch.num_blocks[at].max())
        bs = batch.block_size
        slot_mapping = slot_of_rows(table[slots, logical_block_rows(positions, bs)], positions, bs)
        return ModelInputs(
            request_ids=plan.request_ids,
            input_ids=batch.last_token[at].copy(),
            positions=positions.copy(),
            slot_mapping=slot_mapping,
            query_start_loc=np.arange(k + 1, dtype=np.int32),
            seq_lens=np.add(positions, 1, dtype=np.int32, casting="unsafe"),
            block_tables=table[at, :width].astype(np.int32),
            sample_rows=np.arange(k, dtype=np.int64),
            sample_request_ids=plan.request_ids,
        )


class BulkDecodes:
    """Every decode of a step in one pool call and one vector commit."""

    def __init__(self, batch: BulkBatch, pool: BlockPool, max_len: int) -> None:
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
        growth = run.append_decodes(tokens, growing, fills, filled)
        if growth is None:
            return False
        batch.grew(rows, growing, growth)
        step.copies.extend(growth.copies)
        step.plan.add_decodes(rows, rows.positions.tolist())
        step.bulk_ids = rows.request_ids
        step.decoded = rows.requests
        step.budget -= len(slots)
        return True

    def all_decoding(self) -> bool:
        return self.batch.all_decoding()

    def inputs(self, plan: StepPlan) -> ModelInputs | None:
        return self.batch.inputs(plan)

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


def _indices(mask: npt.NDArray[np.bool_]) -> list[int]:
    """The indices where a 1-D ``mask`` is true. (``np.flatnonzero`` goes through three
    Python-level wrappers: a few microseconds per call when the caches are cold.)"""
    found: list[int] = mask.nonzero()[0].tolist()
    return found


def _consume(calls: Iterator[object]) -> None:
    """Run a ``map`` of calls for their effect, at C speed (a deque that keeps nothing)."""
    deque(calls, maxlen=0)
