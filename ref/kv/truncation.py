"""Speculative decoding's side of the pool: K/V of rejected draft tokens given back.

A step that verifies drafts takes slots for them; at commit the scheduler keeps the
positions up to the first rejected draft (docs/SPECULATIVE.md, "Rejected drafts") and
:func:`truncate` cuts the request's table there: the blocks past the kept positions go
back to the free queue, and every block that held a rejected position loses its cache
entry.

It is an attachment, separate from the pool (ref/kv/pool.py), because tables otherwise
only grow: this is the one place a held table shrinks, with an undo of its own. It uses
the pool's public parts (the tables, the allocator, the prefix index, the journal
through ``BlockPool.atomic``), and the pool does not know it.
"""

from __future__ import annotations

from refserve.errors import InvalidArgument
from refserve.kv.pool import BlockPool, require_int
from refserve.kv.tables import BlockTable
from refserve.spec.arith import blocks_needed, full_blocks

__all__ = ["truncate"]


def truncate(pool: BlockPool, request_id: str, num_stored: int) -> list[int]:
    """Keep the K/V of positions ``[0, num_stored)`` of ``request_id`` only.

    The blocks past the kept positions hold only rejected ones and go back to the
    free queue (tail first, as ``BlockPool.free``); they are returned. Every block that
    holds a rejected position loses its cache entry: the kept block is overwritten
    from ``num_stored`` on by the next step, and the returned ones would chain from
    it. Inside a step the changes join its transaction.
    """
    table = pool.tables.table(request_id, "truncate")
    stored = table.num_stored
    require_int(num_stored, "num_stored", minimum=0)
    if num_stored > stored:
        raise InvalidArgument(
            f"truncate: request {request_id!r} stores {stored} tokens; it cannot keep {num_stored}"
        )
    if num_stored == stored:
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


def _untruncate(table: BlockTable, tails: tuple[list[int], list[bytes], list[int]]) -> None:
    # Undo of truncate: every later change to the table is undone already.
    tokens, keys, blocks = tails
    table.token_ids += tokens
    table.keys += keys
    table.block_table += blocks
