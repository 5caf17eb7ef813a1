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
* ``snapshot`` returns a :class:`spec.EngineSnapshot` at a step boundary: every live
  request, plus the requests that finished or were aborted since the last ``schedule``
  began (status ``finished`` / ``aborted``); the pool with ref counts, the free queue in
  hand-out order, one :class:`spec.TableSnapshot` per request holding blocks, and (feature
  ``cache_index``) the prefix-cache index as :class:`spec.CacheEntry` records keyed by
  :func:`spec.hashing.block_key`.

Request state mapping: a request not yet scheduled is ``waiting``; one whose prompt is
partly computed is ``prefilling``; one with KV for all but its last sampled token is
``decoding``; one that lost its KV to preemption and waits to recompute is ``preempted``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol, runtime_checkable

from spec.snapshot import EngineSnapshot, ScheduledRequest


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


ALL_FEATURES = frozenset(Feature)


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


def load_factory(spec: str) -> AdapterFactory:
    """Resolve ``MODULE:FACTORY`` (e.g. ``conformance.adapters.ref:make``)."""
    import importlib

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"adapter must be MODULE:FACTORY, got {spec!r}")
    module = importlib.import_module(module_name)
    factory = getattr(module, attr, None)
    if factory is None or not callable(factory):
        raise ValueError(f"{module_name!r} has no callable {attr!r}")
    return factory  # type: ignore[no-any-return]  # checked callable; shape is the contract
