"""Adapter for lmdeploy's PyTorch engine (``refserve.conformance.adapters.lmdeploy:make``);
third-party, optional.

Install and run: ``make conformance-lmdeploy`` (its own virtualenv ``.venv-lmdeploy``,
never refserve's: lmdeploy 0.18.0 installed with ``--no-deps`` next to the few packages
its paging modules import). The adapter drives ``lmdeploy.pytorch.paging.Scheduler``
(its block manager, prefix trie and recompute eviction helper) in-process and never
loads a model: the scheduler is built as lmdeploy's own paging unit tests build it,
``Scheduler(SchedulerConfig, CacheConfig, seq_meta=SequenceMeta(block_size,
strategy=ARSequenceStrategy()))``. Nothing of lmdeploy is copied or patched. Its
conventions are declared in :data:`LMDEPLOY_PROPERTIES`.

The adapter plays lmdeploy's engine loop (``engine/inputs_maker.py``,
``engine/engine_loop.py``, ``strategies/ar/sequence.py``), the part of the engine
around the scheduler, one step at a time:

* A step is a prefill batch or a decode batch, never both. ``schedule(is_prefill=True,
  prealloc_size=P)`` first; if it admits anybody the step is that prefill batch
  (``activate_seqs``: READY to RUNNING at dispatch), else the running sequences decode:
  ``schedule_running(running, num_required_tokens=1, prealloc_size=P)`` and
  ``preempt_seqs`` for the ones it refuses. ``P`` is ``SchedulerConfig.prefill_interval``
  (``ARStrategy.get_prealloc_size``). The engine's ``do_prefill_default`` may also
  decode while requests wait (to fill a batch); the adapter always tries the prefill
  first, and says so (``step_order``).
* The running list is the engine's ``InputsMaker.running_seqs``: admitted sequences
  appended in admission order, the decode's refused ones dropped.
* Positions and slots are what ``create_model_inputs`` feeds the model: a prefill
  computes ``[num_history_ids, num_all_ids)``, a decode position ``num_history_ids``
  (its one token), each written at ``table[p // block_size] * block_size + p %
  block_size`` of ``get_block_tables`` (physical ids).
* ``commit`` applies ``update_running``: ``update_token_ids(token, PREFILL|DECODE)``,
  then ``finish()`` for a sequence the model agent would stop (its ``SamplingParam``:
  ``max_new_tokens`` reached, or a token of ``stop_words``, which carry the eos and the
  stop token ids), and ``end_session`` for a finished one, as the engine does for a
  request that does not keep its cache.
* Abort is ``end_session`` in any state.

How its state maps onto the protocol (the adapter translates, it never fixes):

* KV length is ``num_history_ids``. A RUNNING sequence is ``decoding``. lmdeploy's
  preemption is soft: ``preempt_seqs`` makes a sequence WAITING *with* its blocks and
  history; such a sequence is reported ``prefilling`` (KV for part of its tokens, more
  to compute). Its KV goes only when an admission's eviction helper reclaims it
  (``release_paging_resources``: blocks freed, step reset to 0); the step in which a
  live sequence's blocks drop to none is reported as its preemption (it is then
  ``preempted``, or re-admitted in the same step).
* Ref counts: the trie holds one allocator reference on every block it indexes, and a
  block only the trie holds (allocator count 1) is evictable on demand. The pool
  reports, per physical block, the requests holding it (allocator count minus the
  trie's one); the free queue is the allocator's free stack in hand-out order followed
  by the trie-only blocks (which leave by LRU eviction, an order of their own: the
  queue order is declared unordered).
* The trie keys blocks by Python ``hash`` of their tokens (and the adapter name), not
  the spec hash chain, so ``cache_entries`` is empty and ``cache_index`` is off; PREFIX
  is checked through sharing, writes and the KV read-back instead.
* Not played here: the long-context chunker (a prompt over ``max_prefill_token_num`` is
  prefilled in chunks driven by ``inputs_maker``'s ``_LongContextChunker``; a step that
  would start one raises NotSupported), speculative decoding, priorities, cache salt,
  rollback.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from collections.abc import Mapping
from dataclasses import dataclass, replace
from importlib import metadata
from typing import Any

from refserve.conformance.adapter import (
    AdmissionOrder,
    CommitReport,
    EngineConfig,
    EngineProperties,
    Feature,
    NotSupported,
    Rejected,
    RequestSpec,
    StepOrder,
    StepReport,
)
from refserve.spec.hashing import Namespace
from refserve.spec.snapshot import (
    EngineSnapshot,
    PoolSnapshot,
    RequestSnapshot,
    RequestStatus,
    ScheduledRequest,
    TableSnapshot,
)


@dataclass(frozen=True)
class LmdeployModules:
    """The lmdeploy classes the adapter builds and reads (lmdeploy ships no type
    information: they are Any here on purpose)."""

    Scheduler: Any
    SchedulerConfig: Any
    CacheConfig: Any
    SequenceMeta: Any
    SamplingParam: Any
    UpdateTokenMode: Any
    MessageStatus: Any
    ARSequenceStrategy: Any
    RecomputeEvictionHelper: Any
    PrefillScheduler: Any


def _import_engine() -> LmdeployModules:
    """Import lmdeploy's paging modules without running ``lmdeploy/__init__.py``.

    Two ``sys.modules`` entries, nothing of lmdeploy modified:

    * ``lmdeploy``, a bare package (its ``__path__`` only), so that the package's
      ``__init__`` (pipeline, serving, mmengine, tqdm) never runs and the submodules load
      on their own.
    * ``lmdeploy.pytorch.engine.model_agent``, a stand-in holding ``BatchedOutputs``: the
      AR sequence strategy imports that name only to annotate ``update_running``, which
      the adapter does not call (it plays the model agent). The real module would import
      the model agent and through it the engine package (zmq, xgrammar, tokenizers).
      A module already in ``sys.modules`` is returned without importing its parents, so
      ``lmdeploy.pytorch.engine/__init__`` (the Engine) never runs either.
    """
    if "lmdeploy" not in sys.modules:
        found = importlib.util.find_spec("lmdeploy")
        if found is None or found.submodule_search_locations is None:
            # ModuleNotFoundError, so pytest.importorskip and `except ImportError` both work.
            raise ModuleNotFoundError(
                "lmdeploy is not installed (it lives in .venv-lmdeploy: make conformance-lmdeploy)",
                name="lmdeploy",
            )
        pkg = types.ModuleType("lmdeploy")
        pkg.__path__ = list(found.submodule_search_locations)
        sys.modules["lmdeploy"] = pkg
    agent = "lmdeploy.pytorch.engine.model_agent"
    if agent not in sys.modules:
        stand_in = types.ModuleType(agent)
        stand_in.BatchedOutputs = object  # type: ignore[attr-defined]  # an annotation only
        sys.modules[agent] = stand_in
    config = importlib.import_module("lmdeploy.pytorch.config")
    messages = importlib.import_module("lmdeploy.pytorch.messages")
    scheduler = importlib.import_module("lmdeploy.pytorch.paging.scheduler")
    prefill = importlib.import_module("lmdeploy.pytorch.paging.prefill_scheduler")
    ar = importlib.import_module("lmdeploy.pytorch.strategies.ar.sequence")
    evict = importlib.import_module(
        "lmdeploy.pytorch.paging.eviction_helper.recompute_eviction_helper"
    )
    return LmdeployModules(
        Scheduler=scheduler.Scheduler,
        SchedulerConfig=config.SchedulerConfig,
        CacheConfig=config.CacheConfig,
        SequenceMeta=messages.SequenceMeta,
        SamplingParam=messages.SamplingParam,
        UpdateTokenMode=messages.UpdateTokenMode,
        MessageStatus=messages.MessageStatus,
        ARSequenceStrategy=ar.ARSequenceStrategy,
        RecomputeEvictionHelper=evict.RecomputeEvictionHelper,
        PrefillScheduler=prefill._PrefillScheduler,
    )


L = _import_engine()
M = L.MessageStatus

# lmdeploy's conventions, read from its paging/ and engine/ modules:
# * lookahead_slots 1 + P: an admission allocates ceil((num_all_ids + P) / block_size)
#   blocks (``num_required_blocks``), and after a step a sequence's num_all_ids is its KV
#   length plus the one sampled token, so a table may hold the slot of that token and P
#   more. make() runs with P = prefill_interval = 0.
# * eos: the model agent stops a sequence on a token of ``stop_words``; the adapter puts
#   the eos there, as ``SamplingParam.from_gen_config`` does.
# * FCFS strict: ``_PrefillReorderer`` sorts the waiting sequences by ``arrive_time``
#   (every prompt fits one prefill here: the standard turn keeps that order), and the
#   admission loop stops (``break``) at the first one it cannot admit, for blocks, the
#   batch's token budget or the batch size.
# * prefill-first: the adapter tries a prefill batch first, every step (module docstring).
# * same_step_prefix_hits: ``BlockTrie.allocate`` indexes every complete block of a
#   sequence at its admission, before the forward writes it, so a sequence admitted
#   later in the same batch hits it; safe because lmdeploy's attention layers fill the
#   whole batch's K/V cache before that layer reads it.
# * free queue unordered: free blocks come off the allocator's stack in order, but a
#   trie-only block leaves by LRU eviction when the stack runs short.
# * max_model_len_stop: the engine's max_session_len is the configured limit, at most
#   the pool less one block (``Engine._get_max_session_len``); ``Engine._add_message``
#   clamps ``max_new_tokens`` so a request stops there (reported as each request's
#   ``max_model_len``).
LMDEPLOY_PROPERTIES = EngineProperties(
    lookahead_slots=1,
    eos=True,
    admission_order=AdmissionOrder.FCFS_STRICT,
    step_order=StepOrder.PREFILL_FIRST,
    same_step_prefix_hits=True,
    free_queue_order=False,
    max_model_len_stop=True,
)


def _version() -> str:
    try:
        return metadata.version("lmdeploy")
    except metadata.PackageNotFoundError:  # pragma: no cover - installed from source
        return "unknown"


@dataclass
class _Request:
    """One submitted request: the engine's sequence and what the suite asked for."""

    spec: RequestSpec
    session_id: int
    seq: Any
    ran: bool = False
    done: RequestStatus | None = None


