"""The simulator's step scatter and the loop's time between steps (ref/sim/noise.py,
StepCost.f and .g): seeded, shaped, and refused when malformed."""

from __future__ import annotations

import math

import pytest

from refserve.core.config import SchedulerConfig
from refserve.core.cost import StepCost
from refserve.core.request import Request, StopParams
from refserve.core.scheduler import Scheduler
from refserve.errors import InvalidArgument
from refserve.sim.noise import StepNoise
from refserve.sim.simulator import simulate


def _run(cost: StepCost, noise: StepNoise | None = None) -> list[float]:
    reqs = [
        Request(f"r{i}", list(range(1, 20)), StopParams(max_tokens=6, ignore_eos=True),
                arrival_ms=10.0 * i)
        for i in range(3)
    ]  # fmt: skip
    result = simulate(Scheduler(SchedulerConfig()), reqs, cost, noise=noise)
    return [t for r in result.requests for t in r.token_times_ms]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"factors": ()},
        {"factors": (1.0, -0.5)},
        {"factors": (math.nan,)},
        {"factors": (True,)},
        {"factors": (1.0,), "prefill_factors": (0.0,)},
        {"factors": (1.0,), "gaps_ms": (-1.0,)},
    ],
)
def test_a_malformed_noise_model_is_refused(kwargs: dict[str, tuple[float, ...]]) -> None:
    with pytest.raises(InvalidArgument):
        StepNoise(**kwargs)


def test_a_noisy_replay_is_seeded() -> None:
    cost = StepCost(1.0, 0.1, 1.0)
    noise = StepNoise((0.5, 1.0, 3.0), seed=1)
    assert _run(cost, noise) == _run(cost, noise)
    assert _run(cost, noise) != _run(cost, StepNoise((0.5, 1.0, 3.0), seed=2))
    assert _run(cost, StepNoise((1.0,))) == _run(cost)  # a factor of one changes nothing


def test_prefill_steps_draw_from_their_own_factors() -> None:
    cost = StepCost(1.0, 0.0, 0.0)
    steps = simulate(
        Scheduler(SchedulerConfig()),
        [Request("r", [1, 2, 3], StopParams(max_tokens=3, ignore_eos=True))],
        cost,
        noise=StepNoise((2.0,), prefill_factors=(5.0,)),
    ).steps
    assert [s.end_ms - s.start_ms for s in steps] == [5.0, 2.0, 2.0]


def test_the_prefill_term_and_the_loop_gap() -> None:
    reqs = [Request("r", [1, 2, 3], StopParams(max_tokens=3, ignore_eos=True))]
    result = simulate(Scheduler(SchedulerConfig()), reqs, StepCost(1.0, 0.0, 0.0, f=4.0, g=2.0))
    # The prefill step costs a + f; each token is stamped at its step's end, and the next
    # step starts g later.
    assert result.requests[0].token_times_ms == [5.0, 8.0, 11.0]
    drawn = simulate(
        Scheduler(SchedulerConfig()),
        [Request("r", [1, 2, 3], StopParams(max_tokens=3, ignore_eos=True))],
        StepCost(1.0, 0.0, 0.0),
        noise=StepNoise((1.0,), gaps_ms=(3.0,)),
    )
    assert drawn.requests[0].token_times_ms == [1.0, 5.0, 9.0]
