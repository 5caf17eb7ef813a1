"""Speculative decoding's side of the pool: K/V of rejected draft tokens given back.

A step that verifies drafts takes slots for them; at commit the scheduler keeps the
positions up to the first rejected draft (docs/SPECULATIVE.md, "Rejected drafts") and
:func:`truncate` cuts the request's table there: the blocks past the kept positions go
back to the free queue, and every block that held a rejected position loses its cache
entry.

On a grouped pool (ref/kv/groups.py) it cuts every layer group's table at the same
length, each in its own block size. A window group's table may start with null places
(blocks released before the verification's allocation at ``L``, wholly before the block
holding ``window_start(L, W)``). The kept length ``L'`` is at least ``L + 1`` (the
verified request's last token is always kept), and ``window_start`` never moves back,
so no released block is read again: the places the kept positions' next query reads,
and every place cut off after them, all hold blocks. A cut that would need a released
place is refused by name.

It is an attachment, separate from the pool (ref/kv/pool.py), because tables otherwise
only grow: this is the one place a held table shrinks, with an undo of its own. It uses
the pool's public parts (the tables, the allocator, the prefix index, the journal
through ``BlockPool.atomic``), and the pool does not know it.
"""

from __future__ import annotations

from refserve.errors import InvalidArgument
from refserve.kv.groups import GroupedPool
from refserve.kv.pool import BlockPool, require_int
from refserve.kv.tables import BlockTable
from refserve.spec.arith import blocks_needed, full_blocks
from refserve.spec.groups import NULL_BLOCK

__all__ = ["truncate"]


def truncate(pool: BlockPool, request_id: str, num_stored: int) -> list[int]:
    """Keep the K/V of positions ``[0, num_stored)`` of ``request_id`` only (in every
    layer group of a grouped pool).

    The blocks past the kept positions hold only rejected ones and go back to the
    free queue (tail first, as ``BlockPool.free``); they are returned (group by group).
    Every block that holds a rejected position loses its cache entry: the kept block is
    overwritten from ``num_stored`` on by the next step, and the returned ones would
    chain from it. Inside a step the changes join its transaction; outside one they are
    all or nothing.
    """
    if isinstance(pool, GroupedPool):
        return _truncate_groups(pool, request_id, num_stored)
    table = _checked(pool, request_id, num_stored)
    return _cut(pool, request_id, table, num_stored)


def _checked(pool: BlockPool, request_id: str, num_stored: int) -> BlockTable:
    """The request's table in ``pool``, once ``num_stored`` is a length it can keep."""
    table = pool.tables.table(request_id, "truncate")
    stored = table.num_stored
    require_int(num_stored, "num_stored", minimum=0)
    if num_stored > stored:
        raise InvalidArgument(
            f"truncate: request {request_id!r} stores {stored} tokens; it cannot keep {num_stored}"
        )
    return table


def _cut(pool: BlockPool, request_id: str, table: BlockTable, num_stored: int) -> list[int]:
    """:func:`truncate` in one pool (a group's), its arguments checked."""
    if num_stored == table.num_stored:
        return []
    bs = pool.block_size
    keep_blocks, keep_keys = blocks_needed(num_stored, bs), full_blocks(num_stored, bs)
    blocks = table.block_table
    with pool.atomic():
        pool.prefix_index.forget(blocks[keep_keys:])
        tails = (table.token_ids[num_stored:], table.keys[keep_keys:], blocks[keep_blocks:])
        del table.token_ids[num_stored:], table.keys[keep_keys:], blocks[keep_blocks:]
        pool.journal.record(_untruncate, table, tails)
        pool.tables.mark_changed(request_id)
        pool.allocator.release(tails[2][::-1])
    return tails[2]


def _truncate_groups(pool: GroupedPool, request_id: str, num_stored: int) -> list[int]:
    """:func:`truncate` in every group: each checked first (nothing changes on a typed
    error), then cut in one transaction."""
    tables = [_checked(p, request_id, num_stored) for p in pool.pools]
    for g, table in enumerate(tables):
        # Null places are a window table's first ones: the first place the kept
        # positions' next query reads holding a block means every later one does.
        first = pool.first_read_block(g, num_stored)
        if first < len(table.block_table) and table.block_table[first] == NULL_BLOCK:
            raise InvalidArgument(
                f"truncate: request {request_id!r} cannot keep {num_stored} tokens: window "
                f"group {g} released logical block {first}, which the query at {num_stored} "
                "reads"
            )
    out: list[int] = []
    with pool.atomic():
        for p, table in zip(pool.pools, tables, strict=True):
            out += _cut(p, request_id, table, num_stored)
    return out


def _untruncate(table: BlockTable, tails: tuple[list[int], list[bytes], list[int]]) -> None:
    # Undo of truncate: every later change to the table is undone already.
    tokens, keys, blocks = tails
    table.token_ids += tokens
    table.keys += keys
    table.block_table += blocks
