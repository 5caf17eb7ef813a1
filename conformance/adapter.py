"""The adapter protocol: how the conformance suite drives an engine's scheduler + KV manager.

The suite plays the model. It never loads weights and never runs attention: it calls the
engine's scheduler once per step, reads back what the scheduler planned (positions, slots,
block tables), chooses the sampled token of every request whose chunk reached the end of
its known tokens, and hands those tokens back. Between steps it reads a snapshot of the
engine in spec/ types and checks every invariant on it.

One step, as the suite runs it::

    before = adapter.snapshot()
    plan = adapter.schedule()                 # StepReport: what runs this step
    done = adapter.commit({rid: token, ...})  # one token per ScheduledRequest with samples
    after = adapter.snapshot()

Between steps the suite may call :meth:`EngineAdapter.add_request` and
:meth:`EngineAdapter.abort`. An adapter translates; it never fixes: when the engine does
something wrong, the adapter reports exactly what the engine did.

Semantics every adapter must follow
-----------------------------------
* ``configure`` builds a fresh engine (no request, every block free, empty cache). It
  raises :class:`NotSupported` for a configuration the engine cannot take (for example
  prefix caching off on an engine that always caches); the suite then reports the
  scenario as ``not_supported``.
* ``add_request`` queues a request at the current step boundary. An engine that refuses
  the request (bad input, a prompt that can never fit) raises :class:`Rejected`; the
  suite then checks ATOMIC: the snapshot must be exactly as before the call.
* Key domains (features ``cache_salt``, ``lora``): ``RequestSpec.cache_salt`` and
  ``RequestSpec.lora`` change a request's K/V without changing its tokens. An engine
  with the feature keeps requests of different domains apart in its cache; its adapter
  reports each table's ``root_key`` as ``RequestSpec.namespace.root_key()``. The suite
  sends such requests only to engines that declare the feature.
* ``abort`` (feature ``abort``) removes a live request in any state (waiting, mid-prefill,
  decoding, preempted); its blocks go back to the pool at once.
* ``schedule`` runs the engine's scheduler once and returns a :class:`StepReport`:
  for each request given tokens this step a :class:`spec.ScheduledRequest` with the token
  count, the positions, the slot of each position and the block table **as the engine's
  model runner would receive them** (not recomputed by the spec formula: POS compares
  the two), the ids preempted by this step and the requests the scheduler retired while
  planning (for example a lone request that can never grow, reason ``capacity``).
  ``samples`` is true for a request the engine will sample a token for after the step.
* ``commit`` takes exactly one token per scheduled request with ``samples`` set and
  applies it (stop checks, freeing finished requests). It returns the requests that
  finished in this step (including those of ``StepReport.finished``) with their reasons.
* ``rollback`` (feature ``rollback``) undoes a pending ``schedule`` as if it never ran
  (the model failed): the snapshot must equal the one before ``schedule`` (ATOMIC).
* ``propose(request_id, draft_token_ids)`` (feature ``speculative_decoding``, a method
  only such adapters have) gives a decoding request drafts for the next step, at a step
  boundary. The step may verify a prefix of them, reported as
  ``ScheduledRequest.num_draft_tokens`` (the entry's last tokens, after its last sampled
  one); ``commit(sampled, accepted)`` then gets, per verifying request, how many drafts
  the suite accepts and the token after them; the engine keeps the accepted drafts and
  that token, and drops the rejected drafts' KV (the suite poisons their slots).
* Migration (feature ``migration``, methods only such adapters have; docs/ADAPTERS.md,
  "Migration"): the suite builds several instances of the engine from one factory and
  moves a live request between two of them at a step boundary of both, playing the
  link::

      exp = src.export_request(rid)             # MigrationExport: a pure read
      staged = dst.stage_import(exp, transfer)  # MigrationStaged: blocks reserved
      # the suite copies the K/V of each staged position from src's slot to dst's
      src.release(rid)                          # after the ack: the source lets go
      dst.commit_import()                       # the request runs on dst

  or, when the link fails before the ack, ``dst.abort_import()`` and the request runs
  on as before on the source. ``export_request`` changes nothing; ``stage_import``
  reserves the destination's own blocks (its prefix hit used: only the positions after
  it travel) without making the request visible to its scheduler, and raises
  :class:`Rejected` with nothing changed when the destination cannot take it now;
  ``abort_import`` leaves the destination exactly as before the stage; ``release``
  drops the request from the source (not a finish: it is not listed as finished or
  aborted) and returns every block it held; ``commit_import`` makes it live on the
  destination. ``transfer=False`` asks the destination to recompute (no K/V travels);
  with ``True`` it may still choose to (an engine that always recomputes is correct).
  The suite checks every phase against the migration rules of spec/cluster.py.
* ``snapshot`` returns a :class:`spec.EngineSnapshot` at a step boundary: every live
  request, plus the requests that finished or were aborted since the last ``schedule``
  began (status ``finished`` / ``aborted``); the pool with ref counts, the free queue in
  hand-out order, one :class:`spec.TableSnapshot` per request holding blocks, and (feature
  ``cache_index``) the prefix-cache index as :class:`spec.CacheEntry` records keyed by
  :func:`refserve.spec.hashing.block_key`.

Request state mapping: a request not yet scheduled is ``waiting``; one whose prompt is
partly computed is ``prefilling``; one with KV for all but its last sampled token is
``decoding``; one that lost its KV to preemption and waits to recompute is ``preempted``;
one whose K/V is being loaded from another store (a KV connector) is ``loading``.

Rules and conventions
---------------------
The suite checks *rules* (what no correct engine ever does: docs/CONFORMANCE.md lists
them) and leaves *conventions* to the engine. An adapter declares the conventions its
engine follows in an optional ``properties`` attribute (:class:`EngineProperties`; an
adapter without one gets the documented defaults): blocks reserved ahead of the KV
length, no eos handling, the admission order, the step order, same-step cache hits, an
unordered free list, a stop at ``max_model_len``, placeholder drafts, and, in place of the
admission and step orders, a preemptive multi-level queue discipline
(:class:`MultiLevelQueue`; its adapter then has a ``levels()`` method giving every live
request's level at a step boundary). A correct engine that
declares any documented choice passes with zero findings; a declared policy (admission
order) is then checked exactly, and every declared choice is a promise held both ways:
the engine may make it, and where it says it does, it does (docs/CONFORMANCE.md,
"Declarations are promises"). The guide for adapter authors is docs/ADAPTERS.md.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol, runtime_checkable

from refserve.spec.hashing import Namespace
from refserve.spec.snapshot import EngineSnapshot, ScheduledRequest


class Feature(StrEnum):
    """What an engine can do; scenarios needing a missing feature report ``not_supported``."""

    CHUNKED_PREFILL = "chunked_prefill"
    """A prompt may be split across steps (and mixed with decodes)."""
    PREFIX_CACHING = "prefix_caching"
    """Full blocks of a prompt are reused from earlier requests."""
    PREFIX_CACHING_OPTIONAL = "prefix_caching_optional"
    """Prefix caching can be switched off by ``EngineConfig.enable_prefix_caching``."""
    CACHE_INDEX = "cache_index"
    """The snapshot exposes the cache index as spec.CacheEntry records (spec hash chain)."""
    PREEMPTION = "preemption"
    """A running request can lose its KV to make room and recompute later."""
    PRIORITIES = "priorities"
    """``RequestSpec.priority`` is honoured (smaller value = more important)."""
    ABORT = "abort"
    """:meth:`EngineAdapter.abort` works in every request state."""
    ROLLBACK = "rollback"
    """:meth:`EngineAdapter.rollback` undoes a pending schedule (executor fault)."""
    STOP_TOKEN_IDS = "stop_token_ids"
    """``RequestSpec.stop_token_ids`` are honoured besides the eos token."""
    SPECULATIVE_DECODING = "speculative_decoding"
    """``propose(request_id, draft_token_ids)`` before ``schedule``; a step verifies the
    drafts (``ScheduledRequest.num_draft_tokens``) and ``commit(sampled, accepted)``
    takes how many of each request's drafts the suite accepts (docs/SPECULATIVE.md)."""
    CACHE_SALT = "cache_salt"
    """``RequestSpec.cache_salt`` is honoured: requests with different salts never share
    K/V, whatever their tokens (PREFIX, rule ``key-domains``)."""
    LORA = "lora"
    """``RequestSpec.lora`` names the LoRA adapter a request runs with; its K/V differs
    from the base model's and every other adapter's, so requests with different adapters
    never share K/V (PREFIX, rule ``key-domains``). The suite never loads an adapter:
    only its identity reaches the cache keys."""
    MIGRATION = "migration"
    """``export_request`` / ``stage_import`` / ``commit_import`` / ``abort_import`` /
    ``release``: a live request moves between two instances of the engine, with its K/V
    or without (module docstring; docs/ADAPTERS.md, "Migration")."""

    TRANSFER_FAULTS = "transfer_faults"
    """``transfer_outcomes(outcomes)`` before ``schedule``: the suite decides what each
    copy in flight at the boundary (``PoolSnapshot.transfers``, by request and
    :class:`~refserve.spec.snapshot.TransferKind`) does in the step, one
    :class:`TransferOutcome` each; a copy the step creates follows the adapter's own
    timing. The adapter plays the copying side (a KV connector's worker)."""


