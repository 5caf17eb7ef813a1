"""The KV level's driver: one workload on one fresh adapter, every op checked as the
module docstring of :mod:`refserve.conformance.kv.machine` lists (:class:`KVRun`), and
:func:`replay_kv`, which runs a workload as a failure's ``workload`` holds it.

The suite keeps the logical truth per request and a fake KV memory
(:mod:`refserve.conformance.kv.memory`): it performs the returned copies, then writes
each new position's token at its slot through the *returned* table, so a copy-on-write
done but not reported, or a block released while still held, shows on read-back.
"""

from __future__ import annotations

import contextlib
import copy
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from refserve.conformance.adapter import NotSupported
from refserve.conformance.guard import DEFAULT_CALL_TIMEOUT, AdapterCallError, call, describe
from refserve.conformance.kv.checks import (
    Books,
    hit_violation,
    read_back_violations,
    room,
    table_violations,
)
from refserve.conformance.kv.memory import FakeKVMemory
from refserve.conformance.kv.protocol import (
    KVAdapter,
    KVAdapterFactory,
    KVConfig,
    KVFeature,
    NoSpace,
)
from refserve.conformance.kv.shape import (
    Malformed,
    as_features,
    canonical,
    normalize_allocation,
    normalize_snapshot,
    short,
)
from refserve.conformance.kv.workload import KVFinding, KVWorkload, namespace_of
from refserve.spec.atomic import check_atomic_pool
from refserve.spec.checks import check_pool
from refserve.spec.hashing import DEFAULT_NAMESPACE, Namespace
from refserve.spec.progress import check_quiescent
from refserve.spec.snapshot import PoolSnapshot
from refserve.spec.violation import Invariant, Violation, violation

T = TypeVar("T")


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


class _Stop(Exception):
    """The run cannot go on: a fault was recorded as a finding."""


