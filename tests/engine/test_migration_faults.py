"""A failed migration changes nothing; one past the ack completes (the protocol and its
fault points in ref/engine/migration.py, docs/MIGRATION.md).

``migrate(..., fault=hook)`` calls the hook at every point of :class:`MigrationFault`. A
fault before the ack must leave the source exactly as it was (its scheduler snapshot
equal, the request still running there and finishing with the tokens of a run that never
tried to move it) and the destination too (snapshot and K/V tensors equal: no block
leaked, no half-imported request, every slot a streamed chunk wrote restored). A fault
after the ack completes the move. An import whose ticket carries a bad chunk after a
good one restores the destination's K/V bytes. A request aborted on the source while
its K/V is in flight finishes once, there, with ``abort``; the destination never shows
it.

Two engines with neighbours of their own (so the staged import interleaves with live
state): the source block size 4, budget 5; the destination block size 8, budget 7.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest
from migration_helpers import (
    HOWS,
    INLINE,
    RECOMPUTE,
    STREAM1,
    STREAM2,
    How,
    Trace,
    assert_cache_equal,
    assert_holds_nothing_of,
    cache_state,
    drive,
    make_engine,
    one_torch_thread,
    step_all,
    stream_view,
)

from refserve.core.migration_cost import KVMode
from refserve.core.transit import MIGRATION_FAULT_POINTS, MigrationFault, MigrationRefused
from refserve.engine import migration
from refserve.engine.llm_engine import LLMEngine
from refserve.engine.migration import MigrationAborted, migrate
from refserve.engine.ticket import KVChunk, KVLayoutMismatch, MigrationTicket, TicketError
from refserve.model.executor import SavedRows
from refserve.model.sampler import SamplingParams
from refserve.spec.snapshot import RequestStatus

PARAMS = SamplingParams(max_tokens=10, temperature=0.9, seed=99)
PROMPT = "fault injection: "
BEFORE_ACK = MIGRATION_FAULT_POINTS[: MIGRATION_FAULT_POINTS.index(MigrationFault.AFTER_ACK)]


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    yield from one_torch_thread()


class Injected(Exception):
    """The fault a hook raises on purpose."""


def fault_at(point: str) -> Callable[[str], None]:
    def hook(p: str) -> None:
        if p == point:
            raise Injected(point)

    return hook


def _pair() -> tuple[LLMEngine, LLMEngine]:
    src = make_engine(block_size=4, num_blocks=40, budget=5)
    dst = make_engine(block_size=8, num_blocks=24, budget=7)
    src.add_request(PROMPT, PARAMS, request_id="r")
    src.add_request("the source's neighbour", SamplingParams(max_tokens=6), request_id="ns")
    dst.add_request("the destination's neighbour", SamplingParams(max_tokens=8), request_id="nd")
    return src, dst


@functools.cache
def _reference() -> Trace:
    """Both engines run to the end, nothing moved."""
    src, dst = _pair()
    return drive([src, dst], "r", lambda k: None)


def _advance(at: int) -> tuple[LLMEngine, LLMEngine, Trace]:
    """The pair after ``at`` ticks: ``r`` mid-prefill after 1, decoding after 7."""
    src, dst = _pair()
    trace = Trace()
    for _ in range(at):
        step_all([src, dst], trace)
    r = src.scheduler.requests["r"]
    want = RequestStatus.PREFILLING if at < 4 else RequestStatus.DECODING
    assert r.status is want and r.num_computed_tokens > 0
    return src, dst, trace


def _assert_all_as_unmigrated(src: LLMEngine, dst: LLMEngine, trace: Trace) -> None:
    drive([src, dst], "r", lambda k: None, trace=trace)
    ref = _reference()
    for rid in ("r", "ns", "nd"):
        assert stream_view(trace.of(rid)) == stream_view(ref.of(rid)), f"{rid} changed"
    for e in (src, dst):
        pool = e.scheduler.pool
        assert pool.num_free_blocks == pool.num_blocks, "a block leaked"


# ---------------------------------------------------------------- the protocol points
@pytest.mark.parametrize("how", HOWS, ids=str)
def test_the_hook_sees_every_protocol_point_in_order(how: How) -> None:
    src, dst, trace = _advance(7)
    seen: list[str] = []
    report = migrate(src, dst, "r", kv=how.kv, chunk_blocks=how.chunk_blocks, fault=seen.append)
    # mid_stream comes after each streamed chunk; inline K/V (one chunk in the ticket)
    # or a recompute streams none.
    streams = how.kv == "transfer" and how.chunk_blocks is not None
    streamed = report.num_chunks if streams else 0
    if streams:
        assert streamed >= 2
    else:
        assert report.num_chunks == (1 if how.kv == "transfer" else 0)
    assert seen == [
        "before_export",
        "after_stage",
        *["mid_stream"] * streamed,
        "before_ack",
        "after_ack",
    ]
    _assert_all_as_unmigrated(src, dst, trace)


# ---------------------------------------------------------------- faults before the ack
CASES = [
    (point, how)
    for point in BEFORE_ACK
    for how in HOWS
    if point != "mid_stream" or how.chunk_blocks
]


def check_fault_before_ack(point: str, how: How, at: int) -> None:
    """The fault aborts the move (module doc): both engines as before, then everything
    finishes exactly as in the run that never tried to move."""
    src, dst, trace = _advance(at)
    snaps = (src.scheduler.snapshot(), dst.scheduler.snapshot())
    kv = (cache_state(src), cache_state(dst))
    groups = (set(src.books.request_ids), set(dst.books.request_ids))
    with pytest.raises(MigrationAborted, match=f"aborted at {point}") as info:
        migrate(src, dst, "r", kv=how.kv, chunk_blocks=how.chunk_blocks, fault=fault_at(point))
    assert info.value.point == point and isinstance(info.value.cause, Injected)
    assert info.value.request_id == "r", "the error names the request that stayed"
    assert src.scheduler.snapshot() == snaps[0], "the source changed"
    assert dst.scheduler.snapshot() == snaps[1], "the destination changed"
    assert_cache_equal(src, kv[0])
    assert_cache_equal(dst, kv[1])
    assert (set(src.books.request_ids), set(dst.books.request_ids)) == groups
    assert (src.num_migrations_out, dst.num_migrations_in) == (0, 0)
    _assert_all_as_unmigrated(src, dst, trace)


@pytest.mark.parametrize("at", [1, 7], ids=["mid-prefill", "decoding"])
@pytest.mark.parametrize(("point", "how"), CASES, ids=[f"{p}-{h}" for p, h in CASES])
def test_fault_before_the_ack_leaves_both_engines_as_they_were(
    point: str, how: How, at: int
) -> None:
    check_fault_before_ack(point, how, at)


@pytest.mark.parametrize("how", HOWS, ids=str)
def test_fault_after_the_ack_completes_the_move(how: How) -> None:
    src, dst, trace = _advance(7)
    report = migrate(
        src, dst, "r", kv=how.kv, chunk_blocks=how.chunk_blocks, fault=fault_at("after_ack")
    )
    assert report.fault == "after_ack"
    assert_holds_nothing_of(src, "r", ["r"])
    assert dst.books.has_request("r") and dst.num_migrations_in == 1 and src.num_migrations_out == 1
    _assert_all_as_unmigrated(src, dst, trace)


def test_a_refused_import_leaves_both_engines_as_they_were() -> None:
    """A destination without room refuses at stage (MigrationRefused): nothing moved."""
    src, _, trace = _advance(7)
    dst = make_engine(block_size=8, num_blocks=5, budget=7)
    dst.add_request("the destination's neighbour", SamplingParams(max_tokens=8), request_id="nd")
    for _ in range(7):
        dst.step()
    snaps, kv = (src.scheduler.snapshot(), dst.scheduler.snapshot()), cache_state(dst)
    with pytest.raises(MigrationRefused, match=r"^import: request 'r' needs \d+ free"):
        migrate(src, dst, "r", kv="transfer")
    assert (src.scheduler.snapshot(), dst.scheduler.snapshot()) == snaps
    assert_cache_equal(dst, kv)
    drive([src], "r", lambda k: None, trace=trace)
    ref = _reference()
    for rid in ("r", "ns"):
        assert stream_view(trace.of(rid)) == stream_view(ref.of(rid)), rid


def test_planted_source_freeing_before_the_ack_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The source releases the request as soon as its ticket is out: a fault before the
    ack then finds the source changed (the request gone from it)."""
    real = migration.export

    def export_then_free(engine: LLMEngine, request_id: str, **kw: object) -> MigrationTicket:
        ticket = real(engine, request_id, **kw)  # type: ignore[arg-type]
        migration.release(engine, request_id)
        return ticket

    monkeypatch.setattr(migration, "export", export_then_free)
    with pytest.raises(AssertionError, match="the source changed"):
        check_fault_before_ack("before_ack", INLINE, 7)
    monkeypatch.undo()
    check_fault_before_ack("before_ack", INLINE, 7)


