"""Migration between engines: move a live request to another engine (``LLMEngine``) at any
step boundary, with its K/V or without (docs/MIGRATION.md).

The protocol, one call each, the source unchanged until its last move:

1. ``ticket = src.export_request(rid)``: a pure read (:func:`export`). The ticket carries
   the K/V inline, or none (``inline=False``: it is streamed in step 3), or none at all
   when the rule says recompute (ref/core/migration_cost.py).
2. ``staged = dst.stage_import(ticket)`` (:class:`StagedImport`): checks the ticket
   (model, KV layout, duplicate ids, a finished request: typed errors), reserves the
   destination's own blocks (its prefix hits used: ``staged.needed`` are only the
   positions after them) and writes the inline K/V through its own slot mapping. Its
   K/V writes are journaled: ``staged.abort()`` restores every slot and block.
3. ``staged.write(src.read_kv(seq_id, start, end))`` for each needed range, in chunks.
4. ``staged.ack()``: every needed position was written. From here the destination owns
   the request; before here any failure leaves it running on the source as it was.
5. ``src.release_request(rid)``: the source frees its blocks (only after the ack).
6. ``staged.commit()``: the request becomes runnable on the destination.

:func:`migrate` is the one driver of these steps (the engine, the cluster, the served
cluster, the cluster simulator and the CLI call it; tests/repo/test_one_migration_driver.py
holds every release of a source to it): it runs them between any source and destination
of the shapes :class:`MigrationSource` and :class:`MigrationDestination` (an
``LLMEngine``; a peer reached by whole tickets, ref/cluster/migration.py; a replica
thread of the served cluster, ref/serve/cluster_migration.py; a simulated replica and
its link, ref/cluster/sim_migration.py), with its arguments checked once
(:class:`~refserve.core.transit.MigrationArgs`) and a fault hook at every point of
:class:`~refserve.core.transit.MigrationFault`: a fault before the ack aborts the staged
import and leaves the source as it was; a fault after it rolls forward (the destination
holds the only copy). A request that changed on the source during the transfer
(:func:`~refserve.core.transit.source_changed`, :class:`SourceChanged`) is not moved: the
destination drops what it staged, even after the ack as long as it has not committed, so
an abort finishes the request exactly once, on the source.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Protocol, TypeVar

import torch

from refserve.core import transit
from refserve.core.migration_cost import KVMode, MigrationCost, MigrationDecision
from refserve.core.request import Request
from refserve.core.scheduler import Scheduler
from refserve.core.transit import (
    GroupSlots,
    Import,
    InvalidMigrationArgument,
    KVPlace,
    MigrationArgs,
    MigrationError,
    MigrationFault,
    MigrationRefused,
    RequestState,
)
from refserve.engine.samples import Sample, SampleBook, SampleGroup, sample_spec
from refserve.engine.ticket import (
    GROUPED_TICKET_VERSION,
    TICKET_VERSION,
    KVChunk,
    KVLayoutMismatch,
    MigrationTicket,
    ModelIdentity,
    ModelMismatch,
    SeqTicket,
    TicketError,
)
from refserve.errors import DuplicateRequest
from refserve.model.config import ModelConfig
from refserve.model.executor import ModelExecutor, SavedRows
from refserve.model.llama import HostKVCache, KVCache, LlamaModel
from refserve.model.sampler import SamplingParams
from refserve.model.tokenizer import TextStream, Tokenizer
from refserve.model.weights import LayerWeights
from refserve.spec.groups import layout_text


class Engine(Protocol):
    """What migration reads and writes of an engine: ref/engine/llm_engine.py's
    ``LLMEngine`` public surface (typed here by shape, so that this module does not
    import the engine that imports it)."""

    scheduler: Scheduler
    executor: ModelExecutor
    cache: KVCache
    host_cache: HostKVCache
    tokenizer: Tokenizer
    books: SampleBook
    num_migrations_in: int
    num_migrations_out: int
    migration_ms: float

    @property
    def identity(self) -> ModelIdentity: ...

    def now_ms(self) -> float: ...


FaultHook = Callable[[str], None]


# ---------------------------------------------------------------------------- identity
def model_identity(engine: Engine) -> ModelIdentity:
    """The engine's network (``LLMEngine.identity``, computed once by
    :func:`identify_model`)."""
    return engine.identity


def identify_model(cfg: ModelConfig, model: LlamaModel, cache: KVCache) -> ModelIdentity:
    """A network: shape, dtype and a fingerprint of its weights (the first values of
    every tensor, hashed), so a ticket from another checkpoint is refused."""
    h = hashlib.sha256(repr(cfg).encode())
    w = model.weights
    tensors = [
        w.embed,
        w.norm,
        w.lm_head,
        *(t for layer in w.layers for t in _layer_tensors(layer)),
    ]
    for t in tensors:
        h.update(t.detach().flatten()[:64].to(torch.float64).cpu().numpy().tobytes())
    dtype = str(cache.key[0].dtype).removeprefix("torch.")
    return ModelIdentity(
        cfg.model_type,
        cfg.vocab_size,
        cfg.num_layers,
        cfg.num_kv_heads,
        cfg.head_dim,
        dtype,
        tuple(cfg.layer_window(i) for i in range(cfg.num_layers)),
        h.hexdigest(),
    )


def _layer_tensors(layer: LayerWeights) -> list[torch.Tensor]:
    return [t for t in vars(layer).values() if isinstance(t, torch.Tensor)]


# ---------------------------------------------------------------------------- export
def export(
    engine: Engine,
    request_id: str,
    *,
    kv: KVMode | str = KVMode.AUTO,
    inline: bool = True,
    cost: MigrationCost | None = None,
    hit_tokens: int = 0,
    idle: float = 1.0,
) -> MigrationTicket:
    """Step 1 (module doc): the ticket of every live sample of ``request_id``."""
    group, live = _live_samples(engine, request_id)
    departures = [transit.export(engine.scheduler, s.seq_id) for s in live]  # a step open: raises
    rule = cost or default_cost(engine)
    kv_tokens = max(d.kv_length for d in departures)
    grouped = engine.scheduler.config.grouped
    decision = rule.decide(kv, kv_tokens, min(hit_tokens, kv_tokens), idle)
    seqs = tuple(_seq_ticket(s, d.state, d.kv_place) for s, d in zip(live, departures, strict=True))
    chunks: tuple[KVChunk, ...] = ()
    if decision.mode is KVMode.TRANSFER and inline:
        # Only what the destination lacks travels: positions before its hit are cached
        # there. The hit was probed on one sample; beyond the prompt, which every sample
        # shares, it holds only for that sample.
        first = decision.hit_tokens
        if grouped:  # a grouped destination takes no prefix hit (transit._restore)
            first = 0
        elif len(departures) > 1:
            first = min(first, departures[0].state.num_prompt_tokens)
        chunks = tuple(
            read_kv(engine, d.state.request_id, min(first, d.kv_length), d.kv_length)
            for d in departures
            if d.kv_length > first
        )
    return MigrationTicket(
        request_id=request_id,
        model=model_identity(engine),
        block_size=engine.scheduler.config.block_size,
        params=_plain_params(group.params),
        seed=group.seed,
        turn=group.turn,
        stop=group.stop,
        prompt_token_ids=group.prompt_token_ids,
        child_ids=group.child_ids,
        forked=group.forked,
        sequences=seqs,
        kv_mode=decision.mode,
        clock_ms=engine.now_ms(),
        decisions=(*group.migrations, decision),
        chunks=chunks,
        version=GROUPED_TICKET_VERSION if grouped else TICKET_VERSION,
        kv_layout=kv_layout(engine),
    )


def kv_layout(engine: Engine) -> str:
    """The engine's KV layout as a ticket names it (spec/groups.py ``layout_text``)."""
    groups = engine.scheduler.config.kv_groups
    return layout_text(groups if len(groups) > 1 else ())


