"""The grouped KV level's driver: one grouped workload on one fresh
:class:`~refserve.conformance.kv.groups.GroupedKVAdapter`, every op checked
(:class:`GroupedKVRun`), and :func:`replay_grouped`.

The suite plays the scheduler and the model, as for a plain manager
(:mod:`refserve.conformance.kv.run`), with a fake KV memory per group. After each
allocation it writes each new token's id at its slot through each group's *returned*
table, and after every op it checks:

* BLOCK, POS, KVLEN (spec/groups.py, :func:`check_groups`): the pool's books over every
  group's tables, each table covering its KV length, a request in every group or none
  at one length (rule ``group-tables``), no null entry in a full group (``full-null``);
* window held (:func:`check_window_held`): right after a request's allocation from
  ``L`` stored tokens, its window tables hold every block covering ``[window_start(L, W),
  L + n)`` (``window-early``; ``prefix-complete`` inside a cache hit) and, only when
  the adapter declares feature ``window_eager_free``, none wholly before it
  (``window-late``); every other live request, after every op, still holds what its
  next query reads (from ``window_start`` of its KV length on);
* each group's tables against the suite's books (KV length, token ids; a freed request
  holds nothing), the returned tables equal to the snapshot's, and the read-back: in
  each group every live request reads its own tokens where that group's next query
  reads (all positions in a full group; from ``window_start`` on in a window group,
  never before it: those may be gone);
* a cache hit is whole blocks, on a first allocation, with caching on, and leaves the
  last known token to compute (PREFIX, KVLEN); a write lands only in a block its writer
  holds alone (PREFIX);
* NoSpace: ATOMIC (nothing changed, except the refused request's blocks past its window,
  which may go back either way) and CAP (a finding when the shared pool had room for
  every group's blocks together, counted without the hit);
* PROGRESS: after the drain nothing is held; an adapter call that raises (other than
  NoSpace), hangs or returns a malformed value is a finding naming the call.

An example stops at the first op with a finding.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from refserve.conformance.adapter import NotSupported
from refserve.conformance.guard import DEFAULT_CALL_TIMEOUT, AdapterCallError, call, describe
from refserve.conformance.kv.checks import Books, hit_violation
from refserve.conformance.kv.grouped_checks import (
    Memories,
    group_table_violations,
    grouped_read_back,
    grouped_room,
    refused_atomic,
)
from refserve.conformance.kv.grouped_workload import GroupedWorkload
from refserve.conformance.kv.groups import (
    GroupedKVAdapter,
    GroupedKVAdapterFactory,
    GroupedKVConfig,
)
from refserve.conformance.kv.protocol import KVFeature, NoSpace
from refserve.conformance.kv.run import KV_INVARIANTS
from refserve.conformance.kv.shape import (
    Malformed,
    as_features,
    normalize_grouped_allocation,
    normalize_grouped_snapshot,
    short,
)
from refserve.conformance.kv.workload import KVFinding
from refserve.spec.arith import slot_of
from refserve.spec.groups import (
    NULL_BLOCK,
    WINDOW_LATE,
    GroupedSnapshot,
    check_groups,
    check_window_held,
)
from refserve.spec.progress import check_quiescent
from refserve.spec.violation import Invariant, Violation, violation

T = TypeVar("T")

_ALWAYS = frozenset(KV_INVARIANTS) - {Invariant.ATOMIC}


class _Stop(Exception):
    """The run cannot go on: a fault was recorded as a finding."""


class GroupedKVRun:
    """One grouped workload on one fresh adapter, checked after every op."""

    def __init__(
        self, factory: GroupedKVAdapterFactory, config: GroupedKVConfig, timeout: float
    ) -> None:
        self.factory = factory
        self.config = config
        self.timeout = timeout
        self.bs = config.block_size
        self.adapter: GroupedKVAdapter | None = None
        self.features: frozenset[KVFeature] = frozenset()
        # The suite's truth: never read back from the manager.
        self.known: dict[str, list[int]] = {}
        self.stored: dict[str, int] = {}
        self.cached: dict[str, int] = {}
        self.freed: set[str] = set()
        self.memory: list[dict[int, int]] = [{} for _ in config.groups]
        self.snap: GroupedSnapshot | None = None
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

    @property
    def eager(self) -> bool:
        return KVFeature.WINDOW_EAGER_FREE in self.features

    def workload(self, upto: int | None = None) -> GroupedWorkload:
        """The ops run so far, up to and including op ``upto``."""
        ops = self.ops if upto is None else self.ops[: max(0, upto + 1)]
        return GroupedWorkload(self.config, tuple(ops))

    # ------------------------------------------------------------------ recording
    def _fail(self, inv: Invariant, subject: str, message: str, *, timed_out: bool = False) -> None:
        v = violation(inv, subject, message)
        self.findings.append(KVFinding(v, self.step, self.phase, timed_out))

    def _record(self, vs: Sequence[Violation]) -> None:
        self.findings.extend(KVFinding(v, self.step, self.phase) for v in vs)

    def _call(
        self, what: str, fn: Callable[[], T], passthrough: tuple[type[BaseException], ...] = ()
    ) -> T:
        """A guarded adapter call; a fault becomes a PROGRESS finding and ends the run."""
        try:
            return call(what, fn, self.timeout, (*passthrough, Malformed))
        except AdapterCallError as e:
            self._fail(Invariant.PROGRESS, "adapter", f"{what} {e.detail}", timed_out=e.timed_out)
            raise _Stop from None
        except Malformed as e:
            self._fail(Invariant.PROGRESS, "adapter", f"{what} returned a malformed value: {e}")
            raise _Stop from None

    def _checker(self, name: str, fn: Callable[[], list[Violation]]) -> list[Violation]:
        """A checker on adapter data; one that raises is a finding, not a crash."""
        try:
            return fn()
        except Exception as e:  # the data came from the adapter: anything may go wrong
            self._fail(
                Invariant.PROGRESS, "snapshot", f"{name} cannot read the snapshot: {describe(e)}"
            )
            return []

    def _snapshot(self) -> GroupedSnapshot:
        a = self.adapter
        assert a is not None
        snap = self._call("snapshot()", lambda: normalize_grouped_snapshot(a.snapshot()))
        c, pool = self.config, snap.pool
        wrong = ""
        if snap.groups != c.groups:
            wrong = f"snapshot groups {short(snap.groups)} differ from the configured ones"
        elif pool.num_blocks != c.num_blocks or pool.block_size != c.block_size:
            wrong = (
                f"snapshot pool of {pool.num_blocks} blocks of {pool.block_size} differs from "
                f"the configured {c.num_blocks} of {c.block_size}"
            )
        elif len(pool.ref_cnt) != pool.num_blocks:
            wrong = "ref_cnt length differs from num_blocks"
        if wrong:
            self._fail(Invariant.PROGRESS, "snapshot", wrong)
            raise _Stop
        self.snap = snap
        return snap

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> bool:
        """Build and configure a fresh adapter and check it is empty. False when the
        configuration is not supported (``not_supported`` says why) or on a finding."""
        try:
            adapter = self._call("factory()", self.factory)
            raw = self._call("features", lambda: adapter.features)
            try:
                self.features = as_features(raw)
            except (TypeError, ValueError) as e:
                self._fail(Invariant.PROGRESS, "adapter", f"features: {describe(e)}")
                raise _Stop from None
            self.adapter = adapter
            try:
                self._call("configure()", lambda: adapter.configure(self.config), (NotSupported,))
            except NotSupported as e:
                self.not_supported = f"configure: {e}"
                return False
            self.checked |= _ALWAYS
            snap = self._snapshot()
            self._record(check_quiescent(snap.as_pool()))
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
                self._record(check_quiescent(self.snap.as_pool()))
        except _Stop:
            pass
        self.dead = bool(self.findings)

    def _skip(self, why: str) -> None:
        self.trace.append({"op": self.step, "skipped": why})

    def _dispatch(self, op: Mapping[str, Any]) -> None:
        kind, rid = op["op"], str(op["rid"])
        if kind == "new":
            prompt = [int(t) for t in op["prompt"]]
            n = min(int(op["n"]), len(prompt))
            if rid in self.stored or n < 1:
                return self._skip(f"{rid} is live or the prompt is empty")
            return self._allocate(rid, prompt, n, first=True)
        if rid not in self.stored:
            return self._skip(f"{rid} is not live")
        if kind == "free":
            return self._free(rid)
        if kind != "grow":
            raise ValueError(f"unknown grouped op {kind!r}")
        self.known[rid].extend(int(t) for t in op["append"])
        n = min(int(op["n"]), len(self.known[rid]) - self.stored[rid])
        if n < 1:
            return self._skip(f"{rid} has no unstored token")
        return self._allocate(rid, list(self.known[rid]), n, first=False)

    # ------------------------------------------------------------------ operations
    def _allocate(self, rid: str, tokens: list[int], n: int, *, first: bool) -> None:
        a, before = self.adapter, self.snap
        assert a is not None and before is not None
        self.coverage["allocations"] += 1
        known = tuple(tokens)  # a copy: the manager must not see the suite's lists change
        entry: dict[str, Any] = {"op": self.step, "allocate": rid, "n": n, "known": len(known)}
        self.trace.append(entry)
        prev = 0 if first else self.stored[rid]
        try:
            alloc = self._call(
                f"allocate({rid!r}, n={n})",
                lambda: normalize_grouped_allocation(a.allocate(rid, known, n)),
                (NoSpace,),
            )
        except NoSpace:
            return self._refused(rid, n, first, before, entry)
        tables, hit = alloc.block_tables, alloc.num_cached_tokens
        if len(tables) != len(self.config.groups):
            self._fail(
                Invariant.PROGRESS,
                "adapter",
                f"allocate returned {len(tables)} tables for {len(self.config.groups)} groups",
            )
            raise _Stop
        wrong = hit_violation(
            rid, hit, n, len(known), first=first, caching=self.caching, bs=self.bs
        )
        if wrong is not None:
            self._record([wrong])
            raise _Stop
        start = prev + hit
        if first:
            self.known[rid], self.cached[rid] = list(known), hit
            self.freed.discard(rid)
        self.stored[rid] = start + n
        entry.update(cached=hit, block_tables=[list(t) for t in tables])
        after = self._snapshot()
        self._compare_tables(rid, tables, after)
        self._write(rid, known, tables, range(start, start + n), after)
        held = self._checker("check_window_held", lambda: check_window_held(after, rid, start, hit))
        self._record([v for v in held if self.eager or v.rule != WINDOW_LATE])
        self._observe(rid, hit, before, after)
        self._check_state(after, allocated=rid)

    def _compare_tables(
        self, rid: str, tables: tuple[tuple[int, ...], ...], after: GroupedSnapshot
    ) -> None:
        for g, table in enumerate(tables):
            t = after.table(rid, g)
            if t is not None and t.block_table != table:
                self._record([violation(
                    Invariant.POS,
                    f"request {rid}",
                    f"group {g}: returned block table differs from the snapshot's",
                    short(t.block_table),
                    short(table),
                )])  # fmt: skip

    def _write(
        self,
        rid: str,
        known: tuple[int, ...],
        tables: tuple[tuple[int, ...], ...],
        span: range,
        after: GroupedSnapshot,
    ) -> None:
        """Each new position's token at its slot through each group's returned table. A
        null entry is left to the rules that name it (window-early, full-null)."""
        nb, bs, who = after.pool.num_blocks, self.bs, f"request {rid}"
        out: list[Violation] = []
        for g, table in enumerate(tables):
            written: set[int] = set()
            for p in span:
                b = table[p // bs] if p // bs < len(table) else None
                if b is None or (b != NULL_BLOCK and not 0 <= b < nb):
                    out.append(violation(
                        Invariant.POS if b is None else Invariant.BLOCK,
                        who,
                        f"group {g}: position {p} has no block in range in the returned table",
                        f"a block in 0..{nb - 1}",
                        "none" if b is None else b,
                    ))  # fmt: skip
                    break
                if b != NULL_BLOCK:
                    self.memory[g][slot_of(b, p, bs)] = known[p]
                    written.add(b)
            shared = sorted(b for b in written if after.pool.ref_cnt[b] > 1)
            if shared:
                out.append(violation(
                    Invariant.PREFIX,
                    who,
                    f"group {g}: writes into block {shared[0]} shared by several tables",
                    "ref_cnt 1",
                    after.pool.ref_cnt[shared[0]],
                ))  # fmt: skip
        self._record(out)

    def _refused(
        self, rid: str, n: int, first: bool, before: GroupedSnapshot, entry: dict[str, Any]
    ) -> None:
        """NoSpace: ATOMIC (nothing changed but what may) and CAP (no room really)."""
        self.coverage["no_space"] += 1
        self.checked.add(Invariant.ATOMIC)
        prev = 0 if first else self.stored[rid]
        after = self._snapshot()
        self._record(self._checker("atomic", lambda: refused_atomic(before, after, rid, prev)))
        r = grouped_room(before, rid, prev, n, first=first)
        entry.update(no_space=True, needs=r.need, free=r.free)
        if r.need <= r.free:
            self._record([violation(
                Invariant.CAP,
                f"request {rid}",
                "allocation refused (NoSpace) while the shared pool had room for every group",
                f"served ({r.need} blocks needed over all groups)",
                f"NoSpace with {r.free} blocks free or freeable",
            )])  # fmt: skip
        self._check_state(after)

    def _observe(self, rid: str, hit: int, before: GroupedSnapshot, after: GroupedSnapshot) -> None:
        c = self.coverage
        if hit:
            c["cache_hits"] += 1
            c["cached_tokens"] += hit
        for g in range(len(self.config.groups)):
            t0, t1 = before.table(rid, g), after.table(rid, g)
            was = t0.block_table.count(NULL_BLOCK) if t0 is not None else 0
            now = t1.block_table.count(NULL_BLOCK) if t1 is not None else 0
            c["window_released"] += max(0, now - was)
        lost = {e.key for e in before.pool.cache_entries} - {
            e.key for e in after.pool.cache_entries
        }
        c["evictions"] += len(lost)

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
    def _check_state(self, snap: GroupedSnapshot, allocated: str = "") -> None:
        self._record(self._checker("check_groups", lambda: check_groups(snap)))
        books = Books(self.known, self.stored, self.cached, self.freed, {}, self.bs)
        self._record(group_table_violations(snap, books))
        others = [rid for rid in sorted(self.stored) if rid != allocated]
        # The allocated request was checked from where its allocation started, above;
        # the others still hold what their next query reads.
        held = self._checker(
            "check_window_held",
            lambda: [v for r in others for v in check_window_held(snap, r, self.stored[r])],
        )
        self._record([v for v in held if v.rule != WINDOW_LATE])
        memories = Memories(self.memory, self.known, self.stored, self.cached)
        self._record(self._checker("read-back", lambda: grouped_read_back(snap, memories)))


def find_signature(run: GroupedKVRun, sig: str) -> KVFinding | None:
    """The run's first finding with signature ``sig``."""
    return next((f for f in run.findings if f.signature == sig), None)


def replay_grouped_workload(
    factory: GroupedKVAdapterFactory, w: GroupedWorkload, timeout: float
) -> GroupedKVRun:
    run = GroupedKVRun(factory, w.config, timeout)
    if run.start():
        for op in w.ops:
            run.apply(op)
            if run.dead:
                break
        run.drain()
    return run


def replay_grouped(
    factory: GroupedKVAdapterFactory,
    workload: Mapping[str, Any] | str,
    *,
    call_timeout: float = DEFAULT_CALL_TIMEOUT,
) -> list[KVFinding]:
    """Run one grouped workload (``{"grouped_kv_config": {...}, "ops": [...]}``, a dict
    or its JSON text) on a fresh adapter; the findings (empty: it passes). Raises
    ``ValueError`` on a malformed workload and :class:`NotSupported` when the adapter
    does not take the configuration."""
    run = replay_grouped_workload(factory, GroupedWorkload.from_json(workload), call_timeout)
    if run.not_supported:
        raise NotSupported(run.not_supported)
    return list(run.findings)
