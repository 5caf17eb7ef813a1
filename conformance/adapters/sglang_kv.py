"""SGLang 0.5.23's radix prefix cache as a KV adapter; optional.

Factory: ``refserve.conformance.adapters.sglang_kv:make_kv``.

Install and run: ``make conformance-sglang`` (its own virtualenv ``.venv-sglang``, never
refserve's). The adapter drives SGLang's real ``RadixCache``
(``sglang.srt.mem_cache.radix_cache``), its token-to-KV allocator
(``TokenToKVPoolAllocator`` for block size 1, ``PagedTokenToKVPoolAllocator`` otherwise,
device ``"cpu"``, CPU tensors, no KV buffers) and its ``ReqToTokenPool``, in-process,
without a model or a GPU. It calls what SGLang's scheduler calls around the cache, in the
scheduler's order, and translates; nothing of SGLang is copied, patched or fixed.

How SGLang's state maps onto the protocol:

* **Pages are blocks.** ``page_size`` is the block size. SGLang's allocators keep page 0
  (slots ``0 .. page_size - 1``) as the padding target of dummy writes and hand out
  pages ``1 .. num_blocks``; SGLang page ``p`` is reported as block ``p - 1`` (slot ``s``
  as ``s - page_size``), a consistent relabelling like the vLLM adapter's null block.
* **Tables** are the request's ``req_to_token`` row, ``[0, num_stored)``, read as pages:
  what SGLang's attention reads. **Reference counts**: SGLang keeps none per page. A
  page's count is the number of live requests whose row holds it; the radix tree's own
  hold (``TreeNode.lock_ref``) is per node, and a node is locked exactly while a live
  request's row covers it, so the two agree.
* **Free blocks** are the allocator's free pages (``get_all_free_pages()``, hand-out
  order) followed by the pages of the tree's evictable nodes (``lock_ref == 0``): cached
  but held by no request, the protocol's "free, still indexed". A page that two tree
  nodes claim is listed once (the blocks are the truth). ``stated_free`` is SGLang's own
  figure, the one its scheduler admits by and its idle check compares with the pool:
  ``(allocator.available_size() + tree_cache.evictable_size()) // page_size``.
* **Lock references.** ``inc_lock_ref`` / ``dec_lock_ref`` (through
  ``BasePrefixCache.lock`` / ``unlock``) move a node's tokens between
  ``evictable_size_`` and ``protected_size_``; a request holds one lock, on the last node
  of its matched or checkpointed prefix (``req.lock``).
* **A prefix hit** is ``RadixCache.match_prefix`` with the key capped by SGLang's own
  ``RadixKey.limit`` at ``len(token_ids) - num_new_tokens`` (the protocol's bound: the
  suite, playing the scheduler, picks the new tokens before it knows the hit). The hit
  is page-aligned; the request locks its last node and its row starts with the path's
  pages (``path_device_indices``), as ``alloc_for_extend`` writes them.
* **Allocation** is SGLang's: ``alloc_paged_token_slots_extend`` (``alloc_token_slots``
  for page size 1) for a first allocation and for a chunk of more than one token,
  ``alloc_paged_token_slots_decode`` for one token of a running request. Both evict
  first (``evict_from_tree_cache``: ``RadixCache.evict`` of unlocked leaves, LRU, when
  the allocator is short) and then write the row (``write_cache_indices`` /
  ``req_to_token_pool.write``). Before touching anything the adapter makes the check
  SGLang's scheduler makes before it schedules (``PrefillAdder``: the pages needed
  against ``available_size() + evictable_size()`` after locking the prefix); when it
  fails the call is ``NoSpace`` and nothing changed (a failed ``alloc_extend`` inside
  SGLang raises "Prefill out of memory", which would stop its scheduler). When the
  longest hit does not fit but a miss would (locking cached pages takes them from the
  evictable count), the adapter matches again with the cap at zero: the shorter hit the
  protocol allows; SGLang's scheduler would leave the request waiting instead.
* **Checkpoints.** After an extend forward SGLang checkpoints the running request
  (``checkpoint_kv_cache`` -> ``RadixCache.checkpoint(req, up_to=req.extend_end)``): the
  KV computed so far enters the tree, the row is repointed onto the tree's pages (a
  duplicate page is freed), and the lock moves to the new last node. Here the forward is
  the suite's write, which follows ``allocate``; the checkpoint runs at the start of the
  next adapter call, before anything else, as SGLang processes a batch's result before it
  schedules the next. Decode steps are not checkpointed (nor are they in SGLang).
* **free** is what ``release_kv_cache(req, tree_cache, checkpoint=True)`` does for a
  finished request: ``checkpoint(req, up_to=owned_kv_len)``, then ``free_kv_row`` of
  ``[cache_protected_len, owned_kv_len)`` (the partial last page the tree does not key),
  ``unlock(req.lock)`` and ``req_to_token_pool.free``. The adapter performs those calls
  itself because ``release_kv_cache`` first reads SGLang's published server config
  (``get_spec()``), which only a launched server has; with no speculative decoding and no
  over-allocation its other step (``_release_overallocated_kv_indices``) frees nothing.
* **The request record.** SGLang's ``Req`` pulls in the whole serving stack (OpenAI
  protocol types, grammar backends). The cache reads a handful of its fields, so the
  adapter passes :class:`_Req`, a record with those fields, as SGLang's own regression
  test of this cache does (``_MockDllmReq``, "Minimal Req carrying only what
  cache_unfinished_req touches"); ``req.kv`` mirrors ``ReqKvInfo``. (A real ``Req`` is
  built for each new request, but only to read the key fields its constructor derives:
  see key namespaces below. Its other state is the scheduler's, which the adapter plays.)
* **dLLM requests** (:func:`make_kv_dllm`): a diffusion model's request computes its
  trailing block while its token ids are not final (``dllm_incomplete_ids``, mask ids
  until the block resolves), and SGLang checkpoints it while that block is in flight.
  With this factory each allocation's new tokens are such a block: the adapter
  checkpoints right after allocating, with the block's ids the mask id
  (:data:`MASK_ID`), and the block resolves to the suite's tokens at the next call. The
  checkpoint keys ``_Req.get_cacheable_fill_ids()`` (the settled prefix), as SGLang's fix
  for sglang#35270 does; ``conformance/corpus/patches/sglang_35270.py`` keys
  ``get_fill_ids()`` instead, the bug.
* **Key namespaces** (feature ``key_domains``). SGLang keys its radix tree by
  ``RadixKey(token_ids, extra_key=req.extra_key, cache_salt=req.cache_salt)`` (the
  scheduler's ``_req_radix_key``; child keys ``(extra_key, page)``), with the two fields
  as SGLang's ``Req.__init__`` leaves them. The adapter builds a real ``Req`` for each
  new request (:meth:`SglangKVAdapter._radix_namespace`) from the protocol's namespace
  and passes on its ``extra_key`` and ``cache_salt``; it never composes them itself.
  The namespace's adapter is the request's ``lora_id`` (in a server, the id SGLang's
  LoRA registry gives the adapter). Its cache salt is the caller's cache key: SGLang has
  two, ``extra_key`` ("extra cache key for caller-defined request classification") and
  ``cache_salt``; :func:`make_kv` passes the salt as ``extra_key``, the field into which
  SGLang also puts the LoRA identity, and :func:`make_kv_cache_salt` as ``cache_salt``.
  A table's ``root_key`` is its namespace's ``root_key()`` (``b""`` for the default).
* Not available: ``fork`` (SGLang shares KV between requests only through the tree);
  switching prefix caching off (SGLang then builds ``UnifiedRadixCache``, another cache);
  cache entries in the spec's hash chain (the tree is keyed by token tuples: feature
  ``cache_index`` is off, PREFIX is checked through sharing and the KV read-back).

SGLang is imported when this module is imported (about 10 s, too long for the suite's
per-call timeout), so a missing SGLang makes the module import fail with
:class:`ModuleNotFoundError` naming ``make conformance-sglang``.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import warnings
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from refserve.conformance.adapter import NotSupported
from refserve.conformance.kv.protocol import Allocation, KVConfig, KVFeature, NoSpace
from refserve.spec.hashing import DEFAULT_NAMESPACE, Namespace
from refserve.spec.snapshot import PoolSnapshot, TableSnapshot

SGLANG_VERSION = "0.5.23"
"""The SGLang release this adapter was written against (read from its source)."""

MASK_ID = -1
"""The token id a dLLM request's in-flight block holds until it resolves (no suite token
is negative, so a key holding it never matches a real prompt)."""


MAX_REQUESTS = 1024
"""Rows of SGLang's ``ReqToTokenPool``: the most live requests (its ``max_running_requests``)."""


