"""The persistent batch: the running requests' per-step state in arrays, by slot.

docs/ARCHITECTURE.md, "The persistent batch". Every running request holds a slot; its
KV length, last token, length limit, stop ids, decoding flag and block table live in
preallocated arrays at that slot, so the steady decode step (every running request
decoding one token) is planned, turned into executor inputs and committed with vector
operations: Python runs per request only for those that cross a block boundary, fill
a block (prefix caching), share their last block (copy-on-write) or finish. Slots are
recycled when a request leaves the running set (finish, preemption, pause, abort).

The :class:`~refserve.core.request.Request` objects stay the source of truth; the arrays
mirror them. A row is (re)loaded from its request whenever anything but the bulk path
changed it (admission, a prefill chunk, the reference decode loop), and its block-table
row whenever the pool reports the table changed (``BlockPool.take_changed``; a
rollback reports every table). The bulk commit writes both the arrays and the requests.
The mirror is checked from outside: the differential test runs the per-request
reference loop beside it and requires identical plans, inputs and snapshots at every
step, and the POS invariant reads the slot mapping from the arrays this batch builds.

Arrays are numpy (cheap scalar writes for the few rows that change); the step's inputs
are copies of them, which the model executor wraps as torch tensors sharing that memory.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import compress, repeat
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from refserve.core.request import Request
from refserve.kv import BlockPool, DecodeGrowth, DecodeRun
from refserve.spec.arith import (
    block_offset_rows,
    fills_block_rows,
    length_limit,
    reaches_length_rows,
    starts_block_rows,
)
from refserve.spec.snapshot import RequestStatus

Ints = npt.NDArray[np.int64]
AnyArray = TypeVar("AnyArray", bound=np.generic)

NO_STOP = -1
"""Padding of the stop-id matrix: token ids are >= 0, so it never matches."""
_MIN_CAPACITY = 16
_MIN_WIDTH = 8


@dataclass(frozen=True)
class DecodeRows:
    """The decoding requests of one step, in running (admission) order.

    ``slots`` are their rows in the batch arrays and ``at`` indexes those rows: the
    same slots, or a slice when they are consecutive (the usual case: slots are handed
    out lowest first, so a batch that has not churned holds them in order), which numpy
    reads and writes without a gather. ``positions`` are their KV lengths when planned
    (each row's token goes there; nothing changes them before the commit) and
    ``offsets`` those modulo the block size. The lists are parallel to ``slots``: the
    requests, their ids, and their live token and token-time lists (the bulk commit
    appends to them).
    """

    slots: Ints
    at: Ints | slice
    positions: Ints
    offsets: Ints
    requests: list[Request]
    request_ids: list[str]
    token_lists: list[list[int]]
    time_lists: list[list[float]]


class PersistentBatch:
    """The running requests in admission order, with their per-step state by slot."""

    def __init__(self, block_size: int, max_len: int) -> None:
        self.block_size = block_size
        self.max_len = max_len
        # In running (admission) order; Scheduler.running is ``requests``.
        self.requests: list[Request] = []
        self._ids: list[str] = []
        self._order: list[int] = []  # their slots
        self._token_lists: list[list[int]] = []  # their token_ids (the same list objects)
        self._time_lists: list[list[float]] = []  # their token_times_ms
        self._order_array: Ints | None = None  # _order as an array, rebuilt on change
        self._order_start: int | None = None  # its first slot, if its slots are consecutive
        # The steady step hands these lists out as they are (DecodeRows) instead of
        # copying them; the next change in place copies them first.
        self._lists_lent = False
        # The pool's tables of every running request, in order, while current.
        self._run: DecodeRun | None = None
        self._slot: dict[str, int] = {}
        # By slot.
        cap, width = _MIN_CAPACITY, _MIN_WIDTH
        # KV length; a decoding request holds one token more (KVLEN).
        self.num_computed: Ints = np.zeros(cap, dtype=np.int64)
        self.last_token: Ints = np.zeros(cap, dtype=np.int64)
        # The KV length at which its token count reaches its length limit (LENGTH).
        self.kv_limit: Ints = np.zeros(cap, dtype=np.int64)
        self.stop_ids: Ints = np.full((cap, 1), NO_STOP, dtype=np.int64)
        self.decoding = np.zeros(cap, dtype=np.bool_)
        self.shared_tail = np.zeros(cap, dtype=np.bool_)  # its last block may be shared
        self.num_blocks: Ints = np.zeros(cap, dtype=np.int64)
        # Zero past num_blocks. int64, so the slot mapping needs no cast.
        self.block_table: Ints = np.zeros((cap, width), dtype=np.int64)
        self._free: list[int] = list(reversed(range(cap)))  # recycled slots, lowest last
        # A numpy call costs a fixed ~10 us when the caches are cold (the model ran in
        # between steps), against ~10 ns per row: facts about all rows that rarely
        # change are kept here instead of being recomputed with vector ops each step.
        self._all_decoding: bool | None = None  # every running row decodes; None: unknown
        self._may_share = False  # some row's shared_tail may be set (stays set: forks are rare)
        self._width: int | None = None  # the longest running table; None: unknown

    def _grow(self, capacity: int, width: int) -> None:
        """Reallocate for ``capacity`` slots and ``width`` blocks, keeping every row.
        New rows are zero: every row is loaded (``append``) before anything reads it."""
        have, had_width = self.block_table.shape

        def grown(a: npt.NDArray[AnyArray], shape: tuple[int, ...]) -> npt.NDArray[AnyArray]:
            out = np.zeros(shape, dtype=a.dtype)
            out[tuple(slice(n) for n in a.shape)] = a
            return out

        self.num_computed = grown(self.num_computed, (capacity,))
        self.last_token = grown(self.last_token, (capacity,))
        self.kv_limit = grown(self.kv_limit, (capacity,))
        self.stop_ids = grown(self.stop_ids, (capacity, self.stop_ids.shape[1]))
        self.decoding = grown(self.decoding, (capacity,))
        self.shared_tail = grown(self.shared_tail, (capacity,))
        self.num_blocks = grown(self.num_blocks, (capacity,))
        self.block_table = grown(self.block_table, (capacity, max(width, had_width)))
        self._free.extend(reversed(range(have, capacity)))

    # ------------------------------------------------------------------ membership
    def __len__(self) -> int:
        return len(self.requests)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._slot

    def append(self, r: Request, pool: BlockPool) -> None:
        """``r`` starts running (last in admission order); its row is loaded."""
        rid = r.request_id
        assert rid not in self._slot, f"{rid!r} is already running"
        if not self._free:
            self._grow(2 * len(self.num_computed), self.block_table.shape[1])
        slot = self._free.pop()
        self._slot[rid] = slot
        self._unlend()
        self.requests.append(r)
        self._ids.append(rid)
        self._order.append(slot)
        self._token_lists.append(r.token_ids)
        self._time_lists.append(r.token_times_ms)
        self._order_array = None
        self._run = None
        self.reload(r, pool)  # the whole row: a recycled slot keeps nothing of its last

    def remove(self, r: Request) -> None:
        """``r`` stops running; its slot is recycled."""
        i = self._ids.index(r.request_id)
        self._unlend()
        del self.requests[i], self._ids[i], self._order[i]
        del self._token_lists[i], self._time_lists[i]
        self._order_array = None
        self._run = None
        self._forget(self._slot.pop(r.request_id))

    def remove_many(self, request_ids: set[str]) -> None:
        """Several leave at once (a commit's finishes and victims); the order is kept."""
        keep = [rid not in request_ids for rid in self._ids]
        self.requests = list(compress(self.requests, keep))
        self._ids = list(compress(self._ids, keep))
        self._order = list(compress(self._order, keep))
        self._token_lists = list(compress(self._token_lists, keep))
        self._time_lists = list(compress(self._time_lists, keep))
        self._lists_lent = False  # new lists: the lent ones are left as they were
        self._order_array = None
        self._run = None
        for rid in request_ids:
            slot = self._slot.pop(rid, None)
            if slot is not None:
                self._forget(slot)

    def _forget(self, slot: int) -> None:
        """Recycle ``slot`` (its next request's :meth:`reload` rewrites the row); the
        facts kept about all rows may have changed."""
        self._all_decoding = None
        self._width = None
        self._free.append(slot)

    def _unlend(self) -> None:
        """Copy the order lists before a change in place if DecodeRows hold them."""
        if self._lists_lent:
            self.requests = list(self.requests)
            self._ids = list(self._ids)
            self._order = list(self._order)
            self._token_lists = list(self._token_lists)
            self._time_lists = list(self._time_lists)
            self._lists_lent = False

    # ------------------------------------------------------------------ rows
    def reload(self, r: Request, pool: BlockPool) -> None:
        """Copy running ``r``'s fields (and its block table) into its row."""
        slot = self._slot[r.request_id]
        self.num_computed[slot] = r.num_computed_tokens
        self.last_token[slot] = r.token_ids[-1]
        # A decoding row holds one token more than its KV (KVLEN): its token count
        # reaches the limit when its KV length reaches the limit less one.
        limit = length_limit(r.num_prompt_tokens, r.stop.max_tokens, self.max_len)
        self.kv_limit[slot] = limit - 1
        self.decoding[slot] = r.status is RequestStatus.DECODING
        self._all_decoding = None
        ids = r.stop.stopping_ids
        if len(ids) > self.stop_ids.shape[1]:
            wider = np.full((len(self.stop_ids), len(ids)), NO_STOP, dtype=np.int64)
            wider[:, : self.stop_ids.shape[1]] = self.stop_ids
            self.stop_ids = wider
        self.stop_ids[slot] = NO_STOP
        self.stop_ids[slot, : len(ids)] = sorted(ids)
        self._load_table(slot, r.request_id, pool)

    def _load_table(self, slot: int, request_id: str, pool: BlockPool) -> None:
        """Write ``request_id``'s block table into its row, zero past its end. (The bulk
        path's own growth is written by :meth:`grew`; this serves the rest: admissions,
        prefill chunks, the reference loop, forks, rollbacks.)"""
        table = pool.block_table_view(request_id) if pool.has_request(request_id) else ()
        m = len(table)
        if m > self.block_table.shape[1]:
            self._grow(len(self.num_computed), max(2 * self.block_table.shape[1], m))
        row = self.block_table[slot]
        row[m:] = 0  # a rollback can shrink a table
        row[:m] = table
        self.num_blocks[slot] = m
        shared = m > 0 and pool.ref_count(table[-1]) > 1
        self.shared_tail[slot] = shared
        self._may_share = self._may_share or shared
        self._width = None

    def sync_tables(self, pool: BlockPool) -> None:
        """Rewrite the block-table rows the pool changed since the last sync (every row
        after a rollback, which may have shrunk any table)."""
        changed, everything = pool.take_changed()
        slots = self._slot
        for rid in slots if everything else changed:
            slot = slots.get(rid)
            if slot is not None:
                self._load_table(slot, rid, pool)

    # ------------------------------------------------------------------ the bulk step
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
        if whole and run is not None and pool.is_current(run):
            return run
        run = pool.decode_run(rows.request_ids)
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
        block. (The pool hashes the blocks from these, ``BlockPool.append_decodes``: a
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


def _indices(mask: npt.NDArray[np.bool_]) -> list[int]:
    """The indices where a 1-D ``mask`` is true. (``np.flatnonzero`` goes through three
    Python-level wrappers: a few microseconds per call when the caches are cold.)"""
    found: list[int] = mask.nonzero()[0].tolist()
    return found


def _consume(calls: Iterator[object]) -> None:
    """Run a ``map`` of calls for their effect, at C speed (a deque that keeps nothing)."""
    deque(calls, maxlen=0)
