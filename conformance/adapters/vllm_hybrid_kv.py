"""vLLM 0.33.0's hybrid KV cache manager as a grouped KV adapter; optional.

Factory: ``refserve.conformance.adapters.vllm_hybrid_kv:make`` (the grouped suite:
``refserve conformance --grouped-kv-adapter ...``; protocol in
refserve.conformance.kv.groups, rules in refserve.spec.groups).

Install and run: ``make conformance-vllm`` (its own virtualenv ``.venv-vllm``, never
refserve's). The adapter drives vLLM's real ``KVCacheManager``
(vllm/v1/core/kv_cache_manager.py) in-process, on the CPU, without a model, a
``VllmConfig`` or a GPU: the manager is built straight from a ``KVCacheConfig`` with one
``KVCacheGroupSpec`` per suite group, in the suite's order (one layer each,
``model.layers.<g>.self_attn.attn``): ``FullAttentionSpec`` for a full group,
``SlidingWindowSpec(sliding_window=W)`` for a window group, every one with the same
block size, one KV head of size 32 and float32, so every group has the same page size
(as ``kv_cache_planning._get_kv_cache_groups_uniform_page_size`` groups a hybrid model).
With two or more groups and prefix caching on, vLLM builds a
``HybridKVCacheCoordinator``; with one group a ``UnitaryKVCacheCoordinator``; with
prefix caching off a ``KVCacheCoordinatorNoPrefixCache``. Each group gets its
single-type manager (``FullAttentionManager`` / ``SlidingWindowManager``). Nothing of
vLLM is copied, patched or fixed: the adapter calls what vLLM's scheduler calls
(``get_computed_blocks``, ``allocate_slots``, ``free``) and translates.

What vLLM 0.33 does, read from its source (kv_cache_manager.py,
kv_cache_coordinator.py, single_type_kv_cache_manager.py, block_pool.py):

* **One pool.** The coordinator builds one ``BlockPool`` of ``KVCacheConfig.num_blocks``
  blocks and hands the same object to every group's manager; each manager keeps its own
  ``req_to_blocks`` (one table per request per group). Groups never share a block: the
  prefix cache is keyed by ``(block hash, group id)`` (``BlockHashWithGroupId``), so a
  block's ``ref_cnt`` counts the (request, group) tables that hold it.
* **The null block.** ``BlockPool`` takes block 0 out of the free queue at start-up as
  ``null_block`` (``is_null``; its ``ref_cnt`` is never maintained, ``free_blocks`` and
  ``touch`` skip it). A sliding-window table keeps the places of the blocks that left
  its window as that block. The adapter asks for ``num_blocks + 1`` blocks and reports
  vLLM block ``b`` as block ``b - 1``, and the null block as
  :data:`refserve.spec.groups.NULL_BLOCK`.
* **When window blocks are freed.** ``allocate_slots`` first calls
  ``coordinator.remove_skipped_blocks(request_id, total_computed_tokens -
  num_in_flight_tokens)``, with ``total_computed_tokens`` the request's computed tokens
  plus this call's prefix hit, *before* it counts the free blocks. The window manager
  frees (back to the pool, most recent first) every block wholly before
  ``get_num_skipped_tokens(L) = max(0, L - sliding_window + 1 - extra_retained_tokens)``
  and puts the null block in its place (``_remove_blocks_in_range``, walking down from
  the last such block and stopping at the first null). With ``extra_retained_tokens``
  0 (no multi-module MTP) that is ``refserve.spec.groups.window_start(L, W)``: the query at
  ``L`` reads keys ``L - W < k <= L``, the same convention. In-flight tokens (async
  scheduling, pipeline parallelism) are 0 here: the suite computes every allocated token
  before the next call, as a synchronous scheduler's ``update_from_output`` does. So at
  each allocation from ``L`` stored tokens vLLM holds exactly the blocks covering
  ``[window_start(L, W), L + n)``: rule ``window-early`` holds, and so does the optional
  rule ``window-late`` (vLLM is eager in the spec's sense: the blocks the previous
  chunk's tokens pushed out of the window stay until the next allocation, which the rule,
  measured from ``num_before``, allows). ``Scheduler._free_request`` also calls it
  before handing a finished request's table to a KV connector; nothing else does.
* **Refusal is not atomic.** Because ``remove_skipped_blocks`` runs before the room
  check (vLLM's comment: "We can do this even if we cannot schedule this request due to
  insufficient free blocks"), a refused allocation (``allocate_slots`` returns ``None``)
  of a running request whose window moved since its last allocation has already freed
  those blocks: the adapter raises :class:`NoSpace` and the snapshot shows them freed
  (translated, not undone). A refused first allocation frees nothing, but leaves an
  empty ``req_to_blocks`` entry in each window manager (a ``defaultdict`` read); the
  snapshot lists tables for live requests and for any id that holds a block, so an
  empty entry of a request that holds none is not shown.
* **Prefix hits per group.** ``get_computed_blocks`` (first allocation only; the adapter
  passes ``max_cache_hit_length = len(token_ids) - num_new_tokens``, the protocol's
  bound, instead of the scheduler's default ``num_tokens - 1``) runs
  ``HybridKVCacheCoordinator.find_longest_cache_hit``: the groups are batched by spec
  (``SpecGroup``), full attention first; full attention scans left to right for the
  longest run of cached blocks from block 0; each window spec then scans right to left
  from that length for ``cdiv(W - 1, block_size)`` contiguous cached blocks (or a run
  reaching block 0), and the hit ends at that run's right edge; a shorter answer
  restarts the pass (a fixed point; one pass for one full plus one other spec), and the
  full groups are trimmed to the final length. A hit of ``h`` tokens therefore has, in
  a window group, every block covering ``[window_start(h, W), h)``; ``cdiv(W - 1, bs)``
  is that count whenever ``h >= W - 1``. ``add_local_computed_blocks`` then pads the
  ``get_num_skipped_tokens(h) // bs`` blocks before the window with the null block and
  touches the rest (taking cached free blocks out of the free queue). Hits are
  ``block_size`` aligned here (one block size, no Mamba: no fine-grained partial hits,
  so no copy-on-write copies).
* **Room.** ``get_num_blocks_to_allocate`` sums over groups the blocks each needs
  (beyond those it holds or skips) plus the cached free blocks a hit would revive, and
  ``allocate_slots`` returns ``None`` when that exceeds ``get_num_free_blocks()`` (no
  watermark, no reserved blocks, ``full_sequence_must_fit`` off: the scheduler's
  whole-prompt admission gate is a scheduling policy, not a manager rule). When a first
  allocation with a hit is refused, the adapter asks again without the hit (the
  protocol allows any shorter hit; vLLM's scheduler would leave the request waiting):
  :class:`NoSpace` only when a miss does not fit either.
* **Caching.** ``allocate_slots`` caches (hashes into the index) the full blocks of
  ``min(computed + new, num_tokens)`` tokens at once, the window group's too (dense
  retention: ``prefix_cache_retention_interval`` unset), so a block is indexed in the
  call that allocates it. Freed blocks with a hash go to the tail of the free queue
  (LRU), without one to its head.

Snapshot: ``ref_cnt`` is ``KVCacheBlock.ref_cnt`` of blocks ``1..num_blocks``, the free
queue is ``FreeKVCacheBlockQueue`` walked from its head (the order ``popleft_n`` hands
out), ``stated_free`` is ``get_num_free_blocks()`` (what ``allocate_slots`` admits by),
and a table's KV length is the ``Request.num_computed_tokens`` the adapter advances as
the scheduler does. Cache entries stay empty and feature ``cache_index`` is off: vLLM
keys its cache by its own sha256 hash chain, not the spec's.

vLLM is imported when this module is imported (about 10 s, too long for the suite's
per-call timeout), so a missing or different vLLM makes the module import fail with
:class:`ModuleNotFoundError` / :class:`VllmVersionError`.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from refserve.conformance.adapter import NotSupported
from refserve.conformance.adapters.vllm import VLLM_VERSION, check_installed
from refserve.conformance.kv.groups import GroupedAllocation, GroupedKVConfig
from refserve.conformance.kv.protocol import KVFeature, NoSpace
from refserve.errors import InvalidArgument, UnknownRequest
from refserve.spec.groups import NULL_BLOCK, GroupedSnapshot, GroupKind, GroupTable
from refserve.spec.snapshot import PoolSnapshot, TableSnapshot

NULL_BLOCKS = 1
"""vLLM's ``BlockPool`` reserves block 0 as its null block."""

