"""The migration ticket: its encoding round-trips, and a ticket that does not fit is
refused with a typed error naming what is wrong, the destination unchanged
(ref/engine/ticket.py, the checks of ref/engine/migration.py ``stage``).

Round trip: tickets of requests in every state a request moves in (waiting, mid-prefill
and decoding with their K/V inline, streamed or recomputed, ``n > 1`` forked, paused for
a tool with its K/V on the host, already moved once) decode to an equal ticket and encode
to the same bytes; one decoded from bytes continues on another engine exactly like the
request that never moved.

Refusals, each of its own type and message, checked on the destination's scheduler
snapshot, K/V tensors, requests and counters: another model (other weights, another
vocabulary, layers attending within other windows), another K/V layout (layers, KV
heads, dtype), a duplicate id, a finished request, a ticket whose text or counts do not
fit its tokens, and malformed bytes (bad magic, bad version, truncated anywhere,
trailing bytes, a header that is not JSON, a field missing or of the wrong type).
"""

from __future__ import annotations

import functools
import json
import struct
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch
from migration_helpers import (
    INLINE,
    Trace,
    assert_cache_equal,
    cache_state,
    drive,
    make_engine,
    move,
    one_torch_thread,
    step_all,
    stream_view,
)

from refserve.core.swap import KVRetention
from refserve.core.transit import MigrationError
from refserve.engine import migration
from refserve.engine.llm_engine import LLMEngine
from refserve.engine.ticket import (
    GROUPED_TICKET_VERSION,
    TICKET_VERSION,
    KVChunk,
    KVLayoutMismatch,
    MigrationTicket,
    ModelIdentity,
    ModelMismatch,
    TicketError,
)
from refserve.errors import DuplicateRequest
from refserve.model.config import FULL_ATTENTION as FULL
from refserve.model.config import SLIDING_ATTENTION as SLIDING
from refserve.model.config import tiny_config
from refserve.model.sampler import SamplingParams
from refserve.model.weights import random_weights
from refserve.spec.snapshot import RequestStatus

PARAMS = SamplingParams(
    max_tokens=10, temperature=0.9, seed=21, logprobs=True, stop=("zz",), stop_token_ids=(7,)
)
PROMPT = "a portable request: "
HEAD = struct.Struct("<4sHI")


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    yield from one_torch_thread()


def _source(ticks: int, params: SamplingParams = PARAMS, **kw: Any) -> LLMEngine:
    src = make_engine(block_size=4, num_blocks=48, budget=5, **kw)
    src.add_request(PROMPT, params, request_id="r")
    for _ in range(ticks):
        src.step()
    return src


def _dst(**kw: Any) -> LLMEngine:
    dst = make_engine(block_size=8, num_blocks=24, budget=7, **kw)
    dst.add_request("already here", SamplingParams(max_tokens=4), request_id="here")
    return dst


# ---------------------------------------------------------------- round trip
def _waiting() -> MigrationTicket:
    return _source(0).export_request("r", kv="transfer")


def _mid_prefill() -> MigrationTicket:
    return _source(2).export_request("r", kv="transfer")


def _decoding() -> MigrationTicket:
    return _source(8).export_request("r", kv="transfer")


def _streamed() -> MigrationTicket:
    return _source(8).export_request("r", kv="transfer", inline=False)


def _recompute() -> MigrationTicket:
    return _source(8).export_request("r", kv="recompute")


def _forked() -> MigrationTicket:
    src = _source(6, SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=3))
    t = src.export_request("r", kv="transfer")
    assert t.forked and len(t.sequences) == 3 and len(t.chunks) == 3
    return t


def _paused_on_host() -> MigrationTicket:
    src = _source(8, num_host_blocks=16)
    src.pause("r", KVRetention.HOST)
    src.step()
    t = src.export_request("r", kv="transfer")
    assert t.sequences[0].paused and t.sequences[0].kv_place.value == "host"
    return t


def _moved_once() -> MigrationTicket:
    src, dst = _source(4), make_engine(block_size=8, num_blocks=24, budget=7)
    move(src, dst, "r", INLINE)
    for _ in range(2):
        dst.step()
    t = dst.export_request("r", kv="transfer")
    assert len(t.decisions) == 2
    return t


