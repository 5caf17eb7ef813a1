"""Finding signatures and the greedy shrinker that keeps a finding's exact signature.

A signature says what makes two findings the same bug: the invariant, the kind of
subject (``request``, ``block``, ``step``, ``engine``...) and the message with its numbers
blanked (a crash keeps its ``file:line``). Deduplicating by signature lets a search
report every distinct bug it met, and shrinking that must keep the exact signature
cannot trade one bug for an unrelated one that fails the same invariant.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any

from refserve.conformance.report import signature_of
from refserve.conformance.runner import Finding, RunResult
from refserve.conformance.workload import Workload

MAX_SHRINK_RUNS = 400
"""Workload runs one shrink may spend (each is milliseconds on the engines tried)."""
MAX_SHRINK_SECONDS = 20.0
"""Wall-clock cap of one shrink, so a slow engine cannot stall the report."""


def signature(f: Finding) -> str:
    """The signature of a finding (see the module docstring)."""
    return signature_of(f.invariant, f.violation.subject, f.violation.message)


def candidates(w: Workload) -> Iterator[Workload]:
    """Workloads one step smaller than ``w``: a request dropped, a prompt or output
    shortened, an arrival moved earlier, a rollback dropped, a move dropped, made
    earlier or without its fault, a peer dropped, a limit lowered by one (of any
    instance), a copy's drawn or listed outcome dropped."""
    reqs = w.requests
    for i in range(len(reqs)):
        if len(reqs) > 1:
            yield dataclasses.replace(w, requests=reqs[:i] + reqs[i + 1 :])
    for i, r in enumerate(reqs):

        def put(**kw: Any) -> Workload:
            new = dataclasses.replace(r, **kw)  # noqa: B023 - used at once
            return dataclasses.replace(w, requests=(*reqs[:i], new, *reqs[i + 1 :]))  # noqa: B023

        if r.abort_at is not None:
            yield put(abort_at=None)
        if r.stop_at is not None:
            yield put(stop_at=None)
        if r.max_tokens > 1:
            yield put(max_tokens=r.max_tokens - 1, stop_at=None)
        if len(r.prompt) > 1:
            yield put(prompt=r.prompt[:-1])
            yield put(prompt=r.prompt[1:])
        if r.arrival > 0:
            yield put(arrival=0)
            yield put(arrival=r.arrival - 1)
        if r.priority:
            yield put(priority=0)
    for j in range(len(w.rollback_at)):
        yield dataclasses.replace(w, rollback_at=w.rollback_at[:j] + w.rollback_at[j + 1 :])
    yield from _move_candidates(w)
    yield from _limit_candidates(w)
    yield from _transfer_candidates(w)


def _transfer_candidates(w: Workload) -> Iterator[Workload]:
    """The seed's draws dropped (every copy not listed completes), a listed outcome
    dropped."""
    if w.transfer_seed is not None:
        yield dataclasses.replace(w, transfer_seed=None)
    xs = w.transfer_outcomes
    for j in range(len(xs)):
        yield dataclasses.replace(w, transfer_outcomes=xs[:j] + xs[j + 1 :])


def _limit_candidates(w: Workload) -> Iterator[Workload]:
    """A limit lowered by one, of the engine's config or of any peer's."""
    c = w.config
    for name in LIMITS:
        if getattr(c, name) > 1:
            yield dataclasses.replace(
                w, config=dataclasses.replace(c, **{name: getattr(c, name) - 1})
            )
    for i, peer in enumerate(w.peers):
        for name in LIMITS:
            if getattr(peer, name) > 1:
                lower = dataclasses.replace(peer, **{name: getattr(peer, name) - 1})
                yield dataclasses.replace(w, peers=(*w.peers[:i], lower, *w.peers[i + 1 :]))


LIMITS = ("num_blocks", "max_num_seqs", "max_num_batched_tokens", "block_size")
"""The limits of an instance the shrinker lowers."""


def _move_candidates(w: Workload) -> Iterator[Workload]:
    """Smaller migration workloads (feature ``migration``): a move dropped, without its
    fault, by transfer rather than recompute, earlier; the last peer dropped when no
    move goes to it."""
    moves = w.migrations
    for i, m in enumerate(moves):
        rest = moves[:i] + moves[i + 1 :]
        yield dataclasses.replace(w, migrations=rest)
        for change in (
            {"fault": None} if m.fault is not None else None,
            {"kv": True} if not m.kv else None,
            {"at": m.at - 1} if m.at > 0 else None,
        ):
            if change is not None:
                new = dataclasses.replace(m, **change)
                yield dataclasses.replace(w, migrations=(*moves[:i], new, *moves[i + 1 :]))
    needed = 1 if w.disaggregated else 0  # the decode instance stays
    if len(w.peers) > needed and all(m.to < len(w.peers) for m in moves):
        yield dataclasses.replace(w, peers=w.peers[:-1])


def shrink(run: Callable[[Workload], RunResult], first: RunResult, sig: str) -> RunResult:
    """Greedy delta debugging from ``first`` (a run with a finding of signature ``sig``):
    the smallest workload found whose run still has a finding with exactly ``sig``."""
    best = first
    runs = 0
    deadline = time.monotonic() + MAX_SHRINK_SECONDS
    improved = True
    while improved and runs < MAX_SHRINK_RUNS and time.monotonic() < deadline:
        improved = False
        for cand in candidates(best.workload):
            runs += 1
            r = run(cand)
            if not r.not_supported and any(signature(f) == sig for f in r.findings):
                best = r
                improved = True
                break
            if runs >= MAX_SHRINK_RUNS or time.monotonic() >= deadline:
                break
    return best


def distinct(findings: list[Finding], known: frozenset[str] = frozenset()) -> dict[str, Finding]:
    """The first finding of each signature not in ``known``, in order of appearance."""
    out: dict[str, Finding] = {}
    for f in findings:
        sig = signature(f)
        if sig not in known and sig not in out:
            out[sig] = f
    return out
