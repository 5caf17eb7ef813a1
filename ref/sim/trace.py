"""Workload traces: JSONL, one request per line.

Fields: ``id`` (printable str of at most 256 characters), ``arrival_ms`` (a finite number
in [0, 1e12], non-decreasing down the file), either ``prompt_len`` (int in [1, 2**24]) or
``prompt_token_ids`` (non-empty list of at most 2**24 ints in [0, 2**31)), ``output_len``
(int in [1, 2**24]); optional ``priority`` (int in [-2**31, 2**31)), ``tenant`` (str like
``id``), ``prefix_group`` (str like ``id``, only with ``prompt_len``) with ``prefix_len``
(requests of one group share their first ``prefix_len`` prompt tokens; by default half
the prompt). A whole trace holds at most 2**24 prompt tokens and its file at most 64 MiB.
Any other field, a bad value (``NaN`` and ``Infinity`` included), a duplicate key, an
out-of-order arrival or a duplicate id raises :class:`TraceError` naming the file and
line; nothing is half-loaded. Limits are checked before any token list is built.

"""

from __future__ import annotations

import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from refserve.core.request import Request, StopParams
from refserve.errors import InvalidArgument
from refserve.files import clip, exists, loads_json, read_text_file, show, shown
from refserve.values import is_int, is_number

FIELDS = frozenset(
    {
        "id",
        "arrival_ms",
        "prompt_len",
        "prompt_token_ids",
        "output_len",
        "priority",
        "tenant",
        "prefix_group",
        "prefix_len",
    }
)
BUILTIN = ("seed000_decode", "seed001", "seed002", "shared_prefix", "memory_pressure")

#: Limits of a trace (documented above). Tokens of ``prompt_len`` lines are built in
#: memory (a Python int each), so the total is what bounds a load's time and memory:
#: 2**24 tokens take a few seconds and under 1 GiB.
MAX_TRACE_BYTES = 64 << 20
MAX_REQUEST_TOKENS = 1 << 24
MAX_TRACE_TOKENS = 1 << 24
MAX_TOKEN_ID = (1 << 31) - 1
MAX_ARRIVAL_MS = 1e12  # about 32 years: past it float ms lose sub-microsecond steps
MAX_NAME_CHARS = 256
PRIORITY_RANGE = (-(1 << 31), (1 << 31) - 1)


class TraceError(InvalidArgument):
    """A trace line is malformed; the message names the source and line number."""


@dataclass(frozen=True)
class TraceRequest:
    id: str
    arrival_ms: float
    prompt_token_ids: tuple[int, ...]
    output_len: int
    priority: int = 0
    tenant: str = "default"

    def to_request(self) -> Request:
        return Request(
            self.id,
            list(self.prompt_token_ids),
            StopParams(max_tokens=self.output_len, ignore_eos=True),
            arrival_ms=self.arrival_ms,
            priority=self.priority,
            tenant=self.tenant,
        )


def builtin_path(name: str) -> Path:
    return Path(str(resources.files("refserve.sim") / "traces" / f"{name}.jsonl"))


def load_trace(source: str | Path, *, max_model_len: int | None = None) -> list[TraceRequest]:
    """Load a JSONL trace from a path, or a built-in trace by name (see ``BUILTIN``).

    ``max_model_len``: refuse a prompt longer than this before its tokens are built.
    A file without requests is refused too (a run over nothing is a mistake, not a result).
    """
    path = Path(source)
    if str(source) in BUILTIN and not exists(path):
        path = builtin_path(str(source))
    if not exists(path):
        raise TraceError(
            f"trace {shown(source)!r}: no such file (built-in traces: {', '.join(BUILTIN)})"
        )
    text = read_text_file(path, "trace", MAX_TRACE_BYTES, TraceError)
    out = parse_trace(text, shown(path), max_model_len=max_model_len)
    if not out:
        raise TraceError(f"trace {shown(path)}: holds no requests")
    return out