TICKETS: list[Callable[[], MigrationTicket]] = [
    _waiting,
    _mid_prefill,
    _decoding,
    _streamed,
    _recompute,
    _forked,
    _paused_on_host,
    _moved_once,
]


@pytest.mark.parametrize("make", TICKETS, ids=[f.__name__.strip("_") for f in TICKETS])
def test_round_trip(make: Callable[[], MigrationTicket]) -> None:
    ticket = make()
    blob = ticket.to_bytes()
    back = MigrationTicket.from_bytes(blob)
    assert back == ticket
    assert back.to_bytes() == blob
    # Any bytes-like object reads the same.
    assert MigrationTicket.from_bytes(bytearray(blob)) == ticket  # type: ignore[arg-type]
    assert MigrationTicket.from_bytes(memoryview(blob)) == ticket  # type: ignore[arg-type]


def test_a_ticket_from_bytes_continues_like_the_unmoved_request() -> None:
    ref = drive([_source(0)], "r", lambda k: None).of("r")
    src, trace = _source(0), Trace()
    for _ in range(8):
        step_all([src], trace)
    blob = src.export_request("r", kv="transfer").to_bytes()
    dst = make_engine(block_size=8, num_blocks=24, budget=7)
    assert dst.import_request(MigrationTicket.from_bytes(blob)) == ["r"]
    src.release_request("r")
    drive([src, dst], "r", lambda k: None, trace=trace)
    assert stream_view(trace.of("r")) == stream_view(ref)
    assert trace.of("r")[-1].finished


# ---------------------------------------------------------------- refusals
def refused(dst: LLMEngine, attempt: Callable[[], object], exc: type[Exception], msg: str) -> None:
    """``attempt`` raises exactly ``exc`` matching ``msg``; ``dst`` is as it was and can
    go on (no import left staged)."""
    snap, kv = dst.scheduler.snapshot(), cache_state(dst)
    groups, seqs = set(dst.books.request_ids), set(dst.books.sample_ids)
    counters = (dst.num_migrations_in, dst.migration_ms)
    with pytest.raises(exc, match=msg) as info:
        attempt()
    assert type(info.value) is exc, f"{type(info.value).__name__} is not {exc.__name__}"
    assert dst.scheduler.snapshot() == snap
    assert_cache_equal(dst, kv)
    assert (set(dst.books.request_ids), set(dst.books.sample_ids)) == (groups, seqs)
    assert (dst.num_migrations_in, dst.migration_ms) == counters
    assert not dst.scheduler.pool.in_transaction
    dst.step()


@functools.cache
def _decoding_ticket() -> MigrationTicket:
    return _decoding()


def _model(**changes: Any) -> tuple[Any, Any]:
    cfg = replace(tiny_config(), **changes)
    return cfg, random_weights(cfg, 0)


MODELS: list[tuple[str, Callable[[], LLMEngine], type[Exception], str]] = [
    (
        "other weights",
        lambda: _dst(model_seed=1),
        ModelMismatch,
        r"ticket of 'r' was computed with other weights \([0-9a-f]{12}; this engine's are",
    ),
    (
        "other vocabulary",
        lambda: _dst(model=_model(vocab_size=300)),
        ModelMismatch,
        r"ticket of 'r' is from a llama model of 259 tokens; this engine runs a llama of 300",
    ),
    (
        "other windows",
        lambda: _dst(model=_model(sliding_window=3, layer_types=(SLIDING, FULL))),
        ModelMismatch,
        r"computed by layers that attend \[full, full\]; this engine's attend \[window 3, full\]",
    ),
    (
        "other layers",
        lambda: _dst(model=_model(num_layers=3)),
        KVLayoutMismatch,
        r"has K/V of 2 layers x 2 heads x 16 in float32; this cache is 3 x 2 x 16 in float32",
    ),
    (
        "other KV heads",
        lambda: _dst(model=_model(num_kv_heads=1)),
        KVLayoutMismatch,
        r"2 layers x 2 heads x 16 in float32; this cache is 2 x 1 x 16 in float32",
    ),
    (
        "float64",
        lambda: _dst(dtype=torch.float64),
        KVLayoutMismatch,
        r"2 layers x 2 heads x 16 in float32; this cache is 2 x 2 x 16 in float64",
    ),
]


