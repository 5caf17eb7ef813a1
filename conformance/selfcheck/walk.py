"""The walk itself: the adapter built, read and configured, the one request added and
stepped to its end, every call's result explained, then the verdict."""

from __future__ import annotations

import inspect
import sys

from refserve.conformance import validate
from refserve.conformance.adapter import (
    DEFAULT_PROPERTIES,
    AdapterFactory,
    CommitReport,
    EngineAdapter,
    Feature,
    StepReport,
    load_factory,
    properties_of,
)
from refserve.conformance.guard import DEFAULT_CALL_TIMEOUT, AdapterCallError, call, describe
from refserve.conformance.selfcheck.checks import ScheduleChecks, StateChecks
from refserve.conformance.selfcheck.explain import Report
from refserve.conformance.selfcheck.protocol import (
    CONFIG,
    MAX_STEPS,
    PROTOCOL_METHODS,
    REQUEST,
    ExpectedState,
    SelfCheckResult,
    WalkStopped,
    entry_of,
    hint,
    span_text,
    tuple_text,
)
from refserve.spec.snapshot import (
    EngineSnapshot,
)


class _SelfCheck:
    """One walk: build, identify, configure, add the request, step it to its end."""

    def __init__(self, factory: AdapterFactory, timeout: float, label: str) -> None:
        self.report = Report(timeout)
        self.model = ExpectedState(list(REQUEST.prompt_token_ids))
        self.schedule = ScheduleChecks(self.report, self.model)
        self.state = StateChecks(self.report, self.model)
        self.factory = factory
        self.label = label
        self.built = False
        self.name = "the adapter"
        self.steps_run = 0
        self.before: EngineSnapshot | None = None

    # ------------------------------------------------------------------ the run
    def run(self) -> SelfCheckResult:
        try:
            adapter = self.build()
            self.identity(adapter)
            self.configure(adapter)
            self.add(adapter)
            self.walk(adapter)
        except WalkStopped:
            pass
        except Exception as e:  # a bug of the self-check itself must still end in a verdict
            self.report.fail(
                f"the self-check could not follow the adapter's records: {describe(e)}"
            )
        self.report.indent = ""
        self.report.where = ""
        self.verdict()
        return SelfCheckResult(not self.report.problems, tuple(self.report.lines), self.built)

    def build(self) -> EngineAdapter:
        adapter = self.report.call("building the adapter: factory()", self.factory)
        self.built = True
        self.report.ok(f"built the adapter ({type(adapter).__name__})")
        return adapter

    def identity(self, adapter: EngineAdapter) -> None:
        # Looked up statically: reading the adapter's attributes must not run its code
        # outside the guard (a property that raises or hangs).
        missing = [
            m for m in PROTOCOL_METHODS if not callable(inspect.getattr_static(adapter, m, None))
        ]
        if missing:
            self.report.fail(
                f"the adapter has no method {', '.join(m + '()' for m in missing)}: every "
                "protocol method must exist (raise NotSupported in one the engine lacks, "
                "e.g. abort or rollback)"
            )
        else:
            self.report.ok("every protocol method is present")
        name = self.report.call("reading name", lambda: adapter.name)
        if isinstance(name, str) and name:
            self.name = name
            self.report.ok(f"name {name!r}")
            if "TODO" in name:
                self.report.note("the name still says TODO: reports show it (engine and version)")
        else:
            self.report.fail(f"name must be a non-empty str (engine and version), got {name!r}")
        feats = self.report.call("reading features", lambda: adapter.features)
        self.features(feats)
        try:
            props = call("reading properties", lambda: properties_of(adapter), self.report.timeout)
        except AdapterCallError as e:
            cause = e.__cause__
            if isinstance(cause, TypeError):
                self.report.fail(
                    f"properties: {cause}; declare `properties = EngineProperties(...)` "
                    "(refserve.conformance.adapter) or leave it out for the defaults. The "
                    "self-check goes on with the defaults"
                )
            else:
                self.report.fail(f"{e}{hint(e, 'reading properties')}")
            props = DEFAULT_PROPERTIES
        else:
            declared = props is not DEFAULT_PROPERTIES  # what properties_of returns for none
            text = ", ".join(f"{k} {v}" for k, v in props.to_json().items())
            if declared:
                self.report.ok(f"properties: {text}")
            else:
                self.report.ok(f"properties: none declared, so the defaults apply ({text})")
        self.schedule.props = self.state.props = props

    def features(self, feats: object) -> None:
        if not isinstance(feats, (frozenset, set)):
            self.report.fail(
                f"features must be a frozenset of refserve.conformance.adapter.Feature, got "
                f"{type(feats).__name__}"
            )
            return
        known = {f.value for f in Feature}
        bad = sorted(repr(f) for f in feats if not (isinstance(f, str) and f in known))
        if bad:
            self.report.fail(
                f"features holds {', '.join(bad)}, not Feature members ({', '.join(sorted(known))})"
            )
        good = sorted(str(f) for f in feats if isinstance(f, str) and f in known)
        if good:
            self.report.ok(f"features: {', '.join(good)}")
        else:
            self.report.note(
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
        self.report.call("configure()", lambda: adapter.configure(c))
        self.report.ok(what)

    def add(self, adapter: EngineAdapter) -> None:
        r = REQUEST
        what = (
            f"add_request({r.request_id!r}: prompt of {len(r.prompt_token_ids)} tokens, "
            f"max_tokens {r.max_tokens})"
        )
        self.report.call(f"add_request({r.request_id!r})", lambda: adapter.add_request(r))
        self.report.ok(what)
        self.unfinished(adapter, expected=True)
        snap = self.snapshot(adapter, "after add_request")
        self.before = snap
        self.report.safely("the pool", lambda: self.state.check_pool_shape(snap))
        self.report.safely("the waiting request", lambda: self.state.check_waiting(snap))

    # ------------------------------------------------------------------ steps
    def walk(self, adapter: EngineAdapter) -> None:
        quiet = 0
        for step in range(MAX_STEPS):
            self.report.indent = ""
            self.report.lines.append(f"step {step}:")
            self.report.where = f"step {step}: "
            self.report.indent = "  "
            self.report.step_failed = False
            self.steps_run = step + 1
            scheduled = self.step(adapter)
            quiet = 0 if scheduled else quiet + 1
            self.report.where = ""
            if self.model.finished:
                self.report.indent = ""
                self.report.ok(f"{REQUEST.request_id} finished after {step + 1} steps")
                return
            if self.report.step_failed:
                self.report.indent = ""
                self.report.note(f"stopped after step {step}: later steps would build on the above")
                return
            if quiet >= 3:
                self.report.indent = ""
                self.report.fail("stopped: three steps in a row scheduled nothing (PROGRESS)")
                return
        self.report.indent = ""
        self.report.fail(
            f"{REQUEST.request_id} did not finish within {MAX_STEPS} steps "
            f"({self.model.outputs} of max_tokens {REQUEST.max_tokens} outputs; PROGRESS)"
        )

    def step(self, adapter: EngineAdapter) -> bool:
        m = self.model
        rid = REQUEST.request_id
        before = self.before
        assert before is not None  # set by add()
        rep: object = self.report.call("schedule()", adapter.schedule)
        self.report.plan_shape("schedule()", validate.check_step_report(rep))
        assert isinstance(rep, StepReport)  # plan_shape stops otherwise
        entry = entry_of(rep)
        mark = len(self.report.problems)
        self.report.safely(
            "the step report", lambda: self.schedule.check_schedule(rep, before, entry)
        )
        start = m.computed
        sampled: dict[str, int] = {}
        if entry is not None and entry.samples is True:
            sampled[rid] = m.next_token
        if entry is not None and not self.report.failed_since(mark):
            e = entry
            self.report.ok(
                f"schedule(): {rid} gets {e.num_new_tokens} "
                f"token{'s' if e.num_new_tokens != 1 else ''} at positions "
                f"{span_text(e.positions)}, slots {span_text(e.slot_mapping)} through block table "
                f"{tuple_text(e.block_table)}" + (", samples" if e.samples else ", no sample")
            )
        what = f"commit({sampled!r})"
        done: object = self.report.call(what, lambda: adapter.commit(sampled))
        self.report.plan_shape("commit()", validate.check_commit_report(done))
        assert isinstance(done, CommitReport)  # plan_shape stops otherwise
        if entry is not None:
            n = entry.num_new_tokens if isinstance(entry.num_new_tokens, int) else 0
            m.computed = start + n
        if sampled:
            m.tokens.append(m.next_token)
            m.outputs += 1
            m.next_token += 1
        self.report.safely("the finish", lambda: self.state.check_finish(rep, done, what))
        after = self.snapshot(adapter, "after commit")
        self.report.safely(
            "the snapshot after the step",
            lambda: self.state.check_after(after, entry, reached_end=bool(sampled)),
        )
        if m.finished:
            self.report.safely("the pool at the end", lambda: self.state.check_all_free(after))
        self.unfinished(adapter, expected=not m.finished)
        self.before = after
        return entry is not None

    def snapshot(self, adapter: EngineAdapter, when: str) -> EngineSnapshot:
        snap: object = self.report.call(f"snapshot() {when}", adapter.snapshot)
        self.report.shape("snapshot()", validate.check_engine_snapshot(snap))
        if not isinstance(snap, EngineSnapshot):
            raise WalkStopped
        return snap

    def unfinished(self, adapter: EngineAdapter, *, expected: bool) -> None:
        got: object = self.report.call("has_unfinished()", adapter.has_unfinished)
        if not isinstance(got, bool):
            self.report.fail(f"has_unfinished() must return a bool, got {type(got).__name__}")
        elif got != expected:
            why = (
                f"{REQUEST.request_id} is live"
                if expected
                else f"{REQUEST.request_id} finished and nothing else was added (a retired "
                "request left in a queue keeps the engine busy forever)"
            )
            self.report.fail(f"has_unfinished() is {got}, expected {expected}: {why}")
        else:
            self.report.ok(f"has_unfinished() is {got}")

    # ------------------------------------------------------------------ verdict
    def verdict(self) -> None:
        if not self.report.problems:
            target = self.label or "MODULE:FACTORY"
            self.report.lines.append(
                f"verdict: OK: {self.name} took one request through {self.steps_run} steps "
                f"as the protocol says; next, run the suite: refserve conformance --adapter "
                f"{target}"
            )
            return
        n = len(self.report.problems)
        self.report.lines.append(
            f"verdict: NOT OK: {n} problem{'s' if n > 1 else ''}, the first: "
            f"{self.report.problems[0]} (docs/ADAPTERS.md explains every record field)"
        )


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
