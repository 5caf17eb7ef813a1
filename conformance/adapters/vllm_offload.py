"""vLLM 0.33.0's V1 scheduler with its CPU offloading connector (``vllm_offload:make``); optional.

The adapter of :mod:`refserve.conformance.adapters.vllm` (the same ``Scheduler``, built
on the CPU without a model; every translation there holds here too), with a real
scheduler-side KV connector: the ``VllmConfig`` carries a ``KVTransferConfig`` with
``kv_connector="OffloadingConnector"``, ``kv_role="kv_both"`` and
``kv_connector_extra_config={"cpu_bytes_to_use": ..., "block_size": bs}``, so
``Scheduler.__init__`` builds ``OffloadingConnector(role=KVConnectorRole.SCHEDULER)``
(``vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py``) and with it
the ``OffloadingConnectorScheduler`` and its ``CPUOffloadingManager``
(``vllm/v1/kv_offload/cpu/manager.py``): lookups, admission of asynchronous loads,
store and load jobs, the flush list, the CPU chunk pool and its LRU eviction are vLLM's
own. The offload chunk is one GPU block (``block_size`` = the pool's block size, so
``blocks_per_chunk`` is 1) and the CPU tier holds :data:`HOST_BLOCKS_PER_BLOCK` times the
device pool's blocks (``cpu_bytes_to_use`` is that many chunks of the manager's own
aligned chunk size; checked after construction). Nothing of vLLM is copied or patched.

**The fake worker.** vLLM's worker side (``OffloadingConnectorWorker``) needs GPU KV
tensors and a transfer engine, so the adapter plays it, as the suite plays the model
runner. It reads the jobs the scheduler side put in ``SchedulerOutput
.kv_connector_metadata`` (``OffloadingConnectorMetadata``: ``load_jobs``,
``store_jobs``, ``jobs_to_flush``) and completes every job after a fixed number of
steps, reporting it in that step's ``ModelRunnerOutput.kv_connector_output`` as the
real worker does (``get_finished`` and ``build_connector_worker_meta``):
``kv_connector_worker_meta=OffloadingWorkerMetadata(completed_jobs={job: 1})`` for
every completed load and store (one worker), ``finished_recving`` = the requests of the
completed loads, ``finished_sending`` empty (the offloading worker never sends it: store
completion travels in the worker metadata only).

* A **load** created in step ``t`` (the real worker submits it at the start of step
  ``t``) completes in step ``t + load_steps - 1`` (``load_steps`` >= 1; 2 by default: it is in
  flight at the boundary after ``t``, where the snapshot shows the request ``loading``
  and the load in ``PoolSnapshot.transfers``; with 1 it lands in the step that
  submitted it and no boundary sees it).
* A **store** created in step ``t`` (the real worker defers it to the start of step
  ``t + 1``, after the step's forward wrote the blocks) completes in step
  ``t + store_steps`` (``store_steps`` >= 1; 2 by default), unless a later
  ``jobs_to_flush`` names it first: the real worker then submits it and waits for it
  before the step's forward (``handle_preemptions``), so a flushed store completes in the
  step that flushes it.
* **Drawn outcomes** (feature ``transfer_faults``). When the suite decides the copies
  in flight (a workload's ``transfer_outcomes`` or ``transfer_seed``; the exhaustive
  explorer), it names, before each step, an outcome for each (request, kind) in flight
  at the boundary: the jobs complete in the step, stay in flight (a store the step
  flushes completes all the same: the real worker waits for it), or **fail**. Jobs the
  step creates keep the timing above. A failed job copies nothing (no ``swap_in`` /
  ``swap_out``) and is listed in ``PoolSnapshot.failed_transfers`` from the next
  boundary (a load for as long as its request keeps its blocks for the recompute).
* **A failed load** is reported the way vLLM's connector API lets a worker report one:
  the job in ``completed_jobs`` (the connector's scheduler side releases its CPU
  chunks), the request in ``finished_recving``, its device blocks in
  ``invalid_block_ids``. The scheduler's ``kv_load_failure_policy`` then decides:
  ``fail`` (vLLM's default; :func:`make`) finishes the request with ``FINISHED_ERROR``
  (reason ``error``), ``recompute`` (:func:`make_recompute`) truncates its computed
  tokens at the first failed block and lets it look up again (the CPU tier still holds
  the chunks, so it usually loads them again). vLLM's own worker cannot fail a job
  (``OffloadingConnectorWorker.get_finished`` asserts ``transfer_result.success``).
* **A failed store** is withheld: never reported. vLLM 0.33.0 has no way to hear of a
  failed store (``OffloadingWorkerMetadata`` carries completed jobs only, and nothing
  calls ``complete_store(success=False)``, which would drop the chunks), and reporting
  it completed would make the chunks loadable with K/V that never arrived. Withheld,
  the chunks stay write-pending: no load ever reads them, but a lookup that reaches
  them is deferred until they are ready, which is never (conformance/FINDINGS_vllm.md,
  "Failed transfers").
* Completions are reported in job-id order. A job completes at the start of its step:
  the step's ``StepReport`` carries its copy, ``swap_out`` (device block, CPU chunk) for a
  store and ``swap_in`` (CPU chunk, device block) for a load, which the suite's fake KV
  memory executes before the step's writes. CPU chunk ``c`` is host block ``c`` (one
  block per chunk). A store copies at the latest moment its protection allows: a block
  freed and handed out again before its store completed must be flushed, or the CPU
  copy holds the new owner's K/V and a later load reads it back (the read-back catches
  it). ``EngineSnapshot.host`` stays ``None``: the CPU tier is a cache with no request
  tables (the protocol's host pool is a swap pool whose every block a swapped request
  holds); the swaps work without it.

**A request waiting for remote K/V** (``WAITING_FOR_REMOTE_KVS``: admitted as an
asynchronous load) holds blocks while the load is in flight: its local prefix hit and
fresh blocks for the tokens the load brings (``allocate_slots`` with
``delay_cache_blocks``; ``req_to_blocks``, ref counts 1 and up). vLLM sets its
``num_computed_tokens`` to the hit it will have at admission, before the K/V is there.
In the protocol's terms the request has no KV yet: it is reported with
``num_computed_tokens`` 0, and

* while its load is in flight, with status ``loading``: not runnable until the load
  lands (PROGRESS counts the admission into a load as the step's progress, and the
  starvation bound leaves it alone);
* once the load has landed (vLLM has its id in ``finished_recving_kv_req_ids``) and until
  the scheduler picks it up, with vLLM's own waiting status (``waiting``, or
  ``preempted`` if it ran before): it is runnable again.

Its blocks are held by the load: the snapshot lists them as a table named ``<id>@load``
holding ``num_computed_tokens`` tokens (the prefix the blocks will hold), so the pool's
ref counts stay those of vLLM. No read-back reads that table (the suite knows no request
of that name); the request's own table appears when vLLM schedules it, and the tokens
it loaded are then its ``num_new_loaded_tokens`` (positions start after them and its
prefix hit): no cache hit, so a whole block-aligned prompt loaded and stepped back one
token for a logit is not a partial-block hit; the load's copies are the step's
``swap_in``, so the runner reads them back through its table. A request aborted
while its load is in flight keeps its blocks until the load completes (vLLM's
``delay_free_blocks``), under the same ``<id>@load`` table.

**Copies in flight** at a boundary are ``PoolSnapshot.transfers``: every job the fake
worker has not completed, a load's blocks held by the ``<id>@load`` table. **Blocks of
in-flight stores** are reported as vLLM holds them: the offloading connector
does not delay frees (``request_finished`` returns ``False``), so a finished request's
blocks are free (ref count 0, in the free queue) while their stores are in flight; reuse
is protected by the flush list, not by a reference. A running request's blocks are held
by its table as usual.

**Declared conventions** are :data:`~refserve.conformance.adapters.vllm.VLLM_PROPERTIES`
except the admission order, left ``unspecified``: with an asynchronous load a request
is admitted in one step (its load starts, no token) and scheduled in a later one, while
requests behind it run; and a lookup the connector defers (``get_num_new_matched_tokens``
returns ``None``: its chunks are being loaded for another request, or it still has
transfers in flight) is skipped (``skip_request``) and later requests are admitted. The
strict and the lax order would both call that passing over.

The adapter counts what the connector did: :attr:`VllmOffloadAdapter.transfers` per
instance, :data:`TOTALS` over every instance of the process (stores and loads
completed, chunks moved, flushed stores, requests admitted with a load).
"""

