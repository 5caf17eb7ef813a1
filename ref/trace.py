"""Workload traces: JSONL, one request per line.

Fields: ``id`` (str), ``arrival_ms`` (>= 0, non-decreasing down the file), either
``prompt_len`` (> 0) or ``prompt_token_ids`` (non-empty list of ints >= 0), ``output_len``
(> 0); optional ``priority`` (int), ``tenant`` (str), ``prefix_group`` (str) with
``prefix_len`` (requests of one group share their first ``prefix_len`` prompt tokens; by
default half the prompt). Any other field, a bad value, an out-of-order arrival or a
duplicate id raises :class:`TraceError` naming the file and line; nothing is half-loaded.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ref.errors import InvalidArgument
from ref.request import Request, StopParams

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
    return Path(str(resources.files("ref") / "traces" / f"{name}.jsonl"))


def load_trace(source: str | Path) -> list[TraceRequest]:
    """Load a JSONL trace from a path, or a built-in trace by name (see ``BUILTIN``)."""
    path = Path(source)
    if not path.exists() and str(source) in BUILTIN:
        path = builtin_path(str(source))
    if not path.exists():
        raise TraceError(
            f"trace {str(source)!r}: no such file (built-in traces: {', '.join(BUILTIN)})"
        )
    return parse_trace(path.read_text(encoding="utf-8"), str(path))


def parse_trace(text: str, name: str = "<trace>") -> list[TraceRequest]:
    out: list[TraceRequest] = []
    seen: set[str] = set()
    groups: dict[str, list[int]] = {}
    last_arrival = 0.0
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{name}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        unknown = sorted(set(obj) - FIELDS)
        if unknown:
            raise TraceError(
                f"{where}: unknown field(s) {', '.join(unknown)}; "
                f"allowed: {', '.join(sorted(FIELDS))}"
            )
        rid = obj.get("id")
        if not isinstance(rid, str) or not rid:
            raise TraceError(f"{where}: 'id' must be a non-empty string, got {rid!r}")
        if rid in seen:
            raise TraceError(f"{where}: duplicate request id {rid!r}")
        seen.add(rid)
        arrival = obj.get("arrival_ms", 0.0)
        if isinstance(arrival, bool) or not isinstance(arrival, int | float) or arrival < 0:
            raise TraceError(f"{where}: 'arrival_ms' must be a number >= 0, got {arrival!r}")
        if arrival < last_arrival:
            raise TraceError(
                f"{where}: arrival_ms {arrival} is before the previous line's {last_arrival}"
            )
        last_arrival = float(arrival)
        output_len = _positive_int(obj.get("output_len"), "output_len", where)
        priority = obj.get("priority", 0)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TraceError(f"{where}: 'priority' must be an int, got {priority!r}")
        tenant = obj.get("tenant", "default")
        if not isinstance(tenant, str):
            raise TraceError(f"{where}: 'tenant' must be a string, got {tenant!r}")
        prompt = _prompt(obj, where, rid, groups)
        out.append(TraceRequest(rid, float(arrival), prompt, output_len, priority, tenant))
    return out


def _prompt(
    obj: dict[str, object], where: str, rid: str, groups: dict[str, list[int]]
) -> tuple[int, ...]:
    if ("prompt_len" in obj) == ("prompt_token_ids" in obj):
        raise TraceError(f"{where}: give exactly one of 'prompt_len' or 'prompt_token_ids'")
    if "prompt_token_ids" in obj:
        ids = obj["prompt_token_ids"]
        if not isinstance(ids, list) or not ids:
            raise TraceError(f"{where}: 'prompt_token_ids' must be a non-empty list")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise TraceError(f"{where}: 'prompt_token_ids' holds a bad token id {t!r}")
        return tuple(ids)
    n = _positive_int(obj.get("prompt_len"), "prompt_len", where)
    # Synthetic tokens, deterministic per request id; a prefix group shares its head.
    rng = random.Random(rid)
    tokens = [rng.randrange(256, 32000) for _ in range(n)]
    group = obj.get("prefix_group")
    if group is not None:
        if not isinstance(group, str):
            raise TraceError(f"{where}: 'prefix_group' must be a string, got {group!r}")
        plen = obj.get("prefix_len", n // 2)
        if isinstance(plen, bool) or not isinstance(plen, int) or not 0 <= plen <= n:
            raise TraceError(f"{where}: 'prefix_len' must be an int in 0..{n}, got {plen!r}")
        shared = groups.setdefault(
            group, [random.Random(f"group:{group}").randrange(256, 32000) for _ in range(n)]
        )
        while len(shared) < plen:
            shared.append(random.Random(f"group:{group}:{len(shared)}").randrange(256, 32000))
        tokens[:plen] = shared[:plen]
    return tuple(tokens)


def _positive_int(value: object, field: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TraceError(f"{where}: '{field}' must be an int >= 1, got {value!r}")
    return value
