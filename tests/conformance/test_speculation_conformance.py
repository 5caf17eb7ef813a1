"""The conformance suite's speculative-decoding feature (docs/SPECULATIVE.md,
docs/CONFORMANCE.md): refserve passes its two scenarios with drafts accepted in part,
an engine that verifies fewer drafts than proposed passes too (a design choice), and
planted bugs in the verification's bookkeeping are each found."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import pytest

from refserve.conformance.adapter import StepReport
from refserve.conformance.adapters.ref import RefAdapter
from refserve.conformance.runner import RunResult, run_with
from refserve.conformance.scenarios import by_name
from refserve.core import speculation
from refserve.core.request import Request
from refserve.core.scheduler import Scheduler

SCENARIOS = ("speculation-verify-and-roll-back", "speculation-under-pressure")


def _run(name: str, factory: Callable[[], RefAdapter] = RefAdapter) -> RunResult:
    return run_with(factory, by_name()[name].workload)


def _accepted(res: RunResult) -> list[int]:
    return [n for t in res.trace for n in t.get("accepted", {}).values()]


@pytest.mark.parametrize("name", SCENARIOS)
def test_refserve_passes_with_drafts_accepted_none_some_and_all(name: str) -> None:
    res = _run(name)
    assert res.ok, [str(f) for f in res.findings]
    counts = _accepted(res)
    assert 0 in counts and any(counts)


class _FewerDrafts(RefAdapter):
    """Verifies one draft fewer than proposed: a valid choice (a budget of its own)."""

    def propose(self, request_id: str, draft_token_ids: tuple[int, ...]) -> None:
        super().propose(request_id, draft_token_ids[:-1])


@pytest.mark.parametrize("name", SCENARIOS)
def test_an_engine_verifying_fewer_drafts_passes(name: str) -> None:
    res = _run(name, _FewerDrafts)
    assert res.ok, [str(f) for f in res.findings]


@pytest.fixture
def plant(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], None]]:
    def apply(bug: str) -> None:
        original = Scheduler._commit_verified

        def planted(self: Scheduler, r: Request, *args: object) -> object:
            if bug == "keeps rejected KV":
                monkeypatch.setattr(speculation, "truncate", lambda *_: [])
            out = original(self, r, *args)  # type: ignore[arg-type]
            if bug == "counts the target's token" and not r.is_done:
                r.num_computed_tokens += 1
            return out

        monkeypatch.setattr(Scheduler, "_commit_verified", planted)

    yield apply


@pytest.mark.parametrize(
    ("bug", "invariant"),
    [("keeps rejected KV", "POS"), ("counts the target's token", "KVLEN")],
)
def test_a_planted_verification_bug_is_found(
    plant: Callable[[str], None], bug: str, invariant: str
) -> None:
    plant(bug)
    res = _run(SCENARIOS[0])
    assert not res.ok
    assert invariant in {str(f.invariant) for f in res.findings}, [str(f) for f in res.findings]


class _HidesDrafts(RefAdapter):
    """Reports a verification as a plain chunk (num_draft_tokens lost in translation)."""

    def schedule(self) -> StepReport:
        rep = super().schedule()
        plain = tuple(dataclasses.replace(s, num_draft_tokens=0) for s in rep.scheduled)
        return dataclasses.replace(rep, scheduled=plain)


def test_a_verification_reported_as_a_plain_chunk_is_found() -> None:
    # The suite sees a decode of 4 tokens with 3 beyond the known ones and no accepted
    # counts to give; the engine then cannot commit its verification: a finding either way.
    res = _run(SCENARIOS[0], _HidesDrafts)
    assert not res.ok
    assert "request 'A'" in str(res.findings[0]) or "request A" in str(res.findings[0])
