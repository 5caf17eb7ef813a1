"""refserve's block pool as a KV adapter (``refserve.conformance.adapters.ref_kv:make_kv``).

It drives :class:`refserve.kv.pool.BlockPool` directly with every KV feature on, and must pass
the KV level (refserve.conformance.kv.machine) with zero findings. The pool takes a prefix hit
from :meth:`BlockPool.lookup` as an argument; the protocol leaves the hit to the
manager, so this adapter looks it up itself and trims it (module docstring of
refserve.conformance.kv.protocol): at most the full blocks before the ``num_new_tokens`` the
suite asked for, and a shorter one (down to none) when the pool cannot afford to revive
the cached blocks the longer one would take out of the free queue. A request's key
namespace (feature ``key_domains``) goes to the pool's lookup and first allocation, which
root its table's hash chain there.

``make_grouped`` is the grouped KV level's adapter (refserve.conformance.kv.groups) over
:class:`refserve.kv.groups.GroupedPool`: eager window freeing and prefix caching. On a
first allocation it looks up the hit complete in every group, at most the tokens before
the ``num_new_tokens`` asked for, and allocates without it when the hit's revived blocks
do not fit (the pool is unchanged by a refusal).
"""

from __future__ import annotations

from collections.abc import Sequence

from refserve.conformance.adapter import NotSupported
from refserve.conformance.kv.groups import GroupedAllocation, GroupedKVConfig
from refserve.conformance.kv.protocol import (
    ALL_KV_FEATURES,
    Allocation,
    KVConfig,
    KVFeature,
    NoSpace,
)
from refserve.errors import ExceedsCapacity, OutOfBlocks, RefserveError
from refserve.kv import BlockPool, PrefixHit, fork
from refserve.kv.groups import GroupedPool
from refserve.spec.groups import GroupedSnapshot
from refserve.spec.hashing import DEFAULT_NAMESPACE, Namespace
from refserve.spec.snapshot import PoolSnapshot


class RefKVAdapter:
    """refserve's :class:`BlockPool`, every KV feature on."""

    name = "refserve-kv"

    def __init__(self) -> None:
        self._pool: BlockPool | None = None
        self._namespaces: dict[str, Namespace] = {}

    @property
    def features(self) -> frozenset[KVFeature]:
        return ALL_KV_FEATURES

    @property
    def pool(self) -> BlockPool:
        if self._pool is None:
            raise NotSupported("configure() was not called")
        return self._pool

    def make_pool(self, config: KVConfig) -> BlockPool:
        """The pool for ``config`` (a hook for tests that break the pool on purpose)."""
        return BlockPool(
            config.num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
        )

    def configure(self, config: KVConfig) -> None:
        try:
            self._pool = self.make_pool(config)
        except RefserveError as e:
            raise NotSupported(str(e)) from e
        self._namespaces = {}

    def set_namespace(self, request_id: str, namespace: Namespace) -> None:
        self._namespaces[request_id] = namespace

    def allocate(
        self, request_id: str, token_ids: Sequence[int], num_new_tokens: int
    ) -> Allocation:
        pool = self.pool
        if pool.has_request(request_id):
            try:
                a = pool.allocate(request_id, token_ids, num_new_tokens)
            except (OutOfBlocks, ExceedsCapacity) as e:
                raise NoSpace(str(e)) from e
        else:
            namespace = self._namespaces.get(request_id, DEFAULT_NAMESPACE)
            hit = pool.lookup(token_ids, namespace)
            bs = pool.block_size
            # The hit may not push the KV length past the known tokens.
            most = max(0, (len(token_ids) - num_new_tokens) // bs)
            for k in range(min(len(hit.block_ids), most), -1, -1):
                trimmed = PrefixHit(hit.root_key, hit.block_ids[:k], hit.keys[:k], bs)
                try:
                    a = pool.allocate(
                        request_id, token_ids, num_new_tokens, hit=trimmed, namespace=namespace
                    )
                    break
                except (OutOfBlocks, ExceedsCapacity) as e:
                    # All-or-nothing: the pool is unchanged, so a shorter hit may fit.
                    if k == 0:
                        raise NoSpace(str(e)) from e
        return Allocation(
            pool.block_table(request_id),
            a.num_cached_tokens,
            tuple((c.src, c.dst) for c in a.copies),
        )

    def fork(self, parent: str, child: str) -> None:
        fork(self.pool, parent, child)

    def free(self, request_id: str) -> None:
        self.pool.free(request_id)
        self._namespaces.pop(request_id, None)

    def snapshot(self) -> PoolSnapshot:
        return self.pool.snapshot()


def make_kv() -> RefKVAdapter:
    """The ``MODULE:FACTORY`` entry point."""
    return RefKVAdapter()


class RefGroupedKVAdapter:
    """refserve's :class:`GroupedPool` (window blocks freed eagerly, prefix caching)."""

    name = "refserve-grouped-kv"

    def __init__(self) -> None:
        self._pool: GroupedPool | None = None

    @property
    def features(self) -> frozenset[KVFeature]:
        return frozenset({KVFeature.PREFIX_CACHING, KVFeature.WINDOW_EAGER_FREE})

    @property
    def pool(self) -> GroupedPool:
        if self._pool is None:
            raise NotSupported("configure() was not called")
        return self._pool

    def configure(self, config: GroupedKVConfig) -> None:
        try:
            self._pool = GroupedPool(
                config.num_blocks,
                config.block_size,
                config.groups,
                enable_prefix_caching=config.enable_prefix_caching,
            )
        except RefserveError as e:
            raise NotSupported(str(e)) from e

    def allocate(
        self, request_id: str, token_ids: Sequence[int], num_new_tokens: int
    ) -> GroupedAllocation:
        pool = self.pool
        try:
            if pool.has_request(request_id):
                a = pool.allocate(request_id, token_ids, num_new_tokens)
            else:
                hit = pool.lookup(token_ids, max_tokens=max(0, len(token_ids) - num_new_tokens))
                try:
                    a = pool.allocate(request_id, token_ids, num_new_tokens, hit=hit)
                except (OutOfBlocks, ExceedsCapacity):
                    if not hit.num_tokens:
                        raise
                    a = pool.allocate(request_id, token_ids, num_new_tokens)
        except (OutOfBlocks, ExceedsCapacity) as e:
            raise NoSpace(str(e)) from e
        return GroupedAllocation(pool.block_tables(request_id), a.num_cached_tokens)

    def free(self, request_id: str) -> None:
        self.pool.free(request_id)

    def snapshot(self) -> GroupedSnapshot:
        return self.pool.grouped_snapshot()


def make_grouped() -> RefGroupedKVAdapter:
    """The grouped ``MODULE:FACTORY`` entry point."""
    return RefGroupedKVAdapter()