class TransferOutcome(StrEnum):
    """What a copy in flight does in a step (feature ``transfer_faults``)."""

    COMPLETE = "complete"
    """It lands: its copy is the step's ``swap_in`` / ``swap_out``."""
    DELAY = "delay"
    """It stays in flight (an engine that waits for it, flushing a store, completes it)."""
    FAIL = "fail"
    """It fails: nothing is copied, and the engine is told (``failed_transfers``)."""


ALL_FEATURES = frozenset(Feature)


class AdmissionOrder(StrEnum):
    """The order in which an engine admits waiting requests (a policy, checked if declared)."""

    FCFS = "fcfs"
    """No request is admitted while an earlier-arrived waiting request that fits right
    now is passed over (ORDER); passing over a head that does not fit is allowed."""
    PRIORITY = "priority"
    """As FCFS, ordered by ``RequestSpec.priority`` (smaller first), then arrival."""
    FCFS_STRICT = "fcfs_strict"
    """Head-of-line blocking: no never-run request is admitted while an earlier-arrived
    one that was waiting before the step is not admitted, fitting or not (ORDER)."""
    PRIORITY_STRICT = "priority_strict"
    """As FCFS_STRICT, ordered by ``RequestSpec.priority`` (smaller first), then arrival."""
    UNSPECIFIED = "unspecified"
    """Not checked (reported as such)."""

    @property
    def by_priority(self) -> bool:
        """Whether the order ranks by ``(priority, arrival)`` rather than arrival alone."""
        return self in (AdmissionOrder.PRIORITY, AdmissionOrder.PRIORITY_STRICT)

    @property
    def strict(self) -> bool:
        """Whether a waiting head blocks everyone behind it (head-of-line blocking)."""
        return self in (AdmissionOrder.FCFS_STRICT, AdmissionOrder.PRIORITY_STRICT)