from __future__ import annotations

import importlib
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from refserve.conformance.adapter import (
    AdmissionOrder,
    CommitReport,
    EngineConfig,
    EngineProperties,
    Feature,
    NotSupported,
    StepReport,
    TransferOutcome,
)
from refserve.conformance.adapters.vllm import (
    NULL_BLOCKS,
    VLLM_PROPERTIES,
    V,
    VllmAdapter,
)
from refserve.spec.snapshot import (
    EngineSnapshot,
    RequestStatus,
    ScheduledRequest,
    TableSnapshot,
    Transfer,
    TransferKind,
)

_KVTransferConfig: Any = importlib.import_module("vllm.config").KVTransferConfig
_KVConnectorOutput: Any = importlib.import_module("vllm.v1.outputs").KVConnectorOutput
_WorkerMeta: Any = importlib.import_module(
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading.common"
).OffloadingWorkerMetadata
_CPUSpec: Any = importlib.import_module("vllm.v1.kv_offload.cpu.spec").CPUOffloadingSpec

HOST_BLOCKS_PER_BLOCK = 4
"""CPU chunks per device block: the CPU tier is larger than the pool, as in practice."""

LOADING_SUFFIX = "@load"
"""The suffix of the table that holds an in-flight load's blocks (``A@load``)."""