class LmdeployAdapter:
    """lmdeploy 0.18.0's paging Scheduler behind the conformance protocol."""

    def __init__(self, *, prefill_interval: int = 0) -> None:
        self._prefill_interval = prefill_interval
        self.properties = replace(LMDEPLOY_PROPERTIES, lookahead_slots=1 + prefill_interval)
        self._sched: Any = None
        self._cfg: EngineConfig | None = None
        self._reqs: dict[str, _Request] = {}
        self._running: list[Any] = []  # InputsMaker.running_seqs
        self._pending: list[tuple[str, Any]] = []
        self._pending_prefill = False
        self._retired: list[str] = []
        self._next_session = 0

    @property
    def name(self) -> str:
        extra = f" (prefill_interval={self._prefill_interval})" if self._prefill_interval else ""
        return f"lmdeploy {_version()} PyTorch engine{extra}"

    @property
    def features(self) -> frozenset[Feature]:
        return frozenset(
            {
                Feature.PREFIX_CACHING,
                Feature.PREFIX_CACHING_OPTIONAL,
                Feature.PREEMPTION,
                Feature.ABORT,
                Feature.STOP_TOKEN_IDS,
                Feature.LORA,
            }
        )

    # ------------------------------------------------------------------ setup
    def configure(self, config: EngineConfig) -> None:
        if config.num_speculative_tokens:
            raise NotSupported("the AR strategy driven here does not speculate")
        sched_cfg = L.SchedulerConfig(
            max_batches=config.max_num_seqs,
            max_session_len=config.max_model_len,
            prefill_interval=self._prefill_interval,
        )
        cache_cfg = L.CacheConfig(
            max_batches=config.max_num_seqs,
            block_size=config.block_size,
            num_cpu_blocks=0,
            num_gpu_blocks=config.num_blocks,
            max_prefill_token_num=config.max_num_batched_tokens,
            enable_prefix_caching=config.enable_prefix_caching,
        )
        self._sched = self.make_scheduler(sched_cfg, cache_cfg, config.block_size)
        self._cfg = config
        self._reqs.clear()
        self._running = []
        self._pending = []
        self._pending_prefill = False
        self._retired = []
        self._next_session = 0

    def make_scheduler(self, scheduler_config: Any, cache_config: Any, block_size: int) -> Any:
        """The scheduler, built as lmdeploy's paging tests build it. A hook for the
        corpus's patch modules, which put a bug back on the instances they build and
        nowhere else."""
        meta = L.SequenceMeta(block_size, strategy=L.ARSequenceStrategy())
        return L.Scheduler(scheduler_config, cache_config, seq_meta=meta)

    @property
    def cfg(self) -> EngineConfig:
        if self._cfg is None:
            raise NotSupported("configure() was not called")
        return self._cfg

    @property
    def max_session_len(self) -> int:
        """The engine's limit on a request's tokens (``Engine._get_max_session_len``): the
        configured one, at most the pool less one block."""
        cfg = self.cfg
        return min(cfg.max_model_len, (cfg.num_blocks - 1) * cfg.block_size)

    @property
    def scheduler(self) -> Any:
        """The lmdeploy Scheduler this adapter drives (for patch modules and tests)."""
        return self._sched

    def add_request(self, request: RequestSpec) -> None:
        if request.cache_salt:
            raise NotSupported("lmdeploy has no cache salt")
        if request.request_id in self._reqs:
            raise Rejected(f"duplicate request id {request.request_id!r}")
        if not request.prompt_token_ids:
            raise Rejected("empty prompt")  # Engine._add_message asserts a non-empty input
        stops = list(request.stop_token_ids)
        eos = request.eos_token_id if request.eos_token_id is not None else self.cfg.eos_token_id
        if eos is not None:
            stops.append(eos)
        # EngineInstance refuses a prompt over the engine's max_session_len
        # (INPUT_LENGTH_ERROR), and Engine._add_message clamps max_new_tokens so that the
        # prompt and its outputs fit in it.
        limit = self.max_session_len
        if len(request.prompt_token_ids) > limit:
            raise Rejected(
                f"input length {len(request.prompt_token_ids)} over max_session_len {limit}"
            )
        max_new = min(request.max_tokens, limit - len(request.prompt_token_ids))
        params = L.SamplingParam(max_new_tokens=max_new, stop_words=stops)
        sid = self._next_session
        self._next_session += 1
        session = self._sched.add_session(sid)
        seq = session.add_sequence(
            list(request.prompt_token_ids),
            sampling_param=params,
            adapter_name=request.lora or None,
        )
        self._reqs[request.request_id] = _Request(request, sid, seq)

    def abort(self, request_id: str) -> None:
        r = self._reqs.get(request_id)
        if r is None or r.done is not None:
            raise Rejected(f"no live request {request_id!r}")
        self._end(r, RequestStatus.ABORTED)

    def _end(self, r: _Request, status: RequestStatus) -> None:
        # By identity: SchedulerSequence is a dataclass whose == compares its fields.
        self._running = [s for s in self._running if s is not r.seq]
        self._sched.end_session(r.session_id)
        r.done = status
        self._retired.append(r.spec.request_id)

    def rollback(self) -> None:
        raise NotSupported("lmdeploy's schedule() mutates state and cannot be undone")

    def has_unfinished(self) -> bool:
        return any(r.done is None for r in self._reqs.values())

    # ------------------------------------------------------------------ the step
    def schedule(self) -> StepReport:
        self._retired = []
        held = {rid for rid, r in self._reqs.items() if r.done is None and r.seq.num_blocks > 0}
        kv_before = {rid: self._kv_len(r.seq) for rid, r in self._reqs.items() if r.done is None}
        batch = self._admit() or self._decode()
        ids = {id(r.seq): rid for rid, r in self._reqs.items()}
        self._pending = [(ids[id(s)], s) for s in batch]
        tables = self._sched.get_block_tables(batch)
        scheduled = [
            self._scheduled(rid, seq, table, kv_before.get(rid, 0))
            for (rid, seq), table in zip(self._pending, tables, strict=True)
        ]
        # A victim of the eviction helper lost its blocks; one reclaimed and admitted
        # again in the same call restarts below the KV it had.
        again = {s.request_id for s in scheduled if s.positions[0] < kv_before.get(s.request_id, 0)}
        lost = {rid for rid in held if self._reqs[rid].seq.num_blocks == 0}
        preempted = tuple(sorted(lost | again))
        return StepReport(scheduled=tuple(scheduled), preempted=preempted)

    def _admit(self) -> list[Any]:
        """A prefill batch, as the engine loop runs one when the scheduler admits any."""
        out = self._sched.schedule(is_prefill=True, prealloc_size=self._prefill_interval)
        batch = list(out.running)
        if not batch:
            return batch
        if any(seq.kv_token_limit is not None for seq in batch):
            raise NotSupported(
                "a prompt over max_prefill_token_num is prefilled by lmdeploy's "
                "long-context chunker (engine/inputs_maker.py), not played here"
            )
        self._sched.activate_seqs(batch)
        self._running.extend(batch)
        self._pending_prefill = True
        return batch

    def _decode(self) -> list[Any]:
        """Otherwise a decode of the running list; those that cannot grow are preempted."""
        if not self._running:
            return []
        valid = self._sched.schedule_running(
            self._running, num_required_tokens=1, prealloc_size=self._prefill_interval
        )
        invalid = [s for s, ok in zip(self._running, valid, strict=True) if not ok]
        batch = [s for s, ok in zip(self._running, valid, strict=True) if ok]
        self._sched.preempt_seqs(invalid)
        self._running = batch
        self._pending_prefill = False
        return batch

    def _scheduled(self, rid: str, seq: Any, table: Any, kv_before: int) -> ScheduledRequest:
        self._reqs[rid].ran = True
        bs = self.cfg.block_size
        blocks = tuple(int(b) for b in table)
        start = int(seq.num_history_ids)
        positions = tuple(range(start, int(seq.num_all_ids)))
        slots = tuple(
            blocks[p // bs] * bs + p % bs if p // bs < len(blocks) else -1 for p in positions
        )
        return ScheduledRequest(
            request_id=rid,
            num_new_tokens=len(positions),
            positions=positions,
            slot_mapping=tuple(s for s in slots if s >= 0),
            block_table=blocks,
            # update_running takes no token from a prefill whose max_new_tokens is 0.
            samples=not (self._pending_prefill and seq.sampling_param.max_new_tokens == 0),
            num_new_cached_tokens=max(0, start - kv_before) if self._pending_prefill else 0,
        )

    def commit(self, sampled: Mapping[str, int]) -> CommitReport:
        pending, self._pending = self._pending, []
        mode = L.UpdateTokenMode.PREFILL if self._pending_prefill else L.UpdateTokenMode.DECODE
        finished: list[tuple[str, str]] = []
        for rid, seq in pending:
            if seq.status != M.RUNNING:  # as update_running: only running sequences
                continue
            params = seq.sampling_param
            if self._pending_prefill and params.max_new_tokens == 0:
                # update_running: a prompt that may not grow is prefilled, takes no
                # token, and finishes.
                seq.update_token_ids([], mode=mode)
                seq.finish()
                finished.append((rid, "length"))
                self._end(self._reqs[rid], RequestStatus.FINISHED)
                continue
            token = sampled[rid]
            seq.update_token_ids([token], mode=mode)
            if token in params.stop_words:
                reason = "stop"
            elif seq.num_new_tokens >= params.max_new_tokens:
                reason = "length"
            else:
                continue
            seq.finish()
            finished.append((rid, reason))
            self._end(self._reqs[rid], RequestStatus.FINISHED)
        return CommitReport(tuple(finished))

    # ------------------------------------------------------------------ snapshots
    def _kv_len(self, seq: Any) -> int:
        # As the engine holds it, blocks or not: the model computes from this position.
        return int(seq.num_history_ids)

    def _request(self, rid: str, r: _Request) -> RequestSnapshot:
        seq = r.seq
        kv = self._kv_len(seq)
        if r.done is not None:
            status = r.done
        elif seq.status in (M.RUNNING, M.READY):
            status = RequestStatus.DECODING
        elif kv > 0:
            status = RequestStatus.PREFILLING  # preempted softly: WAITING with its KV
        else:
            status = RequestStatus.PREEMPTED if r.ran else RequestStatus.WAITING
        prompt = len(r.spec.prompt_token_ids)
        return RequestSnapshot(
            request_id=rid,
            status=status,
            num_prompt_tokens=prompt,
            num_output_tokens=int(seq.num_all_ids) - prompt,
            num_computed_tokens=0 if status.is_done else kv,
            max_tokens=r.spec.max_tokens,
            num_cached_tokens=int(seq.cached_tokens),
            max_model_len=self.max_session_len,
            arrival_step=r.spec.arrival_step,
        )

    def snapshot(self) -> EngineSnapshot:
        retired = set(self._retired)
        requests = [
            self._request(rid, r)
            for rid, r in self._reqs.items()
            if r.done is None or rid in retired
        ]
        return EngineSnapshot(tuple(sorted(requests, key=lambda x: x.request_id)), self._pool())

    def _pool(self) -> PoolSnapshot:
        bm = self._sched.block_manager
        alloc = bm.allocator
        n = int(bm.num_gpu_blocks)
        trie_owned = self._trie_blocks()
        # Per physical block: the allocator's count less the trie's own reference.
        ref = [0] * n
        live: list[TableSnapshot] = []
        for rid, r in sorted(self._reqs.items()):
            seq = r.seq
            if r.done is not None or seq.num_blocks == 0:
                continue
            table = tuple(int(b) for b in bm.get_block_table(seq))
            kv = self._kv_len(seq)
            root = Namespace(adapter=r.spec.lora).root_key()
            tokens = tuple(int(t) for t in seq.history_cache[:kv])
            live.append(TableSnapshot(rid, table, kv, tokens, root))
        used = [int(b) for b in range(n) if int(alloc.get_ref_count(b)) > 0]
        for logical in used:
            phys = int(alloc.get_physical_blocks(logical))
            count = int(alloc.get_ref_count(logical))
            ref[phys] = count - (1 if logical in trie_owned else 0)
        gpu = alloc.get_phy_allocator("gpu")
        # The free list's order has no public read: its array holds every block, the
        # used ones first, so the free ones are its tail.
        free_list = gpu._free_blocks
        num_used = len(free_list) - int(gpu.get_num_free_blocks())
        free = [int(b) for b in free_list[num_used:]]
        evictable = sorted(
            int(alloc.get_physical_blocks(b))
            for b in trie_owned
            if int(alloc.get_ref_count(b)) == 1
        )
        return PoolSnapshot(
            num_blocks=n,
            block_size=int(self.cfg.block_size),
            ref_cnt=tuple(ref),
            free_queue=tuple(free + evictable),
            tables=tuple(live),
        )

    def _trie_blocks(self) -> set[int]:
        """Logical ids of the blocks the prefix trie holds (one reference each): every
        node under every adapter root (the trie's own ``_roots``; an adapter reads the
        engine's internals)."""
        out: set[int] = set()
        stack = list(self._sched.block_trie._roots.values())
        while stack:
            node = stack.pop()
            if node.block_id >= 0:
                out.add(int(node.block_id))
            stack.extend(node.children.values())
        return out


def make() -> LmdeployAdapter:
    """Factory for ``--adapter refserve.conformance.adapters.lmdeploy:make``: lmdeploy
    0.18.0's paging scheduler with ``prefill_interval=0`` (no decode preallocation)."""
    return LmdeployAdapter()


def make_prealloc() -> LmdeployAdapter:
    """As :func:`make` with lmdeploy's default ``prefill_interval=16``: each admission and
    decode growth allocates 16 slots ahead (the AR engine runs 16 decode loops per host
    step)."""
    return LmdeployAdapter(prefill_interval=16)
