"""The global prefix index: which replica caches which block, fed by their cache events
(docs/CLUSTER.md, "The global prefix index").

A router that routes by prefix hits must know every replica's cache before it routes,
without asking each replica per request. Each replica publishes its prefix cache's
changes (spec/events.py: ``BlockStored``, ``BlockRemoved``, ``CacheCleared``, numbered
0, 1, 2, ...; ref/kv/events.py); the index applies them and answers
:meth:`GlobalPrefixIndex.longest_prefix`: for a prompt, the cached prefix tokens on every
replica. The keys are the spec hash chain from the namespace's root
(``refserve.spec.hashing.block_key``), so hashing the prompt's full blocks from the root with a
replica's block size gives exactly the keys that replica holds, and the answer equals
the replica's own pool lookup (``LLMEngine.prefix_hit_tokens``), the cap that never
serves the last prompt token included (``refserve.spec.arith.max_cacheable_tokens``). A key is
trusted as the identity of its block (sha256 over the parent key and the token ids);
the pool, which also compares the stored token ids, is the one that serves the K/V.

Memory. Per cached block the index keeps the 32-byte key once, with an ``int`` bit mask
of the replicas holding it (replica ``r`` is bit ``r``: one machine word up to 30
replicas), and per replica holding it a dict entry key -> block id (the block id is what
a ``BlockRemoved`` is checked against). No token ids, no parent keys: a prompt is hashed
at lookup instead.

Gaps (the documented choice). Events are applied a batch at a time and all or nothing:
a batch whose sequence numbers skip one raises :class:`EventGap` and changes nothing;
the caller then calls :meth:`GlobalPrefixIndex.resync` with the replica's snapshot
(:class:`CacheSnapshot`: its entries and the number of its next event), which replaces
what the index holds for that replica. Events numbered below the next expected one are
already reflected (delivered twice, or covered by a resync) and are skipped. An event
that does not apply (a key stored twice, a removal of an entry not held) raises
:class:`EventMismatch`, also with nothing changed. The in-process cluster resyncs on
both and counts it (ref/cluster/cluster.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from refserve.cluster.errors import EventGap, EventMismatch, UnknownReplica
from refserve.errors import InvalidArgument
from refserve.spec.arith import full_blocks, max_cacheable_tokens
from refserve.spec.events import BlockRemoved, BlockStored, CacheChange, CacheEvent
from refserve.spec.hashing import DEFAULT_NAMESPACE, Namespace, packed_block_key, packed_token_ids
from refserve.values import is_int

#: Replica ids are bit positions of the holders' masks; this bounds a mask's size.
MAX_REPLICAS = 1 << 16
_TOKEN_BYTES = 8  # packed_token_ids: int64 per token


@dataclass(frozen=True)
class CacheSnapshot:
    """A replica's prefix cache at one point of its event stream: the entries it holds
    (key, block id) and the number of the next event it will publish."""

    next_seq: int
    entries: tuple[tuple[bytes, int], ...]


@dataclass
class _Books:
    """What the index holds for one replica."""

    block_size: int
    next_seq: int
    blocks: dict[bytes, int]  # key -> block id


class GlobalPrefixIndex:
    """Every replica's cached full blocks, by key (module doc)."""

    def __init__(self) -> None:
        self._holders: dict[bytes, int] = {}  # key -> bit mask of the replicas holding it
        self._books: dict[int, _Books] = {}

    # ------------------------------------------------------------------ replicas
    def add_replica(
        self, replica: int, block_size: int, snapshot: CacheSnapshot | None = None
    ) -> None:
        """Start following ``replica`` (its cache empty at event 0, or ``snapshot``)."""
        _check_replica_id(replica)
        if replica in self._books:
            raise InvalidArgument(f"add_replica: replica {replica} is already in the index")
        if not is_int(block_size) or block_size < 1:
            raise InvalidArgument(
                f"add_replica: block_size must be an int >= 1, got {block_size!r}"
            )
        entries = _snapshot_entries(snapshot) if snapshot is not None else {}
        self._books[replica] = _Books(block_size, 0, {})
        self._replace(replica, entries, 0 if snapshot is None else snapshot.next_seq, "add")

    def remove_replica(self, replica: int) -> None:
        """Stop following ``replica``: no prompt is a hit on it any more."""
        self._replace(replica, {}, 0, "remove_replica")
        del self._books[replica]

    @property
    def replicas(self) -> tuple[int, ...]:
        return tuple(self._books)

    def block_size(self, replica: int) -> int:
        return self._get(replica, "block_size").block_size

    def next_seq(self, replica: int) -> int:
        """The number of the next event expected from ``replica``."""
        return self._get(replica, "next_seq").next_seq

    # ------------------------------------------------------------------ events
    def apply(self, replica: int, events: Sequence[CacheEvent]) -> None:
        """Apply a batch of ``replica``'s events, all or nothing (module doc, "Gaps")."""
        books = self._get(replica, "apply")
        changes: list[tuple[int, CacheChange]] = []
        expected = books.next_seq
        for ev in events:
            if ev.seq < expected:
                continue  # already reflected
            if ev.seq != expected:
                raise EventGap(replica, expected, ev.seq)
            changes.append((ev.seq, ev.change))
            expected += 1
        final, cleared = _fold(replica, books.blocks, changes)
        bit = 1 << replica
        if cleared:
            for key in books.blocks:
                self._unset(key, bit)
            books.blocks = {}
        for key, block in final.items():
            if block is None:
                if books.blocks.pop(key, None) is not None:
                    self._unset(key, bit)
            else:
                books.blocks[key] = block
                self._holders[key] = self._holders.get(key, 0) | bit
        books.next_seq = expected

    def resync(self, replica: int, snapshot: CacheSnapshot) -> None:
        """Replace what the index holds for ``replica`` with its snapshot."""
        self._get(replica, "resync")
        self._replace(replica, _snapshot_entries(snapshot), snapshot.next_seq, "resync")

    # ------------------------------------------------------------------ queries
    def longest_prefix(
        self, token_ids: Sequence[int], namespace: Namespace = DEFAULT_NAMESPACE
    ) -> dict[int, int]:
        """Per replica, how many of ``token_ids`` its prefix cache holds: the longest
        chain of its cached full blocks from ``namespace``'s root, never the last token.

        The prompt is hashed once per distinct block size, and only as far as some
        replica of that size still holds the chain."""
        out = dict.fromkeys(self._books, 0)
        if not token_ids:
            return out
        try:
            packed = packed_token_ids(token_ids)
        except (OverflowError, TypeError) as e:
            raise InvalidArgument(f"longest_prefix: token ids must be int64 ints: {e}") from e
        root = namespace.root_key()
        sizes: dict[int, list[int]] = {}
        for r, books in self._books.items():
            sizes.setdefault(books.block_size, []).append(r)
        for bs, members in sizes.items():
            width = bs * _TOKEN_BYTES
            mask = 0
            for r in members:
                mask |= 1 << r
            parent = root
            n = full_blocks(max_cacheable_tokens(len(token_ids), bs), bs)
            depth = 0
            while mask and depth < n:
                parent = packed_block_key(parent, packed[depth * width : (depth + 1) * width])
                still = mask & self._holders.get(parent, 0)
                for r in _bits(mask & ~still):  # their chains end before this block
                    out[r] = depth * bs
                mask = still
                depth += 1
            for r in _bits(mask):
                out[r] = depth * bs
        return out

    def entries(self, replica: int) -> dict[bytes, int]:
        """A copy of what the index holds for ``replica``: key -> block id."""
        return dict(self._get(replica, "entries").blocks)

    def holders(self, key: bytes) -> frozenset[int]:
        """The replicas holding the block keyed ``key``."""
        mask = self._holders.get(key, 0)
        return frozenset(r for r in self._books if mask >> r & 1)

    @property
    def num_keys(self) -> int:
        """Distinct keys cached somewhere."""
        return len(self._holders)

    @property
    def num_entries(self) -> int:
        """Cached blocks over all replicas (a key cached on two replicas counts twice)."""
        return sum(len(b.blocks) for b in self._books.values())

    # ------------------------------------------------------------------ internals
    def _get(self, replica: int, what: str) -> _Books:
        books = self._books.get(replica) if isinstance(replica, int) else None
        if books is None:
            raise UnknownReplica(replica, what)
        return books

    def _replace(self, replica: int, entries: dict[bytes, int], next_seq: int, what: str) -> None:
        books = self._get(replica, what)
        bit = 1 << replica
        for key in books.blocks:
            self._unset(key, bit)
        for key in entries:
            self._holders[key] = self._holders.get(key, 0) | bit
        books.blocks = entries
        books.next_seq = next_seq

    def _unset(self, key: bytes, bit: int) -> None:
        mask = self._holders[key] & ~bit
        if mask:
            self._holders[key] = mask
        else:
            del self._holders[key]