@dataclass(frozen=True)
class MultiLevelQueue:
    """A preemptive multi-level queue discipline (a multi-level feedback queue), declared
    in place of an admission and a step order (ORDER, rules ``level-admission`` and
    ``level-preemption``, spec/order.py).

    ``num_levels`` levels, level 0 the highest. The adapter reports each live request's
    level at every step boundary with a ``levels()`` method (:data:`LEVELS_METHOD`): a
    mapping from request id to level, read before ``schedule``, so it is the level the
    step is planned with. Where a request's level comes from (its attained service, a
    skip-join, a promotion against starvation) is the engine's business; the suite holds
    the engine to the order it states: admission by level, then arrival within a level,
    and a preemption only to make room for a higher level.
    """

    num_levels: int
    by_priority: bool = False
    """Whether a level's own order is ``(RequestSpec.priority, arrival)`` rather than
    arrival alone (refserve's queue orders each level by priority, then arrival)."""

    def __post_init__(self) -> None:
        n = self.num_levels
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_LEVELS:
            raise ValueError(f"num_levels must be an int in [1, {MAX_LEVELS}], got {n!r}")
        if not isinstance(self.by_priority, bool):
            raise ValueError(f"by_priority must be a bool, got {self.by_priority!r}")

    def to_json(self) -> dict[str, object]:
        return {"num_levels": self.num_levels, "by_priority": self.by_priority}


