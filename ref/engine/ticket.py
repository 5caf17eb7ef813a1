"""The migration ticket: a request's portable state, versioned, typed and serialisable
(docs/MIGRATION.md, "The ticket").

A :class:`MigrationTicket` holds everything another engine needs to continue a request
exactly: per live sample its scheduler state (:class:`~refserve.core.transit.RequestState`:
token ids, KV length, stop rule, priority, tenant, cache namespace, times), what the
engine adds (the turn's tokens and logprobs, how many tokens and characters were already
delivered, tool-wait and speculation counters), the group's sampling parameters and
seed (the sampler's RNG position is ``(seed, output index)``: carrying the seed and the
token count carries it), the model it was computed with, and optionally the K/V as
:class:`KVChunk` rows (token-major, so block sizes may differ on the two sides).

The encoding (:meth:`MigrationTicket.to_bytes`) is stable and never pickle: ``RSMT``,
the version as a little-endian u16, the header length as a u32, a UTF-8 JSON header, then
the chunks' bytes in header order. :meth:`MigrationTicket.from_bytes` checks every field
and raises :class:`TicketError` naming the first one that is wrong.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from refserve.core.migration_cost import KVMode, MigrationDecision
from refserve.core.request import StopParams
from refserve.core.transit import KVPlace, MigrationError, RequestState
from refserve.spec.hashing import Namespace
from refserve.spec.snapshot import RequestStatus
from refserve.values import is_int, is_number

TICKET_VERSION = 2  # 2: the model names each layer's attention window
#: A ticket from a grouped KV pool (several layer groups): it names the layout, and its
#: chunks say from which position each layer's rows start. Plain tickets stay version 2.
GROUPED_TICKET_VERSION = 3
#: The versions this engine reads.
READ_VERSIONS = (TICKET_VERSION, GROUPED_TICKET_VERSION)
MAGIC = b"RSMT"
_HEAD = struct.Struct("<4sHI")

T = TypeVar("T")


class TicketError(MigrationError):
    """A ticket that cannot be read or does not fit this engine (the message says why)."""


class ModelMismatch(TicketError):
    """The ticket was computed with another model (or other weights)."""


class KVLayoutMismatch(TicketError):
    """The ticket's K/V rows are shaped for another cache (layers, heads, dtype)."""


@dataclass(frozen=True)
class ModelIdentity:
    """Which network computed the KV: its shape and a fingerprint of its weights."""

    model_type: str
    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    #: Each layer's sliding window, None for a full-attention layer: the same weights
    #: attending otherwise are another network (its K/V and tokens do not continue here).
    layer_windows: tuple[int | None, ...]
    fingerprint: str

    @property
    def attention(self) -> str:
        """The layers' attention in words: ``[window 8, full, ...]``."""
        kinds = ("full" if w is None else f"window {w}" for w in self.layer_windows)
        return f"[{', '.join(kinds)}]"

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * _itemsize(self.dtype)


@dataclass(frozen=True)
class KVChunk:
    """The K/V of positions ``[start, end)`` of sample ``seq_id``: per layer K then V,
    each ``[end - start, num_kv_heads, head_dim]`` in the model's dtype, as bytes.

    From a grouped pool, ``layer_starts[l]`` is the first position layer ``l`` carries
    (``start <= layer_starts[l] <= end``): a window layer's group holds no K/V before
    its window, so its K and V are each ``[end - layer_starts[l], ...]``. Empty: every
    layer carries ``[start, end)``."""

    seq_id: str
    start: int
    end: int
    data: bytes
    layer_starts: tuple[int, ...] = ()

    def layer_start(self, layer: int) -> int:
        """The first position layer ``layer`` carries."""
        return self.layer_starts[layer] if self.layer_starts else self.start


@dataclass(frozen=True)
class SeqTicket:
    """One live sample of the request."""

    seq_id: str
    index: int
    state: RequestState
    kv_place: KVPlace
    token_ids: tuple[int, ...]  # the current turn's outputs, as delivered or pending
    logprobs: tuple[float, ...] | None
    delivered_tokens: int
    delivered_chars: int
    text: str  # the turn's text so far (held-back tail included): checked on import
    paused: bool = False
    times_from: int = 0
    turn_arrival_ms: float | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass(frozen=True)
