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
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from refserve.errors import DuplicateRequest, InvalidArgument, OutOfBlocks, UnknownRequest
from refserve.kv.journal import Journal
from refserve.kv.pool import BlockCopy
from refserve.spec.arith import blocks_needed
from refserve.spec.snapshot import PoolSnapshot, TableSnapshot
from refserve.values import is_int


@dataclass(frozen=True)
class HostTable:
    """A swapped request's KV on the host: ``num_stored`` positions in ``block_ids``."""

    block_ids: tuple[int, ...]
    num_stored: int
    token_ids: tuple[int, ...]


class HostPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if not is_int(num_blocks) or num_blocks < 0:
            raise InvalidArgument(f"num_host_blocks must be an int >= 0, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
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
        return blocks_needed(num_tokens, self.block_size) <= len(self._free)

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
            tables=tuple(
                TableSnapshot(rid, t.block_ids, t.num_stored, t.token_ids)
                for rid, t in sorted(self._tables.items())
            ),
        )
