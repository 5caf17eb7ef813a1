"""Per-request block tables, and which of them changed (part of the pool's spine).

A request's :class:`BlockTable` lists its blocks and the token ids whose K/V they hold;
the prefix index reads and extends it as a :class:`~refserve.kv.prefix_index.Chain`.
:class:`BlockTables` owns every table of a pool by request id and keeps the books the
persistent batch reads: which tables changed since the last :meth:`BlockTables.take_changed`
and an epoch that any reported change bumps (a held
:class:`~refserve.kv.decode_runs.DecodeRun` is current only while the epoch is).

It is separate from the pool (ref/kv/pool.py) because the tables are one piece of state
with their own undo rules: a table only grows between checkpoints (plus a copy-on-write
swap of its last block), so one undo entry per call restores it, and adding or removing
a table is undone by one dict operation. The pool decides when blocks move; this module
only keeps the tables and their books.
"""

from __future__ import annotations

from collections.abc import Sequence

from refserve.errors import UnknownRequest
from refserve.kv.journal import Journal


class BlockTable:
    """One request's block table, the chain keys of its full blocks and its token ids.

    The lists are changed only by the pool and its attachments, inside the pool's
    journal (each change records its undo)."""

    __slots__ = ("block_table", "keys", "request_id", "root_key", "token_ids")

    def __init__(self, request_id: str, root_key: bytes) -> None:
        self.request_id = request_id
        self.root_key = root_key
        self.block_table: list[int] = []
        self.keys: list[bytes] = []  # chain keys of this table's full blocks, in order
        self.token_ids: list[int] = []

    @property
    def num_stored(self) -> int:
        return len(self.token_ids)


class BlockTables:
    """The tables of one pool by request id, and what changed since the last take."""

    def __init__(self, journal: Journal) -> None:
        self._journal = journal
        self._by_id: dict[str, BlockTable] = {}
        # Requests whose block table changed (or whose last block's sharing did) since
        # the last take_changed(): the persistent batch (ref/core/batch.py) rewrites only
        # their rows. A rollback may shrink any table, so it marks every table changed.
        self._changed: set[str] = set()
        self._all_changed = False
        # Bumped by every change reported to take_changed and by every rollback: a
        # DecodeRun taken at an older epoch may hold a table that is gone or replaced.
        self._epoch = 0

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    @property
    def epoch(self) -> int:
        return self._epoch

    def get(self, request_id: str) -> BlockTable | None:
        # Not the dict's bound ``get`` kept as an attribute: a deep copy of the tables
        # (the KV explorer copies whole pools) would keep reading the original dict.
        return self._by_id.get(request_id)

    def table(self, request_id: str, what: str) -> BlockTable:
        """The table of ``request_id``; :class:`UnknownRequest` naming ``what`` if none."""
        table = self._by_id.get(request_id)
        if table is None:
            raise UnknownRequest(request_id, what)
        return table

    def tables(self, request_ids: Sequence[str], what: str) -> list[BlockTable]:
        """The tables of ``request_ids``, in order (one C-level lookup pass)."""
        try:
            return list(map(self._by_id.__getitem__, request_ids))
        except KeyError as e:
            raise UnknownRequest(str(e.args[0]), what) from None

    def block_tables(self, request_ids: Sequence[str], what: str) -> list[Sequence[int]]:
        """The block lists of ``request_ids``' tables, in order (hot: one pass)."""
        by_id = self._by_id
        try:
            return [by_id[rid].block_table for rid in request_ids]
        except KeyError as e:
            raise UnknownRequest(str(e.args[0]), what) from None

    def by_request(self) -> list[tuple[str, BlockTable]]:
        """Every table with its request id, by request id (for snapshots)."""
        return sorted(self._by_id.items())

    # ---------------------------------------------------------------- changes
    def add(self, request_id: str, root_key: bytes) -> BlockTable:
        """A new empty table for ``request_id`` (not held yet), its insertion journaled."""
        table = BlockTable(request_id, root_key)
        self._by_id[request_id] = table
        self.mark_changed(request_id)
        self._journal.record(self._by_id.pop, request_id)
        return table

    def add_unjournaled(self, table: BlockTable) -> None:
        """Hold ``table`` with no undo entry: the caller is outside every transaction and
        nothing after this can fail (the pool's one-off allocation)."""
        self._by_id[table.request_id] = table
        self._changed.add(table.request_id)  # mark_changed, inlined (hot)
        self._epoch += 1

    def remove(self, request_id: str) -> None:
        """Drop the table of ``request_id`` (held), marked changed; journaled inside a
        transaction."""
        self._changed.add(request_id)  # mark_changed, inlined (hot)
        self._epoch += 1
        table = self._by_id.pop(request_id)
        if self._journal.active:
            self._journal.record(self._by_id.__setitem__, request_id, table)

    def record_growth(self, table: BlockTable) -> None:
        """Record the undo of growing ``table`` from now on: tables only grow (plus a
        copy-on-write swap of the last block), so the undo truncates back to the
        current lengths and restores the last entry. (Chain keys are the index's to
        undo: PrefixIndex.cache_full_blocks.)"""
        if not self._journal.active:
            return
        blocks = table.block_table
        last = blocks[-1] if blocks else None
        self._journal.record(_shrink, table, len(blocks), len(table.token_ids), last)

    def mark_changed(self, request_id: str) -> None:
        """The table of ``request_id`` (or its last block's sharing) changed."""
        self._changed.add(request_id)
        self._epoch += 1

    def mark_all_changed(self) -> None:
        """Any table may have changed (an undo may shrink any of them)."""
        self._all_changed = True
        self._epoch += 1

    def take_changed(self) -> tuple[set[str], bool]:
        """Requests whose block table changed since the last call, and whether every
        table may have (after a rollback); both are reset."""
        changed, everything = self._changed, self._all_changed
        self._changed = set()
        self._all_changed = False
        return changed, everything


def _shrink(table: BlockTable, n_blocks: int, n_tokens: int, last: int | None) -> None:
    # Undo of growth (see BlockTables.record_growth).
    del table.block_table[n_blocks:]
    del table.token_ids[n_tokens:]
    if last is not None:
        table.block_table[-1] = last
