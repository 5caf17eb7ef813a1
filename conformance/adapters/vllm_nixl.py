"""vLLM 0.33.0's V1 scheduler with its NIXL connector, as a prefill/decode pair
(``refserve.conformance.adapters.vllm_nixl:make``); optional. Feature ``migration``.

The adapter of :mod:`refserve.conformance.adapters.vllm` (the same ``Scheduler``, built
on the CPU without a model; every translation there holds here too), with a real
scheduler-side KV connector: the ``VllmConfig`` carries a ``KVTransferConfig`` with
``kv_connector="NixlConnector"``, ``kv_role="kv_both"`` (every instance the suite builds
from the one factory may send and receive; a producer/consumer split would need to know
an instance's place in the workload) and an ``engine_id`` of its own, so
``Scheduler.__init__`` builds ``NixlPullConnector(role=KVConnectorRole.SCHEDULER)`` and
with it ``NixlPullConnectorScheduler``
(``vllm/distributed/kv_transfer/kv_connector/v1/nixl/``). Its scheduler side needs no
NIXL transport: the suite plays the link and the adapter plays the worker side, reporting
finished transfers in a ``KVConnectorOutput`` as the NIXL worker does. Nothing of vLLM
is copied or patched.

A move of request ``r`` from a source ``S`` to a destination ``D`` is vLLM's prefill /
decode hand-off (a request prefilled on a producer, finished there with
``do_remote_decode``, re-submitted to a consumer with ``do_remote_prefill`` and the
producer's ``remote_block_ids``, loaded there asynchronously):

* ``export_request`` is a pure read of ``S``: the blocks the send would carry, computed
  as the connector's finish computes them (``KVCacheManager
  .get_block_ids_for_computed_tokens`` for the request's ``num_computed_tokens``, then
  ``NixlPullConnectorScheduler.get_exchange_clipped_blocks``), their slots for the KV
  length, and the ``kv_transfer_params`` that ``request_finished`` returns for a
  finished producer request (``remote_block_ids``, ``remote_engine_id``,
  ``remote_request_id``, ``remote_num_tokens``, ...). Nothing of ``S`` is changed: the
  real finish is the release.
* ``stage_import`` submits the request to ``D`` as the router re-submits it to a
  consumer, with those ``kv_transfer_params`` and ``do_remote_prefill``, and lets vLLM's
  own admission allocate its blocks: one ``Scheduler.schedule()`` (and its
  ``update_from_output`` with an empty runner output: a step that runs no token, as the
  engine runs one that only admits an asynchronous load) in which ``D``'s scheduler sees
  only this request: its ``running`` list and waiting queues are set aside for the call
  and put back after it. vLLM's code does everything else: the local prefix lookup, the
  connector's ``get_num_new_matched_tokens`` (the tokens to pull),
  ``KVCacheManager.allocate_slots`` (``delay_cache_blocks``), the connector's
  ``update_state_after_alloc`` and the request's move to ``WAITING_FOR_REMOTE_KVS``. The
  destination slots are the ``local_block_ids`` of the receive the step hands the worker
  (``NixlConnectorMetadata.reqs_to_recv``); the hit is the blocks it counts as already
  computed (``local_num_computed_blocks``). A request vLLM does not admit (no room) is
  finished there again (``finish_requests``, aborted): ``Rejected``. What vLLM's
  admission reads of the requests set aside is stated here instead, before the call: a
  full batch (``len(running) >= max_num_active_reqs``, ``max_num_seqs`` here: vLLM admits
  nothing) and requests waiting in the destination's queue (vLLM admits in arrival
  order: they would be admitted first, and their blocks taken first) are ``Rejected``;
  the watermark (applied only when other requests run) is 0 in this configuration.
  Requests holding blocks in ``kv_holding_waiting`` (loads admitted or landed) do not
  stand in its way in vLLM either.
* The link copies the K/V; ``release`` is the producer request's finish on ``S``:
  ``kv_transfer_params={"do_remote_decode": True}`` and ``Scheduler.finish_requests``
  with ``FINISHED_LENGTH_CAPPED`` (the status a producer request finishes with, and the
  one under which ``request_finished`` holds its blocks for the send:
  ``delay_free_blocks``), then the worker's report that the send is done (the ack has
  come): ``finished_sending``, handed to ``Scheduler._update_from_kv_xfer_finished``
  (what ``update_from_output`` does with a ``KVConnectorOutput``), which frees the
  blocks. The blocks vLLM then sends are checked against the export: a difference is an
  error of the engine, reported by the call.
* ``commit_import`` is the worker's report that the receive landed
  (``finished_recving``, the same way); the request is live on ``D`` from then on, with
  its loaded KV, and vLLM's next ``schedule()`` promotes and runs it.

**The request's tokens on the destination.** vLLM's consumer pulls the K/V of the
prompt it was given (``get_num_new_matched_tokens`` counts ``len(prompt_token_ids)``)
and computes the rest. A request with ``k >= 1`` outputs and KV length ``L = prompt + k
- 1`` (decoding) is therefore re-submitted with its first ``L`` tokens as the prompt and
its last sampled token as its one output (``Request.append_output_token_ids``, before
the submission), ``max_tokens`` less the ``k - 1`` outputs folded into the prompt: vLLM
pulls exactly the ``L`` tokens the source holds, allocates the blocks they cover, and
the request lands decoding. A recompute (``transfer=False``, or a source without KV) is
re-submitted with every token as its prompt and no ``kv_transfer_params``, at the
commit. The snapshot reports such a request with the counters it had (prompt, outputs,
``max_tokens``): the adapter adds back what it folded into the prompt. Either way the
destination refuses (``Rejected``) a request whose tokens are not shorter than its
``max_model_len``, as vLLM's ``InputProcessor._validate_prompt_len`` refuses such a
prompt: a live vLLM request never holds that many (``check_stop`` ends it there).

**Moves it cannot make** raise ``NotSupported`` with the reason, and the scenario is
reported as not supported:

* a transfer of a request that has K/V but no output yet (mid-prefill): vLLM's hand-off
  moves the K/V of a whole prompt, after the producer's prefill; a partial prompt would
  have to be submitted as a shorter prompt, which the request is not;
* a transfer whose whole KV is a prefix hit on the destination: vLLM then pulls nothing
  and admits and runs the request in the admitting step, which a stage at a step
  boundary cannot express;
* ``abort_import``: vLLM aborts a request whose load is in flight by holding its blocks
  until the worker reports the transfer done (``finish_requests``,
  ``delay_free_blocks``) and then frees them to the tail of the free queue, not where
  they were taken from; the destination is then not as it was before the stage, which
  the protocol requires of an aborted import.

**Snapshots.** A staged request is listed only by its table (its blocks and the KV
length the load brings: vLLM's ``num_computed_tokens``); from the commit until vLLM
first schedules it, it is ``decoding`` with that KV (vLLM's status is still
``WAITING_FOR_REMOTE_KVS`` with the receive landed), and that first step counts no cache
hit (its KV arrived by the move).
"""