LOAD_FAILURE_POLICIES = ("fail", "recompute")
"""vLLM's ``KVTransferConfig.kv_load_failure_policy`` values (``fail``: its default)."""

OFFLOAD_PROPERTIES = replace(VLLM_PROPERTIES, admission_order=AdmissionOrder.UNSPECIFIED)
"""vLLM's conventions with the connector (module docstring: the admission order)."""

TOTALS: Counter[str] = Counter()
"""What every adapter of this process made the connector do (stores, loads, chunks)."""


@dataclass(frozen=True)
class _Job:
    """One transfer the fake worker has in flight."""

    job_id: int
    is_store: bool
    req_id: str
    pairs: tuple[tuple[int, int], ...]
    """(device block, CPU chunk) for a store, (CPU chunk, device block) for a load, in
    the protocol's block ids."""
    due: int
    """The step in whose output it completes."""
    created: int = 0
    """The step whose metadata created it."""
    flushed: int = -1
    """The step whose ``jobs_to_flush`` named it (-1: none)."""

    @property
    def kind(self) -> TransferKind:
        return TransferKind.STORE if self.is_store else TransferKind.LOAD

    def transfer(self) -> Transfer:
        """The copy as the protocol records it (a load's blocks held by ``<id>@load``)."""
        if self.is_store:
            return Transfer(self.req_id, self.kind, tuple(dev for dev, _ in self.pairs))
        blocks = tuple(dev for _, dev in self.pairs)
        return Transfer(self.req_id, self.kind, blocks, self.req_id + LOADING_SUFFIX)


def _ids(spec: Any) -> list[int]:
    return [int(b) for b in spec.block_ids]


