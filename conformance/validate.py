"""Structural validation of what an adapter returns, before any checker reads it.

The spec checkers assume well-formed records: ``RequestStatus`` members, ints that are
ints, tuples that are tuples, a block size above zero. An
adapter under test may return anything, and a malformed record must become a finding
that names the field, never a crash of the suite (docs/ADAPTERS.md, "Malformed
records"). Each function here returns one line per problem, ``<path>: <what is
wrong>``, for example::

    snapshot.pool.ref_cnt: expected a tuple of int, got list
    snapshot.requests[2].status: 'running' is not a RequestStatus (waiting, prefilling, ...)
    step_report.scheduled[0].samples: expected bool, got int 1

and never raises, whatever it is given.

Only the *shape* is checked here: exact types (a ``bool`` is not a count; a ``list`` is
not a tuple, since snapshots must be hashable and compare equal for ATOMIC), known
statuses, non-negative counts, a block size of at least 1, and ids listed twice where a
lookup would silently take the first (two snapshot records or two tables of one
request). Whether the values are *right* is the job of the invariant checkers in
``spec/``, which report it under their own ids and are deliberately not repeated here:
lengths that disagree (``token_ids`` vs ``num_stored`` and ``slot_mapping`` vs
``positions``: POS; ``positions`` vs ``num_new_tokens``: POS; ``ref_cnt`` vs
``num_blocks``: BLOCK), block ids out of range (BLOCK), a request scheduled twice
(TOKEN), a duplicated free block (BLOCK).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Final

from refserve.conformance.adapter import CommitReport, MigrationExport, MigrationStaged, StepReport
from refserve.spec.snapshot import (
    CacheEntry,
    EngineSnapshot,
    PoolSnapshot,
    RequestSnapshot,
    RequestStatus,
    ScheduledRequest,
    TableSnapshot,
    Transfer,
    TransferKind,
)
from refserve.values import is_int

__all__ = [
    "check_commit_report",
    "check_engine_snapshot",
    "check_levels",
    "check_migration_export",
    "check_migration_staged",
    "check_pool_snapshot",
    "check_step_report",
]

MAX_PROBLEMS: Final = 50
"""Lines returned at most (then one ``... N more`` line): a pool of 100k blocks with a
wrong element type must not produce 100k lines."""

_TOKEN_LIMIT: Final = 1 << 63
"""Token ids are hashed as signed 64-bit values (refserve.spec.hashing.block_key)."""

_STATUSES: Final = ", ".join(s.value for s in RequestStatus)
_MISSING: Final = object()


class _Problems:
    """Collects ``path: message`` lines up to :data:`MAX_PROBLEMS`."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.dropped = 0

    def add(self, where: str, message: str) -> None:
        if len(self.lines) < MAX_PROBLEMS:
            self.lines.append(f"{where}: {message}")
        else:
            self.dropped += 1

    def result(self) -> list[str]:
        if self.dropped:
            return [*self.lines, f"... {self.dropped} more problems not shown"]
        return list(self.lines)


def _guarded(where: str, body: Callable[[_Problems], None]) -> list[str]:
    """Run one validation; any exception (an attribute that raises, a ``__repr__`` that
    raises, a recursion) becomes one more problem line instead of escaping."""
    p = _Problems()
    try:
        body(p)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # "never raises", even on hostile objects
        p.add(where, f"could not be inspected: {type(e).__name__}: {_safe_str(e)}")
    return p.result()


# --------------------------------------------------------------------------- rendering
def _safe_str(x: object) -> str:
    try:
        text = str(x)
    except Exception:  # a hostile __str__
        return "<unprintable>"
    return text if len(text) <= 60 else text[:57] + "..."


def _short(x: object) -> str:
    try:
        text = repr(x)
    except Exception:  # a hostile __repr__
        return "<unrepresentable>"
    return text if len(text) <= 40 else text[:37] + "..."