def parse_trace(
    text: str, name: str = "<trace>", *, max_model_len: int | None = None
) -> list[TraceRequest]:
    parser = _TraceParser(max_model_len)
    out: list[TraceRequest] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            out.append(parser.parse_line(line, f"{name}:{lineno}"))
    return out


class _TraceParser:
    """What one line's checks need from the lines before it: the ids seen, the previous
    arrival, the prompt tokens so far, and each prefix group's shared head."""

    def __init__(self, max_model_len: int | None) -> None:
        self.max_model_len = max_model_len
        self.seen: set[str] = set()
        self.groups: dict[str, list[int]] = {}
        self.last_arrival = 0.0
        self.total_tokens = 0

    def parse_line(self, line: str, where: str) -> TraceRequest:
        """One request; every check in the order the module docstring lists the fields,
        and the prompt's length (and the trace's total) before its tokens are built."""
        obj = _fields(line, where)
        rid = _name(obj.get("id"), "id", where)
        if rid in self.seen:
            raise TraceError(f"{where}: duplicate request id {rid!r}")
        self.seen.add(rid)
        arrival = self._arrival(obj, where)
        output_len = _positive_int(obj.get("output_len"), "output_len", where)
        priority = _priority(obj, where)
        tenant = _name(obj.get("tenant", "default"), "tenant", where)
        n = self._count_prompt(obj, where, rid)
        prompt = _prompt(obj, n, where, rid, self.groups)
        return TraceRequest(rid, float(arrival), prompt, output_len, priority, tenant)

    def _arrival(self, obj: dict[str, object], where: str) -> int | float:
        arrival = obj.get("arrival_ms", 0.0)
        # Compare before float(): an int of 400 digits would overflow it; NaN fails both.
        if not is_number(arrival) or not 0 <= arrival <= MAX_ARRIVAL_MS:
            raise TraceError(
                f"{where}: 'arrival_ms' must be a finite number in [0, {MAX_ARRIVAL_MS:g}], "
                f"got {show(arrival)}"
            )
        if arrival < self.last_arrival:
            raise TraceError(
                f"{where}: arrival_ms {arrival} is before the previous line's {self.last_arrival}"
            )
        self.last_arrival = float(arrival)
        return arrival

    def _count_prompt(self, obj: dict[str, object], where: str, rid: str) -> int:
        """The prompt's length, within ``max_model_len`` and the trace's token limit."""
        n = _prompt_len(obj, where)
        if self.max_model_len is not None and n > self.max_model_len:
            # The scheduler would refuse it too, but only after the tokens were built.
            raise TraceError(
                f"{where}: request {rid!r} prompt has {n} tokens; "
                f"max_model_len is {self.max_model_len}"
            )
        self.total_tokens += n
        if self.total_tokens > MAX_TRACE_TOKENS:
            raise TraceError(
                f"{where}: the trace holds more than {MAX_TRACE_TOKENS} prompt tokens "
                "(the limit of one trace)"
            )
        return n


def _fields(line: str, where: str) -> dict[str, object]:
    """The line as a JSON object holding only known fields."""
    obj = loads_json(line, where, TraceError)
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - FIELDS)
    if unknown:
        raise TraceError(
            f"{where}: unknown field(s) {', '.join(clip(u) for u in unknown[:5])}; "
            f"allowed: {', '.join(sorted(FIELDS))}"
        )
    return obj


def _priority(obj: dict[str, object], where: str) -> int:
    priority = obj.get("priority", 0)
    lo, hi = PRIORITY_RANGE
    if not is_int(priority) or not lo <= priority <= hi:
        raise TraceError(
            f"{where}: 'priority' must be an int in [{lo}, {hi}], got {show(priority)}"
        )
    return priority