class SglangVersionError(ImportError):
    """The installed SGLang is not the release this adapter translates."""


def _check_installed() -> None:
    if importlib.util.find_spec("sglang") is None:
        # ModuleNotFoundError, so pytest.importorskip and `except ImportError` both work.
        raise ModuleNotFoundError(
            f"SGLang is not installed here (the adapter needs sglang=={SGLANG_VERSION} in "
            "its own virtualenv: make conformance-sglang)",
            name="sglang",
        )
    try:
        found = metadata.version("sglang")
    except metadata.PackageNotFoundError:
        found = "unknown"
    if found != SGLANG_VERSION:
        raise SglangVersionError(
            f"SGLang {found} is installed; refserve.conformance.adapters.sglang_kv translates "
            f"SGLang {SGLANG_VERSION} only (its cache's internals change between releases)"
        )


@dataclass(frozen=True)
class _Sglang:
    """The SGLang names the adapter uses (SGLang ships no type information: Any here)."""

    torch: Any
    RadixCache: Any
    RadixKey: Any
    CacheInitParams: Any
    MatchPrefixParams: Any
    ReqToTokenPool: Any
    TokenToKVPoolAllocator: Any
    PagedTokenToKVPoolAllocator: Any
    alloc_token_slots: Any
    alloc_paged_token_slots_extend: Any
    alloc_paged_token_slots_decode: Any
    checkpoint_kv_cache: Any
    Req: Any
    SamplingParams: Any


