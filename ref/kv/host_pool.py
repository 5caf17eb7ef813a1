"""The host-side swap pool: where a preempted (or tool-waiting) request's KV waits.

The second preemption mode (docs/ARCHITECTURE.md, "Where refserve differs from vLLM"):
instead of dropping a victim's KV and recomputing it later, copy its blocks to host memory
and back when it resumes. The host pool is much simpler than the device pool: a host block
belongs to exactly one swapped request (no sharing, no prefix cache), so it is a free list
plus one table per swapped request.

Two rules make the copies of one step safe whatever order the executor's blocks are
reused in (the executor applies every swap-out, then every swap-in, then the forward):

- device blocks freed by a swap-out may be handed to another request in the same step:
  the swap-out reads them before anything writes them;
- host blocks released by a swap-in are *not* reusable until the step commits: a
  swap-out in the same step would otherwise overwrite them before the swap-in read them.

Mutations join the scheduler's step transaction (:meth:`begin` / :meth:`commit` /
:meth:`rollback`) through an undo journal, like the device pool (ATOMIC invariant).

A hybrid model's layer groups (ref/kv/groups.py) swap through :meth:`HostPool.swap_out_groups`:
a swapped request still has one host table, holding in every group only the blocks its
next query reads (spec/groups.py ``held_places``: a window group's from the block
holding ``window_start`` on), with a record of which group and place each block is
(:attr:`HostTable.groups`). The host pool stays one pool of blocks; its snapshot lists
each group's table as the device pool's engine view does (``request@groupN``, null
places before a window group's first block), which spec/host.py checks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from refserve.errors import DuplicateRequest, InvalidArgument, OutOfBlocks, UnknownRequest
from refserve.kv.groups import GroupBlocks
from refserve.kv.journal import Journal
from refserve.kv.pool import BlockCopy
from refserve.spec.arith import blocks_needed
from refserve.spec.groups import (
    NULL_BLOCK,
    GroupedSnapshot,
    GroupTable,
    KVGroup,
    held_places,
    layout_blocks,
)
from refserve.spec.snapshot import PoolSnapshot, TableSnapshot
from refserve.values import is_int


@dataclass(frozen=True)
class HostTable:
    """A swapped request's KV on the host: ``num_stored`` positions in ``block_ids``.

    On a grouped pool ``groups`` records which layer group and place each block is, one
    entry per group in group order (``block_ids`` is their blocks in that order, the
    first group's first); empty on a plain pool, where ``block_ids[i]`` is place ``i``."""

    block_ids: tuple[int, ...]
    num_stored: int
    token_ids: tuple[int, ...]
    groups: tuple[GroupBlocks, ...] = ()


class HostPool:
    def __init__(self, num_blocks: int, block_size: int, groups: Sequence[KVGroup] = ()) -> None:
        if not is_int(num_blocks) or num_blocks < 0:
            raise InvalidArgument(f"num_host_blocks must be an int >= 0, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # A hybrid model's layer groups (several; else the plain pool's one table).
        self.groups: tuple[KVGroup, ...] = tuple(groups) if len(groups) > 1 else ()
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[str, HostTable] = {}
        # Released inside the open transaction: free only once the step commits.
        self._released: list[int] = []
        self._journal = Journal()

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free) - len(self._released)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._tables

    def table(self, request_id: str) -> HostTable:
        t = self._tables.get(request_id)
        if t is None:
            raise UnknownRequest(request_id, "host table")
        return t

    def can_hold(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """The host blocks a swap of ``num_tokens`` tokens of KV takes: every group's
        blocks its next query reads (spec/groups.py ``layout_blocks``) on a grouped pool."""
        if self.groups:
            return layout_blocks(self.groups, num_tokens, 0, self.block_size)
        return blocks_needed(num_tokens, self.block_size)

    # ------------------------------------------------------------ transactions
    def begin(self) -> None:
        self._journal.begin()

    def commit(self) -> None:
        self._journal.commit()
        self._free.extend(self._released)
        self._released = []

    def rollback(self) -> None:
        self._journal.rollback()
        assert not self._released, "rollback left host blocks in quarantine"

    # ---------------------------------------------------------------- mutations
    def swap_out(
        self,
        request_id: str,
        device_blocks: Sequence[int],
        num_stored: int,
        token_ids: Sequence[int],
    ) -> tuple[BlockCopy, ...]:
        """Take host blocks for a request's KV; return the device -> host copies.

        All-or-nothing: raises :class:`OutOfBlocks` with nothing taken.
        """
        if request_id in self._tables:
            raise DuplicateRequest(request_id, "swap_out")
        if self.groups:
            raise InvalidArgument(
                f"swap_out: request {request_id!r} is on a grouped pool, whose swaps take "
                "every group's blocks (swap_out_groups)"
            )
        need = blocks_needed(num_stored, self.block_size)
        if len(device_blocks) != need or len(token_ids) < num_stored:
            raise InvalidArgument(
                f"swap_out: request {request_id!r} has {len(device_blocks)} device blocks and "
                f"{len(token_ids)} token ids for {num_stored} stored positions"
            )
        if need > len(self._free):
            raise OutOfBlocks(request_id, need, len(self._free))
        taken = [self._free.popleft() for _ in range(need)]
        self._tables[request_id] = HostTable(
            tuple(taken), num_stored, tuple(token_ids[:num_stored])
        )
        self._journal.record(self._unswap_out, request_id, taken)
        return tuple(BlockCopy(d, h) for d, h in zip(device_blocks, taken, strict=True))

    def swap_out_groups(
        self,
        request_id: str,
        device: Sequence[GroupBlocks],
        num_stored: int,
        token_ids: Sequence[int],
    ) -> tuple[BlockCopy, ...]:
        """:meth:`swap_out` on a grouped pool: ``device`` is every group's blocks the
        request's next query reads (``GroupedPool.held_blocks``), exactly spec/groups.py
        ``held_places`` at ``num_stored`` in each group. One host table keeps them all,
        with each group's places; the device -> host copies, group by group.

        All-or-nothing: a typed error with nothing taken."""
        if request_id in self._tables:
            raise DuplicateRequest(request_id, "swap_out")
        self._check_groups(request_id, device, num_stored, token_ids)
        need = sum(len(d.block_ids) for d in device)
        if need > len(self._free):
            raise OutOfBlocks(request_id, need, len(self._free))
        taken = [self._free.popleft() for _ in range(need)]
        spans: list[GroupBlocks] = []
        start = 0
        for d in device:
            end = start + len(d.block_ids)
            spans.append(GroupBlocks(d.group, d.first, tuple(taken[start:end])))
            start = end
        self._tables[request_id] = HostTable(
            tuple(taken), num_stored, tuple(token_ids[:num_stored]), tuple(spans)
        )
        self._journal.record(self._unswap_out, request_id, taken)
        sources = [b for d in device for b in d.block_ids]
        return tuple(BlockCopy(d, h) for d, h in zip(sources, taken, strict=True))

    def _check_groups(
        self,
        request_id: str,
        device: Sequence[GroupBlocks],
        num_stored: int,
        token_ids: Sequence[int],
    ) -> None:
        """:meth:`swap_out_groups`'s arguments: one entry per group, in order, each
        exactly the places its group's next query reads, or :class:`InvalidArgument`
        naming the first that is not."""
        if not self.groups:
            raise InvalidArgument(
                f"swap_out_groups: request {request_id!r}: this host pool has no layer groups"
            )
        if not is_int(num_stored) or num_stored < 1 or len(token_ids) < num_stored:
            raise InvalidArgument(
                f"swap_out: request {request_id!r} has {len(token_ids)} token ids for "
                f"{num_stored!r} stored positions"
            )
        if [d.group for d in device] != list(range(len(self.groups))):
            raise InvalidArgument(
                f"swap_out: request {request_id!r} brings groups {[d.group for d in device]}, "
                f"the layout has {len(self.groups)}"
            )
        for d, group in zip(device, self.groups, strict=True):
            places = held_places(group, num_stored, self.block_size)
            if (d.first, len(d.block_ids)) != (places.start, len(places)) or any(
                not is_int(b) or b < 0 for b in d.block_ids
            ):
                raise InvalidArgument(
                    f"swap_out: request {request_id!r} brings group {d.group}'s blocks "
                    f"{list(d.block_ids)} from place {d.first}; its next query at "
                    f"{num_stored} reads places {places.start}..{places.stop - 1}"
                )

    def release(self, request_id: str) -> HostTable:
        """Drop a request's host table (swapped in, or finished while swapped).

        Inside a step its blocks become free when the step commits (see the module doc).
        """
        t = self._tables.pop(request_id, None)
        if t is None:
            raise UnknownRequest(request_id, "release (no host table)")
        if self._journal.active:
            self._journal.record(self._unrelease, request_id, t, len(self._released))
            self._released.extend(t.block_ids)
        else:
            self._free.extend(t.block_ids)
        return t

    def _unswap_out(self, request_id: str, taken: list[int]) -> None:
        # Undo of swap_out: the blocks go back to the head, in their old order.
        del self._tables[request_id]
        self._free.extendleft(reversed(taken))

    def _unrelease(self, request_id: str, table: HostTable, mark: int) -> None:
        # Undo of release inside a step: its blocks leave the quarantine.
        del self._released[mark:]
        self._tables[request_id] = table

    # ------------------------------------------------------------------ snapshot
    def snapshot(self) -> PoolSnapshot:
        """The host pool as spec/host.py checks it; on a grouped pool, every group's
        tables as the device pool's engine view lists them
        (:meth:`refserve.spec.groups.GroupedSnapshot.engine_pool`)."""
        if self.groups:
            return self.grouped_snapshot().engine_pool()
        return self._pool(
            tuple(
                TableSnapshot(rid, t.block_ids, t.num_stored, t.token_ids)
                for rid, t in sorted(self._tables.items())
            )
        )

    def grouped_snapshot(self) -> GroupedSnapshot:
        """A grouped host pool as spec/groups.py states a grouped pool: each swapped
        request's table in each group, at the device table's places (null before a
        window group's first held block)."""
        tables = tuple(
            GroupTable(
                g.group,
                TableSnapshot(
                    rid, (NULL_BLOCK,) * g.first + g.block_ids, t.num_stored, t.token_ids
                ),
            )
            for rid, t in sorted(self._tables.items())
            for g in t.groups
        )
        return GroupedSnapshot(self.groups, self._pool(()), tables)

    def _pool(self, tables: tuple[TableSnapshot, ...]) -> PoolSnapshot:
        ref = [0] * self.num_blocks
        for t in self._tables.values():
            for b in t.block_ids:
                ref[b] += 1
        return PoolSnapshot(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            ref_cnt=tuple(ref),
            # Quarantined blocks are free for every purpose but this step's swap-outs.
            free_queue=(*self._free, *self._released),
            tables=tables,
        )
