"""The canonical key of a state: two states with the same key have the same futures.

Deduplicating on it is what makes an exhaustive exploration finite and small. It factors
out the symmetries a correct engine cannot observe (docs/CONFORMANCE.md, "Exhaustive
exploration"):

* **request ids**: live requests are named by their arrival order (the ids the explorer
  hands out are arbitrary strings to the engine); finished and aborted ones are gone;
* **physical block ids**: renamed by first use, walking the live tables in arrival
  order, then the cache index in key order (content hashes, independent of ids);
* **the free queue**: kept only where it is observable. Free blocks that hold no
  cache entry are interchangeable, so only where the indexed ones sit in the hand-out
  order survives (which evictable block goes first); an engine declaring an unordered
  free list keeps no order at all.

What the key keeps: every live request's counters, tokens and catalogue entry; every
table (renamed), ref count and cache entry; the fake KV memory of every held or indexed
block (the K/V content rule reads nothing else); the explorer's own phase. An engine
whose behaviour depends on state its snapshot does not show (a timer, an aging counter,
its queue order) adds it with an ``explore_key()`` method on its adapter (request ids in
it are renamed like the snapshot's).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

from refserve.spec.snapshot import EngineSnapshot, PoolSnapshot

Key = Hashable


def same_pattern(a: list[int], b: list[int]) -> bool:
    """Whether ``a`` and ``b`` hold equal values at exactly the same pairs of places."""
    n = len(a)
    return all((a[i] == a[j]) == (b[i] == b[j]) for i in range(n) for j in range(i))


def first_use(ids: list[int]) -> list[int]:
    """``ids`` renamed by first use: the canonical form the key gives block ids.

    Two sequences get the same names exactly when they have the same equality pattern,
    so the names factor out every renaming of the physical ids and nothing more (the
    key's symmetry reduction; CrossHair proves it in ``make crosshair`` for up to four
    ids, the loop being the same for any length). A list, not a dict: CrossHair reasons
    about list membership, and keys hold a handful of blocks.

    pre: len(ids) <= 4
    post: len(__return__) == len(ids)
    post: same_pattern(__return__, ids)
    post: all(__return__[i] <= max(__return__[:i], default=-1) + 1 for i in range(len(ids)))
    """
    seen: list[int] = []
    out: list[int] = []
    for b in ids:
        if b not in seen:
            seen.append(b)
        out.append(seen.index(b))
    return out


def pool_key(
    pool: PoolSnapshot,
    rank: Mapping[str, int],
    memory: Mapping[int, object],
    ordered_free: bool,
) -> Key:
    """The canonical form of one pool (device or host) and of its fake memory."""
    tables = sorted(
        (t for t in pool.tables if t.request_id in rank), key=lambda t: rank[t.request_id]
    )
    strays = sorted(t.request_id for t in pool.tables if t.request_id not in rank)
    entries = sorted(pool.cache_entries, key=lambda e: e.key)
    order = [b for t in tables for b in t.block_table] + [e.block_id for e in entries]
    names = dict(zip(order, first_use(order), strict=True))
    table_key = tuple(
        (rank[t.request_id], tuple(names[b] for b in t.block_table), t.num_stored, t.root_key)
        for t in tables
    )
    entry_key = tuple((e.key, names[e.block_id], e.parent_key) for e in entries)
    ref = _ref_counts(pool, names)
    # Blocks counted as held but in no table, cache entry or free slot: a leak the BLOCK
    # check reports; their number is part of the state all the same.
    held = sum(1 for c in pool.ref_cnt if c > 0)
    return (
        table_key,
        tuple(strays),
        entry_key,
        _free_key(pool, names, ordered_free),
        len(pool.free_queue),
        tuple(sorted(ref.items())),
        held - len(ref),
        _contents(names, memory, pool.block_size),
    )


def _free_key(pool: PoolSnapshot, names: Mapping[int, int], ordered_free: bool) -> Key:
    """Where the named (held or indexed) blocks sit in the free queue: in hand-out order
    (unnamed free blocks as None), or as a set for an unordered free list."""
    if ordered_free:
        return tuple(names.get(b) for b in pool.free_queue)
    return tuple(sorted(names[b] for b in pool.free_queue if b in names))


def _ref_counts(pool: PoolSnapshot, names: Mapping[int, int]) -> dict[int, int]:
    """The ref count of every named block, by its name."""
    return {
        names[b]: c for b, c in enumerate(pool.ref_cnt) if b in names and 0 <= b < len(pool.ref_cnt)
    }


def _contents(names: Mapping[int, int], memory: Mapping[int, object], bs: int) -> Key:
    """The fake KV memory of every named block, in name order."""
    return tuple(
        tuple(memory.get(b * bs + off) for off in range(bs))
        for b, _ in sorted(names.items(), key=lambda kv: kv[1])
    )


def request_key(snap: EngineSnapshot, rank: Mapping[str, int]) -> Key:
    live = sorted(
        (r for r in snap.requests if r.request_id in rank), key=lambda r: rank[r.request_id]
    )
    return tuple(
        (
            rank[r.request_id],
            str(r.status),
            r.num_prompt_tokens,
            r.num_output_tokens,
            r.num_computed_tokens,
            r.num_cached_tokens,
            r.max_model_len,
        )
        for r in live
    )


def rename(value: object, rank: Mapping[str, int]) -> Key:
    """``value`` with every live request id replaced by its rank (for ``explore_key``)."""
    if isinstance(value, str):
        return ("#", rank[value]) if value in rank else value
    if isinstance(value, (tuple, list)):
        return tuple(rename(v, rank) for v in value)
    if isinstance(value, (set, frozenset)):
        return frozenset(rename(v, rank) for v in value)
    if isinstance(value, dict):
        return tuple(
            sorted(((rename(k, rank), rename(v, rank)) for k, v in value.items()), key=repr)
        )
    assert isinstance(value, Hashable), f"explore_key() returned an unhashable {value!r}"
    return value
