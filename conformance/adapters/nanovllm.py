"""Adapter for nano-vllm-fork (``refserve.conformance.adapters.nanovllm:make``); third-party,
optional.

Install and run: ``make conformance-nanovllm`` (its own virtualenv ``.venv-nanovllm``,
never refserve's: nano-vllm-fork installed with ``--no-deps`` next to numpy and
transformers, the ``nanovllm`` extra). The adapter drives
``nanovllm.engine.scheduler.Scheduler`` and its ``BlockManager`` in-process and never
loads a model: the scheduler is built from a hand-made config object holding only the
five fields its constructor reads (``nanovllm.config.Config`` would load a Hugging Face
model directory). Nothing of nano-vllm is copied or patched. Its conventions are
declared in :data:`NANOVLLM_PROPERTIES`.

How its state maps onto the protocol (the adapter translates, it never fixes):

* ``schedule()`` returns ``(seqs, is_prefill)``. The positions and slots reported are the
  ones nano-vllm's model runner feeds the model for those sequences (its
  ``prepare_prefill`` / ``prepare_decode`` contract, restated here from the engine's
  state, not recomputed with the spec formula): a prefill computes positions
  ``[num_cached_tokens, len(seq))`` and writes block ``block_table[i]`` for
  ``i in [num_cached_blocks, num_blocks)`` slot by slot (the last block up to
  ``last_block_num_tokens``); a decode computes position ``len(seq) - 1`` into slot
  ``block_table[-1] * block_size + last_block_num_tokens - 1`` (no slot when the table
  is empty: the model runner would raise there). Every scheduled sequence samples one
  token (``postprocess`` appends one per sequence).
* nano-vllm keeps no KV-length counter. Its model runner writes KV for every position
  but the last sampled token, so at a step boundary a ``RUNNING`` sequence holding blocks
  has ``len(seq) - 1`` tokens of KV, and a ``WAITING`` one none.
* A ``WAITING`` sequence that has run before was preempted (``Scheduler.preempt``); the
  scheduler does not report preemptions, so the adapter reports the sequences that held
  blocks before ``schedule()`` and are ``WAITING`` after it (whatever they hold then:
  BLOCK checks that a victim let its blocks go).
* A sequence that finished but that nano-vllm brings back (a stale ``running`` entry
  preempted into ``waiting`` again) is reported live, with the blocks it holds, as the
  engine holds it.
* The prefix-cache index is keyed by xxhash integers, not by the spec hash chain, so
  ``cache_entries`` is empty and the ``cache_index`` feature is off (PREFIX is checked
  through sharing, writes and the KV read-back instead).
* Not available in the engine: chunked prefill, priorities, abort, rollback, stop token
  ids (one global eos), switching prefix caching off.

``Sequence.block_size`` is a class attribute fixed at 256 that the engine never sets from
its config. :func:`make` uses a per-adapter subclass carrying the configured block size so
small pools can be tested; :func:`make_native` uses nano-vllm's own ``Sequence`` as is.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from collections.abc import Mapping
from importlib import metadata
from types import SimpleNamespace
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
from refserve.spec.hashing import DEFAULT_NAMESPACE
from refserve.spec.snapshot import (
    EngineSnapshot,
    PoolSnapshot,
    RequestSnapshot,
    RequestStatus,
    ScheduledRequest,
    TableSnapshot,
)


def _import_engine() -> tuple[Any, Any, Any, Any, Any]:
    """Import nano-vllm's scheduler modules without running ``nanovllm/__init__.py``.

    The package's ``__init__`` imports the model runner, which needs ``flash_attn`` and a
    GPU; the scheduler, block manager and sequence modules need neither. When ``nanovllm``
    is not imported yet, it is registered as a bare package (its ``__path__`` only) so
    that its submodules load on their own; nothing of the package is modified.
    """
    if "nanovllm" not in sys.modules:
        found = importlib.util.find_spec("nanovllm")
        if found is None or found.submodule_search_locations is None:
            # ModuleNotFoundError, so pytest.importorskip and `except ImportError` both work.
            raise ModuleNotFoundError(
                "nano-vllm-fork is not installed (it lives in .venv-nanovllm: "
                "make conformance-nanovllm)",
                name="nanovllm",
            )
        pkg = types.ModuleType("nanovllm")
        pkg.__path__ = list(found.submodule_search_locations)
        sys.modules["nanovllm"] = pkg
    sched = importlib.import_module("nanovllm.engine.scheduler")
    seq = importlib.import_module("nanovllm.engine.sequence")
    params = importlib.import_module("nanovllm.sampling_params")
    blocks = importlib.import_module("nanovllm.engine.block_manager")
    return (
        sched.Scheduler,
        blocks.BlockManager,
        seq.Sequence,
        seq.SequenceStatus,
        params.SamplingParams,
    )


# nano-vllm-fork ships no type information: its classes are Any here on purpose.
Scheduler, BlockManager, Sequence, SequenceStatus, SamplingParams = _import_engine()

ROOT = DEFAULT_NAMESPACE.root_key()


# nano-vllm's conventions, read from its scheduler.py, block_manager.py and sequence.py
# (the CFG-pair branches are never taken: the adapter submits no paired sequence):
# * lookahead_slots 0: a prefill allocates ceil(len(seq) / block_size) blocks, exactly the
#   prompt it writes, and ``may_append`` adds a block only when the token about to be
#   computed (position len(seq) - 1) starts one, so at a step boundary a table holds
#   ceil(kv / block_size) blocks and no slot ahead.
# * eos: ``postprocess`` finishes a sequence whose token equals ``config.eos`` unless
#   ``ignore_eos`` (False in the SamplingParams the adapter builds).
# * FCFS: ``waiting`` is a deque appended at submission; admission looks only at its head
#   and stops (``break``) at the first sequence that does not fit in the budget
#   (len(seq), cache hits not deducted) or in the free blocks: head-of-line blocking,
#   nothing is ever passed over (declared: fcfs_strict). Preempted sequences go back to
#   the front (appendleft), which ORDER leaves to the engine.
# * prefill-first: a step that admits any waiting sequence runs prefills only; decodes
#   run only in steps where nothing was admitted.
# * same_step_prefix_hits: ``allocate`` indexes a full block's hash as soon as it
#   allocates it, so a sequence admitted later in the same ``schedule()`` call hits it;
#   safe because ``Attention.forward`` runs ``store_kvcache`` for the whole batch before
#   that layer's attention reads the cache (layers/attention.py).
# * free_queue_order: ``free_block_ids`` is a deque, new blocks come from its head
#   (``free_block_ids[0]``) and freed ones are appended at its tail; a freed block loses
#   its hash entry, so no cache hit takes one from the middle.
NANOVLLM_PROPERTIES = EngineProperties(
    lookahead_slots=0,
    eos=True,
    admission_order=AdmissionOrder.FCFS_STRICT,
    step_order=StepOrder.PREFILL_FIRST,
    same_step_prefix_hits=True,
    free_queue_order=True,
)


def _version() -> str:
    try:
        return metadata.version("nano-vllm-fork")
    except metadata.PackageNotFoundError:  # pragma: no cover - installed from source
        return "unknown"


class NanoVllmAdapter:
    """nano-vllm-fork's Scheduler + BlockManager behind the conformance protocol."""

    properties = NANOVLLM_PROPERTIES

    def __init__(self, *, native_sequence: bool = False) -> None:
        self._native = native_sequence
        self._sched: Any = None
        self._seq_cls: Any = Sequence
        self._cfg: EngineConfig | None = None
        self._seqs: dict[str, Any] = {}  # request id -> Sequence, live ones
        self._all: dict[str, Any] = {}  # request id -> Sequence, every one submitted
        self._ids: dict[int, str] = {}  # seq_id -> request id
        self._max_tokens: dict[str, int] = {}
        self._arrival: dict[str, int] = {}
        self._ran: set[str] = set()  # has been scheduled at least once
        self._retired: list[tuple[Any, RequestStatus]] = []
        self._pending: list[Any] = []

    @property
    def name(self) -> str:
        return f"nano-vllm-fork {_version()}" + (" (native Sequence)" if self._native else "")

    @property
    def features(self) -> frozenset[Feature]:
        return frozenset({Feature.PREFIX_CACHING, Feature.PREEMPTION})

    # ------------------------------------------------------------------ setup
    def configure(self, config: EngineConfig) -> None:
        if not config.enable_prefix_caching:
            raise NotSupported("nano-vllm always caches prefixes")
        if config.block_size < 2:
            # Its Config only allows multiples of 256, and may_append detects "the next
            # token starts a new block" as len(seq) % block_size == 1, never true for 1.
            raise NotSupported("nano-vllm needs block_size >= 2 (its Config: multiples of 256)")
        # Exactly the fields Scheduler.__init__ reads from nanovllm.config.Config.
        hand_made = SimpleNamespace(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            eos=config.eos_token_id if config.eos_token_id is not None else -1,
            num_kvcache_blocks=config.num_blocks,
            kvcache_block_size=config.block_size,
        )
        self._sched = Scheduler(hand_made)
        self._sched.block_manager = self.make_block_manager(config.num_blocks, config.block_size)
        self._seq_cls = (
            Sequence
            if self._native
            else type("ConformanceSequence", (Sequence,), {"block_size": config.block_size})
        )
        self._cfg = config
        self._seqs.clear()
        self._all.clear()
        self._ids.clear()
        self._max_tokens.clear()
        self._arrival.clear()
        self._ran.clear()
        self._retired.clear()
        self._pending = []

    def make_block_manager(self, num_blocks: int, block_size: int) -> Any:
        """The block manager the scheduler runs with: nano-vllm's own, built exactly as
        ``Scheduler.__init__`` builds it. A hook for the corpus's patch modules, which put
        a bug back (or a fix in) on the instances they build and nowhere else."""
        return BlockManager(num_blocks, block_size)

    @property
    def cfg(self) -> EngineConfig:
        if self._cfg is None:
            raise NotSupported("configure() was not called")
        return self._cfg

    def add_request(self, request: RequestSpec) -> None:
        if request.stop_token_ids:
            raise NotSupported("nano-vllm has no per-request stop token ids")
        if request.eos_token_id not in (None, self.cfg.eos_token_id):
            raise NotSupported("nano-vllm has one global eos token id")
        if request.request_id in self._seqs:
            raise Rejected(f"duplicate request id {request.request_id!r}")
        try:
            params = SamplingParams(max_tokens=request.max_tokens)
            seq = self._seq_cls(list(request.prompt_token_ids), params)
        except (AssertionError, IndexError, ValueError) as e:
            raise Rejected(f"{type(e).__name__}: {e}") from e
        self._seqs[request.request_id] = seq
        self._all[request.request_id] = seq
        self._ids[seq.seq_id] = request.request_id
        self._max_tokens[request.request_id] = request.max_tokens
        self._arrival[request.request_id] = request.arrival_step
        self._sched.add(seq)

    def abort(self, request_id: str) -> None:
        raise NotSupported("nano-vllm has no abort")

    def rollback(self) -> None:
        raise NotSupported("nano-vllm's schedule() mutates state and cannot be undone")

    def has_unfinished(self) -> bool:
        return not self._sched.is_finished()

    @property
    def scheduler(self) -> Any:
        """The nano-vllm Scheduler this adapter drives (the bench times it directly)."""
        return self._sched

    # ------------------------------------------------------------------ the step
    def schedule(self) -> StepReport:
        self._retired = []
        held = {rid for rid, s in self._all.items() if s.block_table}
        seqs, is_prefill = self._sched.schedule()
        self._pending = list(seqs)
        bs = self.cfg.block_size
        scheduled: list[ScheduledRequest] = []
        for seq in seqs:
            rid = self._ids[seq.seq_id]
            self._ran.add(rid)
            table = tuple(int(b) for b in seq.block_table)
            if is_prefill:
                cached = int(seq.num_cached_tokens)
                positions = tuple(range(cached, len(seq)))
                slots: list[int] = []
                for i in range(seq.num_cached_blocks, seq.num_blocks):
                    if i >= len(table):
                        break
                    fill = bs if i != seq.num_blocks - 1 else seq.last_block_num_tokens
                    slots.extend(range(table[i] * bs, table[i] * bs + fill))
            else:
                cached = 0
                positions = (len(seq) - 1,)
                # A sequence preempted after it was scheduled has an empty table: the
                # model runner's block_table[-1] has no slot to give (it would raise
                # IndexError), so none is reported (POS: slot mapping length).
                slots = [table[-1] * bs + seq.last_block_num_tokens - 1] if table else []
            scheduled.append(
                ScheduledRequest(
                    request_id=rid,
                    num_new_tokens=len(positions),
                    positions=positions,
                    slot_mapping=tuple(slots),
                    block_table=table,
                    samples=True,
                    num_new_cached_tokens=cached,
                )
            )
        preempted = tuple(
            sorted(rid for rid in held if self._all[rid].status == SequenceStatus.WAITING)
        )
        return StepReport(scheduled=tuple(scheduled), preempted=preempted)

    def commit(self, sampled: Mapping[str, int]) -> CommitReport:
        seqs, self._pending = self._pending, []
        tokens = [sampled[self._ids[s.seq_id]] for s in seqs]
        self._sched.postprocess(seqs, tokens)
        finished: list[tuple[str, str]] = []
        for seq in seqs:
            rid = self._ids[seq.seq_id]
            if seq.status == SequenceStatus.FINISHED and rid not in dict(finished):
                eos = self.cfg.eos_token_id
                reason = "stop" if eos is not None and seq.last_token == eos else "length"
                finished.append((rid, reason))
                self._seqs.pop(rid, None)
                self._retired.append((seq, RequestStatus.FINISHED))
        return CommitReport(tuple(finished))

    # ------------------------------------------------------------------ snapshots
    def _kv_len(self, seq: Any) -> int:
        if seq.status == SequenceStatus.RUNNING and seq.block_table:
            return len(seq) - 1
        return 0

    def _request(self, rid: str, seq: Any, status: RequestStatus | None = None) -> RequestSnapshot:
        kv = self._kv_len(seq)
        if status is None:
            if seq.status == SequenceStatus.RUNNING:
                status = RequestStatus.DECODING
            elif seq.status == SequenceStatus.FINISHED:
                status = RequestStatus.FINISHED
            else:
                status = RequestStatus.PREEMPTED if rid in self._ran else RequestStatus.WAITING
        return RequestSnapshot(
            request_id=rid,
            status=status,
            num_prompt_tokens=int(seq.num_prompt_tokens),
            num_output_tokens=int(seq.num_completion_tokens),
            num_computed_tokens=kv if not status.is_done else 0,
            max_tokens=self._max_tokens[rid],
            num_cached_tokens=int(seq.num_cached_tokens),
            max_model_len=self.cfg.max_model_len,
            arrival_step=self._arrival.get(rid, 0),
        )

    def _revived(self) -> dict[str, Any]:
        """Sequences nano-vllm brought back after they finished: a stale queue entry that
        its decode loop preempted is WAITING again and may run again (and hold blocks).
        They are reported as the engine holds them, never hidden."""
        retired = {s.seq_id for s, _ in self._retired}
        queued = {s.seq_id for s in (*self._sched.waiting, *self._sched.running)}
        return {
            rid: seq
            for rid, seq in self._all.items()
            if rid not in self._seqs
            and seq.seq_id not in retired
            and seq.status != SequenceStatus.FINISHED
            and (seq.seq_id in queued or seq.block_table)
        }

    def snapshot(self) -> EngineSnapshot:
        bm = self._sched.block_manager
        live = {**self._seqs, **self._revived()}
        requests = [self._request(rid, seq) for rid, seq in live.items()]
        requests += [self._request(self._ids[s.seq_id], s, st) for s, st in self._retired]
        tables = [
            TableSnapshot(
                rid,
                tuple(int(b) for b in seq.block_table),
                self._kv_len(seq),
                tuple(int(t) for t in seq.token_ids[: self._kv_len(seq)]),
                ROOT,
            )
            for rid, seq in sorted(self._all.items())
            if seq.block_table
        ]
        pool = PoolSnapshot(
            num_blocks=len(bm.blocks),
            block_size=int(bm.block_size),
            ref_cnt=tuple(int(b.ref_count) for b in bm.blocks),
            free_queue=tuple(int(b) for b in bm.free_block_ids),
            tables=tuple(tables),
        )
        return EngineSnapshot(tuple(sorted(requests, key=lambda r: r.request_id)), pool)


def make() -> NanoVllmAdapter:
    """Factory for ``--adapter refserve.conformance.adapters.nanovllm:make``."""
    return NanoVllmAdapter()


def make_native() -> NanoVllmAdapter:
    """Like :func:`make` but with nano-vllm's own ``Sequence`` (block size fixed at 256)."""
    return NanoVllmAdapter(native_sequence=True)
