"""The adapter for refserve itself (``refserve.conformance.adapters.ref:make``); it must pass
everything.

It drives :class:`refserve.core.scheduler.Scheduler` directly: ``schedule`` plans a step and builds
the executor's real inputs with :func:`refserve.core.inputs.build_inputs` (the same arrays the
model would get, as :class:`refserve.core.engine_core.EngineCore` does when it checks itself), so
POS checks the slot mapping the executor really receives.

Migration (feature ``migration``) is :mod:`refserve.core.transit` as it is: ``export_request``
is :func:`refserve.core.transit.export` (the ticket is the
:class:`~refserve.core.transit.Departure`, its slots the source slots the engine reads, on the host
for a swapped request),
``stage_import`` one :func:`refserve.core.transit.begin_import` with one ``Import.stage``,
``commit_import`` / ``abort_import`` its ``commit`` / ``abort``, ``release``
:func:`refserve.core.transit.release`. The link (copying the K/V from slot to slot) is the suite's,
as the executor is.

Under policy mlfq (``make_mlfq``) refserve is a preemptive multi-level feedback queue: the
adapter declares that discipline (``EngineProperties.multi_level``) instead of an admission
and a step order, reports each live request's level (``levels()``, the policy's
``level_of``) and gives the explorer the policy's books the snapshot does not show
(``explore_key()``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Mapping

from refserve.conformance.adapter import (
    ALL_FEATURES,
    AdmissionOrder,
    CommitReport,
    EngineConfig,
    EngineProperties,
    Feature,
    MigrationExport,
    MigrationStaged,
    MultiLevelQueue,
    NotSupported,
    Rejected,
    RequestSpec,
    StepOrder,
    StepReport,
)
from refserve.core import transit
from refserve.core.config import PolicyName, SchedulerConfig
from refserve.core.inputs import build_inputs, scheduled_requests
from refserve.core.mlfq import SkipJoinMlfq
from refserve.core.mlfq_settings import MlfqSettings
from refserve.core.plan import StepPlan
from refserve.core.policy import Policy
from refserve.core.request import Request, StopParams
from refserve.core.scheduler import Scheduler
from refserve.core.transit import Departure, Import, KVPlace
from refserve.errors import RefserveError
from refserve.spec.snapshot import EngineSnapshot

# refserve's conventions: KV length and table length agree exactly, eos stops a request,
# the free queue is an LRU queue handed out from its head, decode-first batching, and
# strict priority-then-arrival admission with head-of-line blocking (no aging configured:
# Planner._admit stops at the first waiting request that does not fit, so the strict
# order is declared and checked, not the lax one that allows skipping such a head);
# a request that reaches max_model_len (SchedulerConfig.max_len, which its snapshot reports)
# finishes there with reason length (Scheduler.commit).
REF_PROPERTIES = EngineProperties(
    lookahead_slots=0,
    eos=True,
    admission_order=AdmissionOrder.PRIORITY_STRICT,
    step_order=StepOrder.DECODE_FIRST,
    free_queue_order=True,
    max_model_len_stop=True,
)

# Under policy mlfq (ref/core/mlfq.py) refserve is a preemptive multi-level feedback
# queue: its waiting queue is read level by level, each level by priority then arrival
# (the policy's queue groups by level; WaitingQueue orders a group by priority, seq), and
# it displaces a running request only for a waiting one of a higher level. It reorders
# and preempts by design, so it declares that discipline instead of an admission and a
# step order, and reports each request's level (SkipJoinMlfq.level_of).
MLFQ_PROPERTIES = EngineProperties(
    lookahead_slots=0,
    eos=True,
    free_queue_order=True,
    max_model_len_stop=True,
    multi_level=MultiLevelQueue(num_levels=MlfqSettings().num_queues, by_priority=True),
)

# The knobs ``make_mlfq`` runs with: quanta small enough that the suite's short requests
# move between levels (a decode is priced 3 ms, so a level-0 request is demoted after two
# decodes), a starvation bound short enough that the workloads see promotions, and three
# levels so that a request can be displaced by one above it and displace one below.
CONFORMANCE_MLFQ = MlfqSettings(num_queues=3, base_quantum_ms=4.0, starvation_steps=8)


def _is_mlfq(policy: object) -> bool:
    return policy is not None and str(policy) == PolicyName.MLFQ.value


class RefAdapter:
    """refserve's scheduler + block pool, every feature on."""

    name = "refserve"
    properties = REF_PROPERTIES

    def __init__(
        self,
        *,
        policy_factory: Callable[[SchedulerConfig], Policy] | None = None,
        **overrides: object,
    ) -> None:
        """``overrides`` are extra :class:`SchedulerConfig` fields (policy, admission...);
        ``policy_factory`` builds the scheduler's policy object from the configuration
        instead of the one ``policy`` names (a test plants a broken policy this way).

        With ``policy="mlfq"`` the adapter declares the multi-level queue discipline of
        its ``mlfq`` settings (:data:`MLFQ_PROPERTIES`, with their number of levels)."""
        self._overrides = overrides
        self._policy_factory = policy_factory
        if _is_mlfq(overrides.get("policy")):
            mlfq = overrides.get("mlfq", MlfqSettings())
            levels = mlfq.num_queues if isinstance(mlfq, MlfqSettings) else 1
            self.properties = dataclasses.replace(
                MLFQ_PROPERTIES, multi_level=MultiLevelQueue(levels, by_priority=True)
            )
        self._sched: Scheduler | None = None
        self._plan: StepPlan | None = None
        self._import: Import | None = None

    @property
    def features(self) -> frozenset[Feature]:
        # refserve copies nothing to or from another store (its swaps are part of the
        # step): no copy is ever in flight for the suite to decide.
        return ALL_FEATURES - {Feature.TRANSFER_FAULTS}

    @property
    def sched(self) -> Scheduler:
        if self._sched is None:
            raise NotSupported("configure() was not called")
        return self._sched

    def configure(self, config: EngineConfig) -> None:
        overrides = dict(self._overrides)
        if overrides.get("num_host_blocks") == "pool":  # as many host blocks as device ones
            overrides["num_host_blocks"] = config.num_blocks
        try:
            cfg = SchedulerConfig(
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_num_seqs=config.max_num_seqs,
                block_size=config.block_size,
                num_blocks=config.num_blocks,
                max_model_len=config.max_model_len,
                enable_prefix_caching=config.enable_prefix_caching,
                num_speculative_tokens=config.num_speculative_tokens,
                **overrides,  # type: ignore[arg-type]  # caller-chosen extra fields
            )
        except RefserveError as e:
            raise NotSupported(str(e)) from e
        policy = None if self._policy_factory is None else self._policy_factory(cfg)
        self._sched = Scheduler(cfg, policy)
        self._plan = None
        self._import = None

    def add_request(self, request: RequestSpec) -> None:
        try:
            stop = StopParams(
                max_tokens=request.max_tokens,
                stop_token_ids=request.stop_token_ids,
                eos_token_id=request.eos_token_id,
            )
            r = Request(
                request.request_id,
                list(request.prompt_token_ids),
                stop,
                priority=request.priority,
                namespace=request.namespace,
            )
            self.sched.add_request(r)
        except RefserveError as e:
            raise Rejected(str(e)) from e

    def abort(self, request_id: str) -> None:
        self.sched.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.sched.has_unfinished

    def schedule(self) -> StepReport:
        sched = self.sched
        plan = sched.schedule()
        self._plan = plan
        bs = sched.config.block_size
        inputs = build_inputs(plan, sched.requests, sched.pool)
        scheduled = scheduled_requests(plan, inputs, bs)
        return StepReport(
            scheduled=scheduled,
            preempted=plan.preempted,
            finished=tuple((f.request_id, str(f.reason)) for f in plan.finished),
            block_copies=tuple((c.src, c.dst) for c in plan.copies),
            swap_out=tuple((c.src, c.dst) for c in plan.swap_out),
            swap_in=tuple((c.src, c.dst) for c in plan.swap_in),
        )

    def propose(self, request_id: str, draft_token_ids: tuple[int, ...]) -> None:
        self.sched.propose(request_id, draft_token_ids)

    def commit(
        self, sampled: Mapping[str, int], accepted: Mapping[str, int] | None = None
    ) -> CommitReport:
        plan = self._plan
        if plan is None:
            raise RuntimeError("commit without schedule")
        self._plan = None
        sched = self.sched
        sched.commit(plan, sampled, accepted=accepted)
        return CommitReport(
            tuple(
                (r.request_id, str(r.finish_reason))
                for r in sched.retired
                if r.finish_reason is not None and str(r.finish_reason) != "abort"
            )
        )

    def rollback(self) -> None:
        self.sched.rollback()
        self._plan = None

    # ------------------------------------------------------------------ migration
    def export_request(self, request_id: str) -> MigrationExport:
        dep = transit.export(self.sched, request_id)
        return MigrationExport(
            request_id, dep.slots, kv_on_host=dep.kv_place is KVPlace.HOST, ticket=dep
        )

    def stage_import(self, export: MigrationExport, transfer: bool) -> MigrationStaged:
        dep = export.ticket
        if not isinstance(dep, Departure):
            raise Rejected(f"not a refserve ticket: {type(dep).__name__}")
        imp = transit.begin_import(self.sched)
        try:
            arrival = imp.stage(dep.state, with_kv=transfer)
        except RefserveError as e:
            imp.abort()
            raise Rejected(str(e)) from e
        self._import = imp
        return MigrationStaged(dep.state.request_id, arrival.num_hit_tokens, arrival.slots)

    def commit_import(self) -> None:
        self._staged().commit()
        self._import = None

    def abort_import(self) -> None:
        self._staged().abort()
        self._import = None

    def release(self, request_id: str) -> None:
        transit.release(self.sched, request_id)

    def _staged(self) -> Import:
        if self._import is None:
            raise RuntimeError("no import is staged")
        return self._import

    def snapshot(self) -> EngineSnapshot:
        sched = self.sched
        return sched.snapshot(extra=sched.retired)

    # ------------------------------------------------------------------ mlfq
    def _mlfq(self) -> SkipJoinMlfq:
        policy = self.sched.policy
        if not isinstance(policy, SkipJoinMlfq):
            raise NotSupported("levels exist only under policy mlfq")
        return policy

    def levels(self) -> dict[str, int]:
        """Every live request's level (a declared multi-level queue): the books the
        next step is planned with, which change only when a step commits."""
        policy = self._mlfq()
        return {rid: policy.level_of(r) for rid, r in self.sched.requests.items()}

    def explore_key(self) -> Hashable:
        """The policy's books the snapshot does not show (the explorer's key): merging
        two states that differ only in a level, a request's service or its wait towards
        the starvation bound would merge schedules that differ. None under the other
        policies, whose state the snapshot shows."""
        sched = self.sched
        policy = sched.policy
        if not isinstance(policy, SkipJoinMlfq):
            return None
        bound = policy.settings.starvation_steps
        out = []
        for rid in sorted(sched.requests):
            b = policy.books_of(sched.requests[rid])
            # Past the bound every wait is the same to the policy: it promotes.
            waited = None if b.queued_step is None else min(sched.step_index - b.queued_step, bound)
            out.append((rid, b.level, b.served_ms, b.resumed_ms, b.protected_ms, waited))
        return tuple(out)


def make() -> RefAdapter:
    """Factory for ``--adapter refserve.conformance.adapters.ref:make``."""
    return RefAdapter()


def make_swap() -> RefAdapter:
    """refserve preempting by swap (``--adapter refserve.conformance.adapters.ref:make_swap``): a
    host pool as large as the device pool, so every preemption victim is swapped out
    and back, and the runner's fake memory follows the copies."""
    return RefAdapter(preemption_mode="swap", num_host_blocks="pool")


def make_mlfq() -> RefAdapter:
    """refserve under policy mlfq (``--adapter refserve.conformance.adapters.ref:make_mlfq``):
    the skip-join multi-level feedback queue with the small quanta of
    :data:`CONFORMANCE_MLFQ` and a host pool as large as the device pool, so displaced
    requests keep their K/V on the host (proactive swap) as the policy prefers. It
    declares the multi-level queue discipline and reports each request's level."""
    return RefAdapter(policy=PolicyName.MLFQ, mlfq=CONFORMANCE_MLFQ, num_host_blocks="pool")