def _import_sglang() -> _Sglang:
    _check_installed()
    # Its import warns about every quantization method a CPU cannot run.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        radix = importlib.import_module("sglang.srt.mem_cache.radix_cache")
        base = importlib.import_module("sglang.srt.mem_cache.base_prefix_cache")
        allocator = importlib.import_module("sglang.srt.mem_cache.allocator")
        pools = importlib.import_module("sglang.srt.mem_cache.memory_pool")
        allocation = importlib.import_module("sglang.srt.mem_cache.allocation")
        common = importlib.import_module("sglang.srt.mem_cache.common")
        params = importlib.import_module("sglang.srt.mem_cache.cache_init_params")
        sampling = importlib.import_module("sglang.srt.sampling.sampling_params")
        try:
            batch = importlib.import_module("sglang.srt.managers.schedule_batch")
        except ModuleNotFoundError as e:
            # Req's module imports the serving stack: the OpenAI types among others.
            raise ModuleNotFoundError(
                f"SGLang's request class needs {e.name!r}, missing here (make "
                "conformance-sglang installs it into .venv-sglang)",
                name=e.name,
            ) from e
    logging.getLogger("sglang").setLevel(logging.CRITICAL)
    return _Sglang(
        torch=importlib.import_module("torch"),
        RadixCache=radix.RadixCache,
        RadixKey=radix.RadixKey,
        CacheInitParams=params.CacheInitParams,
        MatchPrefixParams=base.MatchPrefixParams,
        ReqToTokenPool=pools.ReqToTokenPool,
        TokenToKVPoolAllocator=allocator.TokenToKVPoolAllocator,
        PagedTokenToKVPoolAllocator=allocator.PagedTokenToKVPoolAllocator,
        alloc_token_slots=allocation.alloc_token_slots,
        alloc_paged_token_slots_extend=allocation.alloc_paged_token_slots_extend,
        alloc_paged_token_slots_decode=allocation.alloc_paged_token_slots_decode,
        checkpoint_kv_cache=common.checkpoint_kv_cache,
        Req=batch.Req,
        SamplingParams=sampling.SamplingParams,
    )


