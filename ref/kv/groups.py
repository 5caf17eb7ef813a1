"""A hybrid model's KV memory: one block table per request per layer group, one pool.

spec/groups.py states the model and the rules: a group is full attention or a sliding
window of ``W`` tokens (the query at ``p`` reads keys ``p - W < k <= p``); a window
group needs, for a request about to compute ``[L, L + n)``, only the blocks covering
``[window_start(L, W), L + n)``, and its table keeps the places of the blocks before
them as :data:`~refserve.spec.groups.NULL_BLOCK`.

:class:`GroupedPool` is one :class:`~refserve.kv.pool.BlockPool` per group, made by
``BlockPool.sharing``: one allocator (reference counts, the LRU free queue), one prefix
index and one journal serve every group, and each group's pool keeps its own tables.
Allocation, copy-on-write, caching, lookup of a full group and free are the pool's own
code; this attachment orders the groups' calls, makes them one transaction and adds
what a window needs:

* **Keys per group.** Group ``g`` roots its hash chains in its own namespace
  (:func:`group_namespace`): one index, and no group ever serves another's K/V (a
  block's K/V is its group's layers'). One index, not one per group, because a block
  taken from the free queue by any group must lose its cache entry whichever group
  indexed it (PREFIX); the pool's eviction does that in the one index it knows.
* **Window freeing, eager.** Before an allocation a window group releases the request's
  blocks wholly before ``window_start(L, W)`` (:func:`_release_before`, journaled), as
  vLLM does; a released block keeps its cache entry until it is reused.
* **Hits complete in every group.** :meth:`GroupedPool.lookup` takes the longest prefix
  of whole blocks, the same in every group, whose blocks each group's next query reads
  are all cached: a full group's whole prefix (the pool's lookup), a window group's
  last blocks, the ones before them skipped (``PrefixHit.num_skipped``). A miss does not
  end a window group's chain, so its keys are read past misses
  (``PrefixIndex.served``).
* **All or nothing.** :meth:`GroupedPool.allocate` counts what every group needs from the
  shared pool (the blocks the window release frees counted as room) before it changes
  anything: :class:`~refserve.errors.OutOfBlocks` or
  :class:`~refserve.errors.ExceedsCapacity` leave every group as it was, inside a step's
  transaction too. The groups' changes then join one transaction (opened here unless the
  caller's :meth:`GroupedPool.begin` has one open). A hit's blocks are held in every
  group before any group takes a free block, so no group's new block evicts another
  group's hit.

* **Compressed groups.** A compressed group's pool (``BlockPool.sharing`` with
  ``ratio`` times the tokens per block) grows like a full group's at a fraction of the
  blocks. It caches nothing (the one index keys blocks of ``block_size`` tokens), so a
  layout with one takes no prefix hits.

* **Swaps.** A swap to the host (ref/kv/host_pool.py) moves, in every group, the blocks
  the request's next query reads (:meth:`GroupedPool.held_blocks`: spec/groups.py
  ``held_places``), and :meth:`GroupedPool.restore` builds every group's table back as
  if the request had computed its tokens, all or nothing. Admission counts a swap-in
  with a :class:`Restored`: the KV it brings back is held like a prefix hit's.

The scheduler reads one table per request: this pool is the first group's (a full
group's), whose tables give the positions and slots, and its allocation, lookup and
free act on every group; forks (ref/kv/forks.py) share every group's blocks, and a
truncation of rejected drafts (ref/kv/truncation.py) cuts every group's table. The
bulk decode path and K/V transfer by migration still move one table: a grouped
scheduler takes the reference decode path and migrates by recompute.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from refserve.errors import (
    DuplicateRequest,
    ExceedsCapacity,
    InvalidArgument,
    OutOfBlocks,
    UnknownRequest,
)
from refserve.kv.pool import Allocation, BlockPool, require_int
from refserve.kv.prefix_index import PrefixHit
from refserve.kv.tables import BlockTable
from refserve.spec.arith import full_blocks, logical_block, max_cacheable_tokens
from refserve.spec.groups import (
    NULL_BLOCK,
    GroupedSnapshot,
    GroupKind,
    GroupTable,
    KVGroup,
    held_places,
    layout_blocks,
)
from refserve.spec.groups import window_start as spec_window_start
from refserve.spec.hashing import DEFAULT_NAMESPACE, Namespace, block_key
from refserve.spec.snapshot import PoolSnapshot

__all__ = [
    "GroupAllocations",
    "GroupBlocks",
    "GroupedHit",
    "GroupedPool",
    "Restored",
    "group_namespace",
]


def group_namespace(namespace: Namespace, group: int) -> Namespace:
    """The namespace of ``group``'s keys for a request in ``namespace``: the request's
    own for the first group (a router's keys), one only a grouped pool makes for the
    others (``Namespace.layer_group``), so two groups' keys never meet and no request's
    namespace, whatever its salt, reaches another group's."""
    return replace(namespace, layer_group=group) if group else namespace


@dataclass(frozen=True)
class GroupedHit(PrefixHit):
    """A prefix hit of ``num_tokens`` tokens taken in every group: ``hits[g]`` is group
    ``g``'s (a window group's skips the blocks before its window). Its own fields are
    the first (full) group's, so the scheduler reads it as that group's hit."""

    hits: tuple[PrefixHit, ...] = ()

    @classmethod
    def of(cls, hits: Sequence[PrefixHit]) -> GroupedHit:
        """The grouped hit of each group's ``hits`` (the first group's fields its own)."""
        if not hits:
            raise InvalidArgument("a grouped prefix hit needs one hit per group, got none")
        f = hits[0]
        return cls(f.root_key, f.block_ids, f.keys, f.block_size, f.num_skipped, tuple(hits))


@dataclass(frozen=True)
class GroupAllocations(Allocation):
    """What :meth:`GroupedPool.allocate` did: the first group's allocation, with every
    group's copy-on-write copies, and each group's allocation in ``groups``."""

    groups: tuple[Allocation, ...] = ()


@dataclass(frozen=True)
class GroupBlocks:
    """Blocks of one layer group's table: places (logical blocks) ``first``,
    ``first + 1``, ... of group ``group`` are ``block_ids`` (a swap's record of which
    block is which, ref/kv/host_pool.py)."""

    group: int
    first: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class Restored(PrefixHit):
    """Not a cache hit: a swapped request's KV of ``num_stored`` tokens coming back from
    the host (:meth:`GroupedPool.restore`), as admission counts it. Like a hit, it is
    KV the request holds without computing it: the tokens after it are the new ones,
    and its blocks (every group's at ``num_stored``) come from the free queue.
    :meth:`GroupedPool.blocks_to_allocate` and :meth:`GroupedPool.can_allocate` take
    it; :meth:`GroupedPool.allocate` refuses it."""

    num_stored: int = 0

    @classmethod
    def of(cls, num_stored: int, block_size: int) -> Restored:
        return cls(b"", (), (), block_size, 0, num_stored)

    @property
    def num_tokens(self) -> int:
        return self.num_stored


@dataclass(frozen=True)
class _Chain:
    """A window group's chain keys of a prompt's full blocks and the block serving each
    from the cache now (None: a miss)."""

    root_key: bytes
    keys: tuple[bytes, ...]
    block_ids: tuple[int | None, ...]


class GroupedPool(BlockPool):
    """``num_blocks`` blocks of ``block_size`` slots shared by the layer ``groups``.

    It is the first group's pool (a full group): a scheduler that reads one table per
    request reads that group's, and its allocation, lookup and free act on every group.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        groups: Sequence[KVGroup],
        *,
        enable_prefix_caching: bool = True,
        cache_events: bool = False,
    ) -> None:
        checked = _checked_groups(groups)
        super().__init__(
            num_blocks,
            block_size,
            enable_prefix_caching=enable_prefix_caching,
            cache_events=cache_events,
        )
        self.groups = checked
        self._pools: tuple[BlockPool, ...] = (
            self,
            *(self.sharing(g.tokens_per_block(block_size)) for g in checked[1:]),
        )
        self._windows = tuple(g.window for g in checked)  # 0: full attention
        # Namespace.root_key() hashes; nearly every request has the default namespace.
        self._default = tuple(group_namespace(DEFAULT_NAMESPACE, g) for g in range(len(groups)))

    # ------------------------------------------------------------------ queries
    @property
    def pools(self) -> tuple[BlockPool, ...]:
        """Each group's pool (its tables), in group order; read them, do not allocate in
        one alone (the groups of a request would disagree)."""
        return self._pools

    def block_tables(self, request_id: str) -> tuple[tuple[int, ...], ...]:
        """The request's table in each group (a window's null places included)."""
        return tuple(BlockPool.block_table(p, request_id) for p in self._pools)

    def num_table_blocks(self, request_id: str) -> int:
        """The blocks the request's tables hold now, over every group (a window's
        released places not counted): what freeing it returns, less shared blocks."""
        return sum(BlockPool.num_table_blocks(p, request_id) for p in self._pools)

    def group_table_views(self, group: int, request_ids: Sequence[str]) -> list[Sequence[int]]:
        """Live tables of several requests in ``group`` (read-only by convention)."""
        return BlockPool.block_table_views(self._pools[group], request_ids)

    def first_read_block(self, group: int, num_tokens: int) -> int:
        """The first logical block the query at ``num_tokens`` reads in ``group``: 0 with
        full attention, the block holding ``window_start(num_tokens, W)`` in a window."""
        window = self._windows[group]
        if not window:
            return 0
        return logical_block(spec_window_start(num_tokens, window), self.block_size)

    def held_blocks(self, request_id: str) -> tuple[GroupBlocks, ...]:
        """The request's blocks its next query reads, in every group (spec/groups.py
        ``held_places`` at its KV length): what a swap-out moves. A window group's
        blocks before them, if its table still holds some, are not among them."""
        stored = self.tables.table(request_id, "held_blocks").num_stored
        out: list[GroupBlocks] = []
        for g, pool in enumerate(self._pools):
            places = held_places(self.groups[g], stored, self.block_size)
            blocks = tuple(BlockPool.block_table_view(pool, request_id)[places.start : places.stop])
            assert NULL_BLOCK not in blocks, f"{request_id!r} lost a block group {g} reads"
            out.append(GroupBlocks(g, places.start, blocks))
        return tuple(out)

    def _group_namespaces(self, namespace: Namespace) -> tuple[Namespace, ...]:
        if namespace is DEFAULT_NAMESPACE:
            return self._default
        return tuple(group_namespace(namespace, g) for g in range(len(self.groups)))

    # ------------------------------------------------------------------- lookup
    def lookup(
        self,
        token_ids: Sequence[int],
        namespace: Namespace = DEFAULT_NAMESPACE,
        *,
        max_tokens: int | None = None,
    ) -> GroupedHit:
        """The longest prefix of whole blocks, at most ``max_tokens`` and never the last
        token, that every group can serve: all its blocks in a full group, those its
        next query reads in a window group (the module doc). Empty with caching off."""
        if len(token_ids) < 1:
            raise InvalidArgument("lookup: token_ids is empty; a request needs at least one token")
        bs = self.block_size
        most = max_cacheable_tokens(len(token_ids), bs)
        if max_tokens is not None:
            require_int(max_tokens, "max_tokens", minimum=0)
            most = min(most, max_tokens)
        k = full_blocks(most, bs) if self.enable_prefix_caching else 0
        spaces = self._group_namespaces(namespace)
        found: list[PrefixHit | _Chain | None] = [None] * len(self._pools)
        for g, pool in enumerate(self._pools):
            if not self._windows[g]:  # a full group's hit ends at its first miss
                full = found[g] = BlockPool.lookup(pool, token_ids[: k * bs + 1], spaces[g])
                k = min(k, len(full.block_ids))
        for g, pool in enumerate(self._pools):
            if self._windows[g]:  # read past misses, as far as every full group goes
                root = pool.prefix_index.root_key(spaces[g])
                found[g] = _chain(pool, token_ids, k, root)
        return self._hit(found, m=next((m for m in range(k, 0, -1) if self._complete(found, m)), 0))

    def _hit(self, found: Sequence[PrefixHit | _Chain | None], m: int) -> GroupedHit:
        """Each group's hit of ``m`` blocks from what :meth:`lookup` found."""
        bs = self.block_size
        hits: list[PrefixHit] = []
        for g, f in enumerate(found):
            assert f is not None, "lookup found every group's chain"
            if isinstance(f, PrefixHit):
                hits.append(PrefixHit(f.root_key, f.block_ids[:m], f.keys[:m], bs))
            else:
                skip = self.first_read_block(g, m * bs)
                held = tuple(b for b in f.block_ids[skip:m] if b is not None)
                hits.append(PrefixHit(f.root_key, held, f.keys[:m], bs, skip))
        return GroupedHit.of(hits)

    def _complete(self, found: Sequence[PrefixHit | _Chain | None], m: int) -> bool:
        """Every window group has the blocks its query at ``m`` blocks reads cached (a
        full group's found prefix is at least ``m`` blocks long)."""
        bs = self.block_size
        return all(
            None not in f.block_ids[self.first_read_block(g, m * bs) : m]
            for g, f in enumerate(found)
            if isinstance(f, _Chain)
        )

    # ------------------------------------------------------------ transactions
    # One journal records every group's changes: the pool's begin and commit span them.
    def rollback(self) -> None:
        super().rollback()
        for pool in self._pools[1:]:
            pool.tables.mark_all_changed()

    # ---------------------------------------------------------------- allocate
    def allocate(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_new_tokens: int,
        *,
        hit: PrefixHit | None = None,
        namespace: Namespace = DEFAULT_NAMESPACE,
    ) -> GroupAllocations:
        """Reserve positions ``[L, L + num_new_tokens)`` in every group (``L``: the KV
        length, or a new request's ``hit``), after each window group released the
        request's blocks wholly before its window. All or nothing (the module doc)."""
        hit = _grouped(hit, request_id)
        spaces = self._group_namespaces(namespace)
        start = self._check_groups(request_id, token_ids, num_new_tokens, hit, spaces)
        hits = hit.hits if hit is not None else (None,) * len(self._pools)
        opened = not self.in_transaction
        if opened:
            self.begin()
        try:
            done = self._allocate_groups(request_id, token_ids, num_new_tokens, hits, spaces, start)
        except BaseException:
            if opened:
                self.rollback()
            raise
        if opened:
            self.commit()
        first = done[0]
        copies = tuple(c for a in done for c in a.copies)
        return GroupAllocations(
            request_id,
            first.start_position,
            first.num_new_tokens,
            first.num_cached_tokens,
            first.new_block_ids,
            copies,
            done,
        )

    def _allocate_groups(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_new_tokens: int,
        hits: Sequence[PrefixHit | None],
        spaces: Sequence[Namespace],
        start: int,
    ) -> tuple[Allocation, ...]:
        """:meth:`allocate`'s changes, inside its transaction, every check passed."""
        pools = self._pools
        for g, pool in enumerate(pools):
            if self._windows[g] and pool.has_request(request_id):
                _release_before(pool, request_id, self.first_read_block(g, start))
        allocator = pools[0].allocator
        pinned = [b for h in hits if h is not None for b in h.block_ids]
        for b in pinned:  # no group's new block may evict another group's hit
            allocator.hold(b)
        # The first group is this pool: its own allocation is the plain pool's.
        own = super().allocate
        done = tuple(
            (own if p is self else p.allocate)(
                request_id, token_ids, num_new_tokens, hit=h, namespace=ns
            )
            for p, h, ns in zip(pools, hits, spaces, strict=True)
        )
        if pinned:
            allocator.release(pinned)
        return done

    def _check_groups(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_new_tokens: int,
        hit: GroupedHit | None,
        spaces: Sequence[Namespace],
    ) -> int:
        """:meth:`allocate`'s checks, nothing changed: the first position, or a typed
        error naming what is wrong (a bad argument, no room now, never room)."""
        require_int(num_new_tokens, "num_new_tokens", minimum=1)
        known = self.has_request(request_id)
        if hit is not None:
            if known:
                raise InvalidArgument(
                    f"allocate: request {request_id!r} already holds blocks; "
                    "a prefix hit applies only to a new request"
                )
            self._check_hit(request_id, token_ids, hit, spaces)
        start = self._pools[0].tables.table(request_id, "allocate").num_stored if known else 0
        start = hit.num_tokens if hit is not None else start
        end = start + num_new_tokens
        if len(token_ids) < end:
            raise InvalidArgument(
                f"allocate: request {request_id!r} asks for positions up to {end} but only "
                f"{len(token_ids)} token ids are known"
            )
        # What every group holds after the call (window groups: from their window on).
        held = layout_blocks(self.groups, start, num_new_tokens, self.block_size)
        if held > self.num_blocks:
            raise ExceedsCapacity(request_id, held, self.num_blocks)
        needed, freed = self._needs(request_id, num_new_tokens, hit)
        room = self.num_free_blocks + freed
        if needed > room:
            raise OutOfBlocks(request_id, needed, room)
        return start

    def blocks_to_allocate(
        self, request_id: str, num_new_tokens: int, hit: PrefixHit | None = None
    ) -> int:
        """Free blocks :meth:`allocate` would consume in all: each group's new,
        copy-on-write and revived blocks, less the blocks the window release before it
        returns (negative when the release returns more)."""
        if isinstance(hit, Restored):
            _require_new(self, request_id, "blocks_to_allocate")
            return layout_blocks(self.groups, hit.num_stored, num_new_tokens, self.block_size)
        needed, freed = self._needs(request_id, num_new_tokens, _grouped(hit, request_id))
        return needed - freed

    def _needs(
        self, request_id: str, num_new_tokens: int, hit: GroupedHit | None
    ) -> tuple[int, int]:
        """The free blocks every group's allocation takes, and those the window release
        before it returns."""
        if hit is not None and len(hit.hits) != len(self._pools):
            raise InvalidArgument(
                f"blocks_to_allocate: prefix hit for {request_id!r} has {len(hit.hits)} "
                f"groups, the pool {len(self._pools)}"
            )
        hits = hit.hits if hit is not None else (None,) * len(self._pools)
        needed = sum(
            BlockPool.blocks_to_allocate(p, request_id, num_new_tokens, h)
            for p, h in zip(self._pools, hits, strict=True)
        )
        table = self.tables.get(request_id)
        if table is None:
            return needed, 0
        return needed, self._freed_by_release(request_id, table.num_stored)

    def can_allocate(
        self, request_id: str, num_new_tokens: int, hit: PrefixHit | None = None
    ) -> bool:
        """:meth:`allocate` would succeed now: the blocks are free and the groups hold
        no more than the pool after it (with a :class:`Restored`: :meth:`restore`, then
        ``num_new_tokens`` more)."""
        table = self.tables.get(request_id)
        start = table.num_stored if table is not None else (hit.num_tokens if hit else 0)
        held = layout_blocks(self.groups, start, num_new_tokens, self.block_size)
        if held > self.num_blocks:
            return False
        return self.blocks_to_allocate(request_id, num_new_tokens, hit) <= self.num_free_blocks

    def _check_hit(
        self,
        request_id: str,
        token_ids: Sequence[int],
        hit: GroupedHit,
        spaces: Sequence[Namespace],
    ) -> None:
        """A grouped hit names one hit per group, of one length, each skipping only
        blocks its group's query does not read, with the skipped keys of ``token_ids``
        (no cache entry confirms them), and each valid now (``PrefixIndex.check_hit``)."""
        if len(hit.hits) != len(self._pools):
            raise InvalidArgument(
                f"allocate: prefix hit for {request_id!r} has {len(hit.hits)} groups, "
                f"the pool {len(self._pools)}"
            )
        lengths = sorted({h.num_tokens for h in hit.hits} | {hit.num_tokens})
        if len(lengths) > 1:
            raise InvalidArgument(
                f"allocate: prefix hit for {request_id!r} covers different lengths in its "
                f"groups: {lengths}"
            )
        for g, (pool, h, ns) in enumerate(zip(self._pools, hit.hits, spaces, strict=True)):
            first = self.first_read_block(g, h.num_tokens)
            if not 0 <= h.num_skipped <= min(first, len(h.keys)):
                raise InvalidArgument(
                    f"allocate: prefix hit for {request_id!r} skips {h.num_skipped} blocks in "
                    f"group {g}, whose query at {h.num_tokens} reads from block {first}"
                )
            skipped = _keys(h.root_key, token_ids, h.num_skipped, self.block_size)
            if h.keys[: h.num_skipped] != tuple(skipped):
                raise InvalidArgument(
                    f"allocate: prefix hit for {request_id!r} does not match its token ids "
                    f"in group {g}'s skipped blocks"
                )
            pool.prefix_index.check_hit(request_id, h, token_ids, pool.prefix_index.root_key(ns))

    def _freed_by_release(self, request_id: str, num_stored: int) -> int:
        """Blocks the window release before an allocation at ``num_stored`` returns to
        the free queue: the request's window blocks before its window that no other
        table holds."""
        freed = 0
        for g, pool in enumerate(self._pools):
            if self._windows[g]:
                table = pool.block_table_view(request_id)
                before = table[: self.first_read_block(g, num_stored)]
                freed += sum(1 for b in before if b != NULL_BLOCK and pool.ref_count(b) == 1)
        return freed

    # ----------------------------------------------------------------- restore
    def restore(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_stored: int,
        *,
        namespace: Namespace = DEFAULT_NAMESPACE,
    ) -> tuple[GroupBlocks, ...]:
        """A swapped request's tables back, as if it had just computed its first
        ``num_stored`` tokens: in every group, fresh blocks at the places its next query
        reads (spec/groups.py ``held_places``), a window group's earlier places null.
        Its full blocks are cached as a computed request's are (the swap-in copies write
        them before the step's forward). All or nothing, one transaction (the caller's
        when one is open). Each group's new blocks: the swap-in copies' destinations."""
        require_int(num_stored, "num_stored", minimum=1)
        if self.has_request(request_id):
            raise DuplicateRequest(request_id, "restore")
        if len(token_ids) < num_stored:
            raise InvalidArgument(
                f"restore: request {request_id!r} has {len(token_ids)} token ids for "
                f"{num_stored} stored positions"
            )
        need = layout_blocks(self.groups, num_stored, 0, self.block_size)
        if need > self.num_blocks:
            raise ExceedsCapacity(request_id, need, self.num_blocks)
        if need > self.num_free_blocks:
            raise OutOfBlocks(request_id, need, self.num_free_blocks)
        tokens = list(token_ids[:num_stored])
        spaces = self._group_namespaces(namespace)
        opened = not self.in_transaction
        if opened:
            self.begin()
        try:
            done = tuple(
                self._restore_group(g, request_id, tokens, spaces[g])
                for g in range(len(self._pools))
            )
        except BaseException:
            if opened:
                self.rollback()
            raise
        if opened:
            self.commit()
        return done

    def _restore_group(
        self, group: int, request_id: str, tokens: list[int], namespace: Namespace
    ) -> GroupBlocks:
        """:meth:`restore` in one group, inside its transaction (the table's insertion,
        the blocks taken and the keys indexed are journaled)."""
        pool = self._pools[group]
        places = held_places(self.groups[group], len(tokens), self.block_size)
        root = pool.prefix_index.root_key(namespace)
        table = pool.tables.add(request_id, root)
        table.block_table.extend([NULL_BLOCK] * places.start)
        if pool.enable_prefix_caching:  # the chain runs through the null places' keys
            table.keys.extend(_keys(root, tokens, places.start, self.block_size))
        blocks = pool.acquire(len(places))
        table.block_table.extend(blocks)
        table.token_ids.extend(tokens)
        if pool.enable_prefix_caching:
            pool.prefix_index.cache_full_blocks(table)
        return GroupBlocks(group, places.start, tuple(blocks))

    # -------------------------------------------------------------------- free
    def free(self, request_id: str) -> None:
        """Release the request's blocks in every group (one transaction)."""
        if not self.has_request(request_id):
            raise UnknownRequest(request_id, "free")
        opened = not self.in_transaction
        if opened:
            self.begin()
        try:
            for pool in self._pools:
                BlockPool.free(pool, request_id)
        except BaseException:
            if opened:
                self.rollback()
            raise
        if opened:
            self.commit()

    # ---------------------------------------------------------------- snapshot
    def snapshot(self) -> PoolSnapshot:
        """The pool as an engine's step checks see it: every group's tables in one pool
        (:meth:`refserve.spec.groups.GroupedSnapshot.engine_pool`)."""
        return self.grouped_snapshot().engine_pool()

    def grouped_snapshot(self) -> GroupedSnapshot:
        """The groups as spec sees them (refserve.spec.groups.check_groups): the shared
        pool (its own ``tables`` empty) and each group's tables."""
        snaps = [BlockPool.snapshot(p) for p in self._pools]
        tables = tuple(GroupTable(g, t) for g, s in enumerate(snaps) for t in s.tables)
        return GroupedSnapshot(self.groups, replace(snaps[0], tables=()), tables)


