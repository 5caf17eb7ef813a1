"""Conformance adapters for the indie engine (tests/conformance/indie_engine.py).

``indie_adapter:make`` drives the whole engine (:class:`IndieAdapter`,
``refserve.conformance.adapter.EngineAdapter``); ``indie_adapter:make_kv`` drives its block manager
alone (:class:`IndieKVAdapter`, ``refserve.conformance.kv.protocol.KVAdapter``). Each planted bug
of :data:`indie_engine.BUGS` has both factories, ``make_<bug>`` and ``make_kv_<bug>``
(e.g. ``indie_adapter:make_cow_skipped`` / ``indie_adapter:make_kv_cow_skipped``),
resolved by the module ``__getattr__`` below; both build the engine or manager with that
bug. ``make_lax`` and ``make_lax_<bug>`` build the same engines declaring the lax ``fcfs``
order instead of the engine's real ``fcfs_strict`` (how ``hol_skip`` passes the lax rule
and fails the strict one). With ``tests/conformance`` on ``sys.path`` they load like any
adapter.

How the engine maps onto the protocol (the adapters translate; they never fix):

* The engine's step is one generator (plan, ``yield`` the batch, receive the sampled
  tokens, commit). ``schedule`` runs it up to the ``yield``; ``commit`` sends the tokens
  and returns what the generator returns. Planning mutates the engine at once and
  nothing can undo it, so ``rollback`` is not supported.
* States: never run -> ``waiting``; ``PREFILL`` -> ``prefilling``; ``DECODE`` ->
  ``decoding``; ``PREEMPTED`` -> ``preempted``; retired requests (the engine's outbox,
  emptied when a step begins) -> ``finished`` or, for reason ``abort``, ``aborted``.
* Positions, slots and block tables are the engine's :class:`indie_engine.Chunk`, as its
  model runner would receive them; the table may hold the block of the slot reserved
  ahead (declared: ``lookahead_slots=1``).
* The pool's free queue is the LIFO stack read from the top (hand-out order). The
  prefix index is keyed by Python ``hash`` chains, not by the spec hash chain, so no
  cache entries are exposed (feature ``cache_index`` off).
* Not supported (undeclared): prefix caching in the scheduler, priorities, rollback,
  stop token ids, eos (declared ``eos=False``: it stops only at ``max_tokens``).
* Without chunked prefill (``chunked=False``: ``make_unchunked``, and
  ``make_unchunked_<bug>`` for :data:`indie_engine.BUGS` and
  :data:`indie_engine.UNCHUNKED_BUGS`) the feature ``chunked_prefill`` is off.
* Migration (feature ``migration``, only with ``migration=True``: ``make_migrating``,
  ``make_migrating_<bug>`` for :data:`indie_engine.MIGRATION_BUGS`, and
  ``make_recompute``, an engine that never takes K/V) is the engine's export / stage /
  commit / abort_import / release; the ticket is its :class:`indie_engine.Ticket`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from indie_engine import (
    BUGS,
    MIGRATION_BUGS,
    UNCHUNKED_BUGS,
    BlockManager,
    EngineError,
    IndieEngine,
    OutOfBlocks,
    Request,
    State,
    StepGen,
    Ticket,
)

from refserve.conformance.adapter import (
    AdmissionOrder,
    CommitReport,
    EngineConfig,
    EngineProperties,
    Feature,
    MigrationExport,
    MigrationStaged,
    NotSupported,
    Rejected,
    RequestSpec,
    StepOrder,
    StepReport,
)
from refserve.conformance.kv.protocol import Allocation, KVConfig, KVFeature, NoSpace
from refserve.spec.snapshot import (
    EngineSnapshot,
    PoolSnapshot,
    RequestSnapshot,
    RequestStatus,
    ScheduledRequest,
    TableSnapshot,
)

PROPERTIES = EngineProperties(
    lookahead_slots=1,
    eos=False,
    # Head-of-line blocking (_Planner.admit stops at a head that does not fit).
    admission_order=AdmissionOrder.FCFS_STRICT,
    step_order=StepOrder.PREFILL_FIRST,
)

_STATUS = {
    State.QUEUED: RequestStatus.WAITING,
    State.PREFILL: RequestStatus.PREFILLING,
    State.DECODE: RequestStatus.DECODING,
    State.PREEMPTED: RequestStatus.PREEMPTED,
}


def pool_snapshot(bm: BlockManager) -> PoolSnapshot:
    return PoolSnapshot(
        num_blocks=bm.num_blocks,
        block_size=bm.block_size,
        ref_cnt=tuple(bm.ref),
        free_queue=tuple(reversed(bm.free_stack)),
        tables=tuple(
            TableSnapshot(rid, tuple(t.blocks), len(t.tokens), tuple(t.tokens))
            for rid, t in sorted(bm.tables.items())
        ),
    )


class IndieAdapter:
    """The indie engine behind ``refserve.conformance.adapter.EngineAdapter``."""

    def __init__(
        self,
        bug: str | None = None,
        order: AdmissionOrder = AdmissionOrder.FCFS_STRICT,
        *,
        migration: bool = False,
        recompute: bool = False,
        chunked: bool = True,
    ) -> None:
        self.bug = bug
        self.chunked = chunked
        self.properties = replace(PROPERTIES, admission_order=order)
        self.migration = migration or recompute
        self.recompute = recompute
        self._eng: IndieEngine | None = None
        self._gen: StepGen | None = None
        self._arrival: dict[str, int] = {}

    @property
    def name(self) -> str:
        kind = " (recomputes imports)" if self.recompute else ""
        kind += "" if self.chunked else " (unchunked)"
        return "indie 0.1" + kind + (f" (bug {self.bug})" if self.bug else "")

    @property
    def features(self) -> frozenset[Feature]:
        out = {
            Feature.PREEMPTION,
            Feature.ABORT,
            # It never caches for new requests, so switching caching off is always
            # honoured; an import's hit is off then too.
            Feature.PREFIX_CACHING_OPTIONAL,
        }
        if self.migration:
            out.add(Feature.MIGRATION)
        if self.chunked:
            out.add(Feature.CHUNKED_PREFILL)
        return frozenset(out)

    @property
    def eng(self) -> IndieEngine:
        if self._eng is None:
            raise NotSupported("configure() was not called")
        return self._eng

    def configure(self, config: EngineConfig) -> None:
        try:
            self._eng = IndieEngine(
                num_blocks=config.num_blocks,
                block_size=config.block_size,
                max_batched_tokens=config.max_num_batched_tokens,
                max_seqs=config.max_num_seqs,
                max_model_len=config.max_model_len,
                bug=self.bug,
                import_hits=self.migration and config.enable_prefix_caching,
                recompute_imports=self.recompute,
                chunked=self.chunked,
            )
        except EngineError as e:
            raise NotSupported(str(e)) from e
        self._gen = None
        self._arrival = {}

    def add_request(self, request: RequestSpec) -> None:
        if request.stop_token_ids:
            raise NotSupported("stop token ids")
        try:
            self.eng.add_request(request.request_id, request.prompt_token_ids, request.max_tokens)
        except EngineError as e:
            raise Rejected(str(e)) from e
        self._arrival[request.request_id] = request.arrival_step

    def abort(self, request_id: str) -> None:
        self.eng.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.eng.has_unfinished()

    def schedule(self) -> StepReport:
        gen = self.eng.step()
        batch = next(gen)
        self._gen = gen
        return StepReport(
            scheduled=tuple(
                ScheduledRequest(
                    c.rid,
                    len(c.positions),
                    c.positions,
                    c.slots,
                    c.block_table,
                    c.samples,
                )
                for c in batch.chunks
            ),
            preempted=batch.preempted,
            finished=batch.retired,
            block_copies=batch.copies,
        )

    def commit(self, sampled: Mapping[str, int]) -> CommitReport:
        gen, self._gen = self._gen, None
        if gen is None:
            raise RuntimeError("commit without schedule")
        try:
            gen.send(dict(sampled))
        except StopIteration as done:
            return CommitReport(done.value.finished)
        raise RuntimeError("the engine's step did not finish after the model's tokens")

    def rollback(self) -> None:
        raise NotSupported("indie commits its plan as it makes it; a step cannot be undone")

    # ------------------------------------------------------------------ migration
    def export_request(self, request_id: str) -> MigrationExport:
        self._migrating()
        t = self.eng.export(request_id)
        return MigrationExport(request_id, t.slots, ticket=t)

    def stage_import(self, export: MigrationExport, transfer: bool) -> MigrationStaged:
        self._migrating()
        t = export.ticket
        if not isinstance(t, Ticket):
            raise Rejected(f"not an indie ticket: {type(t).__name__}")
        try:
            landing = self.eng.stage(t, transfer=transfer)
        except (EngineError, OutOfBlocks) as e:
            raise Rejected(str(e)) from e
        return MigrationStaged(t.rid, landing.hit_tokens, landing.slots)

    def commit_import(self) -> None:
        self._migrating()
        self.eng.commit()

    def abort_import(self) -> None:
        self._migrating()
        self.eng.abort_import()

    def release(self, request_id: str) -> None:
        self._migrating()
        self.eng.release(request_id)
        self._arrival.pop(request_id, None)

    def _migrating(self) -> None:
        if not self.migration:
            raise NotSupported("migration is off (make_migrating turns it on)")

    def snapshot(self) -> EngineSnapshot:
        eng = self.eng
        live = [*eng.requests.values(), *eng.outbox]
        return EngineSnapshot(
            tuple(self._request(r) for r in sorted(live, key=lambda r: r.rid)),
            pool_snapshot(eng.bm),
        )

    def _request(self, r: Request) -> RequestSnapshot:
        if r.state is State.DONE:
            status = RequestStatus.ABORTED if r.reason == "abort" else RequestStatus.FINISHED
        else:
            status = _STATUS[r.state]
        return RequestSnapshot(
            request_id=r.rid,
            status=status,
            num_prompt_tokens=r.num_prompt,
            num_output_tokens=r.num_outputs,
            num_computed_tokens=r.computed,
            max_tokens=r.max_tokens,
            max_model_len=self.eng.max_model_len,
            arrival_step=self._arrival.get(r.rid, 0),
        )


class IndieKVAdapter:
    """The indie block manager behind ``refserve.conformance.kv.protocol.KVAdapter``.

    A request's first allocation goes through the prefix cache
    (:meth:`BlockManager.allocate_cached`); later ones append. It reserves no slot ahead:
    the engine asks for that, and the KV protocol has no lookahead.
    """

    def __init__(self, bug: str | None = None) -> None:
        self.bug = bug
        self._bm: BlockManager | None = None

    @property
    def name(self) -> str:
        return "indie-blocks 0.1" + (f" (bug {self.bug})" if self.bug else "")

    @property
    def features(self) -> frozenset[KVFeature]:
        return frozenset(
            {KVFeature.FORK, KVFeature.PREFIX_CACHING, KVFeature.PREFIX_CACHING_OPTIONAL}
        )

    @property
    def bm(self) -> BlockManager:
        if self._bm is None:
            raise NotSupported("configure() was not called")
        return self._bm

    def configure(self, config: KVConfig) -> None:
        try:
            self._bm = BlockManager(
                config.num_blocks,
                config.block_size,
                prefix_caching=config.enable_prefix_caching,
                bug=self.bug,
            )
        except EngineError as e:
            raise NotSupported(str(e)) from e

    def allocate(
        self, request_id: str, token_ids: Sequence[int], num_new_tokens: int
    ) -> Allocation:
        bm = self.bm
        try:
            if request_id in bm.tables:
                res = bm.append(request_id, token_ids, num_new_tokens)
            else:
                res = bm.allocate_cached(request_id, token_ids, num_new_tokens)
        except OutOfBlocks as e:
            raise NoSpace(str(e)) from e
        return Allocation(res.table, res.cached_tokens, res.copies)

    def fork(self, parent: str, child: str) -> None:
        self.bm.fork(parent, child)

    def free(self, request_id: str) -> None:
        self.bm.free(request_id)

    def snapshot(self) -> PoolSnapshot:
        return pool_snapshot(self.bm)


def make() -> IndieAdapter:
    """``--adapter indie_adapter:make``: the correct engine."""
    return IndieAdapter()


def make_lax() -> IndieAdapter:
    """The correct engine declaring the lax ``fcfs`` order (its strict order implies it)."""
    return IndieAdapter(order=AdmissionOrder.FCFS)


def make_migrating() -> IndieAdapter:
    """The correct engine with migration: K/V transferred, the destination's hit used."""
    return IndieAdapter(migration=True)


