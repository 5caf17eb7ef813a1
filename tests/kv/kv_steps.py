"""Pool tests' shared steps over the real API (no test-only pool methods).

``decode_step`` is one steady decode step as the persistent batch takes it
(``BulkBatch.needs_block``, ``fills_block``, ``filled_blocks``; docs/ARCHITECTURE.md,
"The persistent batch"): its claims are derived here from the pool's tables, and the
step goes through a ``DecodeRun`` and ``DecodeRun.append_decodes``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from refserve.kv import BlockCopy, BlockPool, DecodeGrowth, DecodeRun
from refserve.spec import check_pool


def stored(pool: BlockPool, request_id: str) -> int:
    """The request's KV length, as the snapshot reports it."""
    table = pool.snapshot().table(request_id)
    assert table is not None, f"{request_id!r} holds no table"
    return table.num_stored


def decode_step(
    pool: BlockPool,
    known: Mapping[str, Sequence[int]],
    *,
    run: DecodeRun | None = None,
    claim_filled: bool = True,
) -> DecodeGrowth | None:
    """One more token for each request of ``known`` (its known token ids: the one at its
    KV length is stored now), in that order, with the claims the persistent batch
    makes: which requests start a block or write a shared last block (``needy``), which
    fill one, and (``claim_filled``) the filled blocks' token ids. ``run`` defaults to a
    fresh one over the requests."""
    ids = list(known)
    bs = pool.block_size
    lengths = [stored(pool, rid) for rid in ids]
    needy = [
        i
        for i, (rid, n) in enumerate(zip(ids, lengths, strict=True))
        if n % bs == 0 or pool.ref_count(pool.block_table(rid)[-1]) > 1
    ]
    filling = [i for i, n in enumerate(lengths) if (n + 1) % bs == 0]
    filled = (
        [list(known[ids[i]][lengths[i] + 1 - bs : lengths[i] + 1]) for i in filling]
        if claim_filled
        else None
    )
    tokens = [known[rid][n] for rid, n in zip(ids, lengths, strict=True)]
    run = DecodeRun(pool, ids) if run is None else run
    return run.append_decodes(tokens, needy, filling, filled)


def decode_copies(pool: BlockPool, known: Mapping[str, Sequence[int]]) -> list[BlockCopy] | None:
    """:func:`decode_step`'s copies to apply, or None when the step was refused."""
    growth = decode_step(pool, known)
    return None if growth is None else growth.copies


def decode_each(pool: BlockPool, known: Mapping[str, Sequence[int]]) -> list[BlockCopy] | None:
    """The same step request by request, through ``allocate(rid, known, 1)`` in order:
    refused as a whole (None, nothing changed) when the free blocks cannot cover every
    request that needs one, as ``append_decodes`` refuses it."""
    bs = pool.block_size
    needy = 0
    for rid in known:
        n = stored(pool, rid)
        needy += n % bs == 0 or pool.ref_count(pool.block_table(rid)[-1]) > 1
    if needy > pool.num_free_blocks:
        return None
    return [c for rid, tokens in known.items() for c in pool.allocate(rid, tokens, 1).copies]


def tokens(n: int, base: int = 0) -> list[int]:
    return list(range(base, base + n))


def assert_valid(pool: BlockPool) -> None:
    assert check_pool(pool.snapshot()) == []