MAX_LEVELS = 64
"""The most levels a declared :class:`MultiLevelQueue` may have (a bound for validation)."""

LEVELS_METHOD = "levels"
"""The method an adapter declaring a :class:`MultiLevelQueue` has besides the protocol's:
``levels() -> Mapping[str, int]``, every live request's level at the step boundary."""


class StepOrder(StrEnum):
    """Whether running decodes or new prefill chunks get the budget first (observed, and
    either declared order checked as a promise, spec/order.py)."""

    DECODE_FIRST = "decode_first"
    PREFILL_FIRST = "prefill_first"
    UNSPECIFIED = "unspecified"


@dataclass(frozen=True)
class EngineProperties:
    """Design choices a correct engine may make, declared by its adapter (docs/CONFORMANCE.md).

    Every field has the default that refserve itself follows (``max_model_len_stop``:
    the stricter reading, as the suite's workloads never reach refserve's limit); an
    adapter without a ``properties`` attribute is held to these defaults.
    """

    lookahead_slots: int = 0
    """Slots an engine may hold ahead of the KV length: a table may hold up to
    ``ceil((num_stored + lookahead_slots) / block_size)`` blocks (at least
    ``ceil(num_stored / block_size)``). Typical values: 1 for an engine that reserves the
    slot of the token it samples in the same step, k for speculative lookahead. The blocks
    ahead are still owned by the request alone, counted in the pool (BLOCK), written only
    at their own positions (POS) and freed with the request (PROGRESS at quiescence).
    The declaration is the range, and POS checks both of its bounds; holding the slots
    is not promised (k also bounds blocks an engine keeps, such as those of rejected
    drafts)."""
    eos: bool = True
    """Whether the engine stops a request that samples its eos token. With ``False`` the
    suite still samples eos at a forced stop and never expects a stop: the request must
    keep running (KVLEN, rule ``declared-eos``), so an engine with an eos path does not
    hide it from the suite by declaring none."""
    admission_order: AdmissionOrder = AdmissionOrder.UNSPECIFIED
    """The admission order the suite checks exactly (ORDER); ``unspecified`` is not checked."""
    step_order: StepOrder = StepOrder.UNSPECIFIED
    """Decode-first or prefill-first batching: compared with what the suite observes and
    used to read the golden schedules (which are decode-first). ``decode_first`` is a
    promise, checked (ORDER, rule ``declared-step-order``): no request is admitted in a
    step that leaves a decoding request with no token (unless preempted or retired).
    ``prefill_first`` is one too (same rule): no decode is served in a step that passes
    over the first waiting request in the declared order when it visibly fitted."""
    same_step_prefix_hits: bool = False
    """Whether a request may take as a cache hit a block that another request fills in
    the same step (blocks are indexed when scheduled). Safe when the executor writes
    each layer's K/V for the whole batch before that layer's attention reads it, as
    paged engines with a per-layer cache write do; refserve indexes a block only at
    commit. With ``True`` PREFIX allows the first writer's write into such a block when
    every other holder took it in this very step. A promise too, with prefix caching on:
    nobody computes a block it took as a hit, and two requests admitted in one step hold
    each full block of a shared prefix that a hit may cover in one block (PREFIX, rule
    ``declared-same-step-hits``)."""
    free_queue_order: bool = True
    """Whether ``PoolSnapshot.free_queue`` is the order in which the engine hands out
    free blocks (checked: new blocks come from its head). ``False`` for an engine whose
    free list has no defined order (a set); the queue is then a plain list of the free
    blocks and its order is not checked."""
    max_model_len_stop: bool = False
    """Whether a request that reaches the ``max_model_len`` its snapshot reports
    (``RequestSnapshot.max_model_len``; prompt plus outputs) finishes there with reason
    ``length``, before ``max_tokens``. vLLM does (``check_stop``) and fits
    ``max_model_len`` to the pool, so small pools reach it; refserve does too, with a
    limit the suite's workloads never reach. With ``True`` such a request must finish in
    that step with reason ``length`` (KVLEN); a ``length`` stop anywhere else before
    ``max_tokens`` is still a violation, as is every such stop with ``False``. Going
    past the reported limit is a KVLEN violation either way."""
    placeholder_drafts: bool = False
    """Whether a step may verify more drafts than were proposed to the request, the
    extra ones placeholders the engine makes up and never accepts. vLLM does with a
    speculative config: it pads a request it admits with one token left to compute to
    ``1 + k`` tokens with ``-1`` drafts, so that decode batches stay uniform for its CUDA
    graphs, and its rejection sampler rejects them. With ``True`` the suite takes each
    draft past those it proposed as such a placeholder (:data:`PLACEHOLDER_DRAFT`): it
    is written at its position, never accepted, and its K/V is dropped as a rejected
    draft's; TOKEN still bounds the drafts by ``num_speculative_tokens`` and the budget
    counts them. With ``False`` such a verification is a TOKEN violation."""

    multi_level: MultiLevelQueue | None = None
    """A preemptive multi-level queue discipline (:class:`MultiLevelQueue`), declared
    instead of ``admission_order`` and ``step_order``: such an engine reorders by level,
    and preempts for a higher level, by design, so neither FCFS nor a step order holds.
    Checked (ORDER): no waiting request is passed over, when it visibly fitted, for one
    admitted at a lower level (rule ``level-admission``; within a level, for a later
    arrival), and no request is preempted in a step that admits only requests at its own
    level or lower (rule ``level-preemption``). Declaring it with an admission or a step
    order is refused."""

    def __post_init__(self) -> None:
        if not isinstance(self.lookahead_slots, int) or self.lookahead_slots < 0:
            raise ValueError(f"lookahead_slots must be an int >= 0, got {self.lookahead_slots!r}")
        if not isinstance(self.eos, bool):
            raise ValueError(f"eos must be a bool, got {self.eos!r}")
        if not isinstance(self.same_step_prefix_hits, bool):
            raise ValueError(
                f"same_step_prefix_hits must be a bool, got {self.same_step_prefix_hits!r}"
            )
        if not isinstance(self.free_queue_order, bool):
            raise ValueError(f"free_queue_order must be a bool, got {self.free_queue_order!r}")
        if not isinstance(self.max_model_len_stop, bool):
            raise ValueError(f"max_model_len_stop must be a bool, got {self.max_model_len_stop!r}")
        if not isinstance(self.placeholder_drafts, bool):
            raise ValueError(f"placeholder_drafts must be a bool, got {self.placeholder_drafts!r}")
        object.__setattr__(self, "admission_order", AdmissionOrder(self.admission_order))
        object.__setattr__(self, "step_order", StepOrder(self.step_order))
        if self.multi_level is not None:
            if not isinstance(self.multi_level, MultiLevelQueue):
                raise ValueError(
                    f"multi_level must be a MultiLevelQueue or None, got {self.multi_level!r}"
                )
            # The discipline is the whole order: an admission or step order beside it
            # would be checked against the reordering the discipline itself makes.
            if self.admission_order is not AdmissionOrder.UNSPECIFIED:
                raise ValueError(
                    f"multi_level replaces the admission order: declare admission_order "
                    f"unspecified, got {self.admission_order}"
                )
            if self.step_order is not StepOrder.UNSPECIFIED:
                raise ValueError(
                    f"multi_level replaces the step order: declare step_order unspecified, "
                    f"got {self.step_order}"
                )

    def to_json(self) -> dict[str, object]:
        return {
            "lookahead_slots": self.lookahead_slots,
            "eos": self.eos,
            "admission_order": str(self.admission_order),
            "step_order": str(self.step_order),
            "same_step_prefix_hits": self.same_step_prefix_hits,
            "free_queue_order": self.free_queue_order,
            "max_model_len_stop": self.max_model_len_stop,
            "placeholder_drafts": self.placeholder_drafts,
            "multi_level": None if self.multi_level is None else self.multi_level.to_json(),
        }