class MigrationTicket:
    """A request on its way to another engine (module doc). ``clock_ms`` is the source's
    clock at export (the times in the states are on it); ``block_size`` the source's."""

    request_id: str
    model: ModelIdentity
    block_size: int
    params: Mapping[str, Any]  # SamplingParams fields
    seed: int
    turn: int
    stop: StopParams
    prompt_token_ids: tuple[int, ...]
    child_ids: tuple[str, ...]
    forked: bool
    sequences: tuple[SeqTicket, ...]
    kv_mode: KVMode
    clock_ms: float
    decisions: tuple[MigrationDecision, ...] = ()
    chunks: tuple[KVChunk, ...] = ()
    version: int = TICKET_VERSION
    #: The source's KV layout (spec/groups.py ``layout_text``): ``"full"`` for a plain
    #: pool; a grouped pool's K/V is placed per group, so only the same layout takes it.
    kv_layout: str = "full"

    @property
    def kv_bytes(self) -> int:
        return sum(len(c.data) for c in self.chunks)

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    def to_bytes(self) -> bytes:
        header = _encode(self)
        data = json.dumps(header, separators=(",", ":"), allow_nan=True).encode("utf-8")
        return b"".join(
            [_HEAD.pack(MAGIC, self.version, len(data)), data, *(c.data for c in self.chunks)]
        )

    @staticmethod
    def from_bytes(blob: bytes) -> MigrationTicket:
        if not isinstance(blob, bytes | bytearray | memoryview):
            raise TicketError(f"a ticket is bytes, got {type(blob).__name__}")
        blob = bytes(blob)
        if len(blob) < _HEAD.size:
            raise TicketError(f"a ticket has a {_HEAD.size}-byte head; got {len(blob)} bytes")
        magic, version, n = _HEAD.unpack_from(blob)
        if magic != MAGIC:
            raise TicketError(f"not a migration ticket (magic {magic!r}, expected {MAGIC!r})")
        if version not in READ_VERSIONS:
            raise TicketError(
                f"ticket version {version} is not supported (this engine reads "
                f"{' and '.join(map(str, READ_VERSIONS))})"
            )
        end = _HEAD.size + n
        if end > len(blob):
            raise TicketError(
                f"the ticket header claims {n} bytes; only {len(blob) - _HEAD.size} follow"
            )
        try:
            header = json.loads(blob[_HEAD.size : end].decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise TicketError(f"the ticket header is not JSON: {e}") from None
        return _decode(header, blob[end:], version)


# ---------------------------------------------------------------------------- encoding
def _encode(t: MigrationTicket) -> dict[str, Any]:
    out = {
        "request_id": t.request_id,
        "model": _plain(t.model),
        "block_size": t.block_size,
        "params": dict(t.params),
        "seed": t.seed,
        "turn": t.turn,
        "stop": _plain(t.stop),
        "prompt_token_ids": list(t.prompt_token_ids),
        "child_ids": list(t.child_ids),
        "forked": t.forked,
        "sequences": [_encode_seq(s) for s in t.sequences],
        "kv_mode": t.kv_mode.value,
        "clock_ms": t.clock_ms,
        "decisions": [_plain(d) for d in t.decisions],
        "chunks": [_encode_chunk(c) for c in t.chunks],
    }
    if t.version >= GROUPED_TICKET_VERSION:
        out["kv_layout"] = t.kv_layout
    return out


def _encode_chunk(c: KVChunk) -> list[Any]:
    row: list[Any] = [c.seq_id, c.start, c.end, len(c.data)]
    if c.layer_starts:
        row.append(list(c.layer_starts))
    return row


def _encode_seq(s: SeqTicket) -> dict[str, Any]:
    out = _plain(s)
    st = s.state
    out["state"] = {**_plain(st), "stop": _plain(st.stop), "namespace": _plain(st.namespace)}
    return out


def _plain(obj: object) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in fields(obj):  # type: ignore[arg-type]
        v = getattr(obj, f.name)
        out[f.name] = list(v) if isinstance(v, tuple) else v
    return out


# ---------------------------------------------------------------------------- decoding
class _Fields:
    """Typed reads out of one JSON object; a wrong or missing field is a TicketError."""

    def __init__(self, obj: object, where: str) -> None:
        if not isinstance(obj, dict):
            raise TicketError(f"ticket {where} must be an object, got {type(obj).__name__}")
        self.obj: dict[str, Any] = obj
        self.where = where

    def get(self, key: str, kind: type | tuple[type, ...], *, optional: bool = False) -> Any:
        if key not in self.obj:
            raise TicketError(f"ticket {self.where} has no field {key!r}")
        v = self.obj[key]
        if v is None and optional:
            return None
        numeric = kind in (int, float, (int, float))
        if not isinstance(v, kind) or (isinstance(v, bool) and numeric):
            raise TicketError(f"ticket {self.where}.{key} has the wrong type: {v!r}")
        return v

    def nat(self, key: str, minimum: int = 0) -> int:
        v: int = self.get(key, int)
        if v < minimum:
            raise TicketError(f"ticket {self.where}.{key} must be >= {minimum}, got {v}")
        return v

    def num(self, key: str, *, optional: bool = False) -> Any:
        v = self.get(key, (int, float), optional=optional)
        return v if v is None else float(v)

    def ints(self, key: str) -> tuple[int, ...]:
        v: list[Any] = self.get(key, list)
        if not all(is_int(t) for t in v):
            raise TicketError(f"ticket {self.where}.{key} must be a list of ints")
        return tuple(v)

    def enum(self, key: str, kind: Callable[[str], T]) -> T:
        v: str = self.get(key, str)
        try:
            return kind(v)
        except ValueError:
            raise TicketError(f"ticket {self.where}.{key} is not a known value: {v!r}") from None


def _decode(header: object, data: bytes, version: int) -> MigrationTicket:
    f = _Fields(header, "header")
    grouped = version >= GROUPED_TICKET_VERSION
    chunks = _decode_chunks(f.get("chunks", list), data, grouped)
    layout = f.get("kv_layout", str) if grouped else "full"
    if not grouped and "kv_layout" in f.obj:
        raise TicketError(f"a version {version} ticket names no kv_layout")
    return MigrationTicket(
        request_id=f.get("request_id", str),
        model=_decode_model(_Fields(f.obj.get("model"), "model")),
        block_size=f.nat("block_size", 1),
        params=f.get("params", dict),
        seed=f.nat("seed"),
        turn=f.nat("turn"),
        stop=_decode_stop(_Fields(f.obj.get("stop"), "stop")),
        prompt_token_ids=f.ints("prompt_token_ids"),
        child_ids=tuple(_strs(f, "child_ids")),
        forked=f.get("forked", bool),
        sequences=tuple(_decode_seq(_Fields(s, "sequence")) for s in f.get("sequences", list)),
        kv_mode=f.enum("kv_mode", KVMode),
        clock_ms=f.num("clock_ms"),
        decisions=tuple(_decode_decision(_Fields(d, "decision")) for d in f.get("decisions", list)),
        chunks=chunks,
        version=version,
        kv_layout=layout,
    )


def _strs(f: _Fields, key: str) -> list[str]:
    v: list[str] = f.get(key, list)
    if not all(isinstance(s, str) for s in v):
        raise TicketError(f"ticket {f.where}.{key} must be a list of str")
    return v


def _decode_chunks(rows: list[Any], data: bytes, grouped: bool) -> tuple[KVChunk, ...]:
    out: list[KVChunk] = []
    offset = 0
    for row in rows:
        seq_id, start, end, n, starts = _chunk_row(row, grouped)
        if offset + n > len(data):
            raise TicketError(f"ticket chunk {seq_id!r} [{start}, {end}) runs past the data")
        out.append(KVChunk(seq_id, start, end, data[offset : offset + n], starts))
        offset += n
    if offset != len(data):
        raise TicketError(f"the ticket has {len(data) - offset} bytes no chunk claims")
    return tuple(out)


def _chunk_row(row: object, grouped: bool) -> tuple[str, int, int, int, tuple[int, ...]]:
    """One chunk's header row: ``[seq id, start, end, length]``, and on a grouped ticket
    optionally each layer's first position (:attr:`KVChunk.layer_starts`)."""
    cells: list[Any] = list(row) if isinstance(row, list) else []
    given: Any = cells.pop() if grouped and len(cells) == 5 else None
    ok = len(cells) == 4 and isinstance(cells[0], str)
    ok = ok and all(is_int(x) and x >= 0 for x in cells[1:])
    if not ok or cells[1] >= cells[2]:
        shown = cells if given is not None else row
        raise TicketError(f"ticket chunk {shown!r} is not [seq id, start, end, length]")
    seq_id, start, end, n = cells
    return seq_id, start, end, n, _layer_starts(given, seq_id, start, end)


def _layer_starts(given: object, seq_id: str, start: int, end: int) -> tuple[int, ...]:
    if given is None:
        return ()
    if not isinstance(given, list) or not all(is_int(x) and start <= x <= end for x in given):
        raise TicketError(
            f"ticket chunk {seq_id!r} [{start}, {end}): its layer starts {given!r} "
            "must be positions in its range"
        )
    return tuple(given)


def _decode_model(f: _Fields) -> ModelIdentity:
    return ModelIdentity(
        model_type=f.get("model_type", str),
        vocab_size=f.nat("vocab_size", 1),
        num_layers=f.nat("num_layers", 1),
        num_kv_heads=f.nat("num_kv_heads", 1),
        head_dim=f.nat("head_dim", 1),
        dtype=f.get("dtype", str),
        layer_windows=_layer_windows(f),
        fingerprint=f.get("fingerprint", str),
    )


def _layer_windows(f: _Fields) -> tuple[int | None, ...]:
    v: list[Any] = f.get("layer_windows", list)
    num_layers = f.nat("num_layers", 1)
    if len(v) != num_layers or not all(w is None or (is_int(w) and w >= 1) for w in v):
        raise TicketError(
            f"ticket {f.where}.layer_windows must hold a window >= 1 or null for each of "
            f"{num_layers} layers, got {v!r}"
        )
    return tuple(v)


def _decode_stop(f: _Fields) -> StopParams:
    eos = f.get("eos_token_id", int, optional=True)
    try:
        return StopParams(
            max_tokens=f.nat("max_tokens", 1),
            stop_token_ids=f.ints("stop_token_ids"),
            eos_token_id=eos,
            ignore_eos=f.get("ignore_eos", bool),
        )
    except ValueError as e:
        raise TicketError(f"ticket {f.where}: {e}") from None


def _decode_state(f: _Fields) -> RequestState:
    ns = _Fields(f.obj.get("namespace"), "namespace")
    times = f.get("token_times_ms", list)
    if not all(is_number(t) for t in times):
        raise TicketError("ticket state.token_times_ms must be a list of numbers")
    return RequestState(
        request_id=f.get("request_id", str),
        prompt_token_ids=f.ints("prompt_token_ids"),
        token_ids=f.ints("token_ids"),
        stop=_decode_stop(_Fields(f.obj.get("stop"), "state.stop")),
        status=f.enum("status", RequestStatus),
        num_computed_tokens=f.nat("num_computed_tokens"),
        num_preemptions=f.nat("num_preemptions"),
        priority=f.get("priority", int),
        tenant=f.get("tenant", str),
        namespace=Namespace(
            ns.get("model", str), ns.get("adapter", str), ns.get("cache_salt", str)
        ),
        arrival_ms=f.num("arrival_ms"),
        admitted_ms=f.num("admitted_ms", optional=True),
        token_times_ms=tuple(float(t) for t in times),
    )


def _decode_seq(f: _Fields) -> SeqTicket:
    logprobs = f.get("logprobs", list, optional=True)
    if logprobs is not None and not all(isinstance(x, int | float) for x in logprobs):
        raise TicketError("ticket sequence.logprobs must be a list of numbers")
    return SeqTicket(
        seq_id=f.get("seq_id", str),
        index=f.nat("index"),
        state=_decode_state(_Fields(f.obj.get("state"), "state")),
        kv_place=f.enum("kv_place", KVPlace),
        token_ids=f.ints("token_ids"),
        logprobs=None if logprobs is None else tuple(float(x) for x in logprobs),
        delivered_tokens=f.nat("delivered_tokens"),
        delivered_chars=f.nat("delivered_chars"),
        text=f.get("text", str),
        paused=f.get("paused", bool),
        times_from=f.nat("times_from"),
        turn_arrival_ms=f.num("turn_arrival_ms", optional=True),
        num_draft_tokens=f.nat("num_draft_tokens"),
        num_accepted_tokens=f.nat("num_accepted_tokens"),
    )


def _decode_decision(f: _Fields) -> MigrationDecision:
    return MigrationDecision(
        mode=f.enum("mode", KVMode),
        kv_tokens=f.nat("kv_tokens"),
        hit_tokens=f.nat("hit_tokens"),
        transfer_ms=f.num("transfer_ms"),
        recompute_ms=f.num("recompute_ms"),
        link_gb_per_s=f.num("link_gb_per_s"),
        latency_ms=f.num("latency_ms"),
        idle=f.num("idle"),
    )


_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def _itemsize(dtype: str) -> int:
    size = _ITEMSIZE.get(dtype)
    if size is None:
        raise TicketError(f"KV dtype {dtype!r} is not one of {sorted(_ITEMSIZE)}")
    return size
