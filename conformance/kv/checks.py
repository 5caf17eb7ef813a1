"""The KV level's own checks on one op's outcome, beside :mod:`refserve.spec.checks` (the
module docstring of :mod:`refserve.conformance.kv.machine` lists them): what a cache hit may be
(PREFIX, KVLEN), whether a refused call really lacked room (CAP), whether each table
matches the suite's books (KVLEN, PREFIX, PROGRESS, POS), and whether every live request
reads back its own tokens from the fake KV memory (BLOCK, PREFIX).

Each returns the violations it found; the run records them at its current op.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, field

from refserve.conformance.kv.shape import short
from refserve.conformance.kv.workload import domain_of
from refserve.spec.arith import blocks_needed, max_cacheable_tokens, slot_of
from refserve.spec.hashing import DEFAULT_NAMESPACE, Namespace
from refserve.spec.prefix import KEY_DOMAINS
from refserve.spec.snapshot import PoolSnapshot, TableSnapshot
from refserve.spec.violation import Invariant, Violation, violation


@dataclass(frozen=True)
class Books:
    """The suite's truth about the live requests, never read back from the manager:
    known tokens, tokens stored, tokens that came from the cache, the requests freed,
    and the fake KV memory (slot -> token id); with feature ``key_domains`` also each
    request's key namespace and, per slot, the namespace its token was computed in."""

    known: Mapping[str, Sequence[int]]
    stored: Mapping[str, int]
    cached: Mapping[str, int]
    freed: Set[str]
    memory: Mapping[int, int]
    block_size: int
    namespaces: Mapping[str, Namespace] = field(default_factory=dict)
    """Each live request's key namespace (absent: the default one)."""
    writers: Mapping[int, Namespace] = field(default_factory=dict)
    """Slot -> the namespace of the request that wrote it (absent: the default one)."""


def hit_violation(
    rid: str, hit: int, n: int, known: int, *, first: bool, caching: bool, bs: int
) -> Violation | None:
    """PREFIX: a hit is whole blocks, on a first allocation, with caching on, and spares
    the last known token; KVLEN: hit + new tokens fit in the known tokens."""
    who = f"request {rid}"
    if not first:
        if hit == 0:
            return None
        return violation(
            Invariant.PREFIX, who, "cache hit reported for a request already holding blocks", 0, hit
        )
    cacheable = max_cacheable_tokens(known, bs)
    if hit < 0:
        return violation(Invariant.PREFIX, who, "negative cache hit", ">= 0", hit)
    if hit > 0 and not caching:
        return violation(Invariant.PREFIX, who, "cache hit while prefix caching is off", 0, hit)
    if hit % bs:
        return violation(
            Invariant.PREFIX,
            who,
            "cache hit is not a whole number of blocks",
            f"multiple of {bs}",
            hit,
        )
    if hit > cacheable:
        return violation(
            Invariant.PREFIX,
            who,
            "cache hit covers the last known token (no logit)",
            f"<= {cacheable}",
            hit,
        )
    if hit + n > known:
        return violation(
            Invariant.KVLEN,
            who,
            "cache hit plus new tokens exceed the known tokens",
            f"<= {known}",
            hit + n,
        )
    return None


@dataclass(frozen=True)
class Room:
    """What a refused allocation needed (blocks, without any cache hit, plus one for a
    copy-on-write) and what the pool had free before it."""

    need: int
    free: int


def room(before: PoolSnapshot, rid: str, prev: int, n: int, *, first: bool, bs: int) -> Room:
    """The :class:`Room` of allocating ``n`` tokens to ``rid``, which holds ``prev``."""
    in_queue = set(before.free_queue)
    free = sum(1 for b, rc in enumerate(before.ref_cnt) if rc == 0 and b in in_queue)
    if first:
        return Room(blocks_needed(n, bs), free)
    need = blocks_needed(prev + n, bs) - blocks_needed(prev, bs)
    t = before.table(rid)
    if prev % bs and t is not None and t.block_table:
        last = t.block_table[-1]
        if 0 <= last < len(before.ref_cnt) and before.ref_cnt[last] > 1:
            need += 1
    return Room(need, free)