from __future__ import annotations

import importlib
import itertools
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

from refserve.conformance.adapter import (
    EngineConfig,
    Feature,
    MigrationExport,
    MigrationStaged,
    NotSupported,
    Rejected,
    StepReport,
)
from refserve.conformance.adapters.vllm import NULL_BLOCKS, V, VllmAdapter
from refserve.spec.snapshot import RequestSnapshot, RequestStatus

_KVTransferConfig: Any = importlib.import_module("vllm.config").KVTransferConfig
_KVConnectorOutput: Any = importlib.import_module("vllm.v1.outputs").KVConnectorOutput
_create_request_queue: Any = importlib.import_module(
    "vllm.v1.core.sched.request_queue"
).create_request_queue

_ENGINE_IDS = itertools.count(1)
"""Each instance's NIXL ``engine_id`` (the producer a consumer's ticket names)."""


@dataclass(frozen=True)
class NixlTicket:
    """What a producer hands its consumer for one request: the request as the router
    re-submits it, and the ``kv_transfer_params`` the producer's finish returns."""

    request_id: str
    token_ids: tuple[int, ...]
    num_prompt_tokens: int
    """The request's prompt as the suite submitted it (the source's reported count)."""
    max_tokens: int
    num_computed_tokens: int
    stop_token_ids: tuple[int, ...]
    priority: int
    cache_salt: str | None
    lora_name: str
    arrival_step: int
    root_key: bytes
    kv_transfer_params: dict[str, Any]


