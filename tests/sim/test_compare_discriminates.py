"""``refserve compare`` tells its policies apart on every trace: with the
SLOs and the token budget derived from the cost model and chat sharing a system prompt per
application, at least two policies have different knees on each trace. The knees are
measured by running the sweep on two rates per trace, not read from a committed report."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from refserve.cli.compare import compare_options
from refserve.core.cost import StepCost
from refserve.report.policies import Slo
from refserve.report.sweep import run_sweep

# Two rates per trace around where the policies part (docs/compare/report.md): the
# first is below every one of these policies' knees but the widest budget's.
RATES = {"chat": "4,8", "long": "0.05,0.1", "mixed": "0.5,1", "agent": "0.05,0.1"}
POLICIES = "chunked-4B,chunked,prefix-aware"


def test_slo_and_budget_follow_the_cost_model() -> None:
    slo = Slo.of(StepCost.parse("2+0.5P+D"))
    # 3 x the decode-only step of 32 decodes; TTFT allows twice the prefill time per token.
    assert slo.tbt_ms == pytest.approx(3 * (2 + 32))
    assert slo.ttft_limit_ms(100) == pytest.approx(102 + 100)
    # The largest block multiple B with 2 + 0.5 B + 32 <= 102: 136 -> 128.
    assert slo.budget(StepCost.parse("2+0.5P+D"), 16) == 128
    assert Slo.of(StepCost.parse("2+0.25P+D")).budget(StepCost.parse("2+0.25P+D"), 16) == 272


@pytest.mark.parametrize("trace", sorted(RATES))
def test_policies_have_different_knees(trace: str, tmp_path: Path) -> None:
    args = ["--out", str(tmp_path), "--traces", trace, "--rates", RATES[trace]]
    opts, _ = compare_options([*args, "--policies", POLICIES, "--full-sweep"])
    assert opts.base.max_num_batched_tokens == 128 and opts.slo.tbt_ms == pytest.approx(102)
    sweep = run_sweep(opts, io.StringIO(), progress=False)
    knees = sweep.knees(opts.knee)[trace]
    assert len(set(knees.values())) >= 2, knees
    # The budget is a policy parameter that matters: a full 4 x budget chunk makes a step
    # longer than the TBT SLO, and the widest budget is never the better one.
    wide, narrow = knees["chunked-4B"], knees["chunked"]
    assert wide is not None and (narrow is None or wide <= narrow), knees