@pytest.mark.parametrize(("name", "build", "exc", "msg"), MODELS, ids=[m[0] for m in MODELS])
def test_another_model_or_layout_is_refused(
    name: str, build: Callable[[], LLMEngine], exc: type[Exception], msg: str
) -> None:
    dst = build()
    ticket = _decoding_ticket()
    refused(dst, lambda: dst.import_request(ticket), exc, msg)
    refused(dst, lambda: dst.stage_import(ticket), exc, msg)


def _seq0(t: MigrationTicket, **changes: Any) -> MigrationTicket:
    return replace(t, sequences=(replace(t.sequences[0], **changes), *t.sequences[1:]))


def _state0(t: MigrationTicket, **changes: Any) -> MigrationTicket:
    return _seq0(t, state=replace(t.sequences[0].state, **changes))


BAD_TICKETS: list[tuple[str, Callable[[MigrationTicket], object], type[Exception], str]] = [
    (
        "finished",
        lambda t: _state0(t, status=RequestStatus.FINISHED),
        MigrationError,
        r"import: ticket of 'r' is for a finished request",
    ),
    (
        "aborted",
        lambda t: _state0(t, status=RequestStatus.ABORTED),
        MigrationError,
        r"is for a finished request",
    ),
    ("no sample", lambda t: replace(t, sequences=()), TicketError, r"'r' has no live sample"),
    (
        "chunk of another sample",
        lambda t: replace(t, chunks=(replace(t.chunks[0], seq_id="r#5"),)),
        TicketError,
        r"has K/V for a sample it does not carry",
    ),
    (
        "bad sampling params",
        lambda t: replace(t, params={**t.params, "temperature": -1.0}),
        TicketError,
        r"'r' has bad sampling params: temperature must be 0",
    ),
    (
        "text of other tokens",
        lambda t: _seq0(t, text=t.sequences[0].text + "!"),
        TicketError,
        r"sample 'r': its tokens detokenize to .*, the ticket says",
    ),
    (
        "more characters delivered than the text",
        lambda t: _seq0(t, delivered_chars=len(t.sequences[0].text) + 1),
        TicketError,
        r"sample 'r' claims \d+ tokens and \d+ characters delivered of",
    ),
    (
        "more tokens delivered than sampled",
        lambda t: _seq0(t, delivered_tokens=len(t.sequences[0].token_ids) + 1),
        TicketError,
        r"sample 'r' claims \d+ tokens",
    ),
    (
        "a logprob short",
        lambda t: _seq0(t, logprobs=t.sequences[0].logprobs[:-1]),  # type: ignore[index]
        TicketError,
        r"sample 'r' has \d+ logprobs for \d+ tokens",
    ),
    (
        "a chunk of the wrong size",
        lambda t: replace(t, chunks=(replace(t.chunks[0], data=t.chunks[0].data[:-8]),)),
        KVLayoutMismatch,
        r"chunk 'r' \[0, \d+\) has \d+ bytes",
    ),
    ("not a ticket", lambda t: "ticket", TicketError, r"expected a MigrationTicket, got str"),
]


@pytest.mark.parametrize(
    ("name", "corrupt", "exc", "msg"), BAD_TICKETS, ids=[b[0] for b in BAD_TICKETS]
)
def test_a_ticket_that_does_not_fit_is_refused(
    name: str, corrupt: Callable[[MigrationTicket], object], exc: type[Exception], msg: str
) -> None:
    dst = _dst()
    bad = corrupt(_decoding_ticket())
    refused(dst, lambda: dst.import_request(bad), exc, msg)  # type: ignore[arg-type]


def test_a_duplicate_id_is_refused() -> None:
    dst = _dst()
    dst.add_request("same id, other request", SamplingParams(max_tokens=3), request_id="r")
    refused(
        dst,
        lambda: dst.import_request(_decoding_ticket()),
        DuplicateRequest,
        r"import: request id 'r' is already in use",
    )


def test_a_finished_request_cannot_be_exported() -> None:
    src = _source(0, SamplingParams(max_tokens=2))
    while src.has_unfinished:
        src.step()
    with pytest.raises(MigrationError, match=r"export: request 'r' is not live on this engine"):
        src.export_request("r")