def table_violations(snap: PoolSnapshot, books: Books) -> list[Violation]:
    """KVLEN: each table's KV length is the suite's; PREFIX: its token ids are the
    request's own; PROGRESS: freed requests hold nothing; POS: live ones a table."""
    out: list[Violation] = []
    tables: dict[str, TableSnapshot] = {}
    for one in snap.tables:
        if one.request_id in tables:
            out.append(
                violation(Invariant.BLOCK, f"request {one.request_id}", "has two block tables")
            )
        tables.setdefault(one.request_id, one)
    for rid, held in sorted(tables.items()):
        if rid not in books.stored:
            why = "holds a block table after free" if rid in books.freed else "unknown request"
            out.append(
                violation(
                    Invariant.PROGRESS,
                    f"request {rid}",
                    why,
                    "no table",
                    f"{len(held.block_table)} blocks",
                )
            )
    for rid, want in sorted(books.stored.items()):
        v = _table_violation(rid, want, tables.get(rid), books)
        if v is not None:
            out.append(v)
    return out


def _table_violation(
    rid: str, want: int, t: TableSnapshot | None, books: Books
) -> Violation | None:
    """The first thing wrong with a live request's table (``want``: tokens stored)."""
    who = f"request {rid}"
    if t is None:
        need = f"{blocks_needed(want, books.block_size)} blocks"
        return violation(Invariant.POS, who, "live request has no block table", need, "no table")
    if t.num_stored != want:
        return violation(
            Invariant.KVLEN,
            who,
            "KV length differs from the tokens allocated to it (previous + hit + new)",
            want,
            t.num_stored,
        )
    truth = tuple(books.known[rid][:want])
    if t.token_ids != truth:
        return violation(
            Invariant.PREFIX,
            who,
            "stored token ids differ from the request's tokens",
            short(truth),
            short(t.token_ids),
        )
    return None


def read_back_violations(snap: PoolSnapshot, books: Books) -> list[Violation]:
    """Every live request reads exactly its own tokens through its table (BLOCK: a
    block released or moved while still held; PREFIX: a shared or cache-hit block
    holding someone else's tokens, or its own tokens computed in another key namespace,
    rule ``key-domains``). One violation per request at most: its first wrong position."""
    holders: Counter[int] = Counter(b for t in snap.tables for b in set(t.block_table))
    out: list[Violation] = []
    done: set[str] = set()
    for t in snap.tables:
        rid = t.request_id
        if rid not in books.stored or rid in done:
            continue
        done.add(rid)
        v = _read_back_one(t, snap.num_blocks, holders, books)
        if v is not None:
            out.append(v)
    return out


def _read_back_one(
    t: TableSnapshot, nb: int, holders: Counter[int], books: Books
) -> Violation | None:
    rid, bs = t.request_id, books.block_size
    toks = books.known[rid]
    mine = books.namespaces.get(rid, DEFAULT_NAMESPACE)
    for p in range(min(books.stored[rid], t.num_stored, len(t.block_table) * bs)):
        b = t.block_table[p // bs]
        if not 0 <= b < nb:
            return None  # BLOCK reports the id
        slot = slot_of(b, p, bs)
        got = books.memory.get(slot)
        if got == toks[p]:
            theirs = books.writers.get(slot, DEFAULT_NAMESPACE)
            if theirs == mine:
                continue
            return violation(
                Invariant.PREFIX,
                f"request {rid}",
                f"KV read back at position {p}: block {b} holds this token's K/V computed "
                "in another key domain",
                f"token {got} in {domain_of(mine)}",
                f"token {got} in {domain_of(theirs)}",
                rule=KEY_DOMAINS,
            )
        if holders[b] > 1 or p < books.cached.get(rid, 0):
            inv = Invariant.PREFIX
            why = f"shared or cached block {b} holds another request's token"
        elif got is None:
            inv = Invariant.BLOCK
            why = f"block {b} never received this KV (moved without its copy?)"
        else:
            inv, why = Invariant.BLOCK, f"block {b} was overwritten by another request"
        return violation(
            inv, f"request {rid}", f"KV read back at position {p}: {why}", toks[p], got
        )
    return None
