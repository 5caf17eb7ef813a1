"""The generated grouped KV search and the shrinking of its findings.

Hypothesis draws a layout (one full group plus one window group, or two of different
windows; windows mostly not multiples of the block size, so they cross block
boundaries), a pool small enough that NoSpace happens, and each next op from the run's
live state: prompts longer than the windows, often sharing a prefix with an earlier one
(cache hits), chunked prefills, decodes, frees. Every finding signature keeps its first
workload, shrunk by greedy delta debugging that keeps the exact signature.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

from hypothesis import HealthCheck, Phase, Verbosity, given, seed, settings
from hypothesis import strategies as st
from hypothesis.errors import HypothesisException

from refserve.conformance.guard import DEFAULT_CALL_TIMEOUT
from refserve.conformance.kv.grouped_run import (
    GroupedKVRun,
    find_signature,
    replay_grouped_workload,
)
from refserve.conformance.kv.grouped_workload import GroupedWorkload, layout
from refserve.conformance.kv.groups import GroupedKVAdapterFactory, GroupedKVConfig
from refserve.conformance.kv.protocol import KVFeature
from refserve.conformance.kv.search import SEARCH_SEED
from refserve.conformance.kv.shrink import simpler_ops
from refserve.conformance.kv.workload import KVFinding
from refserve.spec.arith import max_cacheable_tokens
from refserve.spec.violation import Invariant

MAX_GROUPED_OPS = 24
MAX_GROUPED_SHRINK_RUNS = 200
_ALPHABET = st.integers(0, 2)  # three token ids, so prompts collide and hits are common


class _SearchStopped(Exception):
    """Ends the generated search early (a call timed out)."""


@dataclass(frozen=True)
class GroupedFound:
    """The first workload (cut after the failing op) showing one finding signature."""

    workload: GroupedWorkload
    finding: KVFinding
    trace: tuple[dict[str, Any], ...]


@dataclass
class GroupedSearchOutcome:
    examples: int = 0
    coverage: Counter[str] = field(default_factory=Counter)
    checked: set[Invariant] = field(default_factory=set)
    found: dict[str, GroupedFound] = field(default_factory=dict)
    not_supported: str = ""
    stopped: str = ""

    def absorb(self, run: GroupedKVRun) -> None:
        self.examples += 1
        self.coverage.update(run.coverage)
        self.checked |= run.checked
        for f in run.findings:
            if f.signature not in self.found:
                self.found[f.signature] = GroupedFound(run.workload(f.step), f, tuple(run.trace))
            if f.timed_out and not self.stopped:
                self.stopped = f"an adapter call timed out: {f.violation.message}"


@st.composite
def _configs(draw: st.DrawFn, features: frozenset[KVFeature]) -> GroupedKVConfig:
    bs = draw(st.integers(1, 4), label="block_size")
    # Mostly windows that are not a multiple of the block size (they end mid-block).
    windows = [w for w in range(2, 3 * bs + 2) if w % bs] or [2, 3]
    ws = st.sampled_from([*windows, *windows, *range(2, 3 * bs + 2)])
    two = draw(st.booleans(), label="two_windows")
    w1 = draw(ws, label="window")
    w2 = draw(ws.filter(lambda w: w != w1), label="window2") if two else 0
    groups = layout(w1, w2) if two else layout(w1)
    caching = KVFeature.PREFIX_CACHING in features
    if KVFeature.PREFIX_CACHING_OPTIONAL in features:
        caching = draw(st.sampled_from([True, True, True, False]), label="caching")
    num_blocks = draw(st.integers(len(groups), 8 * len(groups)), label="num_blocks")
    return GroupedKVConfig(num_blocks, bs, groups, caching)


class _Gen:
    """Draws the next op from the run's live state."""

    def __init__(self, data: st.DataObject, run: GroupedKVRun) -> None:
        self.data, self.run = data, run
        self.history: list[list[int]] = []
        self.next_id = 0
        self.longest = max(g.window for g in run.config.groups)

    def _prompt(self) -> list[int]:
        d, bs = self.data, self.run.bs
        tail = d.draw(st.lists(_ALPHABET, max_size=self.longest + 2 * bs), label="tail")
        prompt = tail
        if self.history and d.draw(st.sampled_from([True, True, False]), label="reuse"):
            base = d.draw(st.sampled_from(self.history), label="base")
            k = d.draw(st.sampled_from([len(base), len(base), *range(len(base))]), label="k")
            prompt = base[:k] + tail
        return prompt[: 4 * self.longest + 4 * bs] or [d.draw(_ALPHABET, label="first")]

    def op(self) -> dict[str, Any]:
        d, run = self.data, self.run
        live = sorted(run.stored)
        kinds = ["new"] * 3 + ["grow"] * 6 + ["free"] * 2
        kind = d.draw(st.sampled_from(kinds), label="op") if live else "new"
        if kind == "new":
            prompt = self._prompt()
            self.history.append(list(prompt))
            del self.history[:-6]
            tail = len(prompt) - max_cacheable_tokens(len(prompt), run.bs)
            n = d.draw(st.sampled_from([tail, tail, 0]), label="n")
            n = n or d.draw(st.integers(1, len(prompt)), label="n_any")
            self.next_id += 1
            return {"op": "new", "rid": f"r{self.next_id}", "prompt": prompt, "n": n}
        rid = d.draw(st.sampled_from(live), label="rid")
        if kind == "free":
            return {"op": "free", "rid": rid}
        rem = len(run.known[rid]) - run.stored[rid]
        append: list[int] = []
        if rem == 0 or d.draw(st.booleans(), label="decode"):
            k = d.draw(st.integers(1, 2), label="k")
            append = d.draw(st.lists(_ALPHABET, min_size=k, max_size=k), label="append")
        n = d.draw(st.integers(1, rem + len(append)), label="n")
        self.history.append(run.known[rid] + append)
        del self.history[:-6]
        return {"op": "grow", "rid": rid, "append": append, "n": n}