# ---------------------------------------------------------------- malformed bytes
def _split(blob: bytes) -> tuple[dict[str, Any], bytes]:
    _, _, n = HEAD.unpack_from(blob)
    return json.loads(blob[HEAD.size : HEAD.size + n]), blob[HEAD.size + n :]


def _join(
    header: object, data: bytes, *, magic: bytes = b"RSMT", version: int = TICKET_VERSION
) -> bytes:
    raw = json.dumps(header).encode()
    return HEAD.pack(magic, version, len(raw)) + raw + data


def _edit(change: Callable[[dict[str, Any]], object]) -> Callable[[bytes], bytes]:
    def edit(blob: bytes) -> bytes:
        header, data = _split(blob)
        change(header)
        return _join(header, data)

    return edit


def _grouped(change: Callable[[dict[str, Any]], object]) -> Callable[[bytes], bytes]:
    """The ticket re-encoded as a grouped one (version 3), ``change`` applied."""

    def edit(blob: bytes) -> bytes:
        header, data = _split(blob)
        change(header)
        return _join(header, data, version=GROUPED_TICKET_VERSION)

    return edit


def _token_ids(h: dict[str, Any]) -> list[Any]:
    ids: list[Any] = h["sequences"][0]["state"]["token_ids"]
    return ids


MALFORMED: list[tuple[str, Callable[[bytes], object], str]] = [
    ("not bytes", lambda b: b.decode("latin-1"), r"a ticket is bytes, got str"),
    (
        "bad magic",
        lambda b: b"RSMX" + b[4:],
        r"not a migration ticket \(magic b'RSMX', expected b'RSMT'\)",
    ),
    (
        "bad version",
        lambda b: _join(*_split(b), version=GROUPED_TICKET_VERSION + 1),
        rf"ticket version {GROUPED_TICKET_VERSION + 1} is not supported "
        rf"\(this engine reads {TICKET_VERSION} and {GROUPED_TICKET_VERSION}\)",
    ),
    (
        "a plain ticket naming a layout",
        _edit(lambda h: h.update(kv_layout="full,window:8")),
        rf"a version {TICKET_VERSION} ticket names no kv_layout",
    ),
    (
        "a plain ticket with layer starts",
        _edit(lambda h: h["chunks"][0].append([0, 0])),
        r"ticket chunk \['r', 0, \d+, \d+, \[0, 0\]\] is not \[seq id, start, end, length\]",
    ),
    (
        "a grouped ticket without its layout",
        _grouped(lambda h: None),
        r"ticket header has no field 'kv_layout'",
    ),
    (
        "a layer start past its chunk",
        _grouped(lambda h: h.update(kv_layout="full") or h["chunks"][0].append([0, 10**6])),
        r"ticket chunk 'r' \[0, \d+\): its layer starts \[0, 1000000\] must be positions in "
        r"its range",
    ),
    ("truncated head", lambda b: b[:7], r"a ticket has a 10-byte head; got 7 bytes"),
    # The head alone, claiming an empty header: the head is whole, the header is not JSON.
    (
        "head alone",
        lambda b: HEAD.pack(*HEAD.unpack_from(b)[:2], 0),
        r"the ticket header is not JSON",
    ),
    (
        "truncated header",
        lambda b: b[: HEAD.size + 20],
        r"the ticket header claims \d+ bytes; only 20 follow",
    ),
    ("truncated K/V", lambda b: b[:-1], r"ticket chunk 'r' \[0, \d+\) runs past the data"),
    ("trailing bytes", lambda b: b + b"\0\0\0", r"the ticket has 3 bytes no chunk claims"),
    (
        "header not JSON",
        lambda b: (
            b[: HEAD.size] + b"{" * HEAD.unpack_from(b)[2] + b[HEAD.size + HEAD.unpack_from(b)[2] :]
        ),
        r"the ticket header is not JSON",
    ),
    ("header a list", lambda b: _join([1, 2], b""), r"ticket header must be an object, got list"),
    (
        "namespace a list",
        _edit(lambda h: h["sequences"][0]["state"].update(namespace=[])),
        r"ticket namespace must be an object, got list",
    ),
    (
        "decision a str",
        _edit(lambda h: h.update(decisions=["transfer"])),
        r"ticket decision must be an object, got str",
    ),
    (
        "head_dim 0",
        _edit(lambda h: h["model"].update(head_dim=0)),
        r"ticket model.head_dim must be >= 1, got 0",
    ),
    (
        "a layer window 0",
        _edit(lambda h: h["model"].update(layer_windows=[0, None])),
        r"ticket model.layer_windows must hold a window >= 1 or null for each of 2 layers, got \[0",
    ),
    (
        "layer windows short",
        _edit(lambda h: h["model"].update(layer_windows=[None])),
        r"ticket model.layer_windows must hold a window >= 1 or null for each of 2 layers",
    ),
    (
        "seed a str",
        _edit(lambda h: h.update(seed="21")),
        r"ticket header.seed has the wrong type: '21'",
    ),
    (
        "seed a bool",
        _edit(lambda h: h.update(seed=True)),
        r"ticket header.seed has the wrong type: True",
    ),
    ("turn missing", _edit(lambda h: h.pop("turn")), r"ticket header has no field 'turn'"),
    (
        "block size 0",
        _edit(lambda h: h.update(block_size=0)),
        r"ticket header.block_size must be >= 1, got 0",
    ),
    (
        "model a str",
        _edit(lambda h: h.update(model="llama")),
        r"ticket model must be an object, got str",
    ),
    (
        "kv mode unknown",
        _edit(lambda h: h.update(kv_mode="teleport")),
        r"ticket header.kv_mode is not a known value: 'teleport'",
    ),
    (
        "a token id a str",
        _edit(lambda h: _token_ids(h).append("7")),
        r"ticket state.token_ids must be a list of ints",
    ),
    (
        "a status unknown",
        _edit(lambda h: h["sequences"][0]["state"].update(status="flying")),
        r"ticket state.status is not a known value: 'flying'",
    ),
    (
        "max_tokens 0",
        _edit(lambda h: h["stop"].update(max_tokens=0)),
        r"ticket stop.max_tokens must be >= 1, got 0",
    ),
    (
        "a chunk row short",
        _edit(lambda h: h["chunks"][0].pop()),
        r"ticket chunk \['r', 0, \d+\] is not \[seq id, start, end, length\]",
    ),
    (
        "a logprob a str",
        _edit(lambda h: h["sequences"][0]["logprobs"].append("x")),
        r"ticket sequence.logprobs must be a list of numbers",
    ),
]


