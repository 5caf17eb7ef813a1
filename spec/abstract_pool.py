"""An obviously-correct abstract model of the block pool, used as the test oracle.

Plain lists and dicts, linear scans, no journal, no fast paths: every operation reads as
its definition. The Hypothesis state machine runs the same operations on the engine's
pool and on this model and requires identical snapshots (free queue order included), so
any divergence in allocation order, eviction, ref counting or copy-on-write shows up.
Operations the pool would refuse return ``False`` here and change nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from refserve.spec.arith import blocks_needed, max_cacheable_tokens
from refserve.spec.hashing import block_key, chain_keys
from refserve.spec.snapshot import CacheEntry, PoolSnapshot, TableSnapshot


@dataclass
class AbstractTable:
    root_key: bytes
    blocks: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)


@dataclass
class AbstractPool:
    num_blocks: int
    block_size: int
    prefix_caching: bool = True
    free: list[int] = field(default_factory=list)
    ref: list[int] = field(default_factory=list)
    tables: dict[str, AbstractTable] = field(default_factory=dict)
    cache: dict[bytes, CacheEntry] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.free = list(range(self.num_blocks))
        self.ref = [0] * self.num_blocks

    def cached_block(self, b: int) -> CacheEntry | None:
        for e in self.cache.values():
            if e.block_id == b:
                return e
        return None

    def lookup(self, token_ids: Sequence[int], root_key: bytes) -> list[int]:
        if not self.prefix_caching:
            return []
        bs = self.block_size
        hits: list[int] = []
        parent = root_key
        for i in range(max_cacheable_tokens(len(token_ids), bs) // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            key = block_key(parent, tokens)
            e = self.cache.get(key)
            if e is None or e.parent_key != parent or e.token_ids != tokens:
                break
            hits.append(e.block_id)
            parent = key
        return hits

    def _pop_free(self) -> int:
        b = self.free.pop(0)
        e = self.cached_block(b)
        if e is not None:
            del self.cache[e.key]
        return b

    def allocate(
        self, rid: str, token_ids: Sequence[int], n: int, root_key: bytes, use_cache: bool
    ) -> bool:
        bs = self.block_size
        table = self.tables.get(rid)
        hits = self.lookup(token_ids, root_key) if table is None and use_cache else []
        held = list(table.blocks) if table else list(hits)
        start = len(table.tokens) if table else len(hits) * bs
        fresh = max(0, blocks_needed(start + n, bs) - len(held))
        cow = bool(table and start % bs and self.ref[table.blocks[-1]] > 1)
        revived = sum(1 for b in hits if self.ref[b] == 0)
        if fresh + int(cow) + revived > len(self.free) or len(token_ids) < start + n:
            return False
        if table is None:
            table = AbstractTable(root_key)
            self.tables[rid] = table
            for b in hits:
                if self.ref[b] == 0:
                    self.free.remove(b)
                self.ref[b] += 1
                table.blocks.append(b)
            table.tokens.extend(token_ids[: len(hits) * bs])
        if cow:
            src = table.blocks[-1]
            dst = self._pop_free()
            self.ref[dst] = 1
            self.ref[src] -= 1
            table.blocks[-1] = dst
        for _ in range(fresh):
            b = self._pop_free()
            self.ref[b] = 1
            table.blocks.append(b)
        table.tokens.extend(token_ids[start : start + n])
        if self.prefix_caching:
            self._cache_full_blocks(table, start // bs)
        return True

    def _cache_full_blocks(self, table: AbstractTable, first: int) -> None:
        """Index blocks ``first ..`` that are full now (blocks full earlier were judged then)."""
        bs = self.block_size
        keys = chain_keys(table.root_key, table.tokens, bs, len(table.tokens) // bs)
        for i in range(first, len(keys)):
            parent = keys[i - 1] if i else table.root_key
            b = table.blocks[i]
            if keys[i] not in self.cache and self.cached_block(b) is None:
                tokens = tuple(table.tokens[i * bs : (i + 1) * bs])
                self.cache[keys[i]] = CacheEntry(keys[i], b, parent, tokens)

    def fork(self, parent: str, child: str) -> bool:
        if parent not in self.tables or child in self.tables:
            return False
        p = self.tables[parent]
        self.tables[child] = AbstractTable(p.root_key, list(p.blocks), list(p.tokens))
        for b in p.blocks:
            self.ref[b] += 1
        return True

    def free_request(self, rid: str) -> bool:
        table = self.tables.pop(rid, None)
        if table is None:
            return False
        for b in reversed(table.blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free.append(b)
        return True

    def truncate(self, rid: str, keep: int) -> bool:
        """Keep the first ``keep`` tokens' K/V (a verification rejected the rest): the
        blocks past them are freed tail first, and every block holding a dropped token
        loses its cache entry."""
        table = self.tables.get(rid)
        if table is None or not 0 <= keep <= len(table.tokens):
            return False
        if keep == len(table.tokens):
            return True
        bs = self.block_size
        for b in table.blocks[keep // bs :]:
            e = self.cached_block(b)
            if e is not None:
                del self.cache[e.key]
        kept = blocks_needed(keep, bs)
        for b in reversed(table.blocks[kept:]):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free.append(b)
        del table.blocks[kept:]
        del table.tokens[keep:]
        return True

    def evict(self, count: int) -> int:
        victims = [b for b in self.free if self.cached_block(b) is not None][:count]
        for b in victims:
            e = self.cached_block(b)
            assert e is not None
            del self.cache[e.key]
        return len(victims)

    def snapshot(self) -> PoolSnapshot:
        return PoolSnapshot(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            ref_cnt=tuple(self.ref),
            free_queue=tuple(self.free),
            tables=tuple(
                TableSnapshot(rid, tuple(t.blocks), len(t.tokens), tuple(t.tokens), t.root_key)
                for rid, t in sorted(self.tables.items())
            ),
            cache_entries=tuple(sorted(self.cache.values(), key=lambda e: e.block_id)),
        )