@dataclass
class _Staged:
    """The import staged on this destination, until its commit."""

    ticket: NixlTicket
    request: Any
    """The vLLM ``Request`` to submit or already admitted (None: not built)."""
    folded: int
    """Outputs folded into the vLLM prompt (added back in the snapshot)."""
    loading: bool
    """Admitted as an asynchronous load (a transfer); False: a recompute."""
    num_hit_tokens: int = 0
    """The destination's own prefix hit (a transfer)."""


class VllmNixlAdapter(VllmAdapter):
    """vLLM's scheduler with ``NixlConnector``'s scheduler side; moves are its P/D hand-off."""

    def __init__(self, *, policy: str = "fcfs") -> None:
        super().__init__(policy=policy)
        self._engine_id = f"refserve-nixl-{next(_ENGINE_IDS)}"
        self._staged: _Staged | None = None
        self._folded: dict[str, int] = {}
        """Request id -> outputs the vLLM request holds as prompt tokens."""
        self._landed: set[str] = set()
        """Imported requests whose K/V landed and which vLLM has not scheduled yet."""
        self.transfers: Counter[str] = Counter()
        """What the connector did: loads admitted, receives and sends finished."""

    @property
    def name(self) -> str:
        return f"{super().name} + NixlConnector (scheduler side; P/D hand-off as migration)"

    @property
    def features(self) -> frozenset[Feature]:
        return super().features | {Feature.MIGRATION}

    def kv_transfer_config(self, config: EngineConfig) -> Any:
        del config
        return _KVTransferConfig(
            kv_connector="NixlConnector", kv_role="kv_both", engine_id=self._engine_id
        )

    def configure(self, config: EngineConfig) -> None:
        super().configure(config)
        self._staged = None
        self._folded = {}
        self._landed = set()
        self.transfers = Counter()

    # ------------------------------------------------------------------ helpers
    @property
    def _nixl(self) -> Any:
        """The connector's scheduler side (``NixlPullConnectorScheduler``)."""
        return self._sched.connector.connector_scheduler

    def _send_blocks(self, rid: str, num_computed: int) -> list[int]:
        """The blocks a finish of ``rid`` sends, as ``Scheduler._connector_finished`` and
        ``request_finished`` compute them (vLLM block ids, one group)."""
        groups = self._sched.kv_cache_manager.get_block_ids_for_computed_tokens(
            request_id=rid, num_computed_tokens=num_computed
        )
        (blocks,) = self._nixl.get_exchange_clipped_blocks(groups)
        return [int(b) for b in blocks]

    def _slots(self, blocks: list[int], first: int, last: int) -> tuple[int, ...]:
        """Protocol slots of positions ``[first, last)`` in ``blocks`` (vLLM ids, the first
        holding position ``first - first % bs``)."""
        bs = self.cfg.block_size
        base = first - first % bs
        return tuple(
            (blocks[(p - base) // bs] - NULL_BLOCKS) * bs + p % bs for p in range(first, last)
        )

    def _reported_prompt(self, rid: str, req: Any) -> int:
        return int(req.num_prompt_tokens) - self._folded.get(rid, 0)

    # ------------------------------------------------------------------ the source
    def export_request(self, request_id: str) -> MigrationExport:
        req = self._live.get(request_id)
        if req is None:
            raise NotSupported(f"request {request_id!r} is not live here")
        kv = int(req.num_computed_tokens)
        if request_id in self._landed or req.status == V.VStatus.WAITING_FOR_REMOTE_KVS:
            raise NotSupported(
                "a request whose K/V has just been loaded here and that vLLM has not run "
                "yet is not handed on (its hand-off is the finish of a request that ran)"
            )
        blocks = self._send_blocks(request_id, kv) if kv else []
        lora = req.lora_request
        params: dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": (blocks,),
            "remote_engine_id": self._engine_id,
            "remote_request_id": request_id,
            "remote_host": self._nixl.side_channel_host,
            "remote_port": self._nixl.side_channel_port,
            "tp_size": self._nixl.transfer_tp_size,
            "remote_num_tokens": kv,
        }
        ticket = NixlTicket(
            request_id=request_id,
            token_ids=tuple(int(t) for t in req.all_token_ids),
            num_prompt_tokens=self._reported_prompt(request_id, req),
            max_tokens=self._max_tokens[request_id],
            num_computed_tokens=kv,
            stop_token_ids=tuple(int(t) for t in req.sampling_params.stop_token_ids or ()),
            priority=int(req.priority),
            cache_salt=req.cache_salt,
            lora_name="" if lora is None else str(lora.lora_name),
            arrival_step=self._arrival.get(request_id, 0),
            root_key=self._root_keys[request_id],
            kv_transfer_params=params,
        )
        return MigrationExport(request_id, self._slots(blocks, 0, kv), ticket=ticket)

    def release(self, request_id: str) -> None:
        req = self._live[request_id]
        exported = self._send_blocks(request_id, int(req.num_computed_tokens))
        req.kv_transfer_params = {"do_remote_decode": True}
        self._sched.finish_requests(request_id, V.VStatus.FINISHED_LENGTH_CAPPED)
        self._live.pop(request_id)
        if not exported:
            return  # nothing to send: request_finished frees at once (no delay_free_blocks)
        if request_id not in self._sched.requests:
            raise RuntimeError(
                f"vLLM freed the blocks of {request_id!r} at its finish instead of holding "
                "them for the send (request_finished returned no delay)"
            )
        sent = self._send_blocks(request_id, int(req.num_computed_tokens))
        if sent != exported:
            raise RuntimeError(
                f"vLLM's finish of {request_id!r} sends blocks {sent}, not the exported {exported}"
            )
        self._sched._update_from_kv_xfer_finished(
            _KVConnectorOutput(finished_sending={request_id}, finished_recving=set())
        )
        self.transfers["sends"] += 1
        self.transfers["blocks_sent"] += len(sent)

    # ------------------------------------------------------------------ the destination
    def _build(self, t: NixlTicket, prompt: tuple[int, ...], outputs: tuple[int, ...]) -> Any:
        """The vLLM request as the router re-submits it (module docstring)."""
        folded = len(prompt) - t.num_prompt_tokens
        params = V.SamplingParams.from_optional(
            max_tokens=t.max_tokens - folded, stop_token_ids=list(t.stop_token_ids)
        )
        params.update_from_generation_config({}, self.cfg.eos_token_id)
        self._clock += 1
        req = V.Request(
            request_id=t.request_id,
            prompt_token_ids=list(prompt),
            sampling_params=params,
            pooling_params=None,
            arrival_time=float(self._clock),
            priority=t.priority,
            lora_request=self._lora_request(t.lora_name),
            cache_salt=t.cache_salt,
            block_hasher=self._hasher,
        )
        if outputs:
            req.append_output_token_ids(list(outputs))
        return req

    def _validate(self, n: int) -> None:
        checker = type(
            "Checker",
            (),
            {
                "skip_prompt_length_check": False,
                "model_config": self._model_config,
                "supports_mm_inputs": False,
                "mm_encoder_cache_size": 0,
            },
        )()
        try:
            V.InputProcessor._validate_prompt_len(checker, n, "decoder")
        except (ValueError, V.ClientError) as e:
            raise Rejected(f"{type(e).__name__}: {e}") from e

    def stage_import(self, export: MigrationExport, transfer: bool) -> MigrationStaged:
        t = export.ticket
        if not isinstance(t, NixlTicket):
            raise Rejected(f"not a vLLM NIXL ticket: {type(t).__name__}")
        if self._staged is not None:
            raise RuntimeError("an import is already staged")
        if t.request_id in self._sched.requests:
            raise Rejected(f"vLLM Scheduler.add_request refused it: duplicate id {t.request_id}")
        kv = t.num_computed_tokens
        outputs = len(t.token_ids) - t.num_prompt_tokens
        if not transfer or kv == 0:
            self._validate(len(t.token_ids))
            self._staged = _Staged(t, None, outputs, loading=False)
            return MigrationStaged(t.request_id)
        if outputs < 1:
            raise NotSupported(
                "a transfer mid-prefill: vLLM's NIXL hand-off moves a whole prompt's K/V "
                "after the producer's prefill (get_num_new_matched_tokens pulls "
                "len(prompt_token_ids) tokens)"
            )
        if kv != len(t.token_ids) - 1:
            raise NotSupported(f"a request with KV length {kv} of {len(t.token_ids)} tokens")
        # The re-submitted request holds every token (its last one as its output): vLLM
        # takes no prompt that is not shorter than max_model_len, and would never hold
        # a live request that reached it (check_stop ends it there).
        self._validate(len(t.token_ids))
        s = self._sched
        if len(s.running) + s.num_waiting_for_streaming_input >= s.max_num_active_reqs:
            raise Rejected("the destination runs max_num_seqs requests: vLLM admits none")
        if len(s.waiting):
            raise Rejected(
                f"{len(s.waiting)} request(s) wait on the destination: vLLM admits in "
                "arrival order, so it would admit them first"
            )
        req = self._build(t, t.token_ids[:kv], t.token_ids[kv:])
        req.kv_transfer_params = dict(t.kv_transfer_params)
        _, hit, _ = self._sched.kv_cache_manager.get_computed_blocks(req)
        if int(hit) >= kv:
            raise NotSupported(
                "the destination's prefix cache holds the whole KV: vLLM then pulls "
                "nothing and runs the request in the step that admits it"
            )
        meta = self._admit_alone(req)
        rid = t.request_id
        if req.status != V.VStatus.WAITING_FOR_REMOTE_KVS or meta is None:
            self._sched.finish_requests(rid, V.VStatus.FINISHED_ABORTED)
            raise Rejected("vLLM did not admit the load now (no room for its blocks)")
        self._all[rid] = req
        self._root_keys[rid] = t.root_key
        bs = self.cfg.block_size
        (local,) = meta.local_block_ids
        hit_tokens = sum(meta.local_num_computed_blocks) * bs
        self._staged = _Staged(t, req, outputs - 1, loading=True, num_hit_tokens=hit_tokens)
        self.transfers["loads_admitted"] += 1
        return MigrationStaged(rid, hit_tokens, self._slots(list(local), hit_tokens, kv))

    def _admit_alone(self, req: Any) -> Any:
        """Submit ``req`` and run one admitting step in which the scheduler sees only it
        (module docstring); the receive the step hands the worker, or None."""
        s = self._sched
        kept = (s.running, s.waiting, s.kv_holding_waiting)
        kept_prev = set(s.prev_step_scheduled_req_ids)
        s.running = []
        s.waiting = _create_request_queue(s.policy)
        s.kv_holding_waiting = _create_request_queue(s.policy)
        try:
            s.add_request(req)
            out = s.schedule()
            self._runner_update(out)
            if out.total_num_scheduled_tokens:
                raise RuntimeError(
                    f"vLLM ran {out.total_num_scheduled_tokens} token(s) in an admitting step"
                )
            s.update_from_output(
                out, V.ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])
            )
            admitted = list(s.kv_holding_waiting)
            left_waiting = list(s.waiting)
        finally:
            s.running, s.waiting, s.kv_holding_waiting = kept
            s.prev_step_scheduled_req_ids.clear()
            s.prev_step_scheduled_req_ids.update(kept_prev)
        if admitted:
            s.kv_holding_waiting.prepend_requests(admitted)
        if left_waiting:
            s.waiting.prepend_requests(left_waiting)
        meta = out.kv_connector_metadata
        return None if meta is None else meta.reqs_to_recv.get(req.request_id)

    def commit_import(self) -> None:
        st = self._take_staged()
        t = st.ticket
        rid = t.request_id
        if st.loading:
            self._sched._update_from_kv_xfer_finished(
                _KVConnectorOutput(finished_recving={rid}, finished_sending=set())
            )
            self._landed.add(rid)
            self.transfers["receives"] += 1
            req = st.request
        else:
            req = self._build(t, t.token_ids, ())
            self._sched.add_request(req)
        self._all[rid] = req
        self._live[rid] = req
        self._root_keys[rid] = t.root_key
        self._folded[rid] = st.folded if st.loading else len(t.token_ids) - t.num_prompt_tokens
        self._max_tokens[rid] = t.max_tokens
        self._arrival[rid] = t.arrival_step
        self._ran.discard(rid)
        self._cached.pop(rid, None)
        if st.loading:
            self._cached[rid] = st.num_hit_tokens  # the hit at its admission here

    def abort_import(self) -> None:
        st = self._take_staged()
        if not st.loading:
            return  # a recompute stages nothing
        raise NotSupported(
            "abort_import: vLLM holds the blocks of an aborted in-flight load until the "
            "worker reports the transfer done (finish_requests: delay_free_blocks) and then "
            "frees them to the free queue's tail, so the destination is not as before the stage"
        )

    def _take_staged(self) -> _Staged:
        if self._staged is None:
            raise RuntimeError("no import is staged")
        st, self._staged = self._staged, None
        return st

    # ------------------------------------------------------------------ translation
    def schedule(self) -> StepReport:
        landed = set(self._landed)
        report = super().schedule()
        if not landed:
            return report
        out = []
        for s in report.scheduled:
            if s.request_id in landed:
                self._landed.discard(s.request_id)
                s = replace(s, num_new_cached_tokens=0)
            out.append(s)
        return replace(report, scheduled=tuple(out))

    def _status(self, rid: str, req: Any) -> RequestStatus:
        if rid in self._landed and not req.is_finished():
            kv = int(req.num_computed_tokens)
            return RequestStatus.DECODING if kv == req.num_tokens - 1 else RequestStatus.PREFILLING
        return super()._status(rid, req)

    def _request(self, rid: str, status: RequestStatus | None = None) -> RequestSnapshot:
        r = super()._request(rid, status)
        folded = self._folded.get(rid, 0)
        if not folded:
            return r
        return replace(
            r,
            num_prompt_tokens=r.num_prompt_tokens - folded,
            num_output_tokens=r.num_output_tokens + folded,
        )


def make() -> VllmNixlAdapter:
    """vLLM (fcfs, chunked prefill) with ``NixlConnector``: moves are its P/D hand-off."""
    return VllmNixlAdapter()


def make_priority() -> VllmNixlAdapter:
    """The same with ``policy="priority"``: every feature of vLLM's scheduler this adapter
    drives (moves, speculative decoding, ``RequestSpec.priority``) in one run."""
    return VllmNixlAdapter(policy="priority")