class KVRun:
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
        self.kv = FakeKVMemory(self.bs)
        # Feature key_domains: each live request's namespace (absent: the default one).
        self.namespaces: dict[str, Namespace] = {}
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

    def clone(self) -> KVRun:
        """An independent copy of this run, adapter included (deep-copied), for the
        exhaustive explorer's copy strategy (refserve.conformance.explore.kv). The suite's books
        are copied one level deep and the snapshots and ops are shared: they are never
        changed in place, and a generic deep copy of them costs more than the op."""
        new = copy.copy(self)
        new.adapter = copy.deepcopy(self.adapter)
        new.known = {rid: list(toks) for rid, toks in self.known.items()}
        new.stored, new.cached = dict(self.stored), dict(self.cached)
        new.kv = self.kv.clone()
        new.namespaces = dict(self.namespaces)
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
            return call(what, fn, self.timeout, (*passthrough, Malformed))
        except AdapterCallError as e:
            self._fail(Invariant.PROGRESS, "adapter", f"{what} {e.detail}", timed_out=e.timed_out)
            raise _Stop from None
        except Malformed as e:
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
        handlers: dict[str, Callable[[Mapping[str, Any]], None]] = {
            "new": self._op_new,
            "grow": self._op_grow,
            "fork": self._op_fork,
            "free": self._op_free,
        }
        kind = op["op"]
        if kind not in handlers:
            raise ValueError(f"unknown op {kind!r}")
        handlers[kind](op)

    def _op_new(self, op: Mapping[str, Any]) -> None:
        rid, prompt = str(op["rid"]), [int(t) for t in op["prompt"]]
        n = min(int(op["n"]), len(prompt))
        if rid in self.stored:
            return self._skip(f"{rid} is live")
        if n < 1:
            return self._skip("empty prompt")
        namespace = namespace_of(op)
        if KVFeature.KEY_DOMAINS in self.features:
            self._set_namespace(rid, namespace)
        elif namespace != DEFAULT_NAMESPACE:
            return self._skip("no key_domains feature")
        return self._allocate(rid, prompt, n, first=True, namespace=namespace)

    def _op_grow(self, op: Mapping[str, Any]) -> None:
        rid = str(op["rid"])
        if rid not in self.stored:
            return self._skip(f"{rid} is not live")
        self.known[rid].extend(int(t) for t in op["append"])
        n = min(int(op["n"]), len(self.known[rid]) - self.stored[rid])
        if n < 1:
            return self._skip(f"{rid} has no unstored token")
        return self._allocate(rid, list(self.known[rid]), n, first=False)

    def _op_fork(self, op: Mapping[str, Any]) -> None:
        parent, child = str(op["parent"]), str(op["child"])
        if KVFeature.FORK not in self.features:
            return self._skip("no fork feature")
        if parent not in self.stored or child in self.stored:
            return self._skip(f"{parent} is not live or {child} is")
        return self._fork(parent, child)

    def _op_free(self, op: Mapping[str, Any]) -> None:
        rid = str(op["rid"])
        if rid not in self.stored:
            return self._skip(f"{rid} is not live")
        return self._free(rid)

    # ------------------------------------------------------------------ operations
    def _set_namespace(self, rid: str, namespace: Namespace) -> None:
        # KVNamespaces.set_namespace, looked up by name: the run holds a KVAdapter.
        set_namespace = getattr(self.adapter, "set_namespace", None)
        if not callable(set_namespace):
            self._fail(
                Invariant.PROGRESS,
                "adapter",
                "declares feature key_domains but has no set_namespace()",
            )
            raise _Stop
        if namespace != DEFAULT_NAMESPACE:
            entry = {"op": self.step, "namespace": rid}
            entry.update(lora=namespace.adapter, cache_salt=namespace.cache_salt)
            self.trace.append(entry)
        self._call(f"set_namespace({rid!r})", lambda: set_namespace(rid, namespace))

    def _allocate(
        self,
        rid: str,
        tokens: list[int],
        n: int,
        *,
        first: bool,
        namespace: Namespace = DEFAULT_NAMESPACE,
    ) -> None:
        a, before = self.adapter, self.snap
        assert a is not None and before is not None
        self.coverage["allocations"] += 1
        known = tuple(tokens)  # a copy: the manager must not see the suite's lists change
        entry: dict[str, Any] = {"op": self.step, "allocate": rid, "n": n, "known": len(known)}
        self.trace.append(entry)
        try:
            alloc = self._call(
                f"allocate({rid!r}, n={n})",
                lambda: normalize_allocation(a.allocate(rid, known, n)),
                (NoSpace,),
            )
        except NoSpace:
            return self._refused(rid, n, first, before, entry)
        table, hit, copies = alloc.block_table, alloc.num_cached_tokens, alloc.copies
        prev = 0 if first else self.stored[rid]
        wrong = hit_violation(
            rid, hit, n, len(known), first=first, caching=self.caching, bs=self.bs
        )
        if wrong is not None:
            self._record([wrong])
            raise _Stop
        start, end = prev + hit, prev + hit + n
        if first:
            self.known[rid] = list(known)
            self.cached[rid] = hit
            self.namespaces[rid] = namespace
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
                short(t.block_table),
                short(table),
            )
        mine = self.namespaces.get(rid, DEFAULT_NAMESPACE)
        done = self.kv.execute(rid, known, table, copies, range(start, end), after, mine)
        self._record(done.violations)
        if done.stop:
            raise _Stop
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
                "check_atomic_pool", lambda: check_atomic_pool(canonical(before), canonical(after))
            )
        )
        r = room(before, rid, 0 if first else self.stored[rid], n, first=first, bs=self.bs)
        need, free = r.need, r.free
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
                    "check_atomic_pool",
                    lambda: check_atomic_pool(canonical(before), canonical(after)),
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
        if parent in self.namespaces:
            self.namespaces[child] = self.namespaces[parent]
        self.freed.discard(child)
        after = self._snapshot()
        tp, tc = after.table(parent), after.table(child)
        if tp is not None and tc is not None and tc.block_table != tp.block_table:
            self._fail(
                Invariant.BLOCK,
                f"request {child}",
                "fork did not share the parent's blocks",
                short(tp.block_table),
                short(tc.block_table),
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
        self.namespaces.pop(rid, None)
        self.freed.add(rid)
        self._check_state(self._snapshot())

    # ------------------------------------------------------------------ state checks
    def _check_state(self, snap: PoolSnapshot) -> None:
        # Tables cover their KV length exactly at this level (no lookahead slots): the
        # suite, not a scheduler, decides how many tokens each call stores.
        self._record(self._checker("check_pool", lambda: check_pool(snap, lookahead=0)))
        self._record(table_violations(snap, self._books()))
        self._record(read_back_violations(snap, self._books()))

    def _books(self) -> Books:
        return Books(
            self.known,
            self.stored,
            self.cached,
            self.freed,
            self.kv.slots,
            self.bs,
            self.namespaces,
            self.kv.writers,
        )


def find_signature(run: KVRun, sig: str) -> KVFinding | None:
    """The run's first finding with signature ``sig``."""
    return next((f for f in run.findings if f.signature == sig), None)


def replay_workload(factory: KVAdapterFactory, w: KVWorkload, timeout: float) -> KVRun:
    run = KVRun(factory, w.config, timeout)
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
    run = replay_workload(factory, KVWorkload.from_json(workload), call_timeout)
    if run.not_supported:
        raise NotSupported(run.not_supported)
    return list(run.findings)
