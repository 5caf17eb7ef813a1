"""The persistent batch: the running requests' per-step state in arrays, by slot.

docs/ARCHITECTURE.md, "The persistent batch". Every running request holds a slot; its
KV length, last token, length limit, stop ids, decoding flag and block table live in
preallocated arrays at that slot, so the steady decode step (every running request
decoding one token) is planned, turned into executor inputs and committed with vector
operations: Python runs per request only for those that cross a block boundary, fill
a block (prefix caching), share their last block (copy-on-write) or finish. Slots are
recycled when a request leaves the running set (finish, preemption, pause, abort).

This module keeps the rows (the spine's running list and its mirror); the bulk step's
operations over them, and the inputs of a step of bulk decodes, are the bulk decode
path's, ``BulkBatch`` in ref/core/bulk.py.

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

from dataclasses import dataclass
from itertools import compress
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from refserve.core.request import Request
from refserve.kv import BlockPool, DecodeRun
from refserve.spec.arith import (
    length_limit,
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
