"""KV-manager conformance: a Hypothesis-driven checker for any :class:`KVAdapter`.

The suite plays scheduler and model for a block manager on its own. Each example is a
*workload*: a :class:`~conformance.kv.protocol.KVConfig` and a plain-data op list (JSON),
replayable with :func:`replay_kv`:

* ``{"op": "new", "rid": "r1", "prompt": [..], "n": 3}``: first allocation of a request
  whose known tokens are ``prompt``, for ``n`` new tokens (plus any cache hit);
* ``{"op": "grow", "rid": "r1", "append": [..], "n": 1}``: the request learns the tokens
  ``append`` (decode outputs; ``[]`` for the rest of a chunked prompt) and asks for ``n``
  more (clipped to the tokens it knows and has not stored);
* ``{"op": "fork", "parent": "r1", "child": "r2"}`` (feature ``fork``);
* ``{"op": "free", "rid": "r1"}``.

An op naming a request that is not live (or a fork into a live one) is skipped, so a
shrunk op list always replays. After the ops every live request is freed (the *drain*,
reported as op ``len(ops)``) and the pool must be quiescent.

The suite keeps the logical truth per request (its known tokens, how many are stored,
how many came from the cache) and a fake KV memory (slot -> token id). After EVERY op:

* BLOCK, CAP, POS, PREFIX: :func:`spec.checks.check_pool` on the snapshot;
* KVLEN: each table's ``num_stored`` is the suite's count (previous + hit + new);
  PREFIX: its ``token_ids`` are the request's own tokens;
* read-back: every live request reads its own tokens through its table. The suite
  writes each new position's token at its slot through the *returned* table, after
  performing the returned copies, so a copy-on-write done but not reported, or a block
  released while still held (ref count too low, double free), shows as a wrong or
  missing token (BLOCK); a wrong token in a shared or cache-hit block (a stale cache
  entry) is PREFIX, as in conformance.runner's read-back;
* PREFIX: a write lands only in a block the writer holds alone (copy-on-write); a cache
  hit is whole blocks, only on a first allocation, only with caching on, and leaves the
  last known token to be computed (KVLEN if hit + new tokens exceed the known tokens);
* POS: the returned ``Allocation.block_table`` is the snapshot's table and covers every
  new position;
* ATOMIC: a :class:`NoSpace` leaves the snapshot unchanged (the free *set*: free-queue
  order is a design choice of the manager and never compared); CAP: a NoSpace while the
  snapshot shows enough free blocks for the call without any cache hit (plus one for a
  copy-on-write) is a finding;
* PROGRESS: after the drain no table remains and no block is referenced
  (:func:`spec.progress.check_quiescent`); an adapter call that raises (other than the
  protocol's answers) or runs past the time limit, and a snapshot or Allocation not
  shaped as the protocol says, are findings naming the call, never a crash.

An example stops at the first op with a finding (later state is collateral damage).
:func:`run_kv_suite` runs the fixed scenarios, then ``max_examples`` generated examples
without stopping at the first failure, keeps the first workload per finding signature
(:func:`conformance.report.signature_of`: invariant, first word of the subject, message
with its numbers blanked) and shrinks each one by greedy delta debugging that keeps
that exact signature. Signatures in a baseline (``known``) are counted, not failed.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import json
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar, cast

from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import strategies as st
from hypothesis.errors import HypothesisException

from conformance.adapter import NotSupported
from conformance.guard import DEFAULT_CALL_TIMEOUT, AdapterCallError, call, describe
from conformance.kv.protocol import KVAdapter, KVAdapterFactory, KVConfig, KVFeature, NoSpace
from conformance.report import Failure, Result, ScenarioInfo, signature_of
from spec.arith import blocks_needed, max_cacheable_tokens, slot_of
from spec.atomic import check_atomic_pool
from spec.checks import check_pool
from spec.progress import check_quiescent
from spec.snapshot import CacheEntry, PoolSnapshot, TableSnapshot
from spec.violation import Invariant, Violation, violation

T = TypeVar("T")

GENERATED_NAME = "kv-generated"
KV_INVARIANTS = (
    Invariant.BLOCK,
    Invariant.CAP,
    Invariant.POS,
    Invariant.PREFIX,
    Invariant.KVLEN,
    Invariant.ATOMIC,
    Invariant.PROGRESS,
)
"""What this level checks; ATOMIC only once some allocation was refused."""
_ALWAYS = frozenset(KV_INVARIANTS) - {Invariant.ATOMIC}
MAX_SHRINK_RUNS = 300
MAX_OPS = 24
_ALPHABET = st.integers(0, 2)  # three token ids, so prompts collide and hits are common


# ---------------------------------------------------------------------------- records
@dataclass(frozen=True)
class KVFinding:
    """A violation and where: ``step`` is the op index (-1: configure, ``len(ops)``: the
    drain), ``op`` the op kind (``new``, ``grow``, ``fork``, ``free``, ``drain``...)."""

    violation: Violation
    step: int
    op: str
    timed_out: bool = False
    """An adapter call ran past the time limit (such a finding is not shrunk)."""

    @property
    def invariant(self) -> Invariant:
        return self.violation.invariant

    @property
    def signature(self) -> str:
        """What makes two findings the same bug (:func:`conformance.report.signature_of`):
        invariant, first word of the subject (``request``, ``block``, ``pool``,
        ``adapter``...), message with its numbers blanked."""
        v = self.violation
        return signature_of(v.invariant, v.subject, v.message)

    def to_json(self) -> dict[str, Any]:
        v = self.violation
        return {
            "invariant": str(v.invariant),
            "step": self.step,
            "op": self.op,
            "subject": v.subject,
            "message": v.message,
            "expected": v.expected,
            "seen": v.seen,
        }

    def __str__(self) -> str:
        return f"op {self.step} ({self.op}): {self.violation}"


@dataclass(frozen=True)
class KVWorkload:
    """A KV configuration and the op list run on it (module docstring for the op format)."""

    config: KVConfig
    ops: tuple[Mapping[str, Any], ...] = ()

    def to_json(self) -> dict[str, Any]:
        c = self.config
        return {
            "kv_config": {
                "num_blocks": c.num_blocks,
                "block_size": c.block_size,
                "enable_prefix_caching": c.enable_prefix_caching,
            },
            "ops": [_op_json(o) for o in self.ops],
        }

    @staticmethod
    def from_json(d: Mapping[str, Any] | str) -> KVWorkload:
        """Parse and validate (``ValueError`` on a malformed workload)."""
        if isinstance(d, str):
            d = json.loads(d)
        if not isinstance(d, Mapping):
            raise ValueError(f"a KV workload is a JSON object, got {type(d).__name__}")
        c = d.get("kv_config")
        if not isinstance(c, Mapping):
            raise ValueError("a KV workload needs a 'kv_config' object")
        config = KVConfig(
            _pos_int(c.get("num_blocks"), "num_blocks"),
            _pos_int(c.get("block_size"), "block_size"),
            bool(c.get("enable_prefix_caching", True)),
        )
        ops = d.get("ops", [])
        if not isinstance(ops, list):
            raise ValueError("'ops' must be a list")
        return KVWorkload(config, tuple(_parse_op(o, i) for i, o in enumerate(ops)))


def _pos_int(x: object, what: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < 1:
        raise ValueError(f"{what} must be an int >= 1, got {x!r}")
    return x


def _parse_op(o: object, i: int) -> dict[str, Any]:
    if not isinstance(o, Mapping):
        raise ValueError(f"op {i} is not an object")
    kind = o.get("op")
    spec: dict[str, tuple[str, ...]] = {
        "new": ("rid", "prompt", "n"),
        "grow": ("rid", "append", "n"),
        "fork": ("parent", "child"),
        "free": ("rid",),
    }
    if kind not in spec:
        raise ValueError(f"op {i}: unknown op {kind!r} (one of {sorted(spec)})")
    out: dict[str, Any] = {"op": kind}
    for key in spec[kind]:
        v = o.get(key)
        if key in ("rid", "parent", "child"):
            if not isinstance(v, str):
                raise ValueError(f"op {i}: {key} must be a string")
        elif key == "n":
            v = _pos_int(v, f"op {i}: n")
        elif not isinstance(v, list) or any(
            isinstance(t, bool) or not isinstance(t, int) for t in v
        ):
            raise ValueError(f"op {i}: {key} must be a list of ints")
        out[key] = list(v) if isinstance(v, list) else v
    return out


def _op_json(o: Mapping[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, list | tuple) else v for k, v in o.items()}


@dataclass(frozen=True)
class KVScenario:
    """A fixed KV workload; ``needs`` are the features without which it is not_supported."""

    name: str
    description: str
    workload: KVWorkload
    needs: frozenset[KVFeature] = frozenset()
    targets: tuple[str, ...] = ()


# ------------------------------------------------------------------- snapshot shape
class _Malformed(Exception):
    """The adapter returned something not shaped as the protocol says."""


class _SearchStopped(Exception):
    """Ends the generated search early (a call timed out)."""


class _Stop(Exception):
    """The run cannot go on: a fault was recorded as a finding."""


def _kind(x: object) -> str:
    text = repr(x)
    return f"{type(x).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def _int(x: object, what: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise _Malformed(f"{what} is {_kind(x)}, not an int")
    return int(x)


def _ints(x: object, what: str) -> tuple[int, ...]:
    if not isinstance(x, tuple | list):
        raise _Malformed(f"{what} is {_kind(x)}, not a tuple of ints")
    return tuple(_int(v, f"{what}[{i}]") for i, v in enumerate(x))


def _bytes(x: object, what: str) -> bytes:
    if not isinstance(x, bytes):
        raise _Malformed(f"{what} is {_kind(x)}, not bytes")
    return x


def _seq(x: object, what: str) -> tuple[object, ...]:
    if not isinstance(x, tuple | list):
        raise _Malformed(f"{what} is {_kind(x)}, not a tuple")
    return tuple(x)


def _attr(obj: object, name: str, what: str) -> object:
    if not hasattr(obj, name):
        raise _Malformed(f"{what} ({type(obj).__name__}) has no {name!r}")
    return cast(object, getattr(obj, name))


def normalize_snapshot(raw: object) -> PoolSnapshot:
    """A plain :class:`PoolSnapshot` of ints, bytes and tuples from whatever the adapter
    returned (duck-typed), or :class:`_Malformed` saying which field is wrong."""
    if raw is None:
        raise _Malformed("None, not a PoolSnapshot")
    tables: list[TableSnapshot] = []
    for i, t in enumerate(_seq(_attr(raw, "tables", "snapshot"), "tables")):
        w = f"tables[{i}]"
        rid = _attr(t, "request_id", w)
        if not isinstance(rid, str):
            raise _Malformed(f"{w}.request_id is {_kind(rid)}, not a str")
        tables.append(
            TableSnapshot(
                rid,
                _ints(_attr(t, "block_table", w), f"{w}.block_table"),
                _int(_attr(t, "num_stored", w), f"{w}.num_stored"),
                _ints(_attr(t, "token_ids", w), f"{w}.token_ids"),
                _bytes(_attr(t, "root_key", w), f"{w}.root_key"),
            )
        )
    entries: list[CacheEntry] = []
    raw_entries = getattr(raw, "cache_entries", ())
    for i, e in enumerate(_seq(raw_entries, "cache_entries")):
        w = f"cache_entries[{i}]"
        entries.append(
            CacheEntry(
                _bytes(_attr(e, "key", w), f"{w}.key"),
                _int(_attr(e, "block_id", w), f"{w}.block_id"),
                _bytes(_attr(e, "parent_key", w), f"{w}.parent_key"),
                _ints(_attr(e, "token_ids", w), f"{w}.token_ids"),
            )
        )
    return PoolSnapshot(
        num_blocks=_int(_attr(raw, "num_blocks", "snapshot"), "num_blocks"),
        block_size=_int(_attr(raw, "block_size", "snapshot"), "block_size"),
        ref_cnt=_ints(_attr(raw, "ref_cnt", "snapshot"), "ref_cnt"),
        free_queue=_ints(_attr(raw, "free_queue", "snapshot"), "free_queue"),
        tables=tuple(tables),
        cache_entries=tuple(entries),
    )


_Alloc = tuple[tuple[int, ...], int, tuple[tuple[int, int], ...]]


def _normalize_allocation(raw: object) -> _Alloc:
    if raw is None:
        raise _Malformed("None, not an Allocation")
    table = _ints(_attr(raw, "block_table", "Allocation"), "block_table")
    hit = _int(_attr(raw, "num_cached_tokens", "Allocation"), "num_cached_tokens")
    copies: list[tuple[int, int]] = []
    for i, c in enumerate(_seq(_attr(raw, "copies", "Allocation"), "copies")):
        pair = _ints(c, f"copies[{i}]")
        if len(pair) != 2:
            raise _Malformed(f"copies[{i}] is not a (src, dst) pair")
        copies.append((pair[0], pair[1]))
    return table, hit, tuple(copies)


def as_features(raw: object) -> frozenset[KVFeature]:
    """The adapter's ``features`` as KVFeature values (``TypeError``/``ValueError`` if not)."""
    if not isinstance(raw, set | frozenset | list | tuple):
        raise TypeError(f"features is {_kind(raw)}, not a set of KVFeature")
    out: set[KVFeature] = set()
    for f in raw:
        if not isinstance(f, str):
            raise TypeError(f"feature {_kind(f)} is not a KVFeature")
        out.add(KVFeature(f))
    return frozenset(out)