def _desc(x: object) -> str:
    """What a value is, for ``got ...``: ``None``, ``list``, ``str 'x'``, ``bool True``."""
    if x is None:
        return "None"
    if isinstance(x, _Raised):
        return f"an error (reading it raised {x.text})"
    name = type(x).__name__
    if isinstance(x, (str, bytes, bool, int, float)):
        return f"{name} {_short(x)}"
    return name


def _qual(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


# --------------------------------------------------------------------------- primitives
class _Raised:
    """Stands for an attribute whose read raised (a property of the adapter's own class)."""

    def __init__(self, e: BaseException) -> None:
        self.text = f"{type(e).__name__}: {_safe_str(e)}"


def _get(obj: object, name: str) -> object:
    try:
        return getattr(obj, name, _MISSING)
    except Exception as e:  # reported where the field is checked, as what was "got"
        return _Raised(e)


def _record(p: _Problems, where: str, x: object, cls: type) -> bool:
    if x is _MISSING:
        p.add(where, "missing")
        return False
    if isinstance(x, cls):
        return True
    p.add(where, f"expected a {_qual(cls)}, got {_desc(x)}")
    return False


def _int(p: _Problems, where: str, x: object, *, minimum: int = 0) -> int | None:
    """An exact int >= ``minimum``; returns it when it is an int at all."""
    if x is _MISSING:
        p.add(where, "missing")
        return None
    if not is_int(x):
        p.add(where, f"expected int, got {_desc(x)}")
        return None
    if x < minimum:
        p.add(where, f"{x} is negative" if minimum == 0 else f"must be >= {minimum}, got {x}")
    return x


def _str(p: _Problems, where: str, x: object) -> str | None:
    if x is _MISSING:
        p.add(where, "missing")
        return None
    if not isinstance(x, str):
        p.add(where, f"expected str, got {_desc(x)}")
        return None
    if not x:
        p.add(where, "empty string")
    return x


def _bytes(p: _Problems, where: str, x: object) -> None:
    if x is _MISSING:
        p.add(where, "missing")
    elif not isinstance(x, bytes):
        p.add(where, f"expected bytes, got {_desc(x)}")


def _bool(p: _Problems, where: str, x: object) -> None:
    if x is _MISSING:
        p.add(where, "missing")
    elif not isinstance(x, bool):
        p.add(where, f"expected bool, got {_desc(x)}")


def _seq(p: _Problems, where: str, x: object, of: str) -> tuple[object, ...] | None:
    """A tuple (a list is reported but still read, so its elements are checked too);
    returns the elements, or None when ``x`` is no sequence at all."""
    if x is _MISSING:
        p.add(where, "missing")
        return None
    if isinstance(x, tuple):
        return x
    p.add(where, f"expected a tuple of {of}, got {_desc(x)}")
    if isinstance(x, list):
        return tuple(x)
    return None


def _ints(
    p: _Problems,
    where: str,
    x: object,
    *,
    upper: int | None = None,
    upper_name: str = "",
    item: str = "int",
) -> tuple[int, ...] | None:
    """A tuple of exact non-negative ints, each < ``upper`` when given. Reports the first
    offending element of each kind (with a count), not every one."""
    items = _seq(p, where, x, "int")
    if items is None:
        return None
    bad_type = [i for i, v in enumerate(items) if not is_int(v)]
    if _first_of(p, where, bad_type, lambda i: f"expected int, got {_desc(items[i])}"):
        return None
    values = tuple(v for v in items if is_int(v))
    negative = [i for i, v in enumerate(values) if v < 0]
    _first_of(p, where, negative, lambda i: f"{values[i]} is negative")
    if upper is not None:
        high = [i for i, v in enumerate(values) if v >= upper]
        _first_of(
            p,
            where,
            high,
            lambda i: f"{item} {values[i]} out of range 0..{upper - 1} ({upper_name} {upper})",
        )
    return values


def _first_of(p: _Problems, where: str, bad: list[int], message: Callable[[int], str]) -> bool:
    """Report the first of the offending indices ``bad`` (with a count of the others);
    whether there was one."""
    if not bad:
        return False
    more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
    p.add(f"{where}[{bad[0]}]", message(bad[0]) + more)
    return True


def _tokens(p: _Problems, where: str, x: object) -> tuple[int, ...] | None:
    return _ints(p, where, x, upper=_TOKEN_LIMIT, upper_name="limit", item="token id")


def _strs(p: _Problems, where: str, x: object) -> tuple[str, ...] | None:
    items = _seq(p, where, x, "str")
    if items is None:
        return None
    out: list[str] = []
    for i, v in enumerate(items):
        if isinstance(v, str):
            out.append(v)
        else:
            p.add(f"{where}[{i}]", f"expected str, got {_desc(v)}")
    return tuple(out)


def _pairs(p: _Problems, where: str, x: object, kind: type) -> list[tuple[object, object]]:
    """A tuple of 2-tuples of ``kind`` (``str``: (request id, reason); ``int``: block
    (src, dst), non-negative)."""
    what = "(request id, reason)" if kind is str else "(src, dst)"
    items = _seq(p, where, x, f"{what} pairs")
    if items is None:
        return []
    out: list[tuple[object, object]] = []
    for i, v in enumerate(items):
        w = f"{where}[{i}]"
        if not isinstance(v, tuple) or len(v) != 2:
            got = f"tuple of length {len(v)}" if isinstance(v, tuple) else _desc(v)
            p.add(w, f"expected a {what} tuple of two {kind.__name__}, got {got}")
            continue
        ok = True
        for j, e in enumerate(v):
            if kind is int:
                ok = _int(p, f"{w}[{j}]", e) is not None and ok
            elif not isinstance(e, str):
                p.add(f"{w}[{j}]", f"expected str, got {_desc(e)}")
                ok = False
        if ok:
            out.append((v[0], v[1]))
    return out


def _duplicates(p: _Problems, where: str, ids: list[tuple[int, str]], what: str) -> None:
    first: dict[str, int] = {}
    for i, rid in ids:
        if rid in first:
            p.add(where, f"request id {rid!r} {what} (indices {first[rid]} and {i})")
        else:
            first[rid] = i


# --------------------------------------------------------------------------- records
def _request(p: _Problems, where: str, r: object) -> str | None:
    if not _record(p, where, r, RequestSnapshot):
        return None
    rid = _str(p, f"{where}.request_id", _get(r, "request_id"))
    status = _get(r, "status")
    if status is _MISSING:
        p.add(f"{where}.status", "missing")
    elif not isinstance(status, RequestStatus):
        if isinstance(status, str) and status in {s.value for s in RequestStatus}:
            # Equal as a string, but the checkers compare with `is` and read
            # `.is_done`: a plain str would slip through them silently.
            p.add(
                f"{where}.status",
                f"expected a RequestStatus, got str {status!r} "
                f"(use RequestStatus.{RequestStatus(status).name})",
            )
        elif isinstance(status, str):
            p.add(f"{where}.status", f"{status!r} is not a RequestStatus ({_STATUSES})")
        else:
            p.add(f"{where}.status", f"expected a RequestStatus, got {_desc(status)}")
    for name in (
        "num_prompt_tokens",
        "num_output_tokens",
        "num_computed_tokens",
        "max_tokens",
        "num_cached_tokens",
        "max_model_len",
        "arrival_step",
    ):
        _int(p, f"{where}.{name}", _get(r, name))
    return rid


def _table(p: _Problems, where: str, t: object, num_blocks: int | None) -> str | None:
    if not _record(p, where, t, TableSnapshot):
        return None
    rid = _str(p, f"{where}.request_id", _get(t, "request_id"))
    _ints(
        p,
        f"{where}.block_table",
        _get(t, "block_table"),
        item="block id",
    )
    stored = _int(p, f"{where}.num_stored", _get(t, "num_stored"))
    tokens = _tokens(p, f"{where}.token_ids", _get(t, "token_ids"))
    del tokens, stored  # token_ids vs num_stored is POS's finding
    _bytes(p, f"{where}.root_key", _get(t, "root_key"))
    return rid


def _entry(p: _Problems, where: str, e: object, num_blocks: int | None) -> None:
    if not _record(p, where, e, CacheEntry):
        return
    _bytes(p, f"{where}.key", _get(e, "key"))
    _int(p, f"{where}.block_id", _get(e, "block_id"))
    _bytes(p, f"{where}.parent_key", _get(e, "parent_key"))
    _tokens(p, f"{where}.token_ids", _get(e, "token_ids"))


def _pool(p: _Problems, where: str, pool: object) -> None:
    if not _record(p, where, pool, PoolSnapshot):
        return
    n = _int(p, f"{where}.num_blocks", _get(pool, "num_blocks"))
    # Every checker divides by the block size: zero must stop here, not in a checker.
    _int(p, f"{where}.block_size", _get(pool, "block_size"), minimum=1)
    upper = n if n is not None and n >= 0 else None
    ref = _ints(p, f"{where}.ref_cnt", _get(pool, "ref_cnt"))
    del ref  # ref_cnt vs num_blocks is BLOCK's finding, as are ids out of range below
    # Duplicates in the free queue are BLOCK's finding (a double free), not a shape error.
    _ints(
        p,
        f"{where}.free_queue",
        _get(pool, "free_queue"),
        item="block id",
    )
    tables = _seq(p, f"{where}.tables", _get(pool, "tables"), "TableSnapshot")
    ids: list[tuple[int, str]] = []
    for i, t in enumerate(tables or ()):
        rid = _table(p, f"{where}.tables[{i}]", t, upper)
        if rid is not None:
            ids.append((i, rid))
    # PoolSnapshot.table() returns the first match: a second table would go unchecked.
    _duplicates(p, f"{where}.tables", ids, "has two tables")
    entries = _seq(p, f"{where}.cache_entries", _get(pool, "cache_entries"), "CacheEntry")
    for i, e in enumerate(entries or ()):
        _entry(p, f"{where}.cache_entries[{i}]", e, upper)
    for name in ("transfers", "failed_transfers"):
        _transfers(p, f"{where}.{name}", _get(pool, name))
    if _get(pool, "stated_free") is not None:
        _int(p, f"{where}.stated_free", _get(pool, "stated_free"))


def _transfers(p: _Problems, where: str, value: object) -> None:
    transfers = _seq(p, where, value, "Transfer")
    for i, t in enumerate(transfers or ()):
        w = f"{where}[{i}]"
        if _record(p, w, t, Transfer):
            _str(p, f"{w}.request_id", _get(t, "request_id"))
            _ints(p, f"{w}.blocks", _get(t, "blocks"), item="block id")
            holder = _get(t, "holder")
            if not isinstance(holder, str):  # "" is the request's own table
                p.add(f"{w}.holder", f"expected str, got {_desc(holder)}")
            if not isinstance(_get(t, "kind"), TransferKind):
                p.add(f"{w}.kind", f"not a TransferKind: {_get(t, 'kind')!r}")


def _engine(p: _Problems, where: str, snap: object) -> None:
    if not _record(p, where, snap, EngineSnapshot):
        return
    requests = _seq(p, f"{where}.requests", _get(snap, "requests"), "RequestSnapshot")
    ids: list[tuple[int, str]] = []
    for i, r in enumerate(requests or ()):
        rid = _request(p, f"{where}.requests[{i}]", r)
        if rid is not None:
            ids.append((i, rid))
    # EngineSnapshot.request() returns the first match: a second record would hide.
    _duplicates(p, f"{where}.requests", ids, "listed twice")
    _pool(p, f"{where}.pool", _get(snap, "pool"))
    host = _get(snap, "host")
    if host is not None:
        _pool(p, f"{where}.host", host)


def _scheduled(p: _Problems, where: str, s: object) -> str | None:
    if not _record(p, where, s, ScheduledRequest):
        return None
    rid = _str(p, f"{where}.request_id", _get(s, "request_id"))
    n = _int(p, f"{where}.num_new_tokens", _get(s, "num_new_tokens"))
    positions = _ints(p, f"{where}.positions", _get(s, "positions"), item="position")
    slots = _ints(p, f"{where}.slot_mapping", _get(s, "slot_mapping"), item="slot")
    _ints(p, f"{where}.block_table", _get(s, "block_table"), item="block id")
    _bool(p, f"{where}.samples", _get(s, "samples"))
    _int(p, f"{where}.num_new_cached_tokens", _get(s, "num_new_cached_tokens"))
    _int(p, f"{where}.num_new_loaded_tokens", _get(s, "num_new_loaded_tokens"), minimum=0)
    _int(p, f"{where}.num_draft_tokens", _get(s, "num_draft_tokens"))
    # Lengths that disagree (positions vs num_new_tokens vs slot_mapping) are the engine's
    # answer, judged by TOKEN and POS under their own ids, not a shape error.
    del n, positions, slots
    return rid


def _step_report(p: _Problems, where: str, rep: object) -> None:
    if not _record(p, where, rep, StepReport):
        return
    scheduled = _seq(p, f"{where}.scheduled", _get(rep, "scheduled"), "ScheduledRequest")
    ids: list[tuple[int, str]] = []
    for i, s in enumerate(scheduled or ()):
        rid = _scheduled(p, f"{where}.scheduled[{i}]", s)
        if rid is not None:
            ids.append((i, rid))
    # A request scheduled twice is TOKEN's finding, not a shape error.
    preempted = _strs(p, f"{where}.preempted", _get(rep, "preempted")) or ()
    _duplicates(p, f"{where}.preempted", list(enumerate(preempted)), "listed twice")
    finished = _pairs(p, f"{where}.finished", _get(rep, "finished"), str)
    _duplicates(
        p, f"{where}.finished", [(i, str(f[0])) for i, f in enumerate(finished)], "listed twice"
    )
    for name in ("block_copies", "swap_out", "swap_in"):
        _pairs(p, f"{where}.{name}", _get(rep, name), int)


def _commit_report(p: _Problems, where: str, rep: object) -> None:
    if not _record(p, where, rep, CommitReport):
        return
    finished = _pairs(p, f"{where}.finished", _get(rep, "finished"), str)
    _duplicates(
        p, f"{where}.finished", [(i, str(f[0])) for i, f in enumerate(finished)], "listed twice"
    )


def _migration_export(p: _Problems, where: str, exp: object, rid: str) -> None:
    if not _record(p, where, exp, MigrationExport):
        return
    _same_id(p, f"{where}.request_id", _get(exp, "request_id"), rid)
    _ints(p, f"{where}.kv_slots", _get(exp, "kv_slots"), item="slot")
    _bool(p, f"{where}.kv_on_host", _get(exp, "kv_on_host"))


def _migration_staged(p: _Problems, where: str, staged: object, rid: str) -> None:
    if not _record(p, where, staged, MigrationStaged):
        return
    _same_id(p, f"{where}.request_id", _get(staged, "request_id"), rid)
    _int(p, f"{where}.num_hit_tokens", _get(staged, "num_hit_tokens"))
    _ints(p, f"{where}.kv_slots", _get(staged, "kv_slots"), item="slot")


def _same_id(p: _Problems, where: str, x: object, rid: str) -> None:
    got = _str(p, where, x)
    if got is not None and got != rid:
        p.add(where, f"{got!r} is not the request asked for ({rid!r})")


# --------------------------------------------------------------------------- public API
def check_engine_snapshot(obj: object, where: str = "snapshot") -> list[str]:
    """Problems in an :class:`refserve.spec.snapshot.EngineSnapshot` returned by ``snapshot()``:
    its requests (types, a valid ``RequestStatus``, non-negative counters, no id twice),
    its device pool and its optional host pool (:func:`check_pool_snapshot`). Empty when
    well formed; never raises."""
    return _guarded(where, lambda p: _engine(p, where, obj))


def check_pool_snapshot(obj: object, where: str = "pool") -> list[str]:
    """Problems in a :class:`refserve.spec.snapshot.PoolSnapshot` (an engine snapshot's ``pool``
    or ``host``, or a KV adapter's ``snapshot()``): ``block_size >= 1``, ``ref_cnt`` one
    non-negative int per block, free-queue, table and cache-entry block ids inside the
    pool, ``len(token_ids) == num_stored`` per table, one table per request id. Never
    raises."""
    return _guarded(where, lambda p: _pool(p, where, obj))


def check_step_report(obj: object, where: str = "step_report") -> list[str]:
    """Problems in a :class:`refserve.conformance.adapter.StepReport` returned by ``schedule()``:
    per scheduled request ``len(positions) == num_new_tokens == len(slot_mapping)``,
    non-negative positions/slots/block ids, ``samples`` a bool, each id scheduled once;
    ``preempted`` ids, ``finished`` (id, reason) pairs and (src, dst) block pairs of the
    copies and swaps. Never raises."""
    return _guarded(where, lambda p: _step_report(p, where, obj))


def check_commit_report(obj: object, where: str = "commit_report") -> list[str]:
    """Problems in a :class:`refserve.conformance.adapter.CommitReport` returned by ``commit()``:
    ``finished`` is a tuple of (request id, reason) string pairs, each id once. Never
    raises."""
    return _guarded(where, lambda p: _commit_report(p, where, obj))


def check_migration_export(obj: object, request_id: str, where: str = "export") -> list[str]:
    """Problems in a :class:`refserve.conformance.adapter.MigrationExport` returned by
    ``export_request(request_id)``: the id asked for, ``kv_slots`` a tuple of
    non-negative ints, ``kv_on_host`` a bool (the ticket is the engine's own and is not
    read). Never raises."""
    return _guarded(where, lambda p: _migration_export(p, where, obj, request_id))


def check_migration_staged(obj: object, request_id: str, where: str = "staged") -> list[str]:
    """Problems in a :class:`refserve.conformance.adapter.MigrationStaged` returned by
    ``stage_import``: the id asked for, a non-negative ``num_hit_tokens`` and ``kv_slots``
    a tuple of non-negative ints. Never raises."""
    return _guarded(where, lambda p: _migration_staged(p, where, obj, request_id))


def _levels(
    p: _Problems, where: str, levels: object, live: Collection[str], num_levels: int
) -> None:
    if not isinstance(levels, Mapping):
        p.add(where, f"expected a mapping of request id to level, got {_desc(levels)}")
        return
    for rid in sorted(live):
        if rid not in levels:
            p.add(where, f"no level for live request {rid!r}")
    for rid, level in levels.items():
        at = f"{where}[{_short(rid)}]"
        if not isinstance(rid, str):
            p.add(at, f"expected a request id (str), got {_desc(rid)}")
            continue
        got = _int(p, at, level)
        if got is not None and got >= num_levels:
            p.add(at, f"level {got} does not exist (declared num_levels {num_levels})")


def check_levels(
    obj: object, live: Collection[str], num_levels: int, where: str = "levels()"
) -> list[str]:
    """Problems in what ``levels()`` returned (a declared
    :class:`refserve.conformance.adapter.MultiLevelQueue`): a mapping from request id to
    an int level in ``[0, num_levels)``, with a level for every request in ``live`` (the
    live requests of the snapshot taken at the same boundary; it may name more). Never
    raises."""
    return _guarded(where, lambda p: _levels(p, where, obj, live, num_levels))
