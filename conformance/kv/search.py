"""The generated KV search: Hypothesis draws each next op from the run's live state
(shared prefixes so cache hits happen, chunk sizes that leave the uncacheable tail),
never stopping at a failure; the first workload per finding signature is kept."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, Phase, Verbosity, given, seed, settings
from hypothesis import strategies as st
from hypothesis.errors import HypothesisException

from refserve.conformance.guard import DEFAULT_CALL_TIMEOUT
from refserve.conformance.kv.protocol import KVAdapterFactory, KVConfig, KVFeature
from refserve.conformance.kv.run import KVRun
from refserve.conformance.kv.workload import KVFinding, KVWorkload
from refserve.spec.arith import max_cacheable_tokens
from refserve.spec.violation import Invariant

MAX_OPS = 24
#: The search's seed: its examples are the same on every run and every machine, and
#: (unlike Hypothesis's derandomize, which hashes the property's source) stay the same
#: when the property's code is edited.
SEARCH_SEED = 0


_ALPHABET = st.integers(0, 2)  # three token ids, so prompts collide and hits are common

# Feature key_domains: the namespaces a new request is drawn in, mostly the default one.
# Their strings overlap on purpose (an adapter named like a salt, a salt and an adapter
# whose concatenation is another's), so a key that joins untagged fields collides.
_NAMESPACES: tuple[dict[str, str], ...] = (
    {},
    {},
    {},
    {"lora": "a"},
    {"cache_salt": "a"},
    {"lora": "b", "cache_salt": "a"},
    {"lora": "ab"},
    {"cache_salt": "ab"},
)


class _SearchStopped(Exception):
    """Ends the generated search early (a call timed out)."""


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

    def absorb(self, run: KVRun) -> None:
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

    def __init__(self, data: st.DataObject, run: KVRun) -> None:
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
            op: dict[str, Any] = {"op": "new", "rid": self._rid(), "prompt": prompt, "n": n}
            if KVFeature.KEY_DOMAINS in run.features:
                op.update(d.draw(st.sampled_from(_NAMESPACES), label="namespace"))
            return op
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
    """``max_examples`` generated examples (seeded: :data:`SEARCH_SEED`), never stopping
    at a failure; a timed-out call ends the search (every later example would hang as
    well)."""
    out = KVSearchOutcome()
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
        run = KVRun(factory, data.draw(_configs(features), label="kv_config"), call_timeout)
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