class VllmOffloadAdapter(VllmAdapter):
    """vLLM's scheduler with ``OffloadingConnector`` and a fake worker side."""

    def __init__(
        self,
        *,
        policy: str = "fcfs",
        load_steps: int = 2,
        store_steps: int = 2,
        offload_prompt_only: bool = True,
        load_failure_policy: str = "fail",
    ) -> None:
        if load_steps < 1 or store_steps < 1:
            raise ValueError("a transfer takes at least one step")
        if load_failure_policy not in LOAD_FAILURE_POLICIES:
            raise ValueError(
                f"load_failure_policy must be one of {LOAD_FAILURE_POLICIES}, "
                f"got {load_failure_policy!r}"
            )
        super().__init__(policy=policy)
        self._offload_prompt_only = offload_prompt_only
        self.properties: EngineProperties = OFFLOAD_PROPERTIES
        self._load_steps = load_steps
        self._store_steps = store_steps
        self._load_failure_policy = load_failure_policy
        self._jobs: dict[int, _Job] = {}
        self._completing: list[_Job] = []
        self._failing: list[_Job] = []
        self._failed: tuple[Transfer, ...] = ()
        """The copies that failed in the last step (the next boundary's snapshots)."""
        self._outcomes: dict[tuple[str, str], TransferOutcome] = {}
        """The suite's outcomes for the copies in flight, for the next schedule()."""
        self._loaded: Counter[str] = Counter()
        """Tokens each request's completed loads wrote, until it is scheduled."""
        self._step = 0
        self._host_blocks = 0
        self.transfers: Counter[str] = Counter()

    @property
    def name(self) -> str:
        outputs = "" if self._offload_prompt_only else "; outputs offloaded too"
        return (
            f"{super().name} + OffloadingConnector (CPU; loads land after "
            f"{self._load_steps} step(s), stores after {self._store_steps}{outputs}; "
            f"kv_load_failure_policy={self._load_failure_policy})"
        )

    @property
    def features(self) -> frozenset[Feature]:
        return super().features | {Feature.TRANSFER_FAULTS}

    def transfer_outcomes(self, outcomes: Mapping[tuple[str, str], TransferOutcome]) -> None:
        """The suite's outcome for each copy group in flight (module docstring)."""
        self._outcomes = {
            (rid, str(kind)): TransferOutcome(o) for (rid, kind), o in outcomes.items()
        }

    # ------------------------------------------------------------------ setup
    def kv_transfer_config(self, config: EngineConfig) -> Any:
        bs = config.block_size
        # The manager's chunk: the pool's page of one block (K and V, one head of 32
        # float32 values per token: the adapter's FullAttentionSpec), page-aligned.
        align = int(_CPUSpec.BLOCK_SIZE_ALIGNMENT)
        chunk = -(-2 * bs * 32 * 4 // align) * align
        self._host_blocks = HOST_BLOCKS_PER_BLOCK * config.num_blocks
        return _KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "cpu_bytes_to_use": self._host_blocks * chunk,
                "block_size": bs,
                # vLLM's default (True) offloads prompt blocks only; False offloads the
                # blocks a request's outputs fill too (make_outputs).
                "offload_prompt_only": self._offload_prompt_only,
            },
            kv_load_failure_policy=self._load_failure_policy,
        )

    def configure(self, config: EngineConfig) -> None:
        super().configure(config)
        manager = self._sched.connector.connector_scheduler.manager
        if int(manager._num_chunks) != self._host_blocks:
            raise NotSupported(
                f"the CPU tier has {manager._num_chunks} chunks, not the "
                f"{self._host_blocks} asked for"
            )
        self._jobs = {}
        self._completing = []
        self._failing = []
        self._failed = ()
        self._outcomes = {}
        self._loaded = Counter()
        self._step = 0
        self.transfers = Counter()

    # ------------------------------------------------------------------ the fake worker
    def _take_jobs(self, meta: Any) -> None:
        """The jobs this step's metadata creates, and the stores it flushes."""
        t = self._step
        for jid, job in sorted(meta.load_jobs.items()):
            src, dst = _ids(job.src_spec), _ids(job.dst_spec)
            pairs = tuple((c, b - NULL_BLOCKS) for c, b in zip(src, dst, strict=True))
            self._jobs[jid] = _Job(jid, False, job.req_id, pairs, t + self._load_steps - 1, t)
            self.transfers["loads_admitted"] += 1
            TOTALS["loads_admitted"] += 1
        for jid, job in sorted(meta.store_jobs.items()):
            src, dst = _ids(job.src_spec), _ids(job.dst_spec)
            pairs = tuple((b - NULL_BLOCKS, c) for b, c in zip(src, dst, strict=True))
            self._jobs[jid] = _Job(jid, True, job.req_id, pairs, t + self._store_steps, t)
        for jid in sorted(meta.jobs_to_flush or ()):
            job = self._jobs.get(jid)
            if job is not None and job.is_store and job.due > t:
                self._jobs[jid] = replace(job, due=t, flushed=t)
                self.transfers["stores_flushed"] += 1
                TOTALS["stores_flushed"] += 1

    def schedule(self) -> StepReport:
        report = super().schedule()
        meta = self._pending.kv_connector_metadata
        if meta is not None:
            self._take_jobs(meta)
        self._settle_jobs()
        swap_out = tuple(p for j in self._completing if j.is_store for p in j.pairs)
        swap_in = tuple(p for j in self._completing if not j.is_store for p in j.pairs)
        scheduled = tuple(self._split_hit(s) for s in report.scheduled)
        return replace(report, scheduled=scheduled, swap_out=swap_out, swap_in=swap_in)

    def _settle_jobs(self) -> None:
        """The jobs that fail and those that complete in this step, out of the jobs in
        flight."""
        failing = self._apply_outcomes()
        self._failing = [self._jobs.pop(jid) for jid in failing]
        due = sorted(jid for jid, job in self._jobs.items() if job.due <= self._step)
        self._completing = [self._jobs.pop(jid) for jid in due]
        # Failed loads whose holder still keeps their blocks stay reported (the
        # scheduler had them before this step, so it decides after it: snapshot()).
        self._failed = (
            *(x for x in self._failed if x.kind is TransferKind.LOAD),
            *(job.transfer() for job in self._failing),
        )

    def _apply_outcomes(self) -> list[int]:
        """The suite's outcomes for the jobs in flight before this step (those the step
        created keep their timing): each completes now, stays in flight (a store this
        step flushes completes all the same: the worker waits for it) or fails; returns
        the failing jobs."""
        t, outcomes = self._step, self._outcomes
        self._outcomes = {}
        failing: list[int] = []
        for jid, job in sorted(self._jobs.items()):
            o = outcomes.get((job.req_id, str(job.kind)))
            if o is None or job.created >= t:
                continue
            if o is TransferOutcome.FAIL:
                failing.append(jid)
            elif o is TransferOutcome.COMPLETE or job.flushed == t:
                self._jobs[jid] = replace(job, due=t)
            else:
                self._jobs[jid] = replace(job, due=max(job.due, t + 1))
        return failing

    def _split_hit(self, s: ScheduledRequest) -> ScheduledRequest:
        """vLLM counts a landed load in the request's computed tokens, as it counts its
        prefix hit; the protocol keeps them apart: the load's tokens are no cache hit
        (after a whole block-aligned prompt loaded, vLLM steps back one token to compute
        a logit, so the load is then one token short of its blocks)."""
        loaded_blocks = self._loaded.pop(s.request_id, 0)
        if not loaded_blocks:
            return s
        # The local hit is whole blocks before the loaded ones; the step back, if any,
        # comes off the loaded part (the last block).
        bs = self.cfg.block_size
        total = s.num_new_cached_tokens
        hit = max(0, -(-(total - loaded_blocks) // bs) * bs)
        return replace(s, num_new_cached_tokens=hit, num_new_loaded_tokens=total - hit)

    def runner_output_extras(self, out: Any) -> dict[str, Any]:
        del out
        done, self._completing = self._completing, []
        failed = self._failing  # reported at the boundary after this step: snapshot()
        self._step += 1
        counts = _count(done) + _count_failed(failed)
        self.transfers.update(counts)
        TOTALS.update(counts)
        for job in done:
            if not job.is_store:
                self._loaded[job.req_id] += len(job.pairs) * self.cfg.block_size
        ended = self._reported_ended(done, failed)
        if not ended:
            return {}
        meta = _WorkerMeta(completed_jobs={job.job_id: 1 for job in ended})
        return {
            "kv_connector_output": _KVConnectorOutput(
                finished_sending=set(),
                finished_recving={job.req_id for job in ended if not job.is_store},
                kv_connector_worker_meta=meta,
                invalid_block_ids=self._invalid_blocks(failed),
            )
        }

    def _reported_ended(self, done: list[_Job], failed: list[_Job]) -> list[_Job]:
        """The jobs the worker reports ended (``completed_jobs``): the completed ones and
        the failed loads (their failure travels as invalid blocks). A failed store is
        withheld (module docstring): vLLM has no way to hear of it."""
        return [*done, *(job for job in failed if not job.is_store)]

    def _invalid_blocks(self, failed: list[_Job]) -> set[int]:
        """The device blocks of the failed loads, in vLLM's ids (``invalid_block_ids``)."""
        return {dev + NULL_BLOCKS for job in failed if not job.is_store for _, dev in job.pairs}

    # ------------------------------------------------------------------ snapshots
    def snapshot(self) -> EngineSnapshot:
        snap = self._with_transfers(super().snapshot())
        loading = {rid for rid, req in self._live.items() if _holds_loaded_blocks(req)}
        loading |= {job.req_id for job in self._jobs.values() if not job.is_store}
        if not loading:
            return snap
        landed = self._sched.finished_recving_kv_req_ids
        requests = []
        for r in snap.requests:
            if r.request_id in loading and not r.status.is_done:
                req = self._all[r.request_id]
                in_flight = (
                    req.status == V.VStatus.WAITING_FOR_REMOTE_KVS and r.request_id not in landed
                )
                status = RequestStatus.LOADING if in_flight else r.status
                r = replace(r, status=status, num_computed_tokens=0)
            requests.append(r)
        tables: list[TableSnapshot] = []
        for t in snap.pool.tables:
            if t.request_id in loading:
                t = replace(t, request_id=t.request_id + LOADING_SUFFIX)
            tables.append(t)
        pool = replace(snap.pool, tables=tuple(tables))
        return replace(snap, requests=tuple(requests), pool=pool)

    def _keeps_failed(self, x: Transfer, snap: EngineSnapshot) -> bool:
        """Whether the request of a failed load still keeps its blocks for the recompute:
        vLLM has not looked at it since (its id in ``failed_recving_kv_req_ids``), or it
        kept a valid prefix and waits with the blocks, not scheduled yet and loading
        nothing else."""
        rid = x.request_id
        if rid not in self._live or x.kind is not TransferKind.LOAD:
            return False
        if rid in self._sched.failed_recving_kv_req_ids:
            return True
        req = self._all[rid]
        table = snap.pool.table(rid)
        return (
            req.status != V.VStatus.WAITING_FOR_REMOTE_KVS
            and _holds_loaded_blocks(req)
            and table is not None
            and set(x.blocks) <= set(table.block_table)
        )

    def commit(self, sampled: Mapping[str, int], *rest: Any) -> CommitReport:
        """As vLLM's scheduler reports it, plus the requests it finished without
        scheduling them: a failed load under ``kv_load_failure_policy="fail"`` finishes
        its request with ``FINISHED_ERROR`` (reason ``error``)."""
        report = super().commit(sampled, *rest)
        done = {rid for rid, _ in report.finished}
        extra = tuple(
            (rid, self._reason(self._all[rid]))
            for rid in list(self._live)
            if rid not in done and self._all[rid].is_finished()
        )
        for rid, _ in extra:
            self._live.pop(rid)
            self._retired.append((rid, RequestStatus.FINISHED))
        return replace(report, finished=report.finished + extra) if extra else report

    def _with_transfers(self, snap: EngineSnapshot) -> EngineSnapshot:
        """The copies in flight at this boundary: every job the fake worker has not
        completed (a load's blocks are held by the request's ``@load`` table); and those
        that failed in the last step."""
        transfers = tuple(
            job.transfer() for job in sorted(self._jobs.values(), key=lambda j: j.job_id)
        )
        failing = {(j.req_id, j.kind, j.transfer().blocks) for j in self._failing}
        failed = tuple(
            x
            for x in self._failed
            if (x.request_id, x.kind, x.blocks) in failing or self._keeps_failed(x, snap)
        )
        self._failed = failed
        pool = replace(snap.pool, transfers=transfers, failed_transfers=failed)
        return replace(snap, pool=pool)


def _holds_loaded_blocks(req: Any) -> bool:
    """Whether a live request waits with blocks: its load is in flight
    (``WAITING_FOR_REMOTE_KVS``), or has landed and the scheduler promoted it to
    ``WAITING``/``PREEMPTED`` with its loaded ``num_computed_tokens`` without scheduling
    it yet (the two cases of vLLM's ``Scheduler._holds_kv_blocks``; read here, not called,
    so that a patched instance is still reported as it is)."""
    if req.status == V.VStatus.WAITING_FOR_REMOTE_KVS:
        return True
    waiting = req.status in (V.VStatus.WAITING, V.VStatus.PREEMPTED)
    return bool(waiting and req.num_computed_tokens > 0)


def _count_failed(failed: list[_Job]) -> Counter[str]:
    return Counter("stores_failed" if job.is_store else "loads_failed" for job in failed)


def _count(done: list[_Job]) -> Counter[str]:
    c: Counter[str] = Counter()
    for job in done:
        if job.is_store:
            c["stores"] += 1
            c["chunks_stored"] += len(job.pairs)
        else:
            c["loads"] += 1
            c["chunks_loaded"] += len(job.pairs)
    return c


def make() -> VllmOffloadAdapter:
    """vLLM (fcfs, chunked prefill) with ``OffloadingConnector``: loads and stores land
    two steps after they start."""
    return VllmOffloadAdapter()


def make_priority() -> VllmOffloadAdapter:
    """As :func:`make`, with ``policy="priority"`` (``RequestSpec.priority`` honoured)."""
    return VllmOffloadAdapter(policy="priority")


def make_slow_loads() -> VllmOffloadAdapter:
    """As :func:`make`, with loads that land three steps after they start (a request is
    seen loading at two step boundaries)."""
    return VllmOffloadAdapter(load_steps=3)


def make_outputs() -> VllmOffloadAdapter:
    """As :func:`make`, with ``offload_prompt_only=False``: the blocks a request's outputs
    fill are offloaded too, so a later turn of the conversation can load them back."""
    return VllmOffloadAdapter(offload_prompt_only=False)


def make_recompute() -> VllmOffloadAdapter:
    """As :func:`make`, with ``kv_load_failure_policy="recompute"``: a request whose load
    fails recomputes what the load was to bring (vLLM's default fails it)."""
    return VllmOffloadAdapter(load_failure_policy="recompute")