SG = _import_sglang()


@dataclass
class _Kv:
    """The fields of SGLang's ``ReqKvInfo`` the cache reads (no SWA, no mamba)."""

    req_pool_idx: int | None = None
    cache_protected_len: int = 0
    cache_inserted_len: int = 0
    kv_committed_len: int = 0
    kv_allocated_len: int = 0
    swa_evict_floor: int = 0
    component_evicted_seqlens: dict[Any, int] = field(default_factory=dict)

    @property
    def holds_kv(self) -> bool:
        return self.req_pool_idx is not None

    def get_evicted_seqlen(self, component_type: Any) -> int:
        return self.component_evicted_seqlens.get(component_type, 0)

    def swa_dead_lo(self, page_size: int) -> int:
        # No sliding window: nothing above the tree-owned prefix is window-dead.
        return max(self.cache_protected_len, self.swa_evict_floor)


@dataclass
class _Req:
    """The fields of SGLang's ``Req`` its cache and cache helpers read."""

    rid: str
    origin_input_ids: array[int]
    full_untruncated_fill_ids: array[int]
    kv: _Kv = field(default_factory=_Kv)
    extra_key: Any = None  # a str in SGLang; any hashable keys its tree
    cache_salt: str | None = None
    priority: int | None = None
    skip_radix_cache_insert: bool = False
    extend_end: int = 0
    prefix_len: int = 0
    last_node: Any = None
    lock: Any = None
    dllm_incomplete_ids: array[int] = field(default_factory=lambda: array("q"))
    # Set by an extend, cleared by the checkpoint that follows its forward.
    checkpoint_due: bool = False

    def finished(self) -> bool:
        return False

    def get_fill_ids(self) -> array[int]:
        return self.full_untruncated_fill_ids[: self.extend_end]

    def get_cacheable_fill_ids(self) -> array[int]:
        """The fix for sglang#35270 (``ReqDllmMixin.get_cacheable_fill_ids``): the fill
        ids without a dLLM request's in-flight block, whose ids are not final."""
        ids = self.get_fill_ids()
        n = len(self.dllm_incomplete_ids)
        return ids[: len(ids) - n] if n else ids


@dataclass(frozen=True)
class RadixNamespace:
    """A request's radix-tree namespace: the two key fields of its ``RadixKey``."""

    extra_key: Any
    cache_salt: Any


SALT_FIELDS = ("extra_key", "cache_salt")
"""The SGLang request fields the protocol's cache salt can be passed as."""