# ---------------------------------------------------------------- a bad chunk mid-write
def _per_token(c: KVChunk) -> int:
    return len(c.data) // (c.end - c.start)


BAD_CHUNKS: list[tuple[str, Callable[[KVChunk, int], KVChunk], type[Exception], str]] = [
    (
        "truncated",
        lambda c, n: KVChunk(c.seq_id, c.start, c.end, c.data[:-4]),
        KVLayoutMismatch,
        r"chunk 'r' \[\d+, \d+\) has \d+ bytes; \d+ tokens of this K/V layout take \d+",
    ),
    (
        "gap",
        lambda c, n: KVChunk(c.seq_id, c.start + 1, c.end, c.data[: -_per_token(c)]),
        TicketError,
        r"chunk 'r' \[\d+, \d+\) is out of order; positions up to \d+ are written",
    ),
    (
        "past the end",
        lambda c, n: KVChunk(c.seq_id, c.start, c.end + 1, c.data + c.data[: _per_token(c)]),
        TicketError,
        r"is out of order",
    ),
]


def check_bad_chunk_restores(
    make_bad: Callable[[KVChunk, int], KVChunk], exc: type[Exception], msg: str
) -> None:
    src, dst, trace = _advance(7)
    ticket = src.export_request("r", kv="transfer", inline=False)
    n = ticket.sequences[0].state.num_computed_tokens
    half = n // 8 * 4
    good, rest = src.read_kv("r", 0, half), src.read_kv("r", half, n)
    # The slots the import writes hold stale K/V of earlier requests or zeros: either way
    # not what the good chunk writes, so a missing restore shows.
    snap, kv, groups = dst.scheduler.snapshot(), cache_state(dst), set(dst.books.request_ids)
    bad = replace(ticket, kv_mode=KVMode.TRANSFER, chunks=(good, make_bad(rest, n)))
    with pytest.raises(exc, match=msg):
        dst.import_request(bad)
    assert dst.scheduler.snapshot() == snap, "the destination's books changed"
    assert_cache_equal(dst, kv)
    assert set(dst.books.request_ids) == groups
    # Nothing is stuck: the whole ticket imports, the source lets go, and the request
    # finishes on the destination as if it had never moved.
    dst.import_request(replace(ticket, kv_mode=KVMode.TRANSFER, chunks=(good, rest)))
    src.release_request("r")
    _assert_all_as_unmigrated(src, dst, trace)