def search_grouped(
    factory: GroupedKVAdapterFactory,
    features: frozenset[KVFeature],
    *,
    max_examples: int = 100,
    call_timeout: float = DEFAULT_CALL_TIMEOUT,
) -> GroupedSearchOutcome:
    """``max_examples`` generated examples (seeded), never stopping at a failure; a
    timed-out call ends the search."""
    out = GroupedSearchOutcome()
    first_reason: list[str] = []

    @settings(
        max_examples=max_examples,
        database=None,
        deadline=None,
        phases=(Phase.generate,),
        suppress_health_check=list(HealthCheck),
        verbosity=Verbosity.quiet,
    )
    @seed(SEARCH_SEED)
    @given(st.data())
    def prop(data: st.DataObject) -> None:
        if out.stopped:
            raise _SearchStopped
        run = GroupedKVRun(factory, data.draw(_configs(features), label="config"), call_timeout)
        if not run.start():
            if run.not_supported:
                out.coverage["configs_not_supported"] += 1
                first_reason[:] = first_reason or [run.not_supported]
                return
        else:
            gen = _Gen(data, run)
            for _ in range(data.draw(st.integers(1, MAX_GROUPED_OPS), label="num_ops")):
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
        if not out.stopped:  # draws follow the adapter's answers (the plain search's note)
            out.stopped = f"the adapter is not deterministic ({type(e).__name__})"
    if out.examples == 0 and first_reason:
        out.not_supported = f"every configuration tried was refused ({first_reason[0]})"
    return out


class _Shrinker:
    """Greedy delta debugging under a replay budget; keeps the exact signature."""

    def __init__(
        self, factory: GroupedKVAdapterFactory, sig: str, timeout: float, max_runs: int
    ) -> None:
        self.factory, self.sig, self.timeout, self.max_runs = factory, sig, timeout, max_runs
        self.runs = 0
        self.best: GroupedWorkload | None = None
        self.best_run: GroupedKVRun | None = None

    def attempt(self, cand: GroupedWorkload) -> bool:
        if self.runs >= self.max_runs:
            return False
        self.runs += 1
        r = replay_grouped_workload(self.factory, cand, self.timeout)
        f = find_signature(r, self.sig)
        if f is not None:
            self.best, self.best_run = r.workload(f.step), r
            return True
        if any(x.timed_out for x in r.findings):
            self.runs = self.max_runs  # each further try could hang for a whole time limit
        return False

    def one_pass(self) -> bool:
        assert self.best is not None
        changed = False
        size = max(1, len(self.best.ops) // 2)
        while size >= 1:
            i = len(self.best.ops) - size
            while i >= 0:
                ops = self.best.ops
                changed = self.attempt(replace(self.best, ops=ops[:i] + ops[i + size :])) or changed
                i = min(i - size, len(self.best.ops) - size)
            size //= 2
        i = 0
        while i < len(self.best.ops) and self.runs < self.max_runs:
            ops = self.best.ops
            if not any(
                self.attempt(replace(self.best, ops=(*ops[:i], new, *ops[i + 1 :])))
                for new in simpler_ops(ops[i])
            ):
                i += 1
            else:
                changed = True
        c = self.best.config
        for nb in sorted({len(c.groups), c.num_blocks // 2, c.num_blocks - 1}):
            if len(c.groups) <= nb < c.num_blocks and self.attempt(
                replace(self.best, config=replace(c, num_blocks=nb))
            ):
                return True
        return changed


def shrink_grouped(
    factory: GroupedKVAdapterFactory,
    w: GroupedWorkload,
    sig: str,
    *,
    call_timeout: float = DEFAULT_CALL_TIMEOUT,
    max_runs: int = MAX_GROUPED_SHRINK_RUNS,
) -> tuple[GroupedWorkload, GroupedKVRun]:
    """The smallest workload found that still shows a finding with exactly ``sig``:
    drop op chunks (halves first), simplify each op, shrink the pool, until a pass
    changes nothing or ``max_runs`` replays are spent."""
    first = replay_grouped_workload(factory, w, call_timeout)
    if find_signature(first, sig) is None:
        return w, first  # not reproducible (a nondeterministic adapter): keep it as found
    s = _Shrinker(factory, sig, call_timeout, max_runs)
    s.best, s.best_run = w, first
    while s.runs < s.max_runs and s.one_pass():
        pass
    assert s.best is not None and s.best_run is not None
    return s.best, s.best_run
