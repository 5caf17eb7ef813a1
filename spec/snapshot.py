"""Plain snapshot data the checkers read: frozen dataclasses of ints, bytes and tuples.

An engine (refserve's own, or a third party through a conformance adapter) turns its
state into these records; no field refers back into engine objects, so a snapshot can be
stored in a trace, compared for equality (ATOMIC) and corrupted on purpose in tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


@dataclass(frozen=True)
class CacheEntry:
    """One prefix-cache index entry: ``key`` maps to physical block ``block_id``.

    ``parent_key`` and ``token_ids`` are what the key was computed from, so a checker can
    recompute it (refserve.spec.hashing.block_key) and compare with the block's live contents.
    """

    key: bytes
    block_id: int
    parent_key: bytes
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class TableSnapshot:
    """One request's view of the pool.

    ``num_stored`` is the KV length the table holds; ``token_ids`` are the token ids whose
    KV sits in positions ``[0, num_stored)`` (len == num_stored); ``root_key`` is the
    namespace root of its hash chain (refserve.spec.hashing.Namespace.root_key).
    """

    request_id: str
    block_table: tuple[int, ...]
    num_stored: int
    token_ids: tuple[int, ...]
    root_key: bytes = b""


class TransferKind(StrEnum):
    LOAD = "load"
    """K/V arriving into device blocks from another store (host memory, a remote engine)."""
    STORE = "store"
    """K/V copied out of device blocks into another store."""


@dataclass(frozen=True)
class Transfer:
    """A copy between the pool and another store that is in flight at a step boundary:
    submitted by the engine (a KV connector), not completed yet.

    Until it completes the blocks belong to the transfer: a load's blocks are held (by
    ``holder``, the table that keeps them) and read by nobody, and no step writes into
    the blocks of a load or a store (spec/transfer.py)."""

    request_id: str
    kind: TransferKind
    blocks: tuple[int, ...]
    """The device blocks it writes (a load) or reads (a store)."""
    holder: str = ""
    """The table that holds a load's blocks while it is in flight (``""``: the
    request's own); its other blocks are the request's prefix hit."""


#: A window group's table entry for a block that has left the window (spec/groups.py).
NULL_BLOCK = -1


@dataclass(frozen=True)
class PoolSnapshot:
    """The paged KV pool: ``ref_cnt[b]`` per block, the free queue in hand-out order."""

    num_blocks: int
    block_size: int
    ref_cnt: tuple[int, ...]
    free_queue: tuple[int, ...]
    tables: tuple[TableSnapshot, ...]
    cache_entries: tuple[CacheEntry, ...] = ()
    transfers: tuple[Transfer, ...] = ()
    """Copies to or from another store in flight at this boundary (a KV connector)."""
    stated_free: int | None = None
    """The blocks the manager itself says it can hand out now (free plus evictable), for
    a manager that keeps such a figure and admits by it; ``None`` when it keeps none.
    BLOCK holds it to ``len(free_queue)``: a figure that drifts from the blocks makes the
    manager admit what it cannot place, or refuse what it could."""
    failed_transfers: tuple[Transfer, ...] = ()
    """Copies that failed: each from the first boundary after it failed, and a load for
    as long as its holder keeps its blocks (for the recompute). No longer in flight, and
    what they copied is no K/V anyone may serve (spec/transfer.py); a holder may keep a
    failed load's blocks past its KV length, as slots reserved ahead (spec/pos.py)."""
    null_entries: bool = False
    """Tables may hold :data:`NULL_BLOCK` entries: a hybrid model's window groups keep
    the places of blocks that left the window (spec/groups.py); such an entry holds no
    block. Off, a null entry is a block id out of range like any other."""

    def table(self, request_id: str) -> TableSnapshot | None:
        for t in self.tables:
            if t.request_id == request_id:
                return t
        return None


class RequestStatus(StrEnum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    PREEMPTED = "preempted"
    SWAPPED = "swapped"
    WAITING_TOOL = "waiting_tool"
    LOADING = "loading"
    """Its K/V is arriving from another store (a KV connector's load from host memory or a
    remote engine): not runnable until the load lands, when it is waiting again."""
    FINISHED = "finished"
    ABORTED = "aborted"

    @property
    def is_done(self) -> bool:
        return self in (RequestStatus.FINISHED, RequestStatus.ABORTED)

    @property
    def is_runnable(self) -> bool:
        """Has work the scheduler could give it a token for."""
        return self in (
            RequestStatus.WAITING,
            RequestStatus.PREFILLING,
            RequestStatus.DECODING,
            RequestStatus.PREEMPTED,
            RequestStatus.SWAPPED,
        )


@dataclass(frozen=True)
class RequestSnapshot:
    """A request's counters. Sampled count and KV length are separate fields on purpose."""

    request_id: str
    status: RequestStatus
    num_prompt_tokens: int
    num_output_tokens: int
    num_computed_tokens: int
    max_tokens: int
    num_cached_tokens: int = 0
    max_model_len: int = 1 << 30
    arrival_step: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens


@dataclass(frozen=True)
class EngineSnapshot:
    """Requests plus pool; ``requests`` keeps finished/aborted requests of the step.

    ``host`` is the host-side swap pool when the engine has one (None otherwise): the
    same record as the device pool, each host block held by at most one table (swapped
    KV is never shared) and no cache entries. Its tables hold the KV of requests that
    are SWAPPED, or WAITING_TOOL with their KV moved to the host.
    """

    requests: tuple[RequestSnapshot, ...]
    pool: PoolSnapshot
    host: PoolSnapshot | None = None

    def request(self, request_id: str) -> RequestSnapshot | None:
        for r in self.requests:
            if r.request_id == request_id:
                return r
        return None


@dataclass(frozen=True)
class ScheduledRequest:
    """What one step gives one request: ``n`` tokens at ``positions`` written to slots."""

    request_id: str
    num_new_tokens: int
    positions: tuple[int, ...]
    slot_mapping: tuple[int, ...]
    block_table: tuple[int, ...]
    samples: bool
    num_new_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache when this step admitted the request."""
    num_new_loaded_tokens: int = 0
    """Tokens whose K/V a completed load (a KV connector's copy from another store) wrote
    into the request's own blocks, after its cache hit and before this step's positions,
    when this step admitted it. TOKEN, POS and KVLEN count them like a hit; they are no
    prefix-cache hit, so PREFIX's whole-block rules leave them alone (the fake KV memory
    reads them back)."""
    num_draft_tokens: int = 0
    """Speculative decoding (docs/SPECULATIVE.md): how many of the ``num_new_tokens``
    are draft tokens this step verifies. They come last, after the request's last
    sampled token, at the positions that follow it; 0 for a plain chunk."""


@dataclass(frozen=True)
class StepSnapshot:
    """One scheduler step: the state before, the plan, and the state after commit."""

    step_index: int
    token_budget: int
    max_num_seqs: int
    before: EngineSnapshot
    scheduled: tuple[ScheduledRequest, ...]
    after: EngineSnapshot
    # Requests whose KV the step released or moved: running victims (recompute or swap)
    # and paused agent turns whose device KV was reclaimed for others.
    preempted: tuple[str, ...] = ()
    finished: tuple[str, ...] = ()
    aborted: tuple[str, ...] = field(default=())
    # The declared most draft tokens one request may verify in a step (k); 0 when the
    # engine does not speculate.
    num_speculative_tokens: int = 0