def _canon(s: PoolSnapshot) -> PoolSnapshot:
    """The snapshot with the manager's design-choice orders removed (free-queue order,
    cache-entry order), so ATOMIC compares what a failed call may not change."""
    return replace(
        s,
        free_queue=tuple(sorted(s.free_queue)),
        tables=tuple(sorted(s.tables, key=lambda t: t.request_id)),
        cache_entries=tuple(sorted(s.cache_entries, key=lambda e: (e.block_id, e.key))),
    )


def _short(value: object, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --------------------------------------------------------------------------- the run
class _KVRun:
    """One workload on one fresh adapter, checked after every op."""

    def __init__(self, factory: KVAdapterFactory, config: KVConfig, timeout: float) -> None:
        self.factory = factory
        self.config = config
        self.timeout = timeout
        self.bs = config.block_size
        self.adapter: KVAdapter | None = None
        self.features: frozenset[KVFeature] = frozenset()
        # The suite's truth: never read back from the manager.
        self.known: dict[str, list[int]] = {}
        self.stored: dict[str, int] = {}
        self.cached: dict[str, int] = {}
        self.freed: set[str] = set()
        self.memory: dict[int, int] = {}
        self.ever_held: set[int] = set()
        self.snap: PoolSnapshot | None = None
        self.ops: list[Mapping[str, Any]] = []
        self.findings: list[KVFinding] = []
        self.trace: list[dict[str, Any]] = []
        self.coverage: Counter[str] = Counter()
        self.checked: set[Invariant] = set()
        self.not_supported = ""
        self.dead = False
        self.step = -1
        self.phase = "configure"

    @property
    def caching(self) -> bool:
        return self.config.enable_prefix_caching and KVFeature.PREFIX_CACHING in self.features

    def workload(self, upto: int | None = None) -> KVWorkload:
        """The ops run so far, up to and including op ``upto``."""
        ops = self.ops if upto is None else self.ops[: max(0, upto + 1)]
        return KVWorkload(self.config, tuple(ops))

    def clone(self) -> _KVRun:
        """An independent copy of this run, adapter included (deep-copied), for the
        exhaustive explorer's copy strategy (conformance.explore.kv). The suite's books
        are copied one level deep and the snapshots and ops are shared: they are never
        changed in place, and a generic deep copy of them costs more than the op."""
        new = copy.copy(self)
        new.adapter = copy.deepcopy(self.adapter)
        new.known = {rid: list(toks) for rid, toks in self.known.items()}
        new.stored, new.cached = dict(self.stored), dict(self.cached)
        new.memory = dict(self.memory)
        new.freed, new.ever_held = set(self.freed), set(self.ever_held)
        new.checked = set(self.checked)
        new.ops, new.findings, new.trace = list(self.ops), list(self.findings), list(self.trace)
        new.coverage = Counter(self.coverage)
        return new

    # ------------------------------------------------------------------ recording
    def _fail(
        self,
        inv: Invariant,
        subject: str,
        message: str,
        expected: object = "",
        seen: object = "",
        *,
        timed_out: bool = False,
    ) -> None:
        v = violation(inv, subject, message, expected, seen)
        self.findings.append(KVFinding(v, self.step, self.phase, timed_out))

    def _record(self, vs: Sequence[Violation]) -> None:
        self.findings.extend(KVFinding(v, self.step, self.phase) for v in vs)

    def _call(
        self, what: str, fn: Callable[[], T], passthrough: tuple[type[BaseException], ...] = ()
    ) -> T:
        """A guarded adapter call; a fault becomes a PROGRESS finding and ends the run."""
        try:
            return call(what, fn, self.timeout, (*passthrough, _Malformed))
        except AdapterCallError as e:
            self._fail(Invariant.PROGRESS, "adapter", f"{what} {e.detail}", timed_out=e.timed_out)
            raise _Stop from None
        except _Malformed as e:
            self._fail(Invariant.PROGRESS, "adapter", f"{what} returned a malformed value: {e}")
            raise _Stop from None

    def _checker(self, name: str, fn: Callable[[], list[Violation]]) -> list[Violation]:
        """A spec checker on adapter data; one that raises (garbage the shape check let
        through, e.g. a token id too large to hash) is a finding, not a crash."""
        try:
            return fn()
        except Exception as e:  # the data came from the adapter: anything may go wrong
            self._fail(
                Invariant.PROGRESS,
                "snapshot",
                f"{name} cannot read the adapter's snapshot: {describe(e)}",
            )
            return []

    def _snapshot(self) -> PoolSnapshot:
        a = self.adapter
        assert a is not None
        snap = self._call("snapshot()", lambda: normalize_snapshot(a.snapshot()))
        c = self.config
        if snap.num_blocks != c.num_blocks:
            self._fail(
                Invariant.CAP,
                "pool",
                "snapshot num_blocks differs from the configured pool",
                c.num_blocks,
                snap.num_blocks,
            )
        elif snap.block_size != c.block_size:
            self._fail(
                Invariant.POS,
                "pool",
                "snapshot block_size differs from the configured one",
                c.block_size,
                snap.block_size,
            )
        elif len(snap.ref_cnt) != snap.num_blocks:
            self._fail(
                Invariant.BLOCK,
                "pool",
                "ref_cnt length differs from num_blocks",
                snap.num_blocks,
                len(snap.ref_cnt),
            )
        else:
            self.snap = snap
            return snap
        raise _Stop

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> bool:
        """Build and configure a fresh adapter and check it is empty (PROGRESS: nothing
        held; BLOCK: every block free). False when the configuration is not supported
        (``not_supported`` says why) or on a finding."""
        try:
            adapter = self._call("factory()", self.factory)
            raw = self._call("features", lambda: adapter.features)
            try:
                self.features = as_features(raw)
            except (TypeError, ValueError) as e:
                self._fail(
                    Invariant.PROGRESS,
                    "adapter",
                    f"features is not a set of KVFeature: {describe(e)}",
                )
                raise _Stop from None
            self.adapter = adapter
            try:
                self._call("configure()", lambda: adapter.configure(self.config), (NotSupported,))
            except NotSupported as e:
                self.not_supported = f"configure: {e}"
                return False
            self.checked |= _ALWAYS
            snap = self._snapshot()
            self._record(check_quiescent(snap))
            self._check_state(snap)
        except _Stop:
            pass
        self.dead = bool(self.findings)
        return not self.dead

    def apply(self, op: Mapping[str, Any]) -> None:
        """Run one op (skipped when it names no live request) and check everything."""
        if self.dead:
            return
        self.step = len(self.ops)
        self.ops.append(op)
        self.phase = str(op["op"])
        before = len(self.findings)
        with contextlib.suppress(_Stop):
            self._dispatch(op)
        if len(self.findings) > before:
            self.dead = True

    def drain(self) -> None:
        """Free every live request, then PROGRESS: no table, no referenced block."""
        if self.dead:
            return
        self.step = len(self.ops)
        self.phase = "drain"
        try:
            for rid in sorted(self.stored):
                self._free(rid)
                if self.findings:
                    break
            if not self.findings and self.snap is not None:
                self._record(check_quiescent(self.snap))
        except _Stop:
            pass
        self.dead = bool(self.findings)

    def _skip(self, why: str) -> None:
        self.trace.append({"op": self.step, "skipped": why})

    def _dispatch(self, op: Mapping[str, Any]) -> None:
        kind = op["op"]
        if kind == "new":
            rid, prompt = str(op["rid"]), [int(t) for t in op["prompt"]]
            n = min(int(op["n"]), len(prompt))
            if rid in self.stored:
                return self._skip(f"{rid} is live")
            if n < 1:
                return self._skip("empty prompt")
            return self._allocate(rid, prompt, n, first=True)
        if kind == "grow":
            rid = str(op["rid"])
            if rid not in self.stored:
                return self._skip(f"{rid} is not live")
            self.known[rid].extend(int(t) for t in op["append"])
            n = min(int(op["n"]), len(self.known[rid]) - self.stored[rid])
            if n < 1:
                return self._skip(f"{rid} has no unstored token")
            return self._allocate(rid, list(self.known[rid]), n, first=False)
        if kind == "fork":
            parent, child = str(op["parent"]), str(op["child"])
            if KVFeature.FORK not in self.features:
                return self._skip("no fork feature")
            if parent not in self.stored or child in self.stored:
                return self._skip(f"{parent} is not live or {child} is")
            return self._fork(parent, child)
        if kind == "free":
            rid = str(op["rid"])
            if rid not in self.stored:
                return self._skip(f"{rid} is not live")
            return self._free(rid)
        raise ValueError(f"unknown op {kind!r}")

    # ------------------------------------------------------------------ operations
    def _allocate(self, rid: str, tokens: list[int], n: int, *, first: bool) -> None:
        a, before = self.adapter, self.snap
        assert a is not None and before is not None
        self.coverage["allocations"] += 1
        known = tuple(tokens)  # a copy: the manager must not see the suite's lists change
        entry: dict[str, Any] = {"op": self.step, "allocate": rid, "n": n, "known": len(known)}
        self.trace.append(entry)
        try:
            alloc = self._call(
                f"allocate({rid!r}, n={n})",
                lambda: _normalize_allocation(a.allocate(rid, known, n)),
                (NoSpace,),
            )
        except NoSpace:
            return self._refused(rid, n, first, before, entry)
        table, hit, copies = alloc
        prev = 0 if first else self.stored[rid]
        if not self._hit_ok(rid, hit, n, len(known), first):
            raise _Stop
        start, end = prev + hit, prev + hit + n
        if first:
            self.known[rid] = list(known)
            self.cached[rid] = hit
            self.freed.discard(rid)
        self.stored[rid] = end
        entry.update(cached=hit, copies=[list(c) for c in copies], block_table=list(table))
        after = self._snapshot()
        t = after.table(rid)
        if t is not None and t.block_table != table:
            self._fail(
                Invariant.POS,
                f"request {rid}",
                "returned block table differs from the snapshot's",
                _short(t.block_table),
                _short(table),
            )
        self._execute(rid, known, table, copies, start, end, after)
        self._observe(before, after, table, hit, copies)
        self._check_state(after)

    def _refused(
        self, rid: str, n: int, first: bool, before: PoolSnapshot, entry: dict[str, Any]
    ) -> None:
        """NoSpace: ATOMIC (nothing changed) and CAP (the pool really lacked room)."""
        self.coverage["no_space"] += 1
        self.checked.add(Invariant.ATOMIC)
        after = self._snapshot()
        self._record(
            self._checker(
                "check_atomic_pool", lambda: check_atomic_pool(_canon(before), _canon(after))
            )
        )
        need, free = self._room(before, rid, n, first)
        entry.update(no_space=True, needs=need, free=free)
        if need <= free:
            self._fail(
                Invariant.CAP,
                f"request {rid}",
                "allocation refused (NoSpace) while the pool had room",
                f"served ({need} blocks needed)",
                f"NoSpace with {free} free blocks",
            )
        self._check_state(after)

    def _room(self, before: PoolSnapshot, rid: str, n: int, first: bool) -> tuple[int, int]:
        """(blocks the call needs without any cache hit, plus a copy-on-write; free blocks)."""
        bs = self.bs
        in_queue = set(before.free_queue)
        free = sum(1 for b, rc in enumerate(before.ref_cnt) if rc == 0 and b in in_queue)
        if first:
            return blocks_needed(n, bs), free
        prev = self.stored[rid]
        need = blocks_needed(prev + n, bs) - blocks_needed(prev, bs)
        t = before.table(rid)
        if prev % bs and t is not None and t.block_table:
            last = t.block_table[-1]
            if 0 <= last < len(before.ref_cnt) and before.ref_cnt[last] > 1:
                need += 1
        return need, free

    def _hit_ok(self, rid: str, hit: int, n: int, known: int, first: bool) -> bool:
        """PREFIX: a hit is whole blocks, on a first allocation, with caching on, and
        spares the last known token; KVLEN: hit + new tokens fit in the known tokens."""
        who, bs = f"request {rid}", self.bs
        cacheable = max_cacheable_tokens(known, bs)
        if not first and hit != 0:
            self._fail(
                Invariant.PREFIX,
                who,
                "cache hit reported for a request already holding blocks",
                0,
                hit,
            )
        elif not first:
            return True
        elif hit < 0:
            self._fail(Invariant.PREFIX, who, "negative cache hit", ">= 0", hit)
        elif hit > 0 and not self.caching:
            self._fail(Invariant.PREFIX, who, "cache hit while prefix caching is off", 0, hit)
        elif hit % bs:
            self._fail(
                Invariant.PREFIX,
                who,
                "cache hit is not a whole number of blocks",
                f"multiple of {bs}",
                hit,
            )
        elif hit > cacheable:
            self._fail(
                Invariant.PREFIX,
                who,
                "cache hit covers the last known token (no logit)",
                f"<= {cacheable}",
                hit,
            )
        elif hit + n > known:
            self._fail(
                Invariant.KVLEN,
                who,
                "cache hit plus new tokens exceed the known tokens",
                f"<= {known}",
                hit + n,
            )
        else:
            return True
        return False

    def _execute(
        self,
        rid: str,
        known: tuple[int, ...],
        table: tuple[int, ...],
        copies: tuple[tuple[int, int], ...],
        start: int,
        end: int,
        after: PoolSnapshot,
    ) -> None:
        """The executor: the returned copies, then each new token at its slot through the
        returned table (POS: the table covers the positions; PREFIX: written blocks are
        private to the writer, i.e. copy-on-write happened)."""
        bs, nb, who = self.bs, after.num_blocks, f"request {rid}"
        for src, dst in copies:
            if not (0 <= src < nb and 0 <= dst < nb):
                self._fail(
                    Invariant.BLOCK,
                    who,
                    "copy names a block out of range",
                    f"0..{nb - 1}",
                    (src, dst),
                )
                raise _Stop
            for off in range(bs):
                v = self.memory.get(src * bs + off)
                if v is None:
                    self.memory.pop(dst * bs + off, None)
                else:
                    self.memory[dst * bs + off] = v
        written: set[int] = set()
        for p in range(start, end):
            idx = p // bs
            if idx >= len(table):
                self._fail(
                    Invariant.POS,
                    who,
                    f"position {p} lies beyond the returned block table",
                    f"< {len(table) * bs}",
                    p,
                )
                break
            b = table[idx]
            if not 0 <= b < nb:
                self._fail(
                    Invariant.BLOCK,
                    who,
                    "returned block table names a block out of range",
                    f"0..{nb - 1}",
                    b,
                )
                break
            self.memory[slot_of(b, p, bs)] = known[p]
            written.add(b)
        for b in sorted(written):
            if after.ref_cnt[b] > 1:
                self._fail(
                    Invariant.PREFIX,
                    who,
                    f"writes into block {b} shared by several requests",
                    "ref_cnt 1 (copy-on-write)",
                    after.ref_cnt[b],
                )
                break

    def _observe(
        self,
        before: PoolSnapshot,
        after: PoolSnapshot,
        table: tuple[int, ...],
        hit: int,
        copies: tuple[tuple[int, int], ...],
    ) -> None:
        c = self.coverage
        c["cow_copies"] += len(copies)
        if hit:
            c["cache_hits"] += 1
            c["cached_tokens"] += hit
            hits = table[: hit // self.bs]
            c["revived_hits"] += sum(
                1 for b in hits if 0 <= b < len(before.ref_cnt) and before.ref_cnt[b] == 0
            )
        lost = {e.key for e in before.cache_entries} - {e.key for e in after.cache_entries}
        c["evictions"] += len(lost)
        held = {b for t in before.tables for b in t.block_table}
        c["reused_blocks"] += sum(1 for b in set(table) - held if b in self.ever_held)
        self.ever_held.update(table)

    def _fork(self, parent: str, child: str) -> None:
        a, before = self.adapter, self.snap
        assert a is not None and before is not None
        self.trace.append({"op": self.step, "fork": parent, "child": child})
        try:
            self._call(f"fork({parent!r}, {child!r})", lambda: a.fork(parent, child), (NoSpace,))
        except NoSpace:
            self.checked.add(Invariant.ATOMIC)
            after = self._snapshot()
            self._record(
                self._checker(
                    "check_atomic_pool", lambda: check_atomic_pool(_canon(before), _canon(after))
                )
            )
            self._fail(
                Invariant.PROGRESS,
                f"request {parent}",
                "fork refused with NoSpace (a fork shares blocks and needs none)",
            )
            return
        self.coverage["forks"] += 1
        if self.stored[parent] % self.bs:
            self.coverage["forks_partial_block"] += 1
        self.stored[child] = self.stored[parent]
        # The child shares the KV; it samples its own future tokens from here on.
        self.known[child] = self.known[parent][: self.stored[parent]]
        self.cached[child] = self.cached[parent]
        self.freed.discard(child)
        after = self._snapshot()
        tp, tc = after.table(parent), after.table(child)
        if tp is not None and tc is not None and tc.block_table != tp.block_table:
            self._fail(
                Invariant.BLOCK,
                f"request {child}",
                "fork did not share the parent's blocks",
                _short(tp.block_table),
                _short(tc.block_table),
            )
        self._check_state(after)

    def _free(self, rid: str) -> None:
        a = self.adapter
        assert a is not None
        self.trace.append({"op": self.step, "free": rid})
        self._call(f"free({rid!r})", lambda: a.free(rid))
        self.coverage["frees"] += 1
        for d in (self.stored, self.known, self.cached):
            d.pop(rid, None)
        self.freed.add(rid)
        self._check_state(self._snapshot())

    # ------------------------------------------------------------------ state checks
    def _check_state(self, snap: PoolSnapshot) -> None:
        # Tables cover their KV length exactly at this level (no lookahead slots): the
        # suite, not a scheduler, decides how many tokens each call stores.
        self._record(self._checker("check_pool", lambda: check_pool(snap, lookahead=0)))
        self._check_tables(snap)
        self._read_back(snap)

    def _check_tables(self, snap: PoolSnapshot) -> None:
        """KVLEN: each table's KV length is the suite's; PREFIX: its token ids are the
        request's own; PROGRESS: freed requests hold nothing; POS: live ones a table."""
        tables: dict[str, TableSnapshot] = {}
        for one in snap.tables:
            if one.request_id in tables:
                self._fail(Invariant.BLOCK, f"request {one.request_id}", "has two block tables")
            tables.setdefault(one.request_id, one)
        for rid, held in sorted(tables.items()):
            if rid not in self.stored:
                why = "holds a block table after free" if rid in self.freed else "unknown request"
                self._fail(
                    Invariant.PROGRESS,
                    f"request {rid}",
                    why,
                    "no table",
                    f"{len(held.block_table)} blocks",
                )
        for rid, want in sorted(self.stored.items()):
            t = tables.get(rid)
            if t is None:
                self._fail(
                    Invariant.POS,
                    f"request {rid}",
                    "live request has no block table",
                    f"{blocks_needed(want, self.bs)} blocks",
                    "no table",
                )
                continue
            if t.num_stored != want:
                self._fail(
                    Invariant.KVLEN,
                    f"request {rid}",
                    "KV length differs from the tokens allocated to it (previous + hit + new)",
                    want,
                    t.num_stored,
                )
                continue
            truth = tuple(self.known[rid][:want])
            if t.token_ids != truth:
                self._fail(
                    Invariant.PREFIX,
                    f"request {rid}",
                    "stored token ids differ from the request's tokens",
                    _short(truth),
                    _short(t.token_ids),
                )

    def _read_back(self, snap: PoolSnapshot) -> None:
        """Every live request reads exactly its own tokens through its table (BLOCK: a
        block released or moved while still held; PREFIX: a shared or cache-hit block
        holding someone else's tokens)."""
        bs, nb = self.bs, snap.num_blocks
        holders: Counter[int] = Counter(b for t in snap.tables for b in set(t.block_table))
        done: set[str] = set()
        for t in snap.tables:
            rid = t.request_id
            if rid not in self.stored or rid in done:
                continue
            done.add(rid)
            toks = self.known[rid]
            for p in range(min(self.stored[rid], t.num_stored, len(t.block_table) * bs)):
                b = t.block_table[p // bs]
                if not 0 <= b < nb:
                    break  # BLOCK reports the id
                got = self.memory.get(slot_of(b, p, bs))
                if got == toks[p]:
                    continue
                if holders[b] > 1 or p < self.cached.get(rid, 0):
                    inv = Invariant.PREFIX
                    why = f"shared or cached block {b} holds another request's token"
                elif got is None:
                    inv = Invariant.BLOCK
                    why = f"block {b} never received this KV (moved without its copy?)"
                else:
                    inv, why = Invariant.BLOCK, f"block {b} was overwritten by another request"
                self._fail(
                    inv, f"request {rid}", f"KV read back at position {p}: {why}", toks[p], got
                )
                break


# ------------------------------------------------------------------------ replay/shrink
def _replay(factory: KVAdapterFactory, w: KVWorkload, timeout: float) -> _KVRun:
    run = _KVRun(factory, w.config, timeout)
    if run.start():
        for op in w.ops:
            run.apply(op)
            if run.dead:
                break
        run.drain()
    return run


def replay_kv(
    factory: KVAdapterFactory,
    workload: Mapping[str, Any] | str,
    *,
    call_timeout: float = DEFAULT_CALL_TIMEOUT,
) -> list[KVFinding]:
    """Run one workload (``{"kv_config": {...}, "ops": [...]}``, a dict or its JSON text,
    as in a failure's ``workload``) on a fresh adapter; the findings (empty: it passes).

    Raises ``ValueError`` on a malformed workload and :class:`NotSupported` when the
    adapter does not take the configuration.
    """
    run = _replay(factory, KVWorkload.from_json(workload), call_timeout)
    if run.not_supported:
        raise NotSupported(run.not_supported)
    return list(run.findings)


def _simpler_ops(op: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """Smaller versions of one op: shorter token lists, smaller counts, fewer distinct ids."""
    o = dict(op)
    n = int(o.get("n", 1))
    prompt, append = list(o.get("prompt", ())), list(o.get("append", ()))
    if len(prompt) > 1:
        yield {**o, "prompt": prompt[:-1], "n": min(n, len(prompt) - 1)}
        yield {**o, "prompt": prompt[1:], "n": min(n, len(prompt) - 1)}
    if append:
        yield {**o, "append": append[:-1]}
    if n > 1:
        yield {**o, "n": 1}
        yield {**o, "n": n - 1}
    for key, toks in (("prompt", prompt), ("append", append)):
        for i, t in enumerate(toks):
            if t != 0:
                yield {**o, key: [*toks[:i], 0, *toks[i + 1 :]]}


def _smaller_configs(c: KVConfig, features: frozenset[KVFeature]) -> Iterator[KVConfig]:
    # Smallest first: a small pool makes the op drops that follow succeed more often.
    for nb in sorted({1, c.num_blocks // 2, c.num_blocks - 1}):
        if 1 <= nb < c.num_blocks:
            yield replace(c, num_blocks=nb)
    for bs in sorted({1, c.block_size - 1}):
        if 1 <= bs < c.block_size:
            yield replace(c, block_size=bs)
    if c.enable_prefix_caching and KVFeature.PREFIX_CACHING_OPTIONAL in features:
        yield replace(c, enable_prefix_caching=False)


def _find(run: _KVRun, sig: str) -> KVFinding | None:
    return next((f for f in run.findings if f.signature == sig), None)


class _Shrinker:
    """Greedy delta debugging under a replay budget; keeps the exact signature."""

    def __init__(
        self,
        factory: KVAdapterFactory,
        sig: str,
        features: frozenset[KVFeature],
        timeout: float,
        max_runs: int,
    ) -> None:
        self.factory, self.sig, self.features = factory, sig, features
        self.timeout, self.max_runs = timeout, max_runs
        self.runs = 0
        self.best = KVWorkload(KVConfig(1, 1))
        self.best_run: _KVRun | None = None

    @property
    def spent(self) -> bool:
        return self.runs >= self.max_runs

    def attempt(self, cand: KVWorkload) -> bool:
        if self.spent:
            return False
        self.runs += 1
        r = _replay(self.factory, cand, self.timeout)
        f = _find(r, self.sig)
        if f is not None:
            self.best, self.best_run = r.workload(f.step), r
            return True
        if any(x.timed_out for x in r.findings):
            self.runs = self.max_runs  # each further try could hang for a whole time limit
        return False

    def drop_chunks(self) -> bool:
        changed = False
        size = len(self.best.ops) // 2
        while size >= 1 and not self.spent:
            i = len(self.best.ops) - size
            while i >= 0 and not self.spent:
                ops = self.best.ops
                if self.attempt(replace(self.best, ops=ops[:i] + ops[i + size :])):
                    changed = True
                i = min(i - size, len(self.best.ops) - size)
            size //= 2
        return changed

    def simplify_ops(self) -> bool:
        changed = False
        i = 0
        while i < len(self.best.ops) and not self.spent:
            ops = self.best.ops
            for new in _simpler_ops(ops[i]):
                if self.attempt(replace(self.best, ops=(*ops[:i], new, *ops[i + 1 :]))):
                    changed = True
                    break  # the same op again, from its new form
            else:
                i += 1
        return changed

    def drop_with_pool(self) -> bool:
        """Drop one op *and* shrink the pool: with a FIFO free queue a bug may need the
        n-th handed-out block, so neither change alone keeps it (both together may)."""
        i = len(self.best.ops) - 1
        while i >= 0 and not self.spent:
            ops, c = self.best.ops, self.best.config
            for k in (1, 2, 3):
                if c.num_blocks - k < 1:
                    break
                cand = KVWorkload(replace(c, num_blocks=c.num_blocks - k), ops[:i] + ops[i + 1 :])
                if self.attempt(cand):
                    return True
            i -= 1
        return False

    def shrink_config(self) -> bool:
        for c in _smaller_configs(self.best.config, self.features):
            if self.attempt(replace(self.best, config=c)):
                return True
        return False


def shrink_kv(
    factory: KVAdapterFactory,
    w: KVWorkload,
    sig: str,
    *,
    features: frozenset[KVFeature],
    call_timeout: float = DEFAULT_CALL_TIMEOUT,
    max_runs: int = MAX_SHRINK_RUNS,
) -> tuple[KVWorkload, _KVRun]:
    """Greedy delta debugging: the smallest workload found that still produces a finding
    with exactly ``sig``, in passes (drop op chunks from the end, halves first; shrink
    each op's tokens and count; shrink the pool, the block size, switch caching off;
    when those stall, drop an op and shrink the pool together) until a pass changes
    nothing or ``max_runs`` replays are spent. A candidate that
    times out ends the search: each further try of a hanging adapter would cost a whole
    time limit."""
    first = _replay(factory, w, call_timeout)
    if _find(first, sig) is None:
        return w, first  # not reproducible (a nondeterministic adapter): keep it as found
    s = _Shrinker(factory, sig, features, call_timeout, max_runs)
    s.best, s.best_run = w, first
    changed = True
    while changed and not s.spent:
        changed = s.drop_chunks()
        changed = s.simplify_ops() or changed
        changed = s.shrink_config() or changed
        changed = changed or s.drop_with_pool()
    assert s.best_run is not None
    return s.best, s.best_run


# ---------------------------------------------------------------------------- search
@dataclass(frozen=True)
class Found:
    """The first workload (cut after the failing op) showing one finding signature."""

    workload: KVWorkload
    finding: KVFinding
    trace: tuple[dict[str, Any], ...]


@dataclass
class KVSearchOutcome:
    examples: int = 0
    coverage: Counter[str] = field(default_factory=Counter)
    checked: set[Invariant] = field(default_factory=set)
    found: dict[str, Found] = field(default_factory=dict)
    """Per finding signature, in the order found."""
    not_supported: str = ""
    stopped: str = ""
    """Why the search ended before ``max_examples`` (a call that timed out)."""

    def absorb(self, run: _KVRun) -> None:
        self.examples += 1
        self.coverage.update(run.coverage)
        self.checked |= run.checked
        for f in run.findings:
            if f.signature not in self.found:
                self.found[f.signature] = Found(run.workload(f.step), f, tuple(run.trace))
            if f.timed_out and not self.stopped:
                self.stopped = f"an adapter call timed out: {f.violation.message}"


def _configs(features: frozenset[KVFeature]) -> st.SearchStrategy[KVConfig]:
    if KVFeature.PREFIX_CACHING_OPTIONAL in features:
        caching: st.SearchStrategy[bool] = st.sampled_from([True, True, True, False])
    else:
        caching = st.just(KVFeature.PREFIX_CACHING in features)
    return st.builds(KVConfig, st.integers(1, 12), st.integers(1, 4), caching)


class _Gen:
    """Draws the next op from the run's live state: shared prefixes so hits happen,
    chunk sizes that often leave exactly the uncacheable tail to compute."""

    def __init__(self, data: st.DataObject, run: _KVRun) -> None:
        self.data = data
        self.run = run
        self.history: list[list[int]] = []
        self.next_id = 0

    def _rid(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def _remember(self, tokens: list[int]) -> None:
        self.history.append(list(tokens))
        del self.history[:-8]

    def _prompt(self) -> list[int]:
        d, bs = self.data, self.run.bs
        tail = d.draw(st.lists(_ALPHABET, max_size=bs + 2), label="tail")
        prompt = tail
        if self.history and d.draw(st.sampled_from([True, True, True, False]), label="reuse"):
            base = d.draw(st.sampled_from(self.history), label="base")
            k = d.draw(st.sampled_from([len(base), len(base), 0, *range(len(base))]), label="k")
            prompt = base[:k] + tail
        cap = self.run.config.num_blocks * bs + bs  # now and then more than the pool holds
        return prompt[:cap] or [d.draw(_ALPHABET, label="first")]

    def op(self) -> dict[str, Any]:
        d, run = self.data, self.run
        live = sorted(run.stored)
        kinds = ["new"] * 3 + ["grow"] * 4 + ["free"] * 2
        if KVFeature.FORK in run.features:
            kinds += ["fork"] * 2
        kind = d.draw(st.sampled_from(kinds), label="op") if live else "new"
        if kind == "new":
            prompt = self._prompt()
            self._remember(prompt)
            tail = len(prompt) - max_cacheable_tokens(len(prompt), run.bs)
            n = d.draw(st.sampled_from([tail, tail, 0]), label="n")
            n = n or d.draw(st.integers(1, len(prompt)), label="n_any")
            return {"op": "new", "rid": self._rid(), "prompt": prompt, "n": n}
        rid = d.draw(st.sampled_from(live), label="rid")
        if kind == "fork":
            return {"op": "fork", "parent": rid, "child": self._rid()}
        if kind == "free":
            return {"op": "free", "rid": rid}
        rem = len(run.known[rid]) - run.stored[rid]
        append: list[int] = []
        if rem == 0 or d.draw(st.booleans(), label="decode"):
            k = d.draw(st.integers(1, run.bs + 1), label="k")
            append = d.draw(st.lists(_ALPHABET, min_size=k, max_size=k), label="append")
        n = d.draw(st.integers(1, rem + len(append)), label="n")
        self._remember(run.known[rid] + append)
        return {"op": "grow", "rid": rid, "append": append, "n": n}


def search_kv(
    factory: KVAdapterFactory,
    features: frozenset[KVFeature],
    *,
    max_examples: int = 100,
    call_timeout: float = DEFAULT_CALL_TIMEOUT,
) -> KVSearchOutcome:
    """``max_examples`` generated examples (derandomized), never stopping at a failure;
    a timed-out call ends the search (every later example would hang as well)."""
    out = KVSearchOutcome()
    first_reason: list[str] = []

    @settings(
        max_examples=max_examples,
        database=None,
        deadline=None,
        derandomize=True,
        phases=(Phase.generate,),
        suppress_health_check=list(HealthCheck),
        verbosity=Verbosity.quiet,
    )
    @given(st.data())
    def prop(data: st.DataObject) -> None:
        if out.stopped:
            raise _SearchStopped
        run = _KVRun(factory, data.draw(_configs(features), label="kv_config"), call_timeout)
        if not run.start():
            if run.not_supported:
                out.coverage["configs_not_supported"] += 1
                first_reason[:] = first_reason or [run.not_supported]
                return
        else:
            gen = _Gen(data, run)
            for _ in range(data.draw(st.integers(1, MAX_OPS), label="num_ops")):
                run.apply(gen.op())
                if run.dead:
                    break
            run.drain()
        out.absorb(run)
        if out.stopped:
            raise _SearchStopped

    try:
        prop()
    except _SearchStopped:
        pass
    except HypothesisException as e:
        # Hypothesis replays the example that raised _SearchStopped, which now stops
        # before drawing anything: that is ours, not a flaky strategy. Otherwise draws
        # follow the adapter's answers, so an adapter that answers identical calls
        # differently makes Hypothesis stop; what was found so far is still reported.
        if not out.stopped:
            out.stopped = f"the adapter is not deterministic ({type(e).__name__})"
    if out.examples == 0 and first_reason:
        out.not_supported = f"every configuration tried was refused ({first_reason[0]})"
    return out


# --------------------------------------------------------------------- fixed scenarios
def _new(rid: str, prompt: list[int], n: int) -> dict[str, Any]:
    return {"op": "new", "rid": rid, "prompt": prompt, "n": n}


def _grow(rid: str, append: list[int], n: int = 1) -> dict[str, Any]:
    return {"op": "grow", "rid": rid, "append": append, "n": n}


def _fork(parent: str, child: str) -> dict[str, Any]:
    return {"op": "fork", "parent": parent, "child": child}


def _free(rid: str) -> dict[str, Any]:
    return {"op": "free", "rid": rid}


def kv_scenarios() -> list[KVScenario]:
    """The fixed KV scenarios, run before the generated search."""
    return [
        KVScenario(
            "kv-fork-cow",
            "Block size 2: a 3-token prompt forked, then both sides decode into the shared "
            "partial block (copy-on-write), then a fork of a fork and an append after the "
            "other holder left (no copy needed any more).",
            KVWorkload(
                KVConfig(8, 2),
                (
                    _new("r1", [1, 2, 3], 3),
                    _fork("r1", "r2"),
                    _grow("r2", [4]),
                    _grow("r1", [5]),
                    _grow("r2", [6]),
                    _grow("r1", [7]),
                    _fork("r2", "r3"),
                    _free("r2"),
                    _grow("r3", [8]),
                    _fork("r1", "r4"),
                    _grow("r1", [9]),
                    _grow("r4", [0]),
                ),
            ),
            frozenset({KVFeature.FORK}),
            ("BLOCK", "PREFIX"),
        ),
        KVScenario(
            "kv-prefix-reuse",
            "Two requests share a 2-block prefix and are freed; an unrelated request takes "
            "every block (evicting the cached prefix); a third request with the old prefix "
            "must not hit the reused blocks (a stale cache entry reads back wrong tokens).",
            KVWorkload(
                KVConfig(4, 2),
                (
                    _new("r1", [1, 2, 3, 4, 5], 5),
                    _new("r2", [1, 2, 3, 4, 6], 1),
                    _free("r1"),
                    _free("r2"),
                    _new("r3", [7, 8, 7, 8, 7, 8, 7, 8], 8),
                    _free("r3"),
                    _new("r4", [1, 2, 3, 4, 5], 1),
                    _new("r5", [7, 8, 7, 8, 7], 1),
                ),
            ),
            frozenset({KVFeature.PREFIX_CACHING}),
            ("PREFIX", "BLOCK"),
        ),
        KVScenario(
            "kv-double-free",
            "Blocks shared by a parent and two forks are released once per holder: freeing "
            "one holder must not free a block the others still read (or free it twice).",
            KVWorkload(
                KVConfig(6, 2),
                (
                    _new("r1", [1, 2, 3, 4, 5], 5),
                    _fork("r1", "r2"),
                    _fork("r1", "r3"),
                    _free("r2"),
                    _grow("r1", [6]),
                    _free("r1"),
                    _new("r4", [9, 9, 9, 9, 9, 9], 6),
                    _free("r3"),
                    _free("r4"),
                    _new("r5", [5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5], 12),
                ),
            ),
            frozenset({KVFeature.FORK}),
            ("BLOCK", "PROGRESS"),
        ),
        KVScenario(
            "kv-no-space",
            "A full 3-block pool refuses a new request and a growing one (nothing may "
            "change), serves the new one once blocks are free (a refusal with room is "
            "CAP), refuses it 3 blocks with 2 free (grabbing those 2 before giving up is "
            "ATOMIC), then serves it 1.",
            KVWorkload(
                KVConfig(3, 2),
                (
                    _new("r1", [1, 2, 3, 4, 5], 5),
                    _new("r2", [6, 7], 2),
                    _grow("r1", [8]),
                    _grow("r1", [9]),
                    _free("r1"),
                    _new("r2", [6, 7], 2),
                    _grow("r2", [1, 2, 3, 4, 5], 5),
                    _grow("r2", [], 2),
                ),
            ),
            frozenset(),
            ("ATOMIC", "CAP"),
        ),
    ]


def kv_scenario_names() -> list[str]:
    return [s.name for s in kv_scenarios()] + [GENERATED_NAME]


# ---------------------------------------------------------------------------- results
def _note(inv: Invariant, features: frozenset[KVFeature]) -> str:
    if inv is not Invariant.PREFIX:
        return ""
    if KVFeature.PREFIX_CACHING not in features:
        return "partial: no prefix caching; sharing after fork and the KV read-back are checked"
    if KVFeature.CACHE_INDEX not in features:
        return (
            "partial: the adapter exposes no cache index in the spec hash chain; sharing, "
            "hit sizes and the KV read-back (stale hits) are checked"
        )
    return ""


def _results(
    name: str,
    factory: KVAdapterFactory,
    adapter_spec: str,
    checked: set[Invariant],
    found: Mapping[str, Found],
    features: frozenset[KVFeature],
    call_timeout: float,
    suppressed: int,
) -> list[Result]:
    """One Result per invariant checked or failed; each signature shrunk apart."""
    failures: dict[Invariant, list[Failure]] = {}
    for sig, first in found.items():
        best, f, trace = first.workload, first.finding, list(first.trace)
        if not f.timed_out:  # replaying a hang costs a whole time limit per try
            best, run = shrink_kv(factory, best, sig, features=features, call_timeout=call_timeout)
            f, trace = _find(run, sig) or f, run.trace
        v = f.violation
        workload = {"kv_adapter": adapter_spec, **best.to_json()}
        failures.setdefault(f.invariant, []).append(
            Failure(
                f.step,
                "kv",
                v.subject,
                v.message,
                v.expected,
                v.seen,
                workload,
                trace,
                signature=sig,
            )
        )
    results: list[Result] = []
    for inv in KV_INVARIANTS:
        fs = failures.get(inv, [])
        note = _note(inv, features)
        if fs:
            results.append(Result(name, str(inv), "fail", note, fs[0], tuple(fs[1:])))
        elif inv in checked:
            if suppressed and not note:
                note = "known findings suppressed by the baseline"
            results.append(Result(name, str(inv), "pass", note))
    return results


def _not_supported(
    name: str, description: str, kind: str, targets: tuple[str, ...], why: str
) -> tuple[list[Result], ScenarioInfo]:
    results = [Result(name, str(i), "not_supported", why) for i in KV_INVARIANTS]
    return results, ScenarioInfo(name, description, kind, targets, why)


def run_kv_fixed(
    factory: KVAdapterFactory,
    sc: KVScenario,
    features: frozenset[KVFeature] | None,
    *,
    adapter_spec: str = "",
    call_timeout: float = DEFAULT_CALL_TIMEOUT,
    known: frozenset[str] = frozenset(),
) -> tuple[list[Result], ScenarioInfo]:
    """One fixed scenario: its results (one per invariant checked) and its info. With
    ``features`` None (unreadable) it runs anyway, so the run reports that fault.
    Findings whose signature is in ``known`` (a baseline) are counted, not failed."""
    missing = sorted(str(f) for f in sc.needs - features) if features is not None else []
    if missing:
        why = f"needs KV feature(s) {', '.join(missing)}"
        return _not_supported(sc.name, sc.description, "fixed", sc.targets, why)
    run = _replay(factory, sc.workload, call_timeout)
    if run.not_supported:
        return _not_supported(sc.name, sc.description, "fixed", sc.targets, run.not_supported)
    found: dict[str, Found] = {}
    for f in run.findings:
        found.setdefault(f.signature, Found(run.workload(f.step), f, tuple(run.trace)))
    suppressed = len(found.keys() & known)
    fresh = {sig: x for sig, x in found.items() if sig not in known}
    results = _results(
        sc.name, factory, adapter_spec, run.checked, fresh, run.features, call_timeout, suppressed
    )
    observed: dict[str, Any] = {
        "ops": len(sc.workload.ops),
        "coverage": dict(sorted(run.coverage.items())),
    }
    if suppressed:
        observed["suppressed"] = suppressed
    return results, ScenarioInfo(sc.name, sc.description, "fixed", sc.targets, "", observed)


def run_kv_generated(
    factory: KVAdapterFactory,
    features: frozenset[KVFeature],
    *,
    adapter_spec: str = "",
    max_examples: int = 100,
    call_timeout: float = DEFAULT_CALL_TIMEOUT,
    known: frozenset[str] = frozenset(),
) -> tuple[list[Result], ScenarioInfo]:
    """The generated search: its results and its info (coverage counts in ``observed``).
    Findings whose signature is in ``known`` are counted, not failed or shrunk."""
    description = (
        "Hypothesis-generated op lists on pools of 1-12 blocks of 1-4 tokens: new requests "
        "with shared prefixes (cache hits), chunked and decode growth, forks, frees; "
        "every op checked, each distinct finding shrunk."
    )
    targets = tuple(str(i) for i in KV_INVARIANTS)
    out = search_kv(factory, features, max_examples=max_examples, call_timeout=call_timeout)
    if out.not_supported:
        return _not_supported(GENERATED_NAME, description, "generated", targets, out.not_supported)
    fresh = {sig: x for sig, x in out.found.items() if sig not in known}
    suppressed = len(out.found) - len(fresh)
    results = _results(
        GENERATED_NAME,
        factory,
        adapter_spec,
        out.checked,
        fresh,
        features,
        call_timeout,
        suppressed,
    )
    observed: dict[str, Any] = {
        "examples": out.examples,
        "coverage": dict(sorted(out.coverage.items())),
        "distinct_findings": len(fresh),
    }
    if suppressed:
        observed["suppressed"] = suppressed
    if out.stopped:
        observed["stopped"] = out.stopped
    return results, ScenarioInfo(GENERATED_NAME, description, "generated", targets, "", observed)


def probe_features(factory: KVAdapterFactory, call_timeout: float) -> frozenset[KVFeature] | None:
    """The adapter's declared features; None when it cannot say (each run then reports
    the fault itself as a PROGRESS finding)."""
    try:
        adapter = call("factory()", factory, call_timeout)
        raw = call("features", lambda: adapter.features, call_timeout)
        return as_features(raw)
    except (AdapterCallError, TypeError, ValueError):
        return None


def run_kv_suite(
    factory: KVAdapterFactory,
    adapter_spec: str,
    *,
    max_examples: int = 100,
    call_timeout: float = DEFAULT_CALL_TIMEOUT,
    names: Sequence[str] | None = None,
    known: frozenset[str] = frozenset(),
) -> list[tuple[list[Result], ScenarioInfo]]:
    """The KV level: every fixed scenario (:func:`kv_scenarios`), then ``kv-generated``.

    Returns one ``(results, info)`` pair per scenario, in run order (the fixed ones
    first): the results hold one :class:`Result` per invariant checked (or all
    ``not_supported``), to be appended with the info to a report's lists. ``names``
    selects scenarios (:func:`kv_scenario_names`; an unknown name is a ``ValueError``);
    findings whose signature is in ``known`` (a baseline report's) are counted in the
    info's ``observed["suppressed"]``, not failed.
    """
    wanted = set(names) if names else None
    if wanted is not None and wanted - set(kv_scenario_names()):
        raise ValueError(
            f"unknown KV scenarios: {', '.join(sorted(wanted - set(kv_scenario_names())))}"
        )
    probed = probe_features(factory, call_timeout)
    features = probed if probed is not None else frozenset()
    out: list[tuple[list[Result], ScenarioInfo]] = []
    for sc in kv_scenarios():
        if wanted is None or sc.name in wanted:
            out.append(
                run_kv_fixed(
                    factory,
                    sc,
                    probed,
                    adapter_spec=adapter_spec,
                    call_timeout=call_timeout,
                    known=known,
                )
            )
    if wanted is None or GENERATED_NAME in wanted:
        out.append(
            run_kv_generated(
                factory,
                features,
                adapter_spec=adapter_spec,
                max_examples=max_examples,
                call_timeout=call_timeout,
                known=known,
            )
        )
    return out


def load_kv_factory(spec: str) -> KVAdapterFactory:
    """Resolve ``MODULE:FACTORY`` (e.g. ``conformance.adapters.ref_kv:make_kv``)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"KV adapter must be MODULE:FACTORY, got {spec!r}")
    module = importlib.import_module(module_name)
    factory = getattr(module, attr, None)
    if factory is None or not callable(factory):
        raise ValueError(f"{module_name!r} has no callable {attr!r}")
    return cast(KVAdapterFactory, factory)