DEFAULT_PROPERTIES = EngineProperties()

PLACEHOLDER_DRAFT = -1
"""The token the suite writes for a draft an engine made up (``placeholder_drafts``):
vLLM's own placeholder, never a token the suite samples."""


def properties_of(adapter: object) -> EngineProperties:
    """The adapter's declared :class:`EngineProperties` (the defaults when it has none).

    Raises ``TypeError`` when ``properties`` is there but is not an EngineProperties.
    """
    props = getattr(adapter, "properties", None)
    if props is None:
        return DEFAULT_PROPERTIES
    if not isinstance(props, EngineProperties):
        raise TypeError(
            f"adapter.properties must be refserve.conformance.adapter.EngineProperties, "
            f"got {type(props).__name__}"
        )
    return props


@dataclass(frozen=True)
class EngineConfig:
    """The limits of one run. The three limits are separate: none stands in for another."""

    block_size: int
    num_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    enable_prefix_caching: bool = True
    max_model_len: int = 1 << 20
    eos_token_id: int | None = None
    """One eos id for every request of the run (engines often hold it globally)."""
    num_speculative_tokens: int = 0
    """The most drafts one request verifies in a step (feature ``speculative_decoding``);
    0: the suite proposes none."""


@dataclass(frozen=True)
class RequestSpec:
    """One request as the suite submits it."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    eos_token_id: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    arrival_step: int = 0
    """The step boundary at which the suite submits it (informational)."""
    priority: int = 0
    """Smaller is more important (feature ``priorities``)."""
    cache_salt: str = ""
    """The tenant's cache salt (feature ``cache_salt``); ``""``: none."""
    lora: str = ""
    """The LoRA adapter's name (feature ``lora``); ``""``: the base model."""

    @property
    def namespace(self) -> Namespace:
        """Everything besides the tokens that the request's K/V depends on.

        An adapter reports ``TableSnapshot.root_key`` as ``namespace.root_key()``: the
        identity the request was submitted with, so PREFIX can tell domains apart."""
        return Namespace(adapter=self.lora, cache_salt=self.cache_salt)