def _prompt_len(obj: dict[str, object], where: str) -> int:
    """The prompt's length, checked, before any token is built."""
    if ("prompt_len" in obj) == ("prompt_token_ids" in obj):
        raise TraceError(f"{where}: give exactly one of 'prompt_len' or 'prompt_token_ids'")
    if "prompt_token_ids" in obj:
        ids = obj["prompt_token_ids"]
        if not isinstance(ids, list) or not ids:
            raise TraceError(f"{where}: 'prompt_token_ids' must be a non-empty list")
        if len(ids) > MAX_REQUEST_TOKENS:
            raise TraceError(
                f"{where}: 'prompt_token_ids' holds {len(ids)} tokens; at most "
                f"{MAX_REQUEST_TOKENS} per request"
            )
        for field_name in ("prefix_group", "prefix_len"):
            if field_name in obj:
                raise TraceError(f"{where}: '{field_name}' applies only with 'prompt_len'")
        return len(ids)
    return _positive_int(obj.get("prompt_len"), "prompt_len", where)


def _prompt(
    obj: dict[str, object], n: int, where: str, rid: str, groups: dict[str, list[int]]
) -> tuple[int, ...]:
    if "prompt_token_ids" in obj:
        return _given_tokens(obj["prompt_token_ids"], where)
    group_value = obj.get("prefix_group")
    if group_value is None and "prefix_len" in obj:
        raise TraceError(f"{where}: 'prefix_len' needs 'prefix_group'")
    group = None if group_value is None else _name(group_value, "prefix_group", where)
    plen = obj.get("prefix_len", n // 2)
    if not is_int(plen) or not 0 <= plen <= n:
        raise TraceError(f"{where}: 'prefix_len' must be an int in 0..{n}, got {show(plen)}")
    # Synthetic tokens, deterministic per request id; a prefix group shares its head.
    rng = random.Random(rid)
    tokens = [rng.randrange(256, 32000) for _ in range(n)]
    if group is not None:
        tokens[:plen] = _group_head(groups, group, n, plen)
    return tuple(tokens)


def _given_tokens(ids: object, where: str) -> tuple[int, ...]:
    """``prompt_token_ids`` (a non-empty list, length checked by :func:`_prompt_len`)."""
    assert isinstance(ids, list)
    for t in ids:
        if not is_int(t) or not 0 <= t <= MAX_TOKEN_ID:
            raise TraceError(f"{where}: 'prompt_token_ids' holds a bad token id {show(t)}")
    return tuple(ids)


def _group_head(groups: dict[str, list[int]], group: str, n: int, plen: int) -> list[int]:
    """The first ``plen`` tokens ``group`` shares: made when the group is first seen (``n``
    of them) and grown, deterministically, when a later member asks for more."""
    shared = groups.setdefault(
        group, [random.Random(f"group:{group}").randrange(256, 32000) for _ in range(n)]
    )
    while len(shared) < plen:
        shared.append(random.Random(f"group:{group}:{len(shared)}").randrange(256, 32000))
    return shared[:plen]


def _positive_int(value: object, field: str, where: str) -> int:
    if not is_int(value) or value < 1:
        raise TraceError(f"{where}: '{field}' must be an int >= 1, got {show(value)}")
    if value > MAX_REQUEST_TOKENS:
        raise TraceError(
            f"{where}: '{field}' is {show(value)}; at most {MAX_REQUEST_TOKENS} tokens per request"
        )
    return value


def _name(value: object, field: str, where: str) -> str:
    """An id-like string: non-empty, short, printable (no control characters, no lone
    surrogates: either would break the tables and files the run writes)."""
    if not isinstance(value, str) or not value:
        raise TraceError(f"{where}: '{field}' must be a non-empty string, got {show(value)}")
    if len(value) > MAX_NAME_CHARS:
        raise TraceError(
            f"{where}: '{field}' has {len(value)} characters; at most {MAX_NAME_CHARS}"
        )
    if not value.isprintable():
        raise TraceError(
            f"{where}: '{field}' must be printable text (no control characters or lone "
            f"surrogates), got {show(value)}"
        )
    return value
