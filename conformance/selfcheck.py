"""``refserve conformance --self-check``: walk one request through a new adapter and explain.

The full suite reports what an engine gets wrong as invariant violations over shrunk
workloads; an adapter that is still being written mostly gets the *protocol* wrong
instead (a list where a tuple belongs, a position off by one, a request that vanishes
from the snapshot when it finishes), and the suite's findings then point at the engine
when the adapter is at fault. The self-check is the first thing to run on a new adapter
(docs/ADAPTERS.md, "The self-check"): it builds the adapter, reads its name, features
and declared properties, configures one small engine, adds ONE request and steps it to
its end, and after every call says in plain words what is right and what is not,
field by field and step by step:

* every record is validated structurally (:mod:`conformance.validate`);
* the request's counters and status are compared with what the protocol implies after
  each step (waiting before its first chunk; prefilling mid-prompt; decoding with
  ``num_computed_tokens == num_tokens - 1`` once its chunk reached the end and sampled;
  finished, and still listed once, after the commit that sampled ``max_tokens``) --
  the KVLEN relations;
* the scheduled positions continue the KV already computed and each slot is
  ``block_table[pos // bs] * bs + pos % bs`` (POS); ``samples`` is set exactly when the
  chunk reaches the last known token (KVLEN);
* the table's ``num_stored`` equals ``num_computed_tokens``, ``token_ids`` are the
  tokens at those positions, and the table holds between ``ceil(num_stored / bs)`` and
  ``ceil((num_stored + lookahead_slots) / bs)`` blocks (POS, the declared lookahead);
* blocks are taken from the head of the free queue (BLOCK, unless the adapter declares
  ``free_queue_order=False``) and all are free again at the end (PROGRESS);
* ``has_unfinished()`` is true exactly while the request is live.

Every adapter call goes through :func:`conformance.guard.call`, so an exception or a
hang is explained (``schedule() raised KeyError: 'x' at engine.py:12``) instead of
ending the check. Exit status of :func:`self_check_main`: 0 when everything is right,
1 when something is wrong, 2 when the adapter cannot be loaded or built.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from conformance import validate
from conformance.adapter import (
    DEFAULT_PROPERTIES,
    ENGINE_ADAPTER_METHODS,
    AdapterFactory,
    CommitReport,
    EngineAdapter,
    EngineConfig,
    EngineProperties,
    Feature,
    NotSupported,
    RequestSpec,
    StepReport,
    load_factory,
    properties_of,
)
from conformance.guard import DEFAULT_CALL_TIMEOUT, AdapterCallError, call, describe
from spec.arith import blocks_needed, slot_of
from spec.snapshot import (
    EngineSnapshot,
    RequestSnapshot,
    RequestStatus,
    ScheduledRequest,
    TableSnapshot,
)

__all__ = ["CONFIG", "REQUEST", "SelfCheckResult", "self_check", "self_check_main"]

T = TypeVar("T")

CONFIG = EngineConfig(
    block_size=4,
    num_blocks=16,
    max_num_batched_tokens=16,
    max_num_seqs=4,
    enable_prefix_caching=True,
    eos_token_id=1,
)
"""The self-check's engine: small, and roomy enough that one request never has to wait,
be chunked or be preempted (every engine should accept it)."""

REQUEST = RequestSpec(
    request_id="A", prompt_token_ids=(11, 12, 13, 14, 15, 16), max_tokens=3, eos_token_id=1
)
"""The one request: a 6-token prompt (one full block and half of another at block size
4) and three outputs, so a table grows, a block fills and the request finishes by
length. The sampled tokens are 2, 3, 4, ... (never the eos id 1)."""

MAX_STEPS = 20
"""Steps after which a request that has not finished is a PROGRESS problem."""

PROTOCOL_METHODS = ENGINE_ADAPTER_METHODS


@dataclass(frozen=True)
class SelfCheckResult:
    """What the self-check found: ``ok`` when nothing is wrong; ``lines`` the report."""

    ok: bool
    lines: tuple[str, ...]
    built: bool = True
    """False when the factory could not build an adapter (exit status 2)."""

    @property
    def exit_code(self) -> int:
        """0 when ok, 1 when something is wrong, 2 when the adapter could not be built."""
        if not self.built:
            return 2
        return 0 if self.ok else 1

    def render(self) -> str:
        return "\n".join(self.lines)


class _Stop(Exception):
    """Nothing sensible can follow (a call failed, or the step left broken state)."""


@dataclass
class _Model:
    """What the protocol says A's state is (the self-check's own oracle, never read back
    from the adapter, so one wrong snapshot does not shift every later expectation)."""

    tokens: list[int]
    computed: int = 0
    outputs: int = 0
    finished: bool = False
    next_token: int = 2


def _span(xs: tuple[int, ...] | list[int]) -> str:
    if not xs:
        return "()"
    if len(xs) > 2 and list(xs) == list(range(xs[0], xs[0] + len(xs))):
        return f"{xs[0]}..{xs[-1]}"
    return ", ".join(str(x) for x in xs)


def _tup(xs: tuple[int, ...] | list[int]) -> str:
    return "(" + ", ".join(str(x) for x in xs) + ("," if len(xs) == 1 else "") + ")"


class _SelfCheck:
    def __init__(self, factory: AdapterFactory, timeout: float, label: str) -> None:
        self.factory = factory
        self.timeout = timeout
        self.label = label
        self.lines: list[str] = []
        self.problems: list[str] = []
        self.indent = ""
        self.built = False
        self.step_failed = False
        self.malformed_seen: set[str] = set()
        self.props: EngineProperties = DEFAULT_PROPERTIES
        self.name = "the adapter"
        self.model = _Model(list(REQUEST.prompt_token_ids))
        self.steps_run = 0
        self.before: EngineSnapshot | None = None
        self.where = ""  # the step a problem belongs to, for the verdict ("step 2: ")

    # ------------------------------------------------------------------ output
    def ok(self, msg: str) -> None:
        self.lines.append(f"{self.indent}ok: {msg}")

    def note(self, msg: str) -> None:
        self.lines.append(f"{self.indent}note: {msg}")

    def fail(self, msg: str) -> None:
        self.lines.append(f"{self.indent}FAIL: {msg}")
        self.problems.append(f"{self.where}{msg}")
        self.step_failed = True

    def failed_since(self, mark: int) -> bool:
        return len(self.problems) > mark

    # ------------------------------------------------------------------ guarded calls
    def call(self, what: str, fn: Callable[[], T]) -> T:
        """One adapter call through the guard; a raise or a hang is explained, then the
        check stops (the adapter's state is unknown after it)."""
        try:
            return call(what, fn, self.timeout)
        except AdapterCallError as e:
            self.fail(f"{e}{_hint(e, what)}")
            raise _Stop from None

    def shape(self, what: str, problems: list[str]) -> None:
        """Structural problems of a returned record, each explained once (the same
        malformed field in every snapshot is one problem, not one per step)."""
        for p in problems:
            if p in self.malformed_seen:
                continue
            self.malformed_seen.add(p)
            self.lines.append(f"{self.indent}FAIL: {what} returned a malformed record: {p}")
            self.problems.append(f"{self.where}{what}: {p}")

    def plan_shape(self, what: str, problems: list[str]) -> None:
        """A malformed step or commit report ends the check, as it ends a scenario of the
        suite: the tokens to sample and the step's effects cannot be read from it. (A
        malformed snapshot does not: later snapshots still say useful things.)"""
        self.shape(what, problems)
        if problems:
            self.note(f"stopped: the suite ends a scenario at a malformed {what} record too")
            raise _Stop

    def safely(self, what: str, fn: Callable[[], None]) -> None:
        """Run one group of semantic checks; a record too malformed to read is already
        explained by :meth:`shape`, so a failure here only notes what was skipped."""
        try:
            fn()
        except _Stop:
            raise
        except Exception as e:
            self.note(f"could not check {what}: {describe(e)} (see the malformed fields above)")
            self.step_failed = True

    # ------------------------------------------------------------------ the run
    def run(self) -> SelfCheckResult:
        try:
            adapter = self.build()
            self.identity(adapter)
            self.configure(adapter)
            self.add(adapter)
            self.walk(adapter)
        except _Stop:
            pass
        except Exception as e:  # a bug of the self-check itself must still end in a verdict
            self.fail(f"the self-check could not follow the adapter's records: {describe(e)}")
        self.indent = ""
        self.where = ""
        self.verdict()
        return SelfCheckResult(not self.problems, tuple(self.lines), self.built)

    def build(self) -> EngineAdapter:
        adapter = self.call("building the adapter: factory()", self.factory)
        self.built = True
        self.ok(f"built the adapter ({type(adapter).__name__})")
        return adapter

    def identity(self, adapter: EngineAdapter) -> None:
        # Looked up statically: reading the adapter's attributes must not run its code
        # outside the guard (a property that raises or hangs).
        missing = [
            m for m in PROTOCOL_METHODS if not callable(inspect.getattr_static(adapter, m, None))
        ]
        if missing:
            self.fail(
                f"the adapter has no method {', '.join(m + '()' for m in missing)}: every "
                "protocol method must exist (raise NotSupported in one the engine lacks, "
                "e.g. abort or rollback)"
            )
        else:
            self.ok("every protocol method is present")
        name = self.call("reading name", lambda: adapter.name)
        if isinstance(name, str) and name:
            self.name = name
            self.ok(f"name {name!r}")
            if "TODO" in name:
                self.note("the name still says TODO: reports show it (engine and version)")
        else:
            self.fail(f"name must be a non-empty str (engine and version), got {name!r}")
        feats = self.call("reading features", lambda: adapter.features)
        self.features(feats)
        try:
            props = call("reading properties", lambda: properties_of(adapter), self.timeout)
        except AdapterCallError as e:
            cause = e.__cause__
            if isinstance(cause, TypeError):
                self.fail(
                    f"properties: {cause}; declare `properties = EngineProperties(...)` "
                    "(conformance.adapter) or leave it out for the defaults. The self-check "
                    "goes on with the defaults"
                )
            else:
                self.fail(f"{e}{_hint(e, 'reading properties')}")
            props = DEFAULT_PROPERTIES
        else:
            declared = props is not DEFAULT_PROPERTIES  # what properties_of returns for none
            text = ", ".join(f"{k} {v}" for k, v in props.to_json().items())
            if declared:
                self.ok(f"properties: {text}")
            else:
                self.ok(f"properties: none declared, so the defaults apply ({text})")
        self.props = props

    def features(self, feats: object) -> None:
        if not isinstance(feats, (frozenset, set)):
            self.fail(
                f"features must be a frozenset of conformance.adapter.Feature, got "
                f"{type(feats).__name__}"
            )
            return
        known = {f.value for f in Feature}
        bad = sorted(repr(f) for f in feats if not (isinstance(f, str) and f in known))
        if bad:
            self.fail(
                f"features holds {', '.join(bad)}, not Feature members ({', '.join(sorted(known))})"
            )
        good = sorted(str(f) for f in feats if isinstance(f, str) and f in known)
        if good:
            self.ok(f"features: {', '.join(good)}")
        else:
            self.note(
                "features is empty: every scenario that needs chunked prefill, prefix "
                "caching, preemption, abort, ... will be reported not_supported"
            )

    def configure(self, adapter: EngineAdapter) -> None:
        c = CONFIG
        what = (
            f"configure(block size {c.block_size}, {c.num_blocks} blocks, budget "
            f"{c.max_num_batched_tokens} tokens, {c.max_num_seqs} seqs, prefix caching on, "
            f"eos {c.eos_token_id})"
        )
        self.call("configure()", lambda: adapter.configure(c))
        self.ok(what)

    def add(self, adapter: EngineAdapter) -> None:
        r = REQUEST
        what = (
            f"add_request({r.request_id!r}: prompt of {len(r.prompt_token_ids)} tokens, "
            f"max_tokens {r.max_tokens})"
        )
        self.call(f"add_request({r.request_id!r})", lambda: adapter.add_request(r))
        self.ok(what)
        self.unfinished(adapter, expected=True)
        snap = self.snapshot(adapter, "after add_request")
        self.before = snap
        self.safely("the pool", lambda: self.check_pool_shape(snap))
        self.safely("the waiting request", lambda: self.check_waiting(snap))

    # ------------------------------------------------------------------ steps
    def walk(self, adapter: EngineAdapter) -> None:
        quiet = 0
        for step in range(MAX_STEPS):
            self.indent = ""
            self.lines.append(f"step {step}:")
            self.where = f"step {step}: "
            self.indent = "  "
            self.step_failed = False
            self.steps_run = step + 1
            scheduled = self.step(adapter)
            quiet = 0 if scheduled else quiet + 1
            self.where = ""
            if self.model.finished:
                self.indent = ""
                self.ok(f"{REQUEST.request_id} finished after {step + 1} steps")
                return
            if self.step_failed:
                self.indent = ""
                self.note(f"stopped after step {step}: later steps would build on the above")
                return
            if quiet >= 3:
                self.indent = ""
                self.fail("stopped: three steps in a row scheduled nothing (PROGRESS)")
                return
        self.indent = ""
        self.fail(
            f"{REQUEST.request_id} did not finish within {MAX_STEPS} steps "
            f"({self.model.outputs} of max_tokens {REQUEST.max_tokens} outputs; PROGRESS)"
        )

    def step(self, adapter: EngineAdapter) -> bool:
        m = self.model
        rid = REQUEST.request_id
        before = self.before
        assert before is not None  # set by add()
        rep: object = self.call("schedule()", adapter.schedule)
        self.plan_shape("schedule()", validate.check_step_report(rep))
        assert isinstance(rep, StepReport)  # plan_shape stops otherwise
        entry = _entry_of(rep)
        mark = len(self.problems)
        self.safely("the step report", lambda: self.check_schedule(rep, before, entry))
        start = m.computed
        sampled: dict[str, int] = {}
        if entry is not None and entry.samples is True:
            sampled[rid] = m.next_token
        if entry is not None and not self.failed_since(mark):
            e = entry
            self.ok(
                f"schedule(): {rid} gets {e.num_new_tokens} "
                f"token{'s' if e.num_new_tokens != 1 else ''} at positions "
                f"{_span(e.positions)}, slots {_span(e.slot_mapping)} through block table "
                f"{_tup(e.block_table)}" + (", samples" if e.samples else ", no sample")
            )
        what = f"commit({sampled!r})"
        done: object = self.call(what, lambda: adapter.commit(sampled))
        self.plan_shape("commit()", validate.check_commit_report(done))
        assert isinstance(done, CommitReport)  # plan_shape stops otherwise
        if entry is not None:
            n = entry.num_new_tokens if isinstance(entry.num_new_tokens, int) else 0
            m.computed = start + n
        if sampled:
            m.tokens.append(m.next_token)
            m.outputs += 1
            m.next_token += 1
        self.safely("the finish", lambda: self.check_finish(rep, done, what))
        after = self.snapshot(adapter, "after commit")
        self.safely(
            "the snapshot after the step",
            lambda: self.check_after(after, entry, reached_end=bool(sampled)),
        )
        if m.finished:
            self.safely("the pool at the end", lambda: self.check_all_free(after))
        self.unfinished(adapter, expected=not m.finished)
        self.before = after
        return entry is not None

    def snapshot(self, adapter: EngineAdapter, when: str) -> EngineSnapshot:
        snap: object = self.call(f"snapshot() {when}", adapter.snapshot)
        self.shape("snapshot()", validate.check_engine_snapshot(snap))
        if not isinstance(snap, EngineSnapshot):
            raise _Stop
        return snap

    def unfinished(self, adapter: EngineAdapter, *, expected: bool) -> None:
        got: object = self.call("has_unfinished()", adapter.has_unfinished)
        if not isinstance(got, bool):
            self.fail(f"has_unfinished() must return a bool, got {type(got).__name__}")
        elif got != expected:
            why = (
                f"{REQUEST.request_id} is live"
                if expected
                else f"{REQUEST.request_id} finished and nothing else was added (a retired "
                "request left in a queue keeps the engine busy forever)"
            )
            self.fail(f"has_unfinished() is {got}, expected {expected}: {why}")
        else:
            self.ok(f"has_unfinished() is {got}")

    # ------------------------------------------------------------------ semantic checks
    def find(self, snap: EngineSnapshot) -> RequestSnapshot | None:
        for r in snap.requests:
            if getattr(r, "request_id", None) == REQUEST.request_id:
                return r
        return None

    def table(self, snap: EngineSnapshot) -> TableSnapshot | None:
        for t in snap.pool.tables:
            if getattr(t, "request_id", None) == REQUEST.request_id:
                return t
        return None

    def check_pool_shape(self, snap: EngineSnapshot) -> None:
        pool = snap.pool
        c = CONFIG
        if pool.num_blocks != c.num_blocks or pool.block_size != c.block_size:
            self.fail(
                f"snapshot.pool has {pool.num_blocks} blocks of block size {pool.block_size}, "
                f"but configure() asked for {c.num_blocks} blocks of {c.block_size}: report "
                "the pool the engine was configured with (num_blocks, block_size)"
            )
        else:
            self.ok(f"snapshot.pool ({pool.num_blocks} blocks, block size {pool.block_size})")
        held = [b for b, rc in enumerate(pool.ref_cnt) if rc != 0]
        missing = sorted(set(range(pool.num_blocks)) - set(pool.free_queue))
        if held or missing or pool.tables:
            self.fail(
                "a fresh engine with one waiting request holds no block: every ref_cnt is 0 "
                "and the free queue lists every block"
                + (f"; ref_cnt is non-zero for blocks {held}" if held else "")
                + (f"; the free queue lacks blocks {missing}" if missing else "")
                + (
                    f"; tables are listed for {[t.request_id for t in pool.tables]}"
                    if pool.tables
                    else ""
                )
            )
        else:
            self.ok(f"all {pool.num_blocks} blocks free, in the free queue")

    def check_waiting(self, snap: EngineSnapshot) -> None:
        rid = REQUEST.request_id
        r = self.find(snap)
        if r is None:
            self.fail(
                f"request {rid} is missing from the snapshot after add_request: a snapshot "
                "lists every live request, waiting ones included"
            )
            return
        mark = len(self.problems)
        if r.status != RequestStatus.WAITING:
            self.fail(
                f"{rid} is {r.status} before any schedule(); a request not yet scheduled "
                "is waiting (prefilling starts with its first chunk)"
            )
        self.counters(r, outputs=0, computed=0)
        if not self.failed_since(mark):
            self.ok(
                f"{rid} is listed: waiting, {r.num_prompt_tokens} prompt tokens, "
                f"num_computed_tokens 0, max_tokens {r.max_tokens}"
            )

    def counters(self, r: RequestSnapshot, *, outputs: int, computed: int) -> None:
        rid = REQUEST.request_id
        n_prompt = len(REQUEST.prompt_token_ids)
        if r.num_prompt_tokens != n_prompt:
            self.fail(
                f"{rid}.num_prompt_tokens is {r.num_prompt_tokens}, expected {n_prompt}: it "
                "counts the prompt only (outputs are num_output_tokens; num_tokens is both)"
            )
        if r.num_output_tokens != outputs:
            self.fail(
                f"{rid}.num_output_tokens is {r.num_output_tokens}, expected {outputs}: it "
                "counts the tokens sampled so far (one per commit that gave it a token)"
            )
        if r.num_computed_tokens != computed:
            hint = ""
            if r.num_computed_tokens == n_prompt + outputs and outputs:
                hint = "; it counts the last sampled token, whose K/V is written only next step"
            self.fail(
                f"{rid}.num_computed_tokens is {r.num_computed_tokens}, expected {computed}: it "
                "is the KV length, the tokens whose K/V the steps so far wrote (the prompt "
                "chunks, then one per decode)" + hint
            )
        if r.max_tokens != REQUEST.max_tokens:
            self.fail(
                f"{rid}.max_tokens is {r.max_tokens}, expected {REQUEST.max_tokens} "
                "(RequestSpec.max_tokens as given)"
            )

    def check_schedule(
        self, rep: StepReport, before: EngineSnapshot, entry: ScheduledRequest | None
    ) -> None:
        """A's entry of the step report, every field compared with the protocol."""
        retired = self.check_others(rep)
        if entry is None:
            if REQUEST.request_id not in retired:
                self.fail(
                    f"schedule() gave {REQUEST.request_id} nothing although it is runnable, "
                    f"alone, and the pool ({CONFIG.num_blocks} blocks) and budget "
                    f"({CONFIG.max_num_batched_tokens} tokens) have room (PROGRESS)"
                )
            return
        start = self.model.computed + entry.num_new_cached_tokens
        self.check_counts(entry, start)
        self.check_positions(entry, start)
        self.check_slots(entry)
        self.check_growth(entry.block_table, before)
        self.check_samples(entry, start)
        if self.props.free_queue_order:
            self.check_free_order(before, entry.block_table)

    def check_others(self, rep: StepReport) -> dict[str, str]:
        """Nothing but A is scheduled; A is neither preempted nor retired while planning.
        Returns the requests the plan retired, with their reasons."""
        rid = REQUEST.request_id
        for s in rep.scheduled:
            if s.request_id != rid:
                self.fail(f"schedule() scheduled {s.request_id!r}, a request that was never added")
        if rid in rep.preempted:
            self.fail(
                f"schedule() preempted {rid} although it is the only request and the pool "
                f"has {CONFIG.num_blocks} blocks: preempt only when the pool runs out"
            )
        retired = {str(f[0]): str(f[1]) for f in rep.finished}
        if rid in retired:
            self.fail(
                f"schedule() retired {rid} (reason {retired[rid]!r}) while planning, after "
                f"{self.model.outputs} of {REQUEST.max_tokens} outputs: nothing stops it yet"
            )
        return retired

    def check_counts(self, s: ScheduledRequest, start: int) -> None:
        """KVLEN: no cache hit in a fresh engine; at least one new token, no more than
        are known and left to compute, and within the budget."""
        n, known = s.num_new_tokens, len(self.model.tokens)
        if s.num_new_cached_tokens:
            self.fail(
                f"num_new_cached_tokens is {s.num_new_cached_tokens}, but nothing is cached in "
                "a fresh engine: it counts prompt tokens served from the prefix cache when "
                "this step admits the request"
            )
        if n < 1:
            self.fail(
                f"num_new_tokens is {n}: a request listed in StepReport.scheduled gets at "
                "least one token (leave out a request that gets none)"
            )
        elif start + n > known:
            self.fail(
                f"num_new_tokens is {n} but only {known - start} of {REQUEST.request_id}'s "
                f"{known} known tokens are left to compute (KV for positions "
                f"0..{start - 1} exists)"
            )
        if n > CONFIG.max_num_batched_tokens:
            self.fail(f"num_new_tokens {n} exceeds the budget {CONFIG.max_num_batched_tokens}")

    def check_positions(self, s: ScheduledRequest, start: int) -> None:
        """POS: the positions continue the KV already computed, contiguously."""
        expected = tuple(range(start, start + s.num_new_tokens))
        if s.positions == expected:
            return
        first = s.positions[0] if s.positions else None
        if first is not None and first == start + 1:
            hint = (
                "; off by one: a token's position is its index in prompt + outputs, "
                "from 0, and the first new token of a decode is the last sampled one, "
                "at num_tokens - 1"
            )
        elif first is not None and first != start:
            hint = f"; they must start at num_computed_tokens = {start}"
        else:
            hint = "; they must be contiguous"
        self.fail(
            f"positions are {_span(s.positions)}, expected {_span(expected)}: positions "
            f"continue from the KV already computed, {start} tokens{hint}"
        )

    def check_slots(self, s: ScheduledRequest) -> None:
        """POS: each slot is ``block_table[pos // bs] * bs + pos % bs``; the first wrong
        one is explained."""
        table, bs = s.block_table, CONFIG.block_size
        for i, (pos, slot) in enumerate(zip(s.positions, s.slot_mapping, strict=False)):
            if pos // bs >= len(table):
                self.fail(
                    f"position {pos} lies beyond the block table {_tup(table)} "
                    f"(covers positions 0..{len(table) * bs - 1}): the table sent with the "
                    "step must already hold the blocks this step writes"
                )
                return
            want = slot_of(table[pos // bs], pos, bs)
            if slot != want:
                hint = " (looks like the position itself)" if slot == pos and pos != want else ""
                self.fail(
                    f"slot_mapping[{i}] is {slot} for position {pos}; the slot of a position "
                    f"is block_table[pos // {bs}] * {bs} + pos % {bs} = "
                    f"{table[pos // bs]} * {bs} + {pos % bs} = {want}{hint}"
                )
                return

    def check_growth(self, table: tuple[int, ...], before: EngineSnapshot) -> None:
        """BLOCK: the step's table names pool blocks and extends the one held before."""
        out_of_pool = [b for b in table if b >= CONFIG.num_blocks]
        if out_of_pool:
            self.fail(f"block table {_tup(table)} names blocks {out_of_pool} outside the pool")
        held_before = self.table(before)
        if held_before is None:
            return
        prev = tuple(held_before.block_table)
        if tuple(table[: len(prev)]) != prev:
            self.fail(
                f"block table {_tup(table)} does not start with the table "
                f"{REQUEST.request_id} held before the step {_tup(prev)}: a request keeps "
                "its blocks in order and only appends"
            )

    def check_samples(self, s: ScheduledRequest, start: int) -> None:
        """KVLEN: ``samples`` is set exactly when the chunk reaches the last known token."""
        n, known = s.num_new_tokens, len(self.model.tokens)
        reaches_end = start + n == known
        if s.samples is reaches_end or not isinstance(s.samples, bool):
            return
        if reaches_end:
            self.fail(
                f"samples is False, but the chunk reaches the last known token "
                f"({start} + {n} == num_tokens {known}): the model samples after it"
            )
        else:
            self.fail(
                f"samples is True, but the chunk ends at position {start + n - 1}, short "
                f"of the last known token (position {known - 1}): a chunk that stops "
                "inside the prompt has no logit worth sampling"
            )

    def check_free_order(self, before: EngineSnapshot, table: tuple[int, ...]) -> None:
        held = self.table(before)
        already = set(held.block_table) if held is not None else set()
        new = [b for b in table if b not in already]
        head = list(before.pool.free_queue[: len(new)])
        if new and sorted(new) != sorted(head):
            self.fail(
                f"new blocks {new} were not taken from the head of the free queue "
                f"{_tup(before.pool.free_queue[: len(new) + 2])}...: the free queue lists free "
                "blocks in the order the engine hands them out (declare "
                "EngineProperties(free_queue_order=False) if its free list has no order)"
            )

    def check_finish(self, rep: StepReport, done: CommitReport, what: str) -> None:
        m = self.model
        rid = REQUEST.request_id
        reasons = {str(f[0]): str(f[1]) for f in (*rep.finished, *done.finished)}
        for other in sorted(set(reasons) - {rid}):
            self.fail(f"{what} reported {other!r} finished, a request that was never added")
        must = m.outputs >= REQUEST.max_tokens
        # The engine's word ends the request either way: later checks then ask whether it
        # is consistently over (listed finished, blocks freed), not for more of the same.
        m.finished = must or rid in reasons
        if must and rid not in reasons:
            self.fail(
                f"{what} did not report {rid} finished, although it sampled output "
                f"{m.outputs} of max_tokens {REQUEST.max_tokens}: return "
                f"CommitReport(finished=(({rid!r}, 'length'),))"
            )
            return
        if not must and rid in reasons:
            self.fail(
                f"{rid} was reported finished (reason {reasons[rid]!r}) after {m.outputs} of "
                f"max_tokens {REQUEST.max_tokens} outputs, without sampling eos"
            )
            return
        if must:
            if reasons[rid] != "length":
                self.fail(
                    f"{rid} finished with reason {reasons[rid]!r}; a request that reached "
                    "max_tokens finishes with 'length' ('stop' means eos or a stop token)"
                )
            else:
                self.ok(f"{what}: {rid} finished, reason 'length' (max_tokens reached)")
        else:
            self.ok(f"{what}: {rid} not finished ({m.outputs} of {REQUEST.max_tokens} outputs)")

    def check_after(
        self, snap: EngineSnapshot, entry: ScheduledRequest | None, *, reached_end: bool
    ) -> None:
        m = self.model
        rid = REQUEST.request_id
        mark = len(self.problems)
        for x in snap.requests:
            if getattr(x, "request_id", None) != rid:
                self.fail(f"the snapshot lists {x.request_id!r}, a request that was never added")
        r = self.find(snap)
        t = self.table(snap)
        if r is None:
            if m.finished:
                self.fail(
                    f"{rid} finished in this step but is missing from the snapshot after "
                    "commit(): a finished request stays listed, status finished, until the "
                    "next schedule() begins"
                )
            else:
                self.fail(
                    f"request {rid} is missing from the snapshot: a snapshot lists every live "
                    "request (plus those finished or aborted since the last schedule began)"
                )
            return
        if m.finished:
            self.check_finished(r, t, mark)
            return
        want, why = self.expected_status()
        if r.status != want:
            self.fail(f"{why}; the snapshot says {r.status}")
        self.counters(r, outputs=m.outputs, computed=m.computed)
        self.check_table(snap, r, t, entry)
        if not self.failed_since(mark):
            assert t is not None  # check_table failed otherwise
            kv = (
                f" == num_tokens {r.num_tokens} - 1"
                if want is RequestStatus.DECODING
                else f" of {r.num_tokens}"
            )
            self.ok(
                f"snapshot: {rid} {r.status}, num_computed_tokens {r.num_computed_tokens}{kv}"
                f"; table {_tup(t.block_table)} stores {t.num_stored} tokens"
            )

    def check_finished(self, r: RequestSnapshot, t: TableSnapshot | None, mark: int) -> None:
        """A request that finished in this step is listed finished, with all its outputs
        and no table (its blocks went back to the pool at once)."""
        rid, outputs = REQUEST.request_id, self.model.outputs
        if r.status != RequestStatus.FINISHED:
            self.fail(f"{rid} finished in this step but the snapshot says {r.status}")
        if r.num_output_tokens != outputs:
            self.fail(f"{rid}.num_output_tokens is {r.num_output_tokens}, expected {outputs}")
        if t is not None:
            self.fail(
                f"{rid} finished but still has a table {_tup(t.block_table)}: a finished "
                "request's blocks go back to the pool at once"
            )
        if not self.failed_since(mark):
            self.ok(f"snapshot: {rid} finished, {r.num_output_tokens} outputs, no table")

    def expected_status(self) -> tuple[RequestStatus, str]:
        """The status a live request has after this step (KVLEN: decoding exactly when
        ``num_computed_tokens == num_tokens - 1`` after a sample), and why."""
        m = self.model
        known = len(m.tokens)
        if m.computed == known - 1 and m.outputs:
            why = (
                "after a chunk that reached the end of the prompt and sampled, the request "
                "should be decoding"
                if m.outputs == 1
                else "after a decode step the request stays decoding"
            )
            why += f" with num_computed_tokens == num_tokens - 1 ({m.computed} == {known} - 1)"
            return RequestStatus.DECODING, why
        return RequestStatus.PREFILLING, (
            f"after a chunk that stopped inside the prompt ({m.computed} of {known} tokens "
            "computed) the request should be prefilling"
        )

    def check_table(
        self,
        snap: EngineSnapshot,
        r: RequestSnapshot,
        t: TableSnapshot | None,
        entry: ScheduledRequest | None,
    ) -> None:
        m = self.model
        rid = REQUEST.request_id
        bs = CONFIG.block_size
        if t is None:
            if r.num_computed_tokens > 0 or m.computed > 0:
                self.fail(
                    f"{rid} has KV ({m.computed} tokens) but snapshot.pool.tables has no "
                    "table for it: list one TableSnapshot per request holding blocks"
                )
            return
        if t.num_stored != r.num_computed_tokens:
            self.fail(
                f"the table's num_stored is {t.num_stored} but {rid}.num_computed_tokens is "
                f"{r.num_computed_tokens}: num_stored is the KV length the table holds, the "
                "same count"
            )
        want_tokens = tuple(m.tokens[: t.num_stored])
        if tuple(t.token_ids) != want_tokens:
            self.fail(
                f"the table's token_ids are {_tup(tuple(t.token_ids))}, expected "
                f"{_tup(want_tokens)}: the token ids whose K/V sits at positions "
                f"0..{t.num_stored - 1}, prompt then outputs"
            )
        need = blocks_needed(t.num_stored, bs)
        most = blocks_needed(t.num_stored + self.props.lookahead_slots, bs)
        held = len(t.block_table)
        if held < need:
            self.fail(
                f"the table holds {held} blocks, too few for num_stored {t.num_stored} "
                f"(ceil({t.num_stored} / {bs}) = {need})"
            )
        elif held > most:
            look = self.props.lookahead_slots
            self.fail(
                f"the table holds {held} blocks but num_stored {t.num_stored} needs {need} "
                f"(ceil({t.num_stored} / {bs})); a table may hold at most "
                f"ceil((num_stored + lookahead_slots) / block_size) = {most} with the declared "
                f"lookahead_slots {look}. An engine that reserves slots ahead (e.g. for the "
                "token it samples) declares EngineProperties(lookahead_slots=k)"
            )
        if entry is not None:
            k = min(need, len(entry.block_table))
            if tuple(t.block_table[:k]) != tuple(entry.block_table[:k]):
                self.fail(
                    f"the table after the step {_tup(t.block_table)} differs from the block "
                    f"table schedule() reported {_tup(entry.block_table)}: both are the same "
                    "request's table"
                )
        pool = snap.pool
        free = set(pool.free_queue)
        for b in t.block_table:
            if not 0 <= b < len(pool.ref_cnt):
                continue  # reported by validate
            if pool.ref_cnt[b] < 1:
                self.fail(
                    f"block {b} of {rid}'s table has ref_cnt {pool.ref_cnt[b]}: ref_cnt counts "
                    "the tables holding a block"
                )
            if b in free:
                self.fail(
                    f"block {b} of {rid}'s table is in the free queue: a held block is not free"
                )

    def check_all_free(self, snap: EngineSnapshot) -> None:
        pool = snap.pool
        held = [b for b, rc in enumerate(pool.ref_cnt) if rc != 0]
        missing = sorted(set(range(pool.num_blocks)) - set(pool.free_queue))
        mark = len(self.problems)
        if held:
            self.fail(
                f"blocks not freed at the end: ref_cnt is non-zero for blocks {held} after "
                "the only request finished (a leak: the pool shrinks with every request)"
            )
        if missing:
            self.fail(
                f"the free queue lacks blocks {missing} after the only request finished: a "
                "block no request holds is free, whether or not the prefix cache still "
                "indexes it (it is evictable)"
            )
        others = [x.request_id for x in pool.tables]
        if others:
            self.fail(f"tables are still listed for {others} after the only request finished")
        if not self.failed_since(mark):
            self.ok(f"all {pool.num_blocks} blocks free again (ref_cnt 0, in the free queue)")

    # ------------------------------------------------------------------ verdict
    def verdict(self) -> None:
        if not self.problems:
            target = self.label or "MODULE:FACTORY"
            self.lines.append(
                f"verdict: OK: {self.name} took one request through {self.steps_run} steps "
                f"as the protocol says; next, run the suite: refserve conformance --adapter "
                f"{target}"
            )
            return
        n = len(self.problems)
        self.lines.append(
            f"verdict: NOT OK: {n} problem{'s' if n > 1 else ''}, the first: "
            f"{self.problems[0]} (docs/ADAPTERS.md explains every record field)"
        )


def _entry_of(rep: StepReport) -> ScheduledRequest | None:
    """The request's entry in a validated report (each id is there at most once)."""
    for s in rep.scheduled:
        if s.request_id == REQUEST.request_id:
            return s
    return None


def _hint(e: AdapterCallError, what: str) -> str:
    """Why a failed call matters, in the terms an adapter author acts on."""
    cause = e.__cause__
    if e.timed_out:
        return (
            ": a call that never returns would stall the suite; it stops a call after "
            "--call-timeout seconds"
        )
    if isinstance(cause, NotImplementedError):
        return " (a method still to be written: the template's TODO)"
    if isinstance(cause, NotSupported):
        if what.startswith("configure"):
            return (
                ": the self-check's configuration is small and ordinary (no chunking, no "
                "preemption needed); every engine should accept it"
            )
        return (
            ": NotSupported answers a configuration or an optional feature (abort, "
            "rollback); this call must work"
        )
    return ""


def self_check(
    factory: AdapterFactory, *, call_timeout: float = DEFAULT_CALL_TIMEOUT, label: str = ""
) -> SelfCheckResult:
    """Build an adapter with ``factory`` and walk one request through the protocol,
    explaining every call's result (see the module docstring; docs/ADAPTERS.md, "The
    self-check"). Each adapter call may take ``call_timeout`` seconds (0: no limit).
    ``label`` (the ``MODULE:FACTORY`` string) is only used in the report's text. Never
    raises for anything the adapter does."""
    return _SelfCheck(factory, call_timeout, label).run()


def self_check_main(adapter_spec: str, call_timeout: float) -> int:
    """``refserve conformance --self-check --adapter MODULE:FACTORY``: print the report;
    return 0 when ok, 1 when something is wrong, 2 when the adapter cannot be loaded or
    built (the reason on stderr, as ``refserve conformance: error: ...``)."""
    try:
        factory = load_factory(adapter_spec)
    except Exception as e:  # ImportError, ValueError, or anything the module raises on import
        print(f"refserve conformance: error: {e}", file=sys.stderr)
        return 2
    result = self_check(factory, call_timeout=call_timeout, label=adapter_spec)
    if not result.built:
        why = next((x.split("FAIL: ", 1)[1] for x in result.lines if "FAIL: " in x), "")
        print(f"refserve conformance: error: cannot build the adapter: {why}", file=sys.stderr)
        return 2
    print(result.render())
    return result.exit_code