MAX_MODEL_LEN = 1 << 22
"""The ``max_model_len`` the manager is built with: far past any suite request (a window
group alone holds a bounded number of blocks however long a request grows)."""

HEAD_SIZE = 32
"""One KV head of this size in float32 in every group: one page size for all."""


def _check_installed() -> None:
    check_installed(
        "refserve.conformance.adapters.vllm_hybrid_kv",
        "its KV manager changes between releases",
    )


@dataclass(frozen=True)
class _Vllm:
    """The vLLM names the adapter uses (vLLM ships no type information: Any here)."""

    torch: Any
    KVCacheManager: Any
    KVCacheConfig: Any
    KVCacheGroupSpec: Any
    FullAttentionSpec: Any
    SlidingWindowSpec: Any
    Request: Any
    RequestStatus: Any
    SamplingParams: Any
    get_request_block_hasher: Any
    init_none_hash: Any
    get_hash_fn_by_name: Any


def _import_vllm() -> _Vllm:
    _check_installed()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.getLogger("vllm").setLevel(logging.ERROR)
    iface = importlib.import_module("vllm.v1.kv_cache_interface")
    utils = importlib.import_module("vllm.v1.core.kv_cache_utils")
    request = importlib.import_module("vllm.v1.request")
    return _Vllm(
        torch=importlib.import_module("torch"),
        KVCacheManager=importlib.import_module("vllm.v1.core.kv_cache_manager").KVCacheManager,
        KVCacheConfig=iface.KVCacheConfig,
        KVCacheGroupSpec=iface.KVCacheGroupSpec,
        FullAttentionSpec=iface.FullAttentionSpec,
        SlidingWindowSpec=iface.SlidingWindowSpec,
        Request=request.Request,
        RequestStatus=request.RequestStatus,
        SamplingParams=importlib.import_module("vllm.sampling_params").SamplingParams,
        get_request_block_hasher=utils.get_request_block_hasher,
        init_none_hash=utils.init_none_hash,
        get_hash_fn_by_name=importlib.import_module("vllm.utils.hashing").get_hash_fn_by_name,
    )