@pytest.mark.parametrize(("name", "corrupt", "msg"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_bytes_are_refused(
    name: str, corrupt: Callable[[bytes], object], msg: str
) -> None:
    dst = _dst()
    blob = corrupt(_decoding_ticket().to_bytes())
    refused(
        dst,
        lambda: dst.import_request(MigrationTicket.from_bytes(blob)),  # type: ignore[arg-type]
        TicketError,
        msg,
    )


def test_every_chunk_of_a_ticket_is_read_back_whole() -> None:
    """The chunks decode to the bytes that were encoded, in order (not just as many)."""
    t = _forked()
    back = MigrationTicket.from_bytes(t.to_bytes())
    assert [(c.seq_id, c.start, c.end, c.data) for c in back.chunks] == [
        (c.seq_id, c.start, c.end, c.data) for c in t.chunks
    ]
    assert all(isinstance(c, KVChunk) and c.data for c in back.chunks)


def test_the_protocol_function_and_the_engine_method_share_their_defaults() -> None:
    """``migration.export`` with no options is ``LLMEngine.export_request`` with none:
    the cost rule decides (auto) for an idle destination holding nothing."""
    src = _source(8)
    ticket = migration.export(src, "r")
    (decision,) = ticket.decisions
    assert (decision.idle, decision.hit_tokens) == (1.0, 0)
    assert ticket.kv_mode is decision.mode
    same = src.export_request("r")
    assert (same.decisions, same.kv_mode, same.chunks) == (
        ticket.decisions,
        ticket.kv_mode,
        ticket.chunks,
    )


def test_an_identity_with_an_unknown_kv_dtype_names_it_and_the_known_ones() -> None:
    identity = ModelIdentity(
        model_type="llama",
        vocab_size=8,
        num_layers=1,
        num_kv_heads=1,
        head_dim=2,
        dtype="int3",
        layer_windows=(None,),
        fingerprint="x",
    )
    with pytest.raises(TicketError, match=r"KV dtype 'int3' is not one of \['bfloat16'"):
        _ = identity.bytes_per_token
