"""Hypothesis-generated workloads: random arrivals, shared prefixes, aborts, tiny pools.

:func:`workloads` draws a :class:`~refserve.conformance.workload.Workload` fitted to an engine's
features (no aborts for an engine without abort, whole sequences within the budget for
one without chunked prefill), so a generated failure is always a real one. :func:`search`
spends the whole example budget, collects every distinct finding signature and shrinks
each one apart (:mod:`refserve.conformance.shrink`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from hypothesis import HealthCheck, Phase, Verbosity, assume, given, settings
from hypothesis import strategies as st

from refserve.conformance.adapter import AdapterFactory, EngineConfig, Feature
from refserve.conformance.guard import DEFAULT_CALL_TIMEOUT
from refserve.conformance.runner import RunResult, adapter_traits, build, run_fresh
from refserve.conformance.shrink import distinct, shrink
from refserve.conformance.workload import EOS, MigrationPlan, RequestPlan, Workload
from refserve.spec.violation import Invariant

KINDS = ("mixed", "tiny-pool", "shared-prefix", "migration")


@dataclass(frozen=True)
class GeneratedScenario:
    name: str
    kind: str
    description: str
    requires: frozenset[Feature] = frozenset()
    """Features without which every example of this kind is not supported."""


GENERATED = (
    GeneratedScenario(
        "generated-mixed",
        "mixed",
        "Random arrivals, budgets from 1, 1-6 requests, aborts and forced stops at random "
        "points, prefix caching on and off.",
    ),
    GeneratedScenario(
        "generated-tiny-pool",
        "tiny-pool",
        "Pools of 1-5 blocks: admission, growth, preemption and recompute under pressure.",
    ),
    GeneratedScenario(
        "generated-shared-prefix",
        "shared-prefix",
        "Prompts drawn from two shared prefixes over a 3-token alphabet: cache hits, "
        "fully cached and block-aligned prompts, same-step sharing, eviction.",
    ),
    GeneratedScenario(
        "generated-migration",
        "migration",
        "The mixed workloads on two or three instances with their own block sizes, pools "
        "and budgets: moves at random boundaries (by transfer or recompute, some failing "
        "before the ack or aborted in transit), or disaggregated prefill/decode.",
        frozenset({Feature.MIGRATION}),
    ),
)


def workloads(features: frozenset[Feature], kind: str = "mixed") -> st.SearchStrategy[Workload]:
    """Workloads an engine with ``features`` can run (see module docstring)."""

    @st.composite
    def build(draw: st.DrawFn) -> Workload:
        bs = draw(st.integers(1, 4))
        lo_blocks = -(-2 // bs)  # every request needs room for >= 1 prompt + 1 output
        hi_blocks = 5 if kind == "tiny-pool" else 12
        blocks = draw(st.integers(lo_blocks, max(lo_blocks, hi_blocks)))
        capacity = blocks * bs
        alphabet = st.integers(2, 4) if kind == "shared-prefix" else st.integers(2, 9)
        prefixes = [
            tuple(draw(st.lists(alphabet, min_size=0, max_size=2 * bs + 2))) for _ in range(2)
        ]
        n = draw(st.integers(1, 6))
        reqs: list[RequestPlan] = []
        for i in range(n):
            reqs.append(_request(draw, f"r{i}", features, kind, capacity, alphabet, prefixes))
        need = max(len(r.prompt) + r.max_tokens for r in reqs)
        if Feature.CHUNKED_PREFILL in features:
            budget = draw(st.integers(1, 16))
        else:
            budget = draw(st.integers(need, need + 8))
        caching = draw(st.booleans()) if Feature.PREFIX_CACHING_OPTIONAL in features else True
        rollback_at: tuple[int, ...] = ()
        if Feature.ROLLBACK in features:
            rollback_at = tuple(sorted(draw(st.lists(st.integers(0, 20), max_size=2, unique=True))))
        cfg = EngineConfig(
            block_size=bs,
            num_blocks=blocks,
            max_num_batched_tokens=budget,
            max_num_seqs=draw(st.integers(1, 4)),
            enable_prefix_caching=caching,
            eos_token_id=EOS,
        )
        # An engine whose copies the suite decides gets drawn outcomes per copy and step
        # (complete, stay in flight, fail); a shrunk failure keeps its seed.
        seed = None
        if Feature.TRANSFER_FAULTS in features:
            seed = draw(st.none() | st.integers(0, 1 << 16))
        w = Workload(cfg, tuple(reqs), rollback_at=rollback_at, transfer_seed=seed)
        return draw(_moves(w, features)) if kind == "migration" else w

    return build()


def _request(
    draw: st.DrawFn,
    rid: str,
    features: frozenset[Feature],
    kind: str,
    capacity: int,
    alphabet: st.SearchStrategy[int],
    prefixes: list[tuple[int, ...]],
) -> RequestPlan:
    """One request of a generated workload: its prompt may start with one of the shared
    prefixes; it fits the pool's ``capacity`` with its outputs."""
    max_tokens = draw(st.integers(1, min(6, capacity - 1)))
    plen = draw(st.integers(1, min(14, capacity - max_tokens)))
    group = draw(st.integers(0, 2 if kind != "shared-prefix" else 1))
    head = prefixes[group] if group < 2 else ()
    tail = tuple(draw(st.lists(alphabet, min_size=plen, max_size=plen)))
    toks = (head + tail)[:plen]
    stop_at = draw(st.none() | st.integers(1, max_tokens))
    abort_at = draw(st.none() | st.integers(0, 12)) if Feature.ABORT in features else None
    prio = draw(st.integers(0, 2)) if Feature.PRIORITIES in features else 0
    arrival = draw(st.integers(0, 8))
    salt, lora = _domain(draw, features) if kind == "shared-prefix" else ("", "")
    return RequestPlan(rid, toks, max_tokens, arrival, prio, stop_at, abort_at, salt, lora)