V = _import_vllm()

# The algorithm EngineCore hashes blocks with by default (CacheConfig.prefix_caching_hash_algo).
HASH_ALGO = "sha256"


def _group_spec(v: _Vllm, index: int, kind: GroupKind, window: int, block_size: int) -> Any:
    common: dict[str, Any] = {
        "block_size": block_size,
        "num_kv_heads": 1,
        "head_size": HEAD_SIZE,
        "dtype": v.torch.float32,
    }
    spec = (
        v.FullAttentionSpec(**common)
        if kind is GroupKind.FULL
        else v.SlidingWindowSpec(**common, sliding_window=window)
    )
    return v.KVCacheGroupSpec([f"model.layers.{index}.self_attn.attn"], spec)


class VllmHybridKVAdapter:
    """vLLM's ``KVCacheManager`` over one group per suite group, one shared pool."""

    name = f"vLLM {VLLM_VERSION} hybrid KVCacheManager"

    def __init__(self) -> None:
        self._config: GroupedKVConfig | None = None
        self._mgr: Any = None
        self._hasher: Any = None
        self._reqs: dict[str, Any] = {}  # request id -> vLLM Request, first allocation done

    @property
    def features(self) -> frozenset[KVFeature]:
        # Eager: each allocation first drops every block wholly before the window of the
        # query it serves (remove_skipped_blocks), so window-late is judged too.
        return frozenset(
            {
                KVFeature.PREFIX_CACHING,
                KVFeature.PREFIX_CACHING_OPTIONAL,
                KVFeature.WINDOW_EAGER_FREE,
            }
        )

    @property
    def manager(self) -> Any:
        """The vLLM ``KVCacheManager`` this adapter drives."""
        if self._mgr is None:
            raise NotSupported("configure() was not called")
        return self._mgr

    @property
    def config(self) -> GroupedKVConfig:
        if self._config is None:
            raise NotSupported("configure() was not called")
        return self._config

    # ------------------------------------------------------------------ setup
    def configure(self, config: GroupedKVConfig) -> None:
        bs, n = config.block_size, config.num_blocks
        if not config.groups:
            raise NotSupported("vLLM's KV cache manager needs at least one group")
        if bs < 1 or n < 1:
            raise NotSupported("vLLM's block pool needs at least one block of one token")
        try:
            kv_cache_config = V.KVCacheConfig(
                num_blocks=n + NULL_BLOCKS,
                kv_cache_tensors=[],
                kv_cache_groups=[
                    _group_spec(V, i, g.kind, g.window, bs) for i, g in enumerate(config.groups)
                ],
            )
            mgr = V.KVCacheManager(
                kv_cache_config,
                max_model_len=MAX_MODEL_LEN,
                scheduler_block_size=bs,
                hash_block_size=bs,
                enable_caching=config.enable_prefix_caching,
            )
        except (AssertionError, ValueError, TypeError) as e:
            raise NotSupported(f"vLLM refuses this configuration: {e}") from e
        self._hasher = None
        if config.enable_prefix_caching:
            # As EngineCore.__init__: the none-hash seed, then the per-request hasher.
            hash_fn = V.get_hash_fn_by_name(HASH_ALGO)
            V.init_none_hash(hash_fn)
            self._hasher = V.get_request_block_hasher(bs, hash_fn)
        self._mgr, self._config, self._reqs = mgr, config, {}

    # ------------------------------------------------------------------ protocol
    def _new_request(self, request_id: str, token_ids: Sequence[int]) -> Any:
        return V.Request(
            request_id=request_id,
            prompt_token_ids=[int(t) for t in token_ids],
            sampling_params=V.SamplingParams(max_tokens=1),
            pooling_params=None,
            block_hasher=self._hasher,
        )

    def _extend(self, req: Any, token_ids: Sequence[int]) -> None:
        """The tokens the request learnt since its last allocation (as
        ``update_from_output`` appends sampled tokens, hashing new full blocks)."""
        known = int(req.num_tokens)
        if len(token_ids) < known or list(req.all_token_ids) != list(token_ids[:known]):
            raise InvalidArgument(
                f"request {req.request_id!r}: token_ids do not extend the {known} tokens "
                "it already has"
            )
        if len(token_ids) > known:
            req.append_output_token_ids([int(t) for t in token_ids[known:]])

    def allocate(
        self, request_id: str, token_ids: Sequence[int], num_new_tokens: int
    ) -> GroupedAllocation:
        mgr, n = self.manager, num_new_tokens
        if n < 1:
            raise InvalidArgument(f"num_new_tokens must be >= 1, got {n}")
        mgr.new_step_starts()
        req = self._reqs.get(request_id)
        hit = 0
        if req is None:
            if n > len(token_ids):
                raise InvalidArgument(f"{n} new tokens but only {len(token_ids)} known")
            req = self._new_request(request_id, token_ids)
            blocks, hit, _ = mgr.get_computed_blocks(req, max_cache_hit_length=len(token_ids) - n)
            out = mgr.allocate_slots(req, n, hit, blocks) if hit else None
            if out is None:
                # The miss the protocol allows when the hit's revived blocks do not fit
                # (or there was no hit).
                hit = 0
                out = mgr.allocate_slots(req, n)
            if out is None:
                raise NoSpace(self._refusal(request_id, n))
            req.status = V.RequestStatus.RUNNING
            self._reqs[request_id] = req
        else:
            self._extend(req, token_ids)
            if int(req.num_computed_tokens) + n > int(req.num_tokens):
                raise InvalidArgument(
                    f"request {request_id!r}: {n} new tokens past its {req.num_tokens} known"
                )
            if mgr.allocate_slots(req, n) is None:
                raise NoSpace(self._refusal(request_id, n))
        # The scheduler advances num_computed_tokens by the hit and the scheduled tokens;
        # the suite computes them all before the next call.
        req.num_computed_tokens = int(req.num_computed_tokens) + hit + n
        return GroupedAllocation(self._tables(request_id), hit)

    def _refusal(self, request_id: str, n: int) -> str:
        free = int(self.manager.block_pool.get_num_free_blocks())
        return f"vLLM allocate_slots refused {n} tokens of {request_id!r}: {free} free blocks"

    def free(self, request_id: str) -> None:
        req = self._reqs.pop(request_id, None)
        if req is None:
            raise UnknownRequest(request_id, "free")
        self.manager.free(req)

    # ------------------------------------------------------------------ snapshot
    def _tables(self, request_id: str) -> tuple[tuple[int, ...], ...]:
        groups = self.manager.get_blocks(request_id).blocks
        return tuple(tuple(_label(b) for b in blocks) for blocks in groups)

    def snapshot(self) -> GroupedSnapshot:
        mgr, cfg = self.manager, self.config
        pool = mgr.block_pool
        managers = mgr.coordinator.single_type_managers
        # Live requests, and any id a group still holds a block for (a leak would show).
        ids = set(self._reqs)
        for m in managers:
            ids |= {rid for rid, blocks in m.req_to_blocks.items() if blocks}
        tables: list[GroupTable] = []
        for rid in sorted(ids):
            req = self._reqs.get(rid)
            kv = int(req.num_computed_tokens) if req is not None else 0
            toks = tuple(int(t) for t in req.all_token_ids[:kv]) if req is not None else ()
            for g, m in enumerate(managers):
                blocks = m.req_to_blocks.get(rid) or []
                table = tuple(_label(b) for b in blocks)
                tables.append(GroupTable(g, TableSnapshot(rid, table, kv, toks)))
        snap = PoolSnapshot(
            num_blocks=len(pool.blocks) - NULL_BLOCKS,
            block_size=cfg.block_size,
            ref_cnt=tuple(int(b.ref_cnt) for b in pool.blocks[NULL_BLOCKS:]),
            free_queue=tuple(_label(b) for b in pool.free_block_queue.get_all_free_blocks()),
            tables=(),
            stated_free=int(pool.get_num_free_blocks()),
        )
        return GroupedSnapshot(cfg.groups, snap, tuple(tables))


def _label(block: Any) -> int:
    """vLLM block ``b`` as the suite's ``b - 1``; its null block as NULL_BLOCK."""
    if block.is_null:
        return NULL_BLOCK
    return int(block.block_id) - NULL_BLOCKS


def make() -> VllmHybridKVAdapter:
    """The ``MODULE:FACTORY`` entry point."""
    return VllmHybridKVAdapter()