def _live_samples(engine: Engine, request_id: str) -> tuple[SampleGroup, list[Sample]]:
    """The request's books and its live samples; a typed error if it has none here."""
    group = engine.books.group(request_id)
    if group is None:
        raise MigrationError(f"export: request {request_id!r} is not live on this engine")
    live = [s for s in group.seqs if not s.finished]
    if not live or any(s.seq_id not in engine.scheduler.requests for s in live):
        raise MigrationError(f"export: request {request_id!r} has finished")
    return group, live


def _plain_params(sp: SamplingParams) -> dict[str, object]:
    """The sampling params as JSON values (tuples as lists: what a decoded ticket holds)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(sp).items()}


def default_cost(engine: Engine) -> MigrationCost:
    """The rule's defaults (:class:`MigrationCost`) with this model's KV bytes per token."""
    return MigrationCost(kv_bytes_per_token=engine.cache.bytes_per_token)


def _seq_ticket(seq: Sample, state: RequestState, place: KVPlace) -> SeqTicket:
    assert seq.pending_stop is None, "a stop string ends its sequence in the same step"
    return SeqTicket(
        seq_id=seq.seq_id,
        index=seq.index,
        state=state,
        kv_place=place,
        token_ids=tuple(seq.token_ids),
        logprobs=None if seq.logprobs is None else tuple(seq.logprobs),
        delivered_tokens=seq.delivered_tokens,
        delivered_chars=len(seq.stream.emitted_text),
        text=seq.stream.text,
        paused=seq.paused,
        times_from=seq.times_from,
        turn_arrival_ms=seq.turn_arrival_ms,
        num_draft_tokens=seq.num_draft_tokens,
        num_accepted_tokens=seq.num_accepted_tokens,
    )


def read_kv(engine: Engine, seq_id: str, start: int, end: int) -> KVChunk:
    """The K/V of positions ``[start, end)`` of a live sample, from the device or the
    host pool (a swapped request's), token-major (:class:`KVChunk`)."""
    d = transit.export(engine.scheduler, seq_id)
    if not 0 <= start < end <= d.kv_length:
        raise MigrationError(
            f"read_kv: {seq_id!r} holds KV for positions [0, {d.kv_length}); asked [{start}, {end})"
        )
    cache = engine.host_cache if d.kv_place is KVPlace.HOST else engine.cache
    if d.groups:
        return _read_groups(engine, cache, d.groups, seq_id, start, end)
    index = torch.tensor(d.slots[start:end], dtype=torch.int64, device=cache.key[0].device)
    rows = [
        t.view(-1, *t.shape[2:]).index_select(0, index)
        for layer in range(len(cache.key))
        for t in (cache.key[layer], cache.value[layer])
    ]
    data = torch.stack(rows).contiguous().cpu().view(torch.uint8).numpy().tobytes()
    return KVChunk(seq_id, start, end, data)


def _read_groups(
    engine: Engine,
    cache: KVCache | HostKVCache,
    groups: Sequence[GroupSlots],
    seq_id: str,
    start: int,
    end: int,
) -> KVChunk:
    """:func:`read_kv` on a grouped pool: each layer's rows from its own group's slots,
    from the first position its group holds (a window group holds none before its
    window, so those positions do not travel)."""
    device = cache.key[0].device
    starts: list[int] = []
    parts: list[bytes] = []
    for layer, g in enumerate(_layer_groups(engine)):
        held = groups[g]
        first = min(max(start, held.start), end)
        starts.append(first)
        slots = held.slots[first - held.start : end - held.start]
        index = torch.tensor(slots, dtype=torch.int64, device=device)
        for t in (cache.key[layer], cache.value[layer]):
            rows = t.view(-1, *t.shape[2:]).index_select(0, index).contiguous().cpu()
            parts.append(rows.view(torch.uint8).numpy().tobytes())
    return KVChunk(seq_id, start, end, b"".join(parts), tuple(starts))


def _layer_groups(engine: Engine) -> tuple[int, ...]:
    """The layer group each layer reads and writes (ref/model/llama.py)."""
    return engine.executor.model.layer_groups


# ---------------------------------------------------------------------------- import
@dataclass
class StagedImport:
    """Steps 2-6 on the destination (module doc). ``needed[seq_id]`` is the range of
    positions whose K/V must still be written; ``hit_tokens[seq_id]`` the destination's
    own prefix hit."""

    engine: Engine
    ticket: MigrationTicket
    transit_ms: float
    needed: dict[str, tuple[int, int]]
    hit_tokens: dict[str, int]
    _import: Import
    _slots: dict[str, tuple[int, ...]]
    _offset: dict[str, int]
    _groups: dict[str, tuple[GroupSlots, ...]] = field(default_factory=dict)
    _written: dict[str, int] = field(default_factory=dict)
    _saved: list[SavedRows] = field(default_factory=list)
    acked: bool = False
    done: bool = False

    def write(self, chunk: KVChunk) -> None:
        """Write one chunk of K/V (positions before the hit are skipped: the
        destination's cached blocks already hold them)."""
        assert not self.done, "write after commit or abort"
        rng = self.needed.get(chunk.seq_id)
        if rng is None:
            raise TicketError(f"a chunk for {chunk.seq_id!r}, which this import does not stage")
        lo, hi = rng
        start, end = max(chunk.start, lo), min(chunk.end, hi)
        if chunk.end > hi or chunk.start > self._written.get(chunk.seq_id, lo):
            raise TicketError(
                f"chunk {chunk.seq_id!r} [{chunk.start}, {chunk.end}) is out of order; "
                f"positions up to {self._written.get(chunk.seq_id, lo)} are written of [{lo}, {hi})"
            )
        if start >= end:
            return
        if self._groups.get(chunk.seq_id):
            self._write_groups(chunk, self._groups[chunk.seq_id], start, end)
            self._written[chunk.seq_id] = max(self._written.get(chunk.seq_id, lo), end)
            return
        if chunk.layer_starts:
            raise KVLayoutMismatch(
                f"chunk {chunk.seq_id!r} [{chunk.start}, {chunk.end}) is from a grouped KV "
                "pool; this engine's pool has one table"
            )
        rows = _rows(self.engine, self.ticket.model, chunk)[
            :, start - chunk.start : end - chunk.start
        ]
        base = self._offset[chunk.seq_id]
        slots = self._slots[chunk.seq_id][start - base : end - base]
        cache = self.engine.cache
        index = torch.tensor(slots, dtype=torch.int64, device=cache.key[0].device)
        keys = [t.view(-1, *t.shape[2:]) for t in cache.key]
        values = [t.view(-1, *t.shape[2:]) for t in cache.value]
        self._saved.append(SavedRows.save(keys, values, index))
        for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
            k.index_copy_(0, index, rows[2 * layer].to(k.device))
            v.index_copy_(0, index, rows[2 * layer + 1].to(v.device))
        self._written[chunk.seq_id] = max(self._written.get(chunk.seq_id, lo), end)

    def _write_groups(
        self, chunk: KVChunk, groups: Sequence[GroupSlots], start: int, end: int
    ) -> None:
        """:meth:`write` on a grouped pool: positions ``[start, end)`` of each layer into
        its own group's slots, from the first its group holds here."""
        cache = self.engine.cache
        device = cache.key[0].device
        rows = _layer_rows(self.engine, self.ticket.model, chunk)
        for layer, g in enumerate(_layer_groups(self.engine)):
            held = groups[g]
            first = max(start, held.start)
            if first >= end:
                continue
            carried = chunk.layer_start(layer)
            if first < carried:
                raise KVLayoutMismatch(
                    f"chunk {chunk.seq_id!r} [{chunk.start}, {chunk.end}) carries layer {layer} "
                    f"from {carried}; this engine holds its group from {first}"
                )
            slots = held.slots[first - held.start : end - held.start]
            index = torch.tensor(slots, dtype=torch.int64, device=device)
            k_cache = cache.key[layer].view(-1, *cache.key[layer].shape[2:])
            v_cache = cache.value[layer].view(-1, *cache.value[layer].shape[2:])
            self._saved.append(SavedRows.save([k_cache], [v_cache], index))
            k, v = rows[layer]
            k_cache.index_copy_(0, index, k[first - carried : end - carried].to(device))
            v_cache.index_copy_(0, index, v[first - carried : end - carried].to(device))

    @property
    def complete(self) -> bool:
        return all(
            self._written.get(sid, lo) >= hi for sid, (lo, hi) in self.needed.items() if hi > lo
        )

    def ack(self) -> None:
        """Step 4: every needed position is written; the destination now owns it."""
        if not self.complete:
            missing = {s: (self._written.get(s, lo), hi) for s, (lo, hi) in self.needed.items()}
            raise MigrationError(f"ack: K/V still missing for {missing}")
        self.acked = True

    def abort(self) -> None:
        """Undo the stage: blocks, prefix-cache entries and every K/V slot written. After
        the ack only when the source finished the request meanwhile (an abort that reached
        it first: it must finish once, there), never after the commit."""
        assert not self.done, "abort after commit or abort"
        self.done = True
        for saved in reversed(self._saved):
            saved.restore()
        self._import.abort()

    @property
    def decisions(self) -> list[MigrationDecision]:
        """The request's migrations, this one last as the destination staged it: the
        hit it really held (the rule was told the hit the driver probed; a recompute
        stages nothing here, so its record keeps the probe)."""
        decisions = list(self.ticket.decisions)
        if decisions and self.ticket.kv_mode is KVMode.TRANSFER:
            decisions[-1] = replace(
                decisions[-1],
                hit_tokens=min(max(self.hit_tokens.values(), default=0), decisions[-1].kv_tokens),
            )
        return decisions

    @property
    def decision(self) -> MigrationDecision:
        """This migration's decision (:attr:`decisions`)."""
        return self.decisions[-1]

    def commit(self, transit_ms: float | None = None) -> list[str]:
        """Step 6: the request is live on the destination; returns its sample ids.
        ``transit_ms``: how long it travelled (None: as staged)."""
        assert self.acked and not self.done, "commit needs the ack, once"
        self.done = True
        if transit_ms is not None:
            self.transit_ms = transit_ms
        offset = self.engine.now_ms() - self.transit_ms - self.ticket.clock_ms
        reqs = self._import.commit(offset)
        _adopt(self, reqs, offset)
        return [r.request_id for r in reqs]


def stage(engine: Engine, ticket: MigrationTicket, *, transit_ms: float = 0.0) -> StagedImport:
    """Step 2 (module doc): check the ticket, stage its requests, write its inline K/V.
    Raises a typed error with the destination unchanged."""
    _check_ticket(engine, ticket)
    with_kv = ticket.kv_mode is KVMode.TRANSFER
    if with_kv:
        _check_layout(engine, ticket)
    imp = transit.begin_import(engine.scheduler)
    try:
        arrivals = [imp.stage(s.state, with_kv=with_kv) for s in ticket.sequences]
    except BaseException:
        imp.abort()
        raise
    staged = StagedImport(
        engine,
        ticket,
        transit_ms,
        needed={a.state.request_id: (a.num_hit_tokens, a.kv_length) for a in arrivals},
        hit_tokens={a.state.request_id: a.num_hit_tokens for a in arrivals},
        _import=imp,
        _slots={a.state.request_id: a.slots for a in arrivals},
        _offset={a.state.request_id: a.num_hit_tokens for a in arrivals},
        _groups={a.state.request_id: a.groups for a in arrivals},
    )
    try:
        for chunk in ticket.chunks:
            staged.write(chunk)
    except BaseException:
        staged.abort()
        raise
    return staged


class KVLayoutRefused(MigrationRefused):
    """K/V from a pool of another layout (a grouped pool and a plain one, or grouped
    pools of other groups or block sizes): it cannot be placed here, so the request
    moves by recompute (``auto`` does; ``transfer`` is refused)."""


def _check_layout(engine: Engine, t: MigrationTicket) -> None:
    """K/V that travels is placed per layer group: the source's layout must be this
    engine's, and a grouped one's block size too (a window group's held places, which
    the K/V covers, start at a block)."""
    mine = kv_layout(engine)
    if t.kv_layout != mine:
        raise KVLayoutRefused(
            f"import: ticket of {t.request_id!r} brings K/V from a {t.kv_layout!r} KV layout; "
            f"this engine's is {mine!r} (the layouts differ: it moves by recompute)"
        )
    bs = engine.scheduler.config.block_size
    if mine != "full" and t.block_size != bs:
        raise KVLayoutRefused(
            f"import: ticket of {t.request_id!r} brings grouped K/V in blocks of "
            f"{t.block_size}; this engine's are {bs} (its window places differ: it moves "
            "by recompute)"
        )


def _check_ticket(engine: Engine, t: MigrationTicket) -> None:
    if not isinstance(t, MigrationTicket):
        raise TicketError(f"import: expected a MigrationTicket, got {type(t).__name__}")
    _check_model(engine, t)
    _check_samples(engine, t)


def _check_model(engine: Engine, t: MigrationTicket) -> None:
    """The ticket's K/V was computed by this engine's network, in its cache layout."""
    mine, theirs = model_identity(engine), t.model
    if (theirs.model_type, theirs.vocab_size) != (mine.model_type, mine.vocab_size):
        raise ModelMismatch(
            f"import: ticket of {t.request_id!r} is from a {theirs.model_type} model of "
            f"{theirs.vocab_size} tokens; this engine runs a {mine.model_type} of {mine.vocab_size}"
        )
    shape = (theirs.num_layers, theirs.num_kv_heads, theirs.head_dim, theirs.dtype)
    if shape != (mine.num_layers, mine.num_kv_heads, mine.head_dim, mine.dtype):
        raise KVLayoutMismatch(
            f"import: ticket of {t.request_id!r} has K/V of {theirs.num_layers} layers x "
            f"{theirs.num_kv_heads} heads x {theirs.head_dim} in {theirs.dtype}; this cache is "
            f"{mine.num_layers} x {mine.num_kv_heads} x {mine.head_dim} in {mine.dtype}"
        )
    if theirs.layer_windows != mine.layer_windows:
        raise ModelMismatch(
            f"import: ticket of {t.request_id!r} was computed by layers that attend "
            f"{theirs.attention}; this engine's attend {mine.attention}"
        )
    if theirs.fingerprint != mine.fingerprint:
        raise ModelMismatch(
            f"import: ticket of {t.request_id!r} was computed with other weights "
            f"({theirs.fingerprint[:12]}; this engine's are {mine.fingerprint[:12]})"
        )


def _check_samples(engine: Engine, t: MigrationTicket) -> None:
    """Live samples with free ids here, K/V only for them, params and text that replay."""
    if not t.sequences:
        raise TicketError(f"import: ticket of {t.request_id!r} has no live sample")
    for s in t.sequences:
        if s.state.status.is_done:
            raise MigrationError(f"import: ticket of {t.request_id!r} is for a finished request")
    rid = t.request_id
    if engine.books.has_request(rid):
        raise DuplicateRequest(rid, "import")
    for s in t.sequences:
        if engine.books.has_sample(s.seq_id) or s.seq_id in engine.scheduler.requests:
            raise DuplicateRequest(s.seq_id, "import")
    if any(c.seq_id not in {s.seq_id for s in t.sequences} for c in t.chunks):
        raise TicketError(f"import: ticket of {rid!r} has K/V for a sample it does not carry")
    try:
        sp = SamplingParams.from_dict(t.params)
    except (TypeError, ValueError) as e:
        raise TicketError(f"import: ticket of {rid!r} has bad sampling params: {e}") from None
    for s in t.sequences:
        _text_stream(engine, sp, t.prompt_token_ids, s)


def _rows(engine: Engine, model: ModelIdentity, chunk: KVChunk) -> torch.Tensor:
    """A chunk's bytes as ``[2 * layers, n, H, D]`` rows in the cache's dtype."""
    n = chunk.end - chunk.start
    per_token = model.bytes_per_token
    if len(chunk.data) != n * per_token:
        raise KVLayoutMismatch(
            f"chunk {chunk.seq_id!r} [{chunk.start}, {chunk.end}) has {len(chunk.data)} bytes; "
            f"{n} tokens of this K/V layout take {n * per_token}"
        )
    dtype = engine.cache.key[0].dtype
    flat = torch.frombuffer(bytearray(chunk.data), dtype=torch.uint8).view(dtype)
    return flat.view(2 * model.num_layers, n, model.num_kv_heads, model.head_dim)


def _layer_rows(
    engine: Engine, model: ModelIdentity, chunk: KVChunk
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A grouped chunk's bytes as each layer's K and V rows ``[n_l, H, D]``, ``n_l`` the
    positions that layer carries (:attr:`KVChunk.layer_starts`)."""
    if not chunk.layer_starts:
        rows = _rows(engine, model, chunk)
        return [(rows[2 * i], rows[2 * i + 1]) for i in range(model.num_layers)]
    if len(chunk.layer_starts) != model.num_layers:
        raise KVLayoutMismatch(
            f"chunk {chunk.seq_id!r} [{chunk.start}, {chunk.end}) gives layer starts for "
            f"{len(chunk.layer_starts)} layers; the model has {model.num_layers}"
        )
    per_row = model.bytes_per_token // (2 * model.num_layers)
    counts = [chunk.end - s for s in chunk.layer_starts]
    if len(chunk.data) != 2 * sum(counts) * per_row:
        raise KVLayoutMismatch(
            f"chunk {chunk.seq_id!r} [{chunk.start}, {chunk.end}) has {len(chunk.data)} bytes; "
            f"its layers' positions take {2 * sum(counts) * per_row}"
        )
    dtype = engine.cache.key[0].dtype
    flat = torch.frombuffer(bytearray(chunk.data), dtype=torch.uint8).view(dtype)
    shape = (model.num_kv_heads, model.head_dim)
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    offset = 0
    for n in counts:
        size = n * shape[0] * shape[1]
        k = flat[offset : offset + size].view(n, *shape)
        v = flat[offset + size : offset + 2 * size].view(n, *shape)
        out.append((k, v))
        offset += 2 * size
    return out


def _adopt(staged: StagedImport, reqs: Sequence[Request], offset_ms: float) -> None:
    """The engine's books for the committed requests: group, samples, specs, streams;
    ``offset_ms`` moves the sample's own times (a resumed turn's arrival) onto this
    engine's clock, as :meth:`Import.commit` moved the request's."""
    from refserve.model.sampler import derive_seed

    engine, t = staged.engine, staged.ticket
    sp = SamplingParams.from_dict(t.params)
    by_id = {r.request_id: r for r in reqs}
    seqs: list[Sample] = []
    for s in t.sequences:
        req = by_id[s.seq_id]
        seq = engine.books.new_sample(s.seq_id, t.request_id, s.index, req, sp, t.prompt_token_ids)
        _replay(seq, s, _text_stream(engine, sp, t.prompt_token_ids, s), t.turn, offset_ms)
        seqs.append(seq)
        forks = (
            ()
            if t.forked or s.index
            else tuple(
                sample_spec(sp, derive_seed(t.seed, i)) for i in range(1, len(t.child_ids) + 1)
            )
        )
        engine.executor.register(s.seq_id, sample_spec(sp, derive_seed(t.seed, s.index)), forks)
    group = SampleGroup(
        t.request_id, sp, t.stop, t.prompt_token_ids, t.seed, seqs, t.child_ids, t.turn
    )
    group.forked = t.forked
    group.migrations = staged.decisions
    engine.books.open(group)
    engine.num_migrations_in += 1
    engine.migration_ms += staged.transit_ms


def _replay(seq: Sample, s: SeqTicket, stream: TextStream, turn: int, offset_ms: float) -> None:
    """The sample's engine state from its ticket: tokens, logprobs, counters, and the
    text stream :func:`_text_stream` rebuilt."""
    seq.stream = stream
    seq.token_ids = list(s.token_ids)
    seq.logprobs = None if s.logprobs is None else list(s.logprobs)
    seq.delivered_tokens = s.delivered_tokens
    seq.paused = s.paused
    seq.turn = turn
    seq.times_from = s.times_from
    arrival = s.turn_arrival_ms
    seq.turn_arrival_ms = None if arrival is None else arrival + offset_ms
    seq.num_draft_tokens = s.num_draft_tokens
    seq.num_accepted_tokens = s.num_accepted_tokens


def _text_stream(
    engine: Engine, sp: SamplingParams, prompt: Sequence[int], s: SeqTicket
) -> TextStream:
    """The sample's text stream, built as ``Engine._new_seq`` builds one and fed the
    same tokens (detokenization and stop-string holdback are deterministic), then told
    how much text was already delivered. A ticket whose tokens do not give its text, or
    whose counts do not fit its tokens, raises :class:`TicketError`: :func:`stage` runs
    this before anything is staged, so that ``commit`` cannot fail half-way."""
    stream = TextStream(
        engine.tokenizer.detokenizer(prompt),
        sp.stop,
        include_stop_str_in_output=sp.include_stop_str_in_output,
    )
    for token in s.token_ids:
        stream.add(token)
    if s.paused:
        stream.finish()
    if stream.text != s.text:
        raise TicketError(
            f"import: sample {s.seq_id!r}: its tokens detokenize to {stream.text!r}, the "
            f"ticket says {s.text!r} (another tokenizer?)"
        )
    n = len(s.token_ids)
    if s.delivered_chars > len(stream.text) or s.delivered_tokens > n:
        raise TicketError(
            f"import: sample {s.seq_id!r} claims {s.delivered_tokens} tokens and "
            f"{s.delivered_chars} characters delivered of {n} tokens and {len(s.text)} characters"
        )
    if s.logprobs is not None and len(s.logprobs) != n:
        raise TicketError(
            f"import: sample {s.seq_id!r} has {len(s.logprobs)} logprobs for {n} tokens"
        )
    stream.mark_delivered(s.delivered_chars)
    return stream


# ---------------------------------------------------------------------------- release
def release(engine: Engine, request_id: str) -> None:
    """Step 5 (module doc): the request leaves the source, its blocks freed; no output
    is produced for it here (the destination continues its stream)."""
    group = engine.books.group(request_id)
    if group is None:
        raise MigrationError(f"release: request {request_id!r} is not live on this engine")
    for seq in group.seqs:
        if not seq.finished and seq.seq_id in engine.scheduler.requests:
            transit.release(engine.scheduler, seq.seq_id)
        engine.executor.unregister(seq.seq_id)
    engine.books.close(request_id)
    engine.num_migrations_out += 1


def export_state(engine: Engine, request_id: str) -> RequestState:
    """The state of the request's first live sample as an export carries it (its KV
    length 0 where its KV is nowhere); a pure read."""
    group = engine.books.group(request_id)
    if group is None:
        raise MigrationError(f"migrate: request {request_id!r} is not live on this engine")
    for s in group.seqs:
        if not s.finished:
            return transit.export(engine.scheduler, s.seq_id).state
    raise MigrationError(f"migrate: request {request_id!r} has finished")


def source_changed(engine: Engine, ticket: MigrationTicket) -> bool:
    """Whether a sample of ``ticket``'s request changed here since it was exported
    (:func:`refserve.core.transit.source_changed`, the one meaning)."""
    return any(transit.source_changed(engine.scheduler, s.state) for s in ticket.sequences)


# ---------------------------------------------------------------------------- the driver
class Ticket(Protocol):
    """What the driver reads of a ticket: :class:`~refserve.engine.ticket.MigrationTicket`
    between engines; the cluster simulator's own ticket between simulated replicas
    (ref/cluster/sim_migration.py), whose K/V is a size, not bytes."""

    @property
    def request_id(self) -> str: ...

    @property
    def kv_mode(self) -> KVMode: ...

    @property
    def block_size(self) -> int: ...

    @property
    def clock_ms(self) -> float: ...

    @property
    def kv_bytes(self) -> int: ...

    @property
    def num_chunks(self) -> int: ...


T = TypeVar("T", bound=Ticket)
T_contra = TypeVar("T_contra", bound=Ticket, contravariant=True)


class StagedMigration(Protocol):
    """A destination's staged import, as the driver uses it (:class:`StagedImport`
    here; a whole-ticket import for a peer in another process; a request put on the
    simulated link)."""

    @property
    def needed(self) -> Mapping[str, tuple[int, int]]: ...

    @property
    def done(self) -> bool: ...

    @property
    def decision(self) -> MigrationDecision: ...

    def write(self, chunk: KVChunk) -> None: ...

    def ack(self) -> None: ...

    def abort(self) -> None: ...

    def commit(self, transit_ms: float | None = None) -> list[str]: ...


class MigrationSource(Protocol[T]):
    """Where a migration starts (``LLMEngine`` has this shape, with tickets of
    :class:`~refserve.engine.ticket.MigrationTicket`)."""

    def export_request(
        self,
        request_id: str,
        *,
        kv: KVMode | str = KVMode.AUTO,
        inline: bool = True,
        cost: MigrationCost | None = None,
        hit_tokens: int = 0,
        idle: float = 1.0,
    ) -> T: ...

    def export_state(self, request_id: str) -> RequestState: ...

    def read_kv(self, seq_id: str, start: int, end: int) -> KVChunk: ...

    def source_changed(self, ticket: T) -> bool: ...

    def release_request(self, request_id: str) -> None: ...

    def now_ms(self) -> float: ...


class MigrationDestination(Protocol[T_contra]):
    """Where a migration lands (``LLMEngine`` has this shape)."""

    @property
    def idle_fraction(self) -> float: ...

    def prefix_hit_tokens(self, token_ids: Sequence[int], state: object = None) -> int: ...

    def stage_import(self, ticket: T_contra, *, transit_ms: float = 0.0) -> StagedMigration: ...


class SourceChanged(MigrationError):
    """The request stepped, finished or was aborted on the source during the transfer."""


class MigrationAborted(MigrationError):
    """A migration failed before the ack: the request runs on the source as before."""

    def __init__(self, request_id: str, point: str, cause: BaseException) -> None:
        super().__init__(f"migration of {request_id!r} aborted at {point}: {cause}")
        self.request_id = request_id
        self.point = point
        self.cause = cause


@dataclass(frozen=True)
class MigrationReport:
    """One :func:`migrate`: what moved, how, and at what cost."""

    request_id: str
    decision: MigrationDecision
    kv_bytes: int
    num_chunks: int
    elapsed_ms: float
    fault: str | None = None  # a fault point hit after the ack (rolled forward)


def migrate(
    src: MigrationSource[T],
    dst: MigrationDestination[T],
    request_id: str,
    *,
    kv: KVMode | str = KVMode.AUTO,
    chunk_blocks: int | None = None,
    cost: MigrationCost | None = None,
    fault: FaultHook | None = None,
) -> MigrationReport:
    """Move ``request_id`` from ``src`` to ``dst`` (module doc). ``chunk_blocks``: stream
    the K/V in chunks of that many source blocks (None: inline in the ticket). Bad
    arguments raise :class:`~refserve.core.transit.InvalidMigrationArgument` before
    anything is read. A fault raised by ``fault(point)`` before the ack aborts
    (:class:`MigrationAborted`, the source unchanged); after the ack the move completes
    and the report names it."""
    args = MigrationArgs.check(kv, chunk_blocks, cost, fault)
    if src is dst:  # type: ignore[comparison-overlap]
        raise InvalidMigrationArgument(
            "dst", f"migration of {request_id!r}: source and destination are one engine"
        )
    hook = args.fault or _no_fault
    t0 = time.perf_counter()
    point: str = MigrationFault.BEFORE_EXPORT
    staged: StagedMigration | None = None
    try:
        hook(point)
        ticket = _export(src, dst, request_id, args)
        try:
            staged = dst.stage_import(ticket)
        except KVLayoutRefused:
            # The K/V cannot be placed there (another KV layout): ``auto`` recomputes.
            if args.kv is not KVMode.AUTO or ticket.kv_mode is not KVMode.TRANSFER:
                raise
            ticket = _export(src, dst, request_id, replace(args, kv=KVMode.RECOMPUTE))
            staged = dst.stage_import(ticket)
        point = MigrationFault.AFTER_STAGE
        hook(point)
        point = MigrationFault.MID_STREAM
        streamed = _stream(src, staged, ticket, args.chunk_blocks, hook)
        point = MigrationFault.BEFORE_ACK
        hook(point)
        # The last look before the destination owns it: the source may have aborted (or
        # stepped) the request after the last chunk, or with nothing to stream at all;
        # acking then would release a request the source no longer holds.
        _require_unchanged(src, ticket)
        staged.ack()
    except BaseException as e:
        if staged is not None and not staged.done:
            staged.abort()
        if isinstance(e, MigrationError) and not isinstance(e, MigrationAborted | SourceChanged):
            raise
        raise MigrationAborted(request_id, point, e) from e
    late: str | None = None
    try:
        hook(MigrationFault.AFTER_ACK)
    except Exception:  # the destination owns it now: roll forward
        late = MigrationFault.AFTER_ACK
    try:
        _require_unchanged(src, ticket)
    except SourceChanged as e:
        # An abort reached the source between the ack and the release: it finished the
        # request there (its final output is the source's), so the destination drops
        # what it staged and the request ends exactly once.
        staged.abort()
        raise MigrationAborted(request_id, MigrationFault.AFTER_ACK, e) from e
    src.release_request(request_id)
    staged.commit(src.now_ms() - ticket.clock_ms)
    return MigrationReport(
        request_id,
        staged.decision,
        ticket.kv_bytes + streamed.kv_bytes,
        ticket.num_chunks + streamed.num_chunks,
        (time.perf_counter() - t0) * 1e3,
        late,
    )


def _no_fault(point: str) -> None:
    pass


def _export(
    src: MigrationSource[T], dst: MigrationDestination[T], request_id: str, args: MigrationArgs
) -> T:
    """Step 1 with the cost rule told the destination's prefix hit of the request's
    K/V (probed with its state, a pure read) and the destination's idle compute."""
    state = src.export_state(request_id)
    hit = dst.prefix_hit_tokens(state.token_ids[: state.num_computed_tokens], state)
    return src.export_request(
        request_id,
        kv=args.kv,
        inline=args.chunk_blocks is None,
        cost=args.cost,
        hit_tokens=hit,
        idle=dst.idle_fraction,
    )