@dataclass(frozen=True)
class StepReport:
    """What one call of the engine's scheduler planned."""

    scheduled: tuple[ScheduledRequest, ...]
    preempted: tuple[str, ...] = ()
    finished: tuple[tuple[str, str], ...] = ()
    """(request id, reason) retired while planning, without being scheduled."""
    block_copies: tuple[tuple[int, int], ...] = ()
    """(src, dst) blocks the executor copies before writing (copy-on-write)."""
    swap_out: tuple[tuple[int, int], ...] = ()
    """(device block, host block) pairs copied to the host first (preemption by swap);
    the snapshot's ``host`` pool then holds the swapped request's table."""
    swap_in: tuple[tuple[int, int], ...] = ()
    """(host block, device block) pairs copied back after every swap-out and before
    ``block_copies`` and the step's writes."""


@dataclass(frozen=True)
class CommitReport:
    """Requests that finished in the step, with the engine's reason.

    Reasons the suite understands: ``stop`` (eos or a stop token id), ``length``
    (max_tokens or max_model_len), ``capacity`` (can never grow in this pool); any other
    string is reported as is.
    """

    finished: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class MigrationExport:
    """What the source engine hands over for one request (feature ``migration``).

    ``kv_slots[p]`` is the slot whose K/V the engine sends as position ``p``, for ``p``
    in ``[0, len(kv_slots))``: its KV length on the source, as the engine's transfer
    really reads it (the adapter does not recompute it from the table). Empty when the
    request has no KV (waiting, preempted by recompute). ``kv_on_host``: the slots are
    in the host swap pool (a swapped request). ``ticket`` is everything else the
    destination needs, in the engine's own form; the suite hands it to the destination
    unchanged and never reads it.
    """

    request_id: str
    kv_slots: tuple[int, ...] = ()
    kv_on_host: bool = False
    ticket: object = None