def make_recompute() -> IndieAdapter:
    """The correct engine with migration that never takes K/V: every import recomputes."""
    return IndieAdapter(recompute=True)


def make_unchunked() -> IndieAdapter:
    """The correct engine without chunked prefill: a prompt is prefilled whole."""
    return IndieAdapter(chunked=False)


def make_kv() -> IndieKVAdapter:
    """``--kv-adapter indie_adapter:make_kv``: the correct block manager."""
    return IndieKVAdapter()


def __getattr__(name: str) -> Callable[[], Any]:
    """``make_<bug>``, ``make_lax_<bug>`` and ``make_kv_<bug>`` for every bug in
    ``indie_engine.BUGS``; ``make_migrating_<bug>`` for every one in ``MIGRATION_BUGS``;
    ``make_unchunked_<bug>`` for every one in ``BUGS`` and ``UNCHUNKED_BUGS``."""
    if name.startswith("make_migrating_") and name[len("make_migrating_") :] in MIGRATION_BUGS:
        bug = name[len("make_migrating_") :]
        return lambda: IndieAdapter(bug, migration=True)
    if name.startswith("make_unchunked_") and name[len("make_unchunked_") :] in (
        BUGS | UNCHUNKED_BUGS
    ):
        bug = name[len("make_unchunked_") :]
        return lambda: IndieAdapter(bug, chunked=False)
    if name.startswith("make_lax_") and name[len("make_lax_") :] in BUGS:
        bug = name[len("make_lax_") :]
        return lambda: IndieAdapter(bug, AdmissionOrder.FCFS)
    if name.startswith("make_kv_") and name[len("make_kv_") :] in BUGS:
        bug = name[len("make_kv_") :]
        return lambda: IndieKVAdapter(bug)
    if name.startswith("make_") and name[len("make_") :] in BUGS:
        bug = name[len("make_") :]
        return lambda: IndieAdapter(bug)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