def _domain(draw: st.DrawFn, features: frozenset[Feature]) -> tuple[str, str]:
    """A key domain for a request of the shared-prefix search (cache salt, adapter): the
    shared prefixes then meet requests whose K/V they must not serve. Names overlap on
    purpose (adapter ``x`` and salt ``x``), as a key of untagged strings confuses them."""
    salt = draw(st.sampled_from(("", "", "x", "t2"))) if Feature.CACHE_SALT in features else ""
    lora = draw(st.sampled_from(("", "", "x"))) if Feature.LORA in features else ""
    return salt, lora


def _moves(w: Workload, features: frozenset[Feature]) -> st.SearchStrategy[Workload]:
    """``w`` spread over one or two peers of its own limits: moves of its requests at
    random boundaries, or disaggregated prefill/decode (feature ``migration``)."""

    @st.composite
    def build(draw: st.DrawFn) -> Workload:
        need = max(len(r.prompt) + r.max_tokens for r in w.requests)
        peers = []
        for _ in range(draw(st.integers(1, 2))):
            bs = draw(st.integers(1, 4))
            lo = -(-need // bs)
            if Feature.CHUNKED_PREFILL in features:
                budget = draw(st.integers(1, 16))
            else:
                budget = draw(st.integers(need, need + 8))
            peers.append(
                dataclasses.replace(
                    w.config,
                    block_size=bs,
                    num_blocks=draw(st.integers(max(1, lo - 1), lo + 8)),
                    max_num_batched_tokens=budget,
                    max_num_seqs=draw(st.integers(1, 4)),
                )
            )
        if draw(st.integers(0, 3)) == 0:
            return dataclasses.replace(w, peers=tuple(peers[:1]), disaggregated=True)
        faults = [None, None, "before_ack"]
        if Feature.ABORT in features:
            faults.append("abort_in_transit")
        ids = [r.request_id for r in w.requests]
        moves = draw(
            st.lists(
                st.builds(
                    MigrationPlan,
                    at=st.integers(0, 12),
                    request_id=st.sampled_from(ids),
                    to=st.integers(0, len(peers)),
                    kv=st.booleans(),
                    fault=st.sampled_from(faults),
                ),
                min_size=1,
                max_size=6,
            )
        )
        return dataclasses.replace(w, peers=tuple(peers), migrations=tuple(moves))

    return build()


def _counting_moves(
    count: Callable[[str, bool], None], then: Callable[[RunResult], None] | None
) -> Callable[[RunResult], None]:
    """An example hook that counts the migration paths an example reached, then calls
    ``then``."""

    def hook(r: RunResult) -> None:
        moved = [e for e in r.trace if "migrate" in e]
        count("migration", any("sent" in e and "fault" not in e for e in moved))
        count("migration_kv", any(e.get("sent") for e in moved))
        count("migration_hit", any(e.get("hit") for e in moved))
        count("migration_fault", any("fault" in e for e in moved))
        count("migration_refused", any("refused" in e for e in moved))
        if then is not None:
            then(r)

    return hook


@dataclass
class SearchOutcome:
    examples: int = 0
    """Examples run (a workload the engine refuses as not supported is not counted)."""
    failures: dict[str, RunResult] = field(default_factory=dict)
    """One shrunk failing run per distinct finding signature, in order of discovery."""
    suppressed: int = 0
    """Examples whose every finding was a known (baseline) signature."""
    checked: set[Invariant] = field(default_factory=set)
    coverage: dict[str, int] = field(default_factory=dict)
    """How many examples reached each rare path (preemption, cache hit, abort...)."""


def search(
    factory: AdapterFactory,
    kind: str,
    *,
    max_examples: int = 100,
    call_timeout: float = DEFAULT_CALL_TIMEOUT,
    known: frozenset[str] = frozenset(),
    features: frozenset[Feature] | None = None,
    on_example: Callable[[RunResult], None] | None = None,
) -> SearchOutcome:
    """Run exactly ``max_examples`` generated workloads of ``kind``; never stop early.

    A finding does not end the search (the next example may hold a different bug): each
    distinct signature (:func:`refserve.conformance.shrink.signature`) keeps the first run that
    showed it, and is shrunk afterwards with the exact signature kept. Signatures in
    ``known`` (a baseline report's) are suppressed, so the search goes on past them.
    """
    out = SearchOutcome()
    first: dict[str, RunResult] = {}
    if features is None:
        features, _ = adapter_traits(build(factory, call_timeout), call_timeout)

    def count(key: str, hit: bool) -> None:
        if hit:
            out.coverage[key] = out.coverage.get(key, 0) + 1

    def run(w: Workload) -> RunResult:
        return run_fresh(factory, w, call_timeout=call_timeout)

    # The moves are counted by the hook, not in ``prop``: derandomized Hypothesis seeds
    # itself from the test function's source, so editing ``prop`` redraws every example.
    on_example = _counting_moves(count, on_example)

    @settings(
        max_examples=max_examples,
        database=None,
        deadline=None,
        derandomize=True,
        phases=(Phase.explicit, Phase.generate),
        suppress_health_check=list(HealthCheck),
        verbosity=Verbosity.quiet,
    )
    @given(workloads(features, kind))
    def prop(w: Workload) -> None:
        r = run(w)
        # A configuration the engine refuses (NotSupported) is not an example.
        assume(not r.not_supported)
        out.examples += 1
        out.checked |= r.checked
        o = r.observed
        count("preemption", o.preemptions > 0)
        count("prefix_hit", o.cached_tokens > 0)
        count("abort", any(e.get("aborted") for e in r.trace))
        count("rejected", o.rejected > 0)
        count("forced_stop", o.finish_reasons.get("stop", 0) > 0)
        count("chunked_prompt", o.chunked_prompts > 0)
        count("capacity_finish", o.finish_reasons.get("capacity", 0) > 0)
        count("rollback", any(e.get("rolled_back") for e in r.trace))
        if on_example is not None:
            on_example(r)
        fresh = distinct(r.findings, known)
        if r.findings and not fresh:
            out.suppressed += 1
        for sig in fresh:
            first.setdefault(sig, r)

    prop()
    for sig, r in first.items():
        out.failures[sig] = shrink(run, r, sig)
    return out
