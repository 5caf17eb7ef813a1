"""KV adapters for the KV-level suite's own tests: one correct manager, many broken ones.

:class:`TinyKV` is a second *correct* block manager whose design choices differ from
refserve's pool (LIFO free stack instead of an LRU queue, optional prefix caching, eager
or lazy eviction, with or without a cache index in the snapshot): the suite must pass it
with zero findings, which shows it checks rules, not refserve's choices. Its ``bug``
switch and the subclasses of :class:`refserve.conformance.adapters.ref_kv.RefKVAdapter` below each
break exactly one thing, so a test can assert the invariant that catches it. Importable
as ``kv_broken_adapters:NAME`` with ``tests/conformance`` on ``sys.path``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from refserve.conformance.adapter import NotSupported
from refserve.conformance.adapters.ref_kv import RefKVAdapter
from refserve.conformance.kv.protocol import Allocation, KVConfig, KVFeature, NoSpace
from refserve.kv import BlockPool
from refserve.kv.prefix_index import Entry
from refserve.spec.arith import blocks_needed
from refserve.spec.hashing import Namespace, block_key
from refserve.spec.snapshot import CacheEntry, PoolSnapshot, TableSnapshot

BUGS = ("fork_no_incref", "double_free", "reserve_ahead", "no_cow", "dirty_refusal", "greedy_hit")


class TinyKV:
    """A small, plain, correct manager (unless ``bug`` is one of :data:`BUGS`)."""

    name = "tiny-kv"

    def __init__(
        self,
        *,
        lifo: bool = True,
        caching: bool = True,
        eager_evict: bool = False,
        expose_index: bool = True,
        bug: str = "",
    ) -> None:
        assert bug in ("", *BUGS), bug
        self.lifo = lifo
        self.caching = caching
        self.eager_evict = eager_evict
        self.expose_index = expose_index
        self.bug = bug
        self.configure(KVConfig(1, 1))

    @property
    def features(self) -> frozenset[KVFeature]:
        f = {KVFeature.FORK}
        if self.caching:
            f |= {KVFeature.PREFIX_CACHING, KVFeature.PREFIX_CACHING_OPTIONAL}
            if self.expose_index:
                f.add(KVFeature.CACHE_INDEX)
        return frozenset(f)

    def configure(self, config: KVConfig) -> None:
        self.bs = config.block_size
        self.num_blocks = config.num_blocks
        self.use_cache = self.caching and config.enable_prefix_caching
        self.free_list = list(range(config.num_blocks))
        self.ref = [0] * config.num_blocks
        self.tables: dict[str, tuple[list[int], list[int]]] = {}
        self.cache: dict[bytes, CacheEntry] = {}
        self.key_of: dict[int, bytes] = {}

    # ------------------------------------------------------------------ internals
    def _target(self, num_tokens: int) -> int:
        ahead = 1 if self.bug == "reserve_ahead" else 0
        return blocks_needed(num_tokens + ahead, self.bs)

    def _take_free(self) -> int:
        b = self.free_list.pop() if self.lifo else self.free_list.pop(0)
        self._uncache(b)  # lazy eviction: a cached block is forgotten when reused
        return b

    def _grab_all(self) -> list[int]:
        """The dirty_refusal bug: takes every free block before it gives up."""
        out = []
        while self.free_list:
            b = self._take_free()
            self.ref[b] = 1
            out.append(b)
        return out

    def _uncache(self, b: int) -> None:
        key = self.key_of.pop(b, None)
        if key is not None:
            del self.cache[key]

    def _hits(self, tokens: Sequence[int], limit: int) -> list[int]:
        if not self.use_cache:
            return []
        bs, out, parent = self.bs, [], b""
        for i in range(max(0, limit) // bs):
            key = block_key(parent, tokens[i * bs : (i + 1) * bs])
            e = self.cache.get(key)
            if e is None:
                break
            out.append(e.block_id)
            parent = key
        return out

    def _index(self, blocks: list[int], tokens: list[int]) -> None:
        bs, parent = self.bs, b""
        for i in range(len(tokens) // bs):
            toks = tuple(tokens[i * bs : (i + 1) * bs])
            key = block_key(parent, toks)
            b = blocks[i]
            if key not in self.cache and b not in self.key_of:
                self.cache[key] = CacheEntry(key, b, parent, toks)
                self.key_of[b] = key
            parent = key

    # ------------------------------------------------------------------ protocol
    def allocate(
        self, request_id: str, token_ids: Sequence[int], num_new_tokens: int
    ) -> Allocation:
        bs, n = self.bs, num_new_tokens
        copies: list[tuple[int, int]] = []
        hit = 0
        if request_id not in self.tables:
            # The hit must leave the n new tokens (and so the last one) to compute.
            limit = len(token_ids) if self.bug == "greedy_hit" else len(token_ids) - n
            hits = self._hits(token_ids, limit)
            for cand in (hits, []):
                revive = sum(1 for b in cand if self.ref[b] == 0)
                need = self._target(len(cand) * bs + n) - len(cand) + revive
                if need <= len(self.free_list):
                    break
            else:
                if self.bug == "dirty_refusal":
                    self.tables[request_id] = (self._grab_all(), [])
                raise NoSpace(f"{need} blocks needed, {len(self.free_list)} free")
            for b in cand:
                if self.ref[b] == 0:
                    self.free_list.remove(b)
                self.ref[b] += 1
            hit = len(cand) * bs
            blocks, tokens = list(cand), list(token_ids[:hit])
            self.tables[request_id] = (blocks, tokens)
        else:
            blocks, tokens = self.tables[request_id]
            start = len(tokens)
            cow = start % bs != 0 and self.ref[blocks[-1]] > 1 and self.bug != "no_cow"
            need = self._target(start + n) - len(blocks) + int(cow)
            if need > len(self.free_list):
                if self.bug == "dirty_refusal":
                    blocks.extend(self._grab_all())
                raise NoSpace(f"{need} blocks needed, {len(self.free_list)} free")
            if cow:
                src, dst = blocks[-1], self._take_free()
                self.ref[src] -= 1
                self.ref[dst] = 1
                blocks[-1] = dst
                copies.append((src, dst))
        start = len(tokens)
        while len(blocks) < self._target(start + n):
            b = self._take_free()
            self.ref[b] = 1
            blocks.append(b)
        tokens.extend(token_ids[start : start + n])
        if self.use_cache:
            self._index(blocks, tokens)
        return Allocation(tuple(blocks), hit, tuple(copies))

    def fork(self, parent: str, child: str) -> None:
        blocks, tokens = self.tables[parent]
        self.tables[child] = (list(blocks), list(tokens))
        if self.bug != "fork_no_incref":
            for b in blocks:
                self.ref[b] += 1

    def free(self, request_id: str) -> None:
        blocks, _ = self.tables.pop(request_id)
        for b in reversed(blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0 or self.bug == "double_free":
                self.free_list.append(b)
                if self.eager_evict:
                    self._uncache(b)

    def snapshot(self) -> PoolSnapshot:
        # Hand-out order: a LIFO stack hands out its end first.
        order = reversed(self.free_list) if self.lifo else iter(self.free_list)
        return PoolSnapshot(
            num_blocks=self.num_blocks,
            block_size=self.bs,
            ref_cnt=tuple(self.ref),
            free_queue=tuple(order),
            tables=tuple(
                TableSnapshot(rid, tuple(bl), len(tk), tuple(tk), b"")
                for rid, (bl, tk) in sorted(self.tables.items())
            ),
            cache_entries=tuple(self.cache.values()) if self.expose_index else (),
        )


# ---------------------------------------------------------- broken refserve adapters
class NoCopiesKV(RefKVAdapter):
    """Copy-on-write happens in the pool but the copies are not reported (BLOCK)."""

    def allocate(
        self, request_id: str, token_ids: Sequence[int], num_new_tokens: int
    ) -> Allocation:
        a = super().allocate(request_id, token_ids, num_new_tokens)
        return dataclasses.replace(a, copies=())


class _StalePool(BlockPool):
    def evict_reused(self, blocks: Sequence[int]) -> list[Entry]:
        return []  # reused without dropping their cache entries


class StaleCacheKV(RefKVAdapter):
    """A reused cached block keeps its old cache entry (PREFIX)."""

    def make_pool(self, config: KVConfig) -> BlockPool:
        return _StalePool(
            config.num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching
        )


class RefusesWithRoomKV(RefKVAdapter):
    """Keeps one block in reserve: refuses while the pool could serve (CAP)."""

    def allocate(
        self, request_id: str, token_ids: Sequence[int], num_new_tokens: int
    ) -> Allocation:
        if self.pool.num_free_blocks <= 1:
            raise NoSpace("keeping one block in reserve")
        return super().allocate(request_id, token_ids, num_new_tokens)


class HangingKV(RefKVAdapter):
    """allocate never returns (PROGRESS within the call timeout)."""

    def allocate(
        self, request_id: str, token_ids: Sequence[int], num_new_tokens: int
    ) -> Allocation:
        while True:
            pass


class SnapshotRaisesKV(RefKVAdapter):
    """snapshot raises once a block is in use (PROGRESS)."""

    def snapshot(self) -> PoolSnapshot:
        if self.pool.num_used_blocks:
            raise RuntimeError("snapshot lost its way")
        return super().snapshot()


class GarbageSnapshotKV(RefKVAdapter):
    """snapshot returns wrongly typed data once a block is in use (PROGRESS)."""

    def snapshot(self) -> PoolSnapshot:
        s = super().snapshot()
        if self.pool.num_used_blocks:
            return dataclasses.replace(s, ref_cnt=tuple(str(x) for x in s.ref_cnt))  # type: ignore[misc]
        return s


class NoneSnapshotKV(RefKVAdapter):
    """snapshot returns None once a block is in use (PROGRESS)."""

    def snapshot(self) -> PoolSnapshot:
        if self.pool.num_used_blocks:
            return None  # type: ignore[return-value]
        return super().snapshot()


class HugeTokenSnapshotKV(RefKVAdapter):
    """Cache entries list a token id no hash chain can pack: well-typed, but a checker
    fails on it (a finding, not a crash)."""

    def snapshot(self) -> PoolSnapshot:
        s = super().snapshot()
        entries = tuple(dataclasses.replace(e, token_ids=(2**70,)) for e in s.cache_entries)
        return dataclasses.replace(s, cache_entries=entries)


class UntaggedNamespaceKV(RefKVAdapter):
    """Keys a request by its salt and adapter joined into one untagged string, so an
    adapter named like a salt, or two splits of one string, share K/V (PREFIX)."""

    def set_namespace(self, request_id: str, namespace: Namespace) -> None:
        joined = namespace.cache_salt + namespace.adapter
        super().set_namespace(request_id, Namespace(cache_salt=joined))


class NamespaceIgnoredKV(RefKVAdapter):
    """Declares key domains and keys every request in the default one (PREFIX)."""

    def set_namespace(self, request_id: str, namespace: Namespace) -> None:
        pass


class NoSetNamespaceKV(TinyKV):
    """Declares key domains without the method that passes them (PROGRESS)."""

    @property
    def features(self) -> frozenset[KVFeature]:
        return super().features | {KVFeature.KEY_DOMAINS}


class BadFeaturesKV(RefKVAdapter):
    """Declares a feature the protocol does not have (PROGRESS in every scenario)."""

    @property
    def features(self) -> frozenset[KVFeature]:
        return frozenset({"fork", "teleport"})  # type: ignore[arg-type]


class RefusesConfigKV(RefKVAdapter):
    """Takes no configuration at all (every KV scenario not_supported)."""

    def configure(self, config: KVConfig) -> None:
        raise NotSupported("this manager only runs on a GPU")


# ------------------------------------------------------------------ zero-arg factories
def tiny_lifo() -> TinyKV:
    return TinyKV()


def tiny_no_caching() -> TinyKV:
    return TinyKV(caching=False)


def tiny_fifo_eager_no_index() -> TinyKV:
    return TinyKV(lifo=False, eager_evict=True, expose_index=False)


def fork_no_incref() -> TinyKV:
    return TinyKV(bug="fork_no_incref")


def double_free() -> TinyKV:
    return TinyKV(bug="double_free")


def reserve_ahead() -> TinyKV:
    return TinyKV(bug="reserve_ahead")


def no_cow() -> TinyKV:
    return TinyKV(bug="no_cow")


def dirty_refusal() -> TinyKV:
    return TinyKV(bug="dirty_refusal")


def greedy_hit() -> TinyKV:
    return TinyKV(bug="greedy_hit")