@dataclass(frozen=True)
class MigrationStaged:
    """What the destination reserved for an import (feature ``migration``).

    Positions ``[0, num_hit_tokens)`` are served by the destination's own prefix cache
    and do not travel; ``kv_slots[i]`` is the destination slot that receives position
    ``num_hit_tokens + i``. The request's KV length on the destination after the commit
    is ``num_hit_tokens + len(kv_slots)``: the source's whole KV length (a transfer) or 0
    (a recompute; the hit is then taken at admission, if at all). Anything in between
    lands part of the KV, which the migration rules refuse (MOVED).
    """

    request_id: str
    num_hit_tokens: int = 0
    kv_slots: tuple[int, ...] = ()

    @property
    def kv_length(self) -> int:
        return self.num_hit_tokens + len(self.kv_slots)


MIGRATION_METHODS = ("export_request", "stage_import", "commit_import", "abort_import", "release")
"""The methods an adapter with feature ``migration`` has besides the protocol's."""


class NotSupported(Exception):
    """The engine cannot take this configuration or operation (reported, not failed)."""


class Rejected(Exception):
    """The engine refused a request at submission (the suite checks ATOMIC)."""


@runtime_checkable
class EngineAdapter(Protocol):
    """Drives one engine instance; see the module docstring for the exact semantics."""

    @property
    def name(self) -> str:
        """A short engine name with version, for reports."""
        ...

    @property
    def features(self) -> frozenset[Feature]: ...

    def configure(self, config: EngineConfig) -> None: ...

    def add_request(self, request: RequestSpec) -> None: ...

    def abort(self, request_id: str) -> None: ...

    def has_unfinished(self) -> bool:
        """Whether any request is live (waiting, running or preempted)."""
        ...

    def schedule(self) -> StepReport: ...

    def commit(self, sampled: Mapping[str, int]) -> CommitReport: ...

    def rollback(self) -> None: ...

    def snapshot(self) -> EngineSnapshot: ...


AdapterFactory = Callable[[], EngineAdapter]
"""A zero-argument callable returning a fresh adapter (``MODULE:FACTORY`` on the CLI)."""

ENGINE_ADAPTER_ATTRIBUTES = ("name", "features")
"""The data members of :class:`EngineAdapter` (``properties`` is optional)."""
ENGINE_ADAPTER_METHODS = (
    "configure",
    "add_request",
    "abort",
    "has_unfinished",
    "schedule",
    "commit",
    "rollback",
    "snapshot",
)
"""The methods of :class:`EngineAdapter`; each must exist (one the engine lacks raises
:class:`NotSupported`)."""

_ABSENT = object()


def missing_members(obj: object, attributes: Sequence[str], methods: Sequence[str]) -> list[str]:
    """The protocol members ``obj`` lacks, in the order given: an attribute or method
    that is not there, or a method that is not callable (``"schedule (not callable)"``).

    Looked up statically (``inspect.getattr_static``), so no property of the adapter
    runs: one that raises or hangs is a finding of the run, under the suite's guard,
    not a reason to call the object something else. Only an object whose class defines
    ``__getattr__`` (a proxy) is asked dynamically for what the static lookup misses; an
    exception other than AttributeError from it propagates to the caller.
    """
    dynamic = hasattr(type(obj), "__getattr__")
    out: list[str] = []
    for m in (*attributes, *methods):
        v = inspect.getattr_static(obj, m, _ABSENT)
        if v is _ABSENT and dynamic:
            with contextlib.suppress(AttributeError):
                v = getattr(obj, m)
        if v is _ABSENT:
            out.append(m)
        elif m in methods and not _method_like(v):
            out.append(f"{m} (not callable)")
    return out


def _method_like(v: object) -> bool:
    # A classmethod object is not callable until bound, and a property may well return
    # a method: neither can be judged without running adapter code, so both pass.
    return callable(v) or isinstance(v, (classmethod, staticmethod, property))


def load_factory(spec: str) -> AdapterFactory:
    """Resolve ``MODULE:FACTORY`` (e.g. ``refserve.conformance.adapters.ref:make``)."""
    import importlib

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"adapter must be MODULE:FACTORY, got {spec!r}")
    module = importlib.import_module(module_name)
    factory = getattr(module, attr, None)
    if factory is None or not callable(factory):
        raise ValueError(f"{module_name!r} has no callable {attr!r}")
    return factory  # type: ignore[no-any-return]  # checked callable; shape is the contract
