"""n > 1 sampling's side of the pool: a child request that shares its parent's blocks.

:func:`fork` gives a new table every block of its parent, each gaining a reference; no
K/V is copied. The first write into the shared partial last block, by either side,
copies it: that copy-on-write is the pool's own (``BlockPool.allocate``, and the bulk
decode step of ref/kv/decode_runs.py), because a shared block is never written whoever
shares it (PREFIX).

It is an attachment, separate from the pool (ref/kv/pool.py), because only parallel
sampling needs it: it uses the pool's public parts (the tables, the allocator, the
journal through ``BlockPool.atomic``), and the pool does not know it.
"""

from __future__ import annotations

from refserve.errors import DuplicateRequest
from refserve.kv.groups import GroupedPool
from refserve.kv.pool import BlockPool
from refserve.spec.groups import NULL_BLOCK

__all__ = ["fork"]


def fork(pool: BlockPool, parent_id: str, child_id: str) -> None:
    """Share every block of ``parent_id`` with a new ``child_id`` in ``pool``, in every
    layer group of a grouped pool (ref/kv/groups.py).

    No block is copied now; the first write into the shared partial last block by
    either side copies it (``allocate`` returns the :class:`~refserve.kv.pool.BlockCopy`).
    Inside a step the changes join its transaction; outside one they are all or nothing.
    """
    groups = pool.pools if isinstance(pool, GroupedPool) else (pool,)
    for p in groups:
        p.tables.table(parent_id, "fork")
        if child_id in p.tables:
            raise DuplicateRequest(child_id, "fork")
    with pool.atomic():
        for p in groups:
            _fork(p, parent_id, child_id)


def _fork(pool: BlockPool, parent_id: str, child_id: str) -> None:
    tables = pool.tables
    parent = tables.table(parent_id, "fork")
    child = tables.add(child_id, parent.root_key)
    tables.mark_changed(parent_id)  # its last block is shared now
    # A window group's null places (blocks that left its window) hold no block.
    pool.allocator.share([b for b in parent.block_table if b != NULL_BLOCK])
    child.block_table.extend(parent.block_table)
    child.keys.extend(parent.keys)
    child.token_ids.extend(parent.token_ids)
