"""TEMPLATE adapter: copy this file next to your engine and fill in every ``TODO``.

The full guide is docs/ADAPTERS.md; this file is the same protocol as code. Work in this
order, running the self-check after each method (it explains what is still off, field by
field, and exits non-zero until everything is right)::

    refserve conformance --self-check --adapter your_package.your_adapter:make
    refserve conformance --adapter your_package.your_adapter:make --report r.json

Ground rules (docs/ADAPTERS.md, "The protocol"):

* The suite plays the model. One step is ``snapshot()``, ``schedule()``,
  ``commit(sampled)``, ``snapshot()``. Between steps it may call ``add_request`` and
  ``abort``.
* The adapter *translates*, it never *fixes*: report exactly what the engine did, even
  when that is wrong. That is what the suite is there to find.
* Return the ``refserve.spec.snapshot`` records with **tuples, ints, str and bytes only** (no
  lists, no numpy ints, no enum-like strings): snapshots are compared for equality and
  hashed. ``refserve.conformance.validate`` rejects anything else as a malformed record.
* Raise ``NotSupported`` for a configuration or an optional operation the engine does
  not have (listed in ``features``); raise ``Rejected`` when the engine refuses a request
  at submission. Anything else an adapter raises is reported as an engine crash.

State mapping: how an engine's request states map onto ``refserve.spec.snapshot.RequestStatus``
(KVLEN checks the counter relations; ``num_tokens = num_prompt_tokens +
num_output_tokens``):

=============== ============================================= ============================
status          when                                          num_computed_tokens
=============== ============================================= ============================
``waiting``     added, never scheduled                        0
``prefilling``  part of the known tokens has KV               0 < c < num_tokens
``decoding``    KV for every token but the last sampled one   num_tokens - 1
``preempted``   lost its KV, waits to recompute               0
``swapped``     KV moved to the host pool (``snapshot.host``) KV length on the host
``finished``    stopped in the step just committed            (any; listed once)
``aborted``     aborted since the last ``schedule()`` began   (any; listed once)
=============== ============================================= ============================
"""

from __future__ import annotations

from collections.abc import Mapping

from refserve.conformance.adapter import (
    AdmissionOrder,
    CommitReport,
    EngineConfig,
    EngineProperties,
    Feature,
    NotSupported,
    RequestSpec,
    StepOrder,
    StepReport,
)
from refserve.spec.snapshot import EngineSnapshot

__all__ = ["TemplateAdapter", "make"]