@pytest.mark.parametrize(
    ("name", "make_bad", "exc", "msg"), BAD_CHUNKS, ids=[b[0] for b in BAD_CHUNKS]
)
def test_bad_chunk_mid_write_restores_the_destination_kv(
    name: str, make_bad: Callable[[KVChunk, int], KVChunk], exc: type[Exception], msg: str
) -> None:
    check_bad_chunk_restores(make_bad, exc, msg)


def test_the_restore_check_fails_without_the_restore(monkeypatch: pytest.MonkeyPatch) -> None:
    """The K/V check above can fail: with the journal's restore skipped, the good
    chunk's rows stay in the destination's cache."""
    monkeypatch.setattr(SavedRows, "restore", lambda self: None)
    _, make_bad, exc, msg = BAD_CHUNKS[0]
    with pytest.raises(AssertionError, match="K/V tensor"):
        check_bad_chunk_restores(make_bad, exc, msg)


# ---------------------------------------------------------------- abort in flight
ABORTS = [
    ("mid_stream", STREAM1),
    ("mid_stream", How("transfer", 64)),  # one chunk: the abort comes after the last
    ("mid_stream", STREAM2),
    ("after_stage", INLINE),
    ("after_stage", RECOMPUTE),
    ("before_ack", STREAM1),
    # After the ack, before the source releases it: the source finished it (its final
    # output is out), so the destination drops what it acked instead of committing.
    ("after_ack", INLINE),
    ("after_ack", STREAM1),
    ("after_ack", RECOMPUTE),
]


@pytest.mark.parametrize(("point", "how"), ABORTS, ids=[f"{p}-{h}" for p, h in ABORTS])
def test_abort_during_the_transfer_finishes_the_request_once(point: str, how: How) -> None:
    src, dst, _ = _advance(7)
    src_outs, dst_outs = Trace(), Trace()
    snap, kv, groups = dst.scheduler.snapshot(), cache_state(dst), set(dst.books.request_ids)
    aborted: list[str] = []

    def hook(p: str) -> None:
        if p == point and not aborted:
            aborted.append(p)
            src.abort("r")

    with pytest.raises(MigrationAborted, match="'r' changed on the source during the transfer"):
        migrate(src, dst, "r", kv=how.kv, chunk_blocks=how.chunk_blocks, fault=hook)
    assert aborted == [point]
    assert dst.scheduler.snapshot() == snap and set(dst.books.request_ids) == groups
    assert_cache_equal(dst, kv)
    while src.has_unfinished or dst.has_unfinished:
        step_all([src], src_outs)
        step_all([dst], dst_outs)
    assert dst_outs.of("r") == []
    finals = [o for o in src_outs.of("r") if o.finished]
    assert len(finals) == 1 and finals[0].finish_reason == "abort"
    assert src_outs.of("r")[-1] is finals[0], "output after the final one"
    for e in (src, dst):
        assert e.scheduler.pool.num_free_blocks == e.scheduler.pool.num_blocks
