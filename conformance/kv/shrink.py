"""Shrinking a KV finding: greedy delta debugging under a replay budget that keeps the
finding's exact signature (:func:`shrink_kv`)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Any

from refserve.conformance.guard import DEFAULT_CALL_TIMEOUT
from refserve.conformance.kv.protocol import KVAdapterFactory, KVConfig, KVFeature
from refserve.conformance.kv.run import KVRun, find_signature, replay_workload
from refserve.conformance.kv.workload import KVWorkload

MAX_SHRINK_RUNS = 300


def simpler_ops(op: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
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
        self.best_run: KVRun | None = None

    @property
    def spent(self) -> bool:
        return self.runs >= self.max_runs

    def attempt(self, cand: KVWorkload) -> bool:
        if self.spent:
            return False
        self.runs += 1
        r = replay_workload(self.factory, cand, self.timeout)
        f = find_signature(r, self.sig)
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
            for new in simpler_ops(ops[i]):
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
) -> tuple[KVWorkload, KVRun]:
    """Greedy delta debugging: the smallest workload found that still produces a finding
    with exactly ``sig``, in passes (drop op chunks from the end, halves first; shrink
    each op's tokens and count; shrink the pool, the block size, switch caching off;
    when those stall, drop an op and shrink the pool together) until a pass changes
    nothing or ``max_runs`` replays are spent. A candidate that
    times out ends the search: each further try of a hanging adapter would cost a whole
    time limit."""
    first = replay_workload(factory, w, call_timeout)
    if find_signature(first, sig) is None:
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