@dataclass(frozen=True)
class Streamed:
    """What step 3 sent: how many chunks, how many bytes of K/V."""

    num_chunks: int = 0
    kv_bytes: int = 0


def _stream(
    src: MigrationSource[T],
    staged: StagedMigration,
    ticket: T,
    chunk_blocks: int | None,
    hook: FaultHook,
) -> Streamed:
    """Step 3: the needed ranges in chunks of ``chunk_blocks`` source blocks; the source
    is checked unchanged before each chunk (an abort meanwhile cancels the move)."""
    if chunk_blocks is None or ticket.kv_mode is not KVMode.TRANSFER:
        return Streamed()
    step = chunk_blocks * ticket.block_size
    count = nbytes = 0
    for seq_id, (lo, hi) in staged.needed.items():
        for start in range(lo, hi, step):
            _require_unchanged(src, ticket)
            chunk = src.read_kv(seq_id, start, min(start + step, hi))
            staged.write(chunk)
            nbytes += len(chunk.data)
            count += 1
            hook(MigrationFault.MID_STREAM)
    return Streamed(count, nbytes)


def _require_unchanged(src: MigrationSource[T], ticket: T) -> None:
    if src.source_changed(ticket):
        raise SourceChanged(
            f"migrate: {ticket.request_id!r} changed on the source during the transfer"
        )