def _keys(root: bytes, token_ids: Sequence[int], num_blocks: int, block_size: int) -> list[bytes]:
    """The chain keys of the first ``num_blocks`` full blocks of ``token_ids``."""
    keys: list[bytes] = []
    parent = root
    for i in range(num_blocks):
        parent = block_key(parent, tuple(token_ids[i * block_size : (i + 1) * block_size]))
        keys.append(parent)
    return keys


def _chain(pool: BlockPool, token_ids: Sequence[int], num_blocks: int, root: bytes) -> _Chain:
    """A window group's chain of ``num_blocks`` full blocks, read past misses."""
    bs = pool.block_size
    keys = _keys(root, token_ids, num_blocks, bs)
    index = pool.prefix_index
    blocks = tuple(
        index.served(key, keys[i - 1] if i else root, tuple(token_ids[i * bs : (i + 1) * bs]))
        for i, key in enumerate(keys)
    )
    return _Chain(root, tuple(keys), blocks)


def _release_before(pool: BlockPool, request_id: str, end: int) -> None:
    """A window group: put ``NULL_BLOCK`` in place of the request's blocks before
    logical block ``end`` and release them, last first (as ``BlockPool.free``); they
    keep their cache entries until reused. The null places are always a table's first
    ones, so the walk goes down from ``end`` and stops at the first null: it costs the
    blocks released, not the table's length. Journaled (the caller's transaction)."""
    table = pool.tables.table(request_id, "allocate")
    blocks = table.block_table
    i = min(end, len(blocks))
    dropped: list[int] = []
    while i > 0 and blocks[i - 1] != NULL_BLOCK:
        i -= 1
        dropped.append(blocks[i])
        blocks[i] = NULL_BLOCK
    if dropped:
        pool.journal.record(_restore, table, i, dropped[::-1])
        pool.tables.mark_changed(request_id)
        pool.allocator.release(dropped)