class SglangKVAdapter:
    """SGLang's ``RadixCache`` over its token-to-KV allocator."""

    name = "sglang-radix-kv"
    req_class: Any = SG.Req
    """The SGLang request class whose construction derives a request's namespace."""

    def __init__(self, *, dllm: bool = False, salt_field: str = "extra_key") -> None:
        if salt_field not in SALT_FIELDS:
            raise ValueError(f"salt_field is one of {SALT_FIELDS}, got {salt_field!r}")
        self.dllm = dllm
        self.salt_field = salt_field
        self._namespaces: dict[str, Namespace] = {}
        self._reqs: dict[str, _Req] = {}
        self._order: list[str] = []
        self._known: dict[str, list[int]] = {}
        self._ps = 1
        self._num_blocks = 0
        self._cache: Any = None

    @property
    def features(self) -> frozenset[KVFeature]:
        return frozenset({KVFeature.PREFIX_CACHING, KVFeature.KEY_DOMAINS})

    # ------------------------------------------------------------------ setup
    def configure(self, config: KVConfig) -> None:
        if not config.enable_prefix_caching:
            raise NotSupported(
                "SGLang builds UnifiedRadixCache when the radix cache is disabled; this "
                "adapter drives RadixCache"
            )
        if config.num_blocks < 1 or config.block_size < 1:
            raise NotSupported("SGLang needs at least one page of at least one slot")
        torch, ps, nb = SG.torch, config.block_size, config.num_blocks
        size = nb * ps
        if ps == 1:
            allocator = SG.TokenToKVPoolAllocator(size, torch.float16, "cpu", None, False)
        else:
            allocator = SG.PagedTokenToKVPoolAllocator(size, ps, torch.float16, "cpu", None, False)
        # Requests sharing cached pages can outnumber the pages, so the rows (SGLang's
        # max_running_requests) are many; a row is as long as the pool can make a request.
        pool = SG.ReqToTokenPool(
            size=MAX_REQUESTS,
            max_context_len=size + 2 * ps,
            device="cpu",
            enable_memory_saver=False,
        )
        self._cache = SG.RadixCache(
            SG.CacheInitParams(
                disable=False,
                req_to_token_pool=pool,
                token_to_kv_pool_allocator=allocator,
                page_size=ps,
            )
        )
        self._ps, self._num_blocks = ps, nb
        self._reqs, self._order, self._known = {}, [], {}
        self._namespaces = {}

    def set_namespace(self, request_id: str, namespace: Namespace) -> None:
        self._namespaces[request_id] = namespace

    def _radix_namespace(self, rid: str, ids: array[int], namespace: Namespace) -> RadixNamespace:
        """The ``extra_key`` and ``cache_salt`` SGLang's own ``Req`` derives for a request
        on adapter ``namespace.adapter`` (its ``lora_id``) with the namespace's cache
        salt in :attr:`salt_field` (``""``: none, as SGLang's input normalization makes
        it)."""
        caller = {self.salt_field: namespace.cache_salt or None}
        req = self.req_class(
            rid, "", ids, SG.SamplingParams(), lora_id=namespace.adapter or None, **caller
        )
        return RadixNamespace(req.extra_key, req.cache_salt)

    @property
    def cache(self) -> Any:
        if self._cache is None:
            raise NotSupported("configure() was not called")
        return self._cache

    # ------------------------------------------------------------------ the scheduler's calls
    def _checkpoint_ids(self, req: _Req) -> array[int]:
        """What a running request's checkpoint keys: SGLang's fixed code."""
        return req.get_cacheable_fill_ids()

    def _checkpoint(self, req: _Req) -> None:
        """``checkpoint_kv_cache`` of a running request, up to what it may key."""
        settled = req.extend_end
        req.extend_end = len(self._checkpoint_ids(req))
        SG.checkpoint_kv_cache(req, self.cache)
        req.extend_end = req.prefix_len = settled

    def _settle(self, skip: str | None = None) -> None:
        """The last forward's results, processed before the next scheduling decision:
        an in-flight dLLM block resolves to its real ids, and every request an extend
        ran for is checkpointed (but ``skip``, which ``free`` releases instead)."""
        for rid in self._order:
            req = self._reqs[rid]
            if req.dllm_incomplete_ids:
                req.dllm_incomplete_ids = array("q")
                req.full_untruncated_fill_ids = array("q", self._known[rid])
            if req.checkpoint_due and rid != skip:
                req.checkpoint_due = False
                self._checkpoint(req)

    def _row(self, req: _Req, start: int, end: int) -> Any:
        idx = req.kv.req_pool_idx
        return self.cache.req_to_token_pool.req_to_token[idx, start:end].to(SG.torch.int64)

    def _pages(self, start: int, end: int) -> int:
        """Pages a row needs for positions [start, end) beyond those it holds."""
        ps = self._ps
        return -(-end // ps) - -(-start // ps)

    def _room(self) -> int:
        """What SGLang's scheduler admits by: available plus evictable tokens."""
        c = self.cache
        return int(c.token_to_kv_pool_allocator.available_size()) + int(c.evictable_size())

    def _match(self, req: _Req, limit: int) -> tuple[int, Any]:
        key = SG.RadixKey(
            req.full_untruncated_fill_ids, req.extra_key, limit=limit, cache_salt=req.cache_salt
        )
        m = self.cache.match_prefix(SG.MatchPrefixParams(key=key))
        return int(m.device_prefix_len), m.last_device_node

    def _admit(self, rid: str, token_ids: Sequence[int], n: int) -> _Req:
        """Match, lock and check room as SGLang's PrefillAdder does; NoSpace (and the
        lock dropped) when even a miss does not fit."""
        ids = array("q", token_ids)
        ns = self._radix_namespace(rid, ids[:], self._namespaces.get(rid, DEFAULT_NAMESPACE))
        req = _Req(rid, ids[:], ids, extra_key=ns.extra_key, cache_salt=ns.cache_salt)
        cache, ps = self.cache, self._ps
        for limit in (len(ids) - n, 0):
            hit, node = self._match(req, limit)
            lock = cache.lock(node)
            if self._pages(hit, hit + n) * ps <= self._room():
                req.prefix_len, req.last_node, req.lock = hit, node, lock
                req.kv.cache_protected_len = hit
                return req
            cache.unlock(lock)
            if hit == 0:
                break
        raise NoSpace(f"{self._pages(0, n)} pages needed, {self._room() // ps} available")

    def _extend(self, req: _Req, start: int, n: int) -> None:
        """``alloc_for_extend`` for one request: its prefix [0, start), n new slots."""
        torch, cache, ps = SG.torch, self.cache, self._ps
        pool = cache.req_to_token_pool
        if req.kv.req_pool_idx is None:
            req.kv.req_pool_idx = int(pool.alloc_rows(1)[0])
            if start:
                prefix = cache.path_device_indices(req.last_node)[:start]
                pool.write((req.kv.req_pool_idx, slice(0, start)), prefix)
        if ps == 1:
            out = SG.alloc_token_slots(cache, n)
        else:
            last = self._row(req, start - 1, start) if start else torch.full((1,), -1)
            prefix_lens = torch.tensor([start], dtype=torch.int64)
            seq_lens = torch.tensor([start + n], dtype=torch.int64)
            out = SG.alloc_paged_token_slots_extend(
                cache, prefix_lens, prefix_lens, seq_lens, seq_lens, last, n
            )
        pool.write((req.kv.req_pool_idx, slice(start, start + n)), out)
        req.kv.kv_allocated_len = req.kv.kv_committed_len = start + n
        req.extend_end = start + n
        req.checkpoint_due = True

    def _decode(self, req: _Req, start: int) -> None:
        """``alloc_for_decode`` for one request and one token."""
        torch, cache, ps = SG.torch, self.cache, self._ps
        if ps == 1:
            out = SG.alloc_token_slots(cache, 1)
        else:
            seq_lens = torch.tensor([start + 1], dtype=torch.int64)
            out = SG.alloc_paged_token_slots_decode(
                cache, seq_lens, seq_lens, self._row(req, start - 1, start)
            )
        cache.req_to_token_pool.write((req.kv.req_pool_idx, slice(start, start + 1)), out)
        req.kv.kv_allocated_len = req.kv.kv_committed_len = start + 1
        req.extend_end = start + 1

    def _in_flight(self, req: _Req, start: int, end: int) -> None:
        """A dLLM block [start, end) computed with its ids not final, and the checkpoint
        SGLang takes of it before it resolves."""
        req.dllm_incomplete_ids = array("q", [MASK_ID] * (end - start))
        req.full_untruncated_fill_ids = (
            req.full_untruncated_fill_ids[:start] + req.dllm_incomplete_ids
        )
        req.checkpoint_due = False
        self._checkpoint(req)

    # ------------------------------------------------------------------ protocol
    def allocate(
        self, request_id: str, token_ids: Sequence[int], num_new_tokens: int
    ) -> Allocation:
        n, req = num_new_tokens, self._reqs.get(request_id)
        start = 0 if req is None else req.kv.kv_committed_len
        # Refuse before the pending checkpoints run, so that a refusal changes nothing;
        # they can only add room (a duplicate page freed), never take it.
        need = self._pages(start, start + n)
        if need * self._ps > self._room():
            raise NoSpace(f"{need} pages needed, {self._room() // self._ps} available")
        if req is None and self.cache.req_to_token_pool.available_size() < 1:
            raise NoSpace(f"all {MAX_REQUESTS} request rows are in use")
        self._settle()
        if req is None:
            req = self._admit(request_id, token_ids, n)
            self._reqs[request_id] = req
            self._order.append(request_id)
            hit = start = req.prefix_len
            self._extend(req, start, n)
        else:
            hit = 0
            req.full_untruncated_fill_ids = array("q", token_ids)
            if n == 1:
                self._decode(req, start)
            else:
                self._extend(req, start, n)
        self._known[request_id] = list(token_ids)
        if self.dllm:
            self._in_flight(req, start, start + n)
        return Allocation(self._table(req), hit)

    def fork(self, parent: str, child: str) -> None:
        raise NotSupported("SGLang shares KV between requests only through the radix tree")

    def free(self, request_id: str) -> None:
        self._settle(skip=request_id)
        req = self._reqs.pop(request_id)
        self._order.remove(request_id)
        self._known.pop(request_id, None)
        cache, kv = self.cache, req.kv
        owned = kv.kv_committed_len
        # release_kv_cache(req, tree_cache, checkpoint=True), call for call.
        cache.checkpoint(req, up_to=owned)
        cache.free_kv_row(kv, [(kv.cache_protected_len, owned)])
        cache.unlock(req.lock)
        req.lock = None
        cache.on_release(req, checkpointed=True)
        cache.req_to_token_pool.free(req)
        kv.kv_allocated_len = 0
        self._namespaces.pop(request_id, None)

    # ------------------------------------------------------------------ snapshot
    def _table(self, req: _Req) -> tuple[int, ...]:
        stored = req.kv.kv_committed_len
        if not stored:
            return ()
        row = self._row(req, 0, stored).tolist()
        return tuple(row[i] // self._ps - 1 for i in range(0, stored, self._ps))

    def _evictable_pages(self) -> list[int]:
        """Pages of the tree's unlocked nodes, in tree order, each once."""
        root, ps = self.cache.root_node, self._ps
        seen: dict[int, None] = {}
        stack = list(root.children.values())
        while stack:
            node = stack.pop()
            if node.value is not None and node.lock_ref == 0:
                for s in node.value.tolist()[::ps]:
                    seen.setdefault(int(s) // ps, None)
            stack.extend(node.children.values())
        return list(seen)

    def snapshot(self) -> PoolSnapshot:
        cache, nb = self.cache, self._num_blocks
        allocator = cache.token_to_kv_pool_allocator
        ref = [0] * nb
        tables: list[TableSnapshot] = []
        for rid in self._order:
            req = self._reqs[rid]
            table = self._table(req)
            for b in set(table):
                if 0 <= b < nb:
                    ref[b] += 1
            stored = req.kv.kv_committed_len
            ns = self._namespaces.get(rid, DEFAULT_NAMESPACE)
            root = b"" if ns == DEFAULT_NAMESPACE else ns.root_key()
            known = tuple(self._known[rid][:stored])
            tables.append(TableSnapshot(rid, table, stored, known, root))
        free_pages = [int(p) for p in allocator.get_all_free_pages().tolist()]
        free = [p - 1 for p in free_pages]
        listed = set(free)
        free += [p - 1 for p in self._evictable_pages() if p - 1 not in listed]
        stated = (int(allocator.available_size()) + int(cache.evictable_size())) // self._ps
        return PoolSnapshot(
            num_blocks=nb,
            block_size=self._ps,
            ref_cnt=tuple(ref),
            free_queue=tuple(free),
            tables=tuple(tables),
            stated_free=stated,
        )


def make_kv() -> SglangKVAdapter:
    """The ``MODULE:FACTORY`` entry point: ordinary (autoregressive) requests."""
    return SglangKVAdapter()


def make_kv_cache_salt() -> SglangKVAdapter:
    """Ordinary requests whose cache salt is SGLang's ``cache_salt`` field."""
    return SglangKVAdapter(salt_field="cache_salt")


def make_kv_dllm() -> SglangKVAdapter:
    """Every allocation is a dLLM block checkpointed in flight (SGLang's fixed code)."""
    return SglangKVAdapter(dllm=True)
