"""Speculative decoding on the simulator (docs/SPECULATIVE.md, "Simulator"): the
acceptance model, the cost of verification tokens, and tokens that do not change."""

from __future__ import annotations

import pytest

from refserve.core.config import SchedulerConfig
from refserve.core.cost import StepCost
from refserve.core.request import Request, StopParams
from refserve.core.scheduler import Scheduler
from refserve.errors import InvalidArgument
from refserve.sim.simulator import SimResult, SimSpeculation, simulate

COST = StepCost(a=2.0, b=0.5, c=1.0)


def _run(
    k: int,
    speculation: SimSpeculation | None,
    n: int = 6,
    gap_ms: float = 5.0,
    budget: int = 64,
) -> SimResult:
    cfg = SchedulerConfig(max_num_batched_tokens=budget, block_size=4, num_speculative_tokens=k)
    reqs = [
        Request(
            f"r{i}", list(range(1, 9 + i)), StopParams(40, ignore_eos=True), arrival_ms=gap_ms * i
        )
        for i in range(n)
    ]
    return simulate(Scheduler(cfg), reqs, COST, check_invariants=True, speculation=speculation)


def _verifications(result: SimResult) -> list[tuple[int, int]]:
    return [
        (v.num_drafts, v.num_accepted) for s in result.steps for v in s.outcome.verified.values()
    ]


def test_speculation_changes_when_tokens_come_not_which() -> None:
    plain = _run(0, None)
    spec = _run(4, SimSpeculation(0.8))
    assert [r.token_ids for r in spec.requests] == [r.token_ids for r in plain.requests]
    assert _verifications(spec) and not _verifications(plain)
    assert spec.num_steps < plain.num_steps
    assert spec.makespan_ms < plain.makespan_ms  # light load: the fixed step cost is shared


def test_accepted_drafts_follow_the_acceptance_rate() -> None:
    # A truncated geometric count: E[accepted] = sum of alpha^j for j = 1..d.
    for alpha in (0.3, 0.8):
        counts = _verifications(_run(4, SimSpeculation(alpha), n=12))
        full = [a for d, a in counts if d == 4]
        assert len(full) >= 100
        mean = sum(full) / len(full)
        expected = sum(alpha**j for j in range(1, 5))
        assert abs(mean - expected) < 0.25 * expected, (alpha, mean, expected)


def test_nothing_accepted_costs_the_verification_tokens_and_saves_no_step() -> None:
    plain = _run(0, None, n=1)
    spec = _run(3, SimSpeculation(0.0), n=1)
    assert spec.num_steps == plain.num_steps
    assert all(a == 0 for _, a in _verifications(spec))
    drafts = sum(d for d, _ in _verifications(spec))
    assert spec.makespan_ms == pytest.approx(plain.makespan_ms + COST.b * drafts)


@pytest.mark.parametrize("rate", [-0.1, 1.5, float("nan"), True, "0.5"])
def test_a_bad_acceptance_rate_is_refused(rate: object) -> None:
    with pytest.raises(InvalidArgument, match="acceptance_rate"):
        SimSpeculation(rate)  # type: ignore[arg-type]


def test_a_prompt_one_token_short_of_its_end_is_not_proposed_drafts() -> None:
    # Budget 7, prompts of 8: the first chunk leaves the prompt's last token, and the
    # request, still prefilling, has KV for all but one token, as a decode would.
    plain = _run(0, None, n=1, budget=7)
    spec = _run(2, SimSpeculation(0.8), n=1, budget=7)
    assert [r.token_ids for r in spec.requests] == [r.token_ids for r in plain.requests]
    assert _verifications(spec)