def _restore(table: BlockTable, start: int, old: list[int]) -> None:
    # Undo of _release_before: the released blocks back in their places.
    table.block_table[start : start + len(old)] = old


def _require_new(pool: GroupedPool, request_id: str, what: str) -> None:
    """A swapped request's restore is counted only while it holds no blocks."""
    if pool.has_request(request_id):
        raise InvalidArgument(
            f"{what}: request {request_id!r} already holds blocks; a restore from the host "
            "applies only to a request that holds none"
        )


def _grouped(hit: PrefixHit | None, request_id: str) -> GroupedHit | None:
    """A hit given to the grouped pool is one of its own lookups (every group's)."""
    if hit is None or isinstance(hit, GroupedHit):
        return hit
    if isinstance(hit, Restored):
        raise InvalidArgument(
            f"allocate: request {request_id!r} comes back from the host: GroupedPool.restore "
            "takes it, not allocate"
        )
    raise InvalidArgument(
        f"allocate: prefix hit for {request_id!r} is one group's; a grouped pool takes "
        "the GroupedHit of its own lookup"
    )


def _checked_groups(groups: Sequence[KVGroup]) -> tuple[KVGroup, ...]:
    """The layout as a tuple, or :class:`InvalidArgument` naming what is wrong."""
    out = tuple(groups)
    if not out:
        raise InvalidArgument("groups: a grouped pool needs at least one layer group")
    for i, g in enumerate(out):
        if not isinstance(g, KVGroup):
            raise InvalidArgument(f"groups[{i}] must be a KVGroup, got {type(g).__name__} {g!r}")
        if g.kind is GroupKind.WINDOW and not (type(g.window) is int and g.window >= 1):
            raise InvalidArgument(
                f"groups[{i}]: a window group needs a window >= 1, got {g.window!r}"
            )
        if g.kind is not GroupKind.WINDOW and g.window:
            raise InvalidArgument(f"groups[{i}]: a {g.kind} group has no window, got {g.window!r}")
    if out[0].kind is not GroupKind.FULL:
        raise InvalidArgument(
            f"groups[0] must be a full group (the table a scheduler reads), got {out[0]!r}"
        )
    return out