class TemplateAdapter:
    """TODO: rename to ``<YourEngine>Adapter``; one instance drives one engine at a time."""

    # TODO: your engine's name and version, e.g. "myengine 1.4.2" (shown in reports).
    name = "template (TODO: engine name and version)"

    properties = EngineProperties(
        # Slots the engine reserves ahead of the KV length. A table may hold up to
        # ceil((num_stored + lookahead_slots) / block_size) blocks. 0: the table covers
        # exactly the KV written (refserve). 1: the engine allocates the slot of the token
        # it is about to sample in the same step. k: speculative lookahead of k tokens.
        lookahead_slots=0,
        # True: the engine stops a request that samples its eos token (reason "stop").
        # False: it never checks eos; the suite then never samples eos on purpose.
        eos=True,
        # The admission order the suite checks exactly (ORDER): FCFS (nobody is admitted
        # past an earlier waiting request that fits), PRIORITY (by RequestSpec.priority,
        # smaller first, then arrival), FCFS_STRICT / PRIORITY_STRICT (head-of-line
        # blocking: nobody is admitted past an earlier waiting request that is not,
        # fitting or not), or UNSPECIFIED (not checked).
        admission_order=AdmissionOrder.UNSPECIFIED,
        # DECODE_FIRST or PREFILL_FIRST batching: observed and reported, never a finding.
        step_order=StepOrder.UNSPECIFIED,
        # True: a request may take as a cache hit a block another request fills in the
        # same step (blocks indexed when scheduled; safe when the executor writes each
        # layer's K/V for the whole batch before attention reads it). False: a block is
        # cached only once its K/V exists (refserve).
        same_step_prefix_hits=False,
        # True: PoolSnapshot.free_queue is the order in which the engine hands out free
        # blocks (new blocks must come from its head). False: the engine's free list has
        # no order (a set); the queue is then just the free blocks.
        free_queue_order=True,
        # True: a request that reaches the max_model_len its RequestSnapshot reports
        # finishes there with reason "length", before max_tokens (vLLM, refserve).
        # False: only eos, stop tokens and max_tokens stop a request.
        max_model_len_stop=False,
    )

    def __init__(self) -> None:
        # The engine is built by configure(), once per scenario; TODO: its real type.
        self._engine: object | None = None

    @property
    def features(self) -> frozenset[Feature]:
        """What the engine can do. Claim only what works: a scenario that needs a feature
        missing here is reported ``not_supported`` (never a failure), while a claimed
        feature that misbehaves is a finding."""
        # TODO: add each that applies:
        #   Feature.CHUNKED_PREFILL          a prompt may be split across steps
        #   Feature.PREFIX_CACHING           full prompt blocks are reused across requests
        #   Feature.PREFIX_CACHING_OPTIONAL  EngineConfig.enable_prefix_caching=False works
        #   Feature.CACHE_INDEX              snapshot lists the cache as spec.CacheEntry
        #   Feature.PREEMPTION               running requests can lose their KV and recompute
        #   Feature.PRIORITIES               RequestSpec.priority is honoured
        #   Feature.ABORT                    abort() works in every state
        #   Feature.ROLLBACK                 rollback() undoes a pending schedule()
        #   Feature.STOP_TOKEN_IDS           RequestSpec.stop_token_ids are honoured
        return frozenset()

    def configure(self, config: EngineConfig) -> None:
        """Build a FRESH engine: no request, every block free, an empty prefix cache.

        Map every field: ``block_size``, ``num_blocks`` (the KV pool), the token budget
        ``max_num_batched_tokens``, ``max_num_seqs``, ``enable_prefix_caching``,
        ``max_model_len`` and the global ``eos_token_id``. Raise ``NotSupported(reason)``
        for a configuration the engine cannot take (e.g. caching off on an engine that
        always caches): the scenario is then reported not_supported.
        """
        # TODO: self._engine = YourScheduler(block_size=config.block_size, ...)
        raise NotImplementedError("TODO(template): build the engine from EngineConfig")

    def add_request(self, request: RequestSpec) -> None:
        """Queue ``request`` (prompt token ids, ``max_tokens``, ``eos_token_id``,
        ``stop_token_ids``, ``priority``) at this step boundary.

        Raise ``Rejected(reason)`` when the engine refuses it (empty prompt, longer than
        max_model_len, a duplicate id, a prompt that can never fit). The suite then checks
        ATOMIC: the snapshot after a refusal must equal the one before.
        """
        # TODO: try: self._engine.add(request.request_id, list(request.prompt_token_ids), ...)
        #       except YourEngineError as e: raise Rejected(str(e)) from e
        #       (Rejected is refserve.conformance.adapter.Rejected)
        raise NotImplementedError("TODO(template): hand the request to the engine")

    def abort(self, request_id: str) -> None:
        """Remove a live request in any state; its blocks go back to the pool at once and
        the next snapshot lists it as ``aborted``. Raise ``NotSupported`` without
        ``Feature.ABORT``."""
        raise NotSupported("TODO(template): abort, or leave Feature.ABORT out")

    def has_unfinished(self) -> bool:
        """True while any request is waiting, running, preempted or swapped; False once
        every request finished or was aborted (a retired request left in a queue is a
        PROGRESS finding)."""
        raise NotImplementedError("TODO(template): return the engine's own answer")

    def schedule(self) -> StepReport:
        """Run the engine's scheduler once and report what runs in this step.

        For each request given tokens, one ``refserve.spec.snapshot.ScheduledRequest``:

        * ``num_new_tokens``: tokens computed this step (prompt chunk, or 1 for a decode).
        * ``positions``: their positions, contiguous from the request's KV length
          (``num_computed_tokens`` plus ``num_new_cached_tokens``). A decode computes the
          last sampled token, at ``num_tokens - 1``.
        * ``slot_mapping``: the KV slot each position is written to, and ``block_table``:
          the request's table, BOTH AS THE ENGINE'S MODEL RUNNER RECEIVES THEM. Take them
          from the engine's input builder; do not recompute them with the formula
          ``slot = block_table[pos // block_size] * block_size + pos % block_size``: POS
          compares the two, and that comparison is the point.
        * ``samples``: True when the chunk reaches the last known token (the model will
          sample after it), False for a chunk that stops inside the prompt.
        * ``num_new_cached_tokens``: prompt tokens served from the prefix cache when this
          step admitted the request (0 otherwise).

        Also: ``preempted`` (ids that lost their KV in this step), ``finished`` ((id,
        reason) retired while planning, e.g. ``capacity``), ``block_copies`` ((src, dst)
        copy-on-write copies), ``swap_out`` / ``swap_in`` ((device, host) / (host,
        device) block pairs). Keep whatever the engine needs to finish the step (its plan
        object) for ``commit`` or ``rollback``.
        """
        # TODO: plan = self._engine.schedule(); inputs = self._engine.prepare_inputs(plan)
        #       build the ScheduledRequest records from `inputs`, as tuples.
        raise NotImplementedError("TODO(template): run the scheduler, report the plan")

    def commit(self, sampled: Mapping[str, int]) -> CommitReport:
        """Apply the step: ``sampled`` holds exactly one token per scheduled request with
        ``samples`` set. Append it, run the stop checks (eos, stop token ids,
        ``max_tokens``, ``max_model_len``), free finished requests' blocks.

        Return every request that finished in this step, with the engine's reason:
        ``stop`` (eos or a stop token), ``length`` (max_tokens or max_model_len),
        ``capacity`` (can never grow in this pool); include those of
        ``StepReport.finished``. A finished request stays in the next snapshot with
        status ``finished`` until the next ``schedule()`` begins.
        """
        raise NotImplementedError("TODO(template): feed the sampled tokens to the engine")

    def rollback(self) -> None:
        """Undo the pending ``schedule()`` as if it never ran (the model failed): the
        snapshot must equal the one before it (ATOMIC). Raise ``NotSupported`` without
        ``Feature.ROLLBACK``."""
        raise NotSupported("TODO(template): rollback, or leave Feature.ROLLBACK out")

    def snapshot(self) -> EngineSnapshot:
        """The engine's state at a step boundary as ``refserve.spec.snapshot`` records.

        * ``requests``: one ``RequestSnapshot`` per live request (see the state mapping
          in the module docstring) plus those finished or aborted since the last
          ``schedule()`` began. ``num_output_tokens`` counts sampled tokens,
          ``num_computed_tokens`` the KV length; they are separate fields on purpose.
        * ``pool``: ``PoolSnapshot(num_blocks, block_size, ref_cnt, free_queue, tables,
          cache_entries)``. ``ref_cnt[b]`` is the number of tables holding block ``b``;
          ``free_queue`` lists every block no request holds (cached or not), in the
          order the engine hands them out; one ``TableSnapshot`` per request holding
          blocks: ``block_table``, ``num_stored`` (the KV length the table holds, equal
          to the request's ``num_computed_tokens``), ``token_ids`` (the token ids at
          positions ``0..num_stored-1``, prompt then outputs) and ``root_key``
          (``refserve.spec.hashing.DEFAULT_NAMESPACE.root_key()`` unless the engine namespaces
          its cache). ``cache_entries`` only with ``Feature.CACHE_INDEX``.
        * ``host``: the host swap pool (same record) for an engine that swaps, else None.
        """
        raise NotImplementedError("TODO(template): translate the engine's state")


def make() -> TemplateAdapter:
    """The factory the CLI calls: ``--adapter your_package.your_adapter:make``."""
    return TemplateAdapter()