def _fold(
    replica: int, held: Mapping[bytes, int], changes: Iterable[tuple[int, CacheChange]]
) -> tuple[dict[bytes, int | None], bool]:
    """The net effect of ``changes`` on ``held``, checked before anything is applied:
    per key touched its final block id (None: removed), and whether the cache was
    cleared first (then the keys not touched after the clear are gone)."""
    final: dict[bytes, int | None] = {}
    cleared = False

    def now(key: bytes) -> int | None:
        if key in final:
            return final[key]
        return None if cleared else held.get(key)

    for seq, c in changes:
        if isinstance(c, BlockStored):
            if now(c.key) is not None:
                raise EventMismatch(replica, seq, "stores a key the replica already holds")
            final[c.key] = c.block_id
        elif isinstance(c, BlockRemoved):
            if now(c.key) != c.block_id:
                raise EventMismatch(
                    replica,
                    seq,
                    f"removes key {c.key.hex()[:12]} from block {c.block_id}, "
                    f"which the index does not hold there",
                )
            final[c.key] = None
        else:
            final.clear()
            cleared = True
    return final, cleared


def _bits(mask: int) -> Iterator[int]:
    """The positions of the set bits of ``mask``, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def _check_replica_id(replica: object) -> None:
    if not is_int(replica) or not 0 <= replica < MAX_REPLICAS:
        raise InvalidArgument(f"replica ids are ints in [0, {MAX_REPLICAS}), got {replica!r}")


def _snapshot_entries(snapshot: CacheSnapshot) -> dict[bytes, int]:
    if not isinstance(snapshot, CacheSnapshot):
        raise InvalidArgument(f"expected a CacheSnapshot, got {type(snapshot).__name__}")
    seq = snapshot.next_seq
    if not is_int(seq) or seq < 0:
        raise InvalidArgument(f"snapshot next_seq must be an int >= 0, got {seq!r}")
    entries: dict[bytes, int] = {}
    for key, block in snapshot.entries:
        if not isinstance(key, bytes) or key in entries:
            raise InvalidArgument(f"snapshot key {key!r} is not bytes or appears twice")
        entries[key] = block
    return entries
