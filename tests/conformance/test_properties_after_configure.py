"""Declared properties are read once the engine is configured.

A convention may follow from the configuration: vLLM with a speculative config keeps
the blocks of rejected drafts, so its tables hold up to its draft count of slots past
their KV length, and the count is the configuration's (conformance/adapters/vllm.py).
The suite checks the properties the adapter declares after ``configure``; here shown
with refserve's adapter switching off ``eos`` in ``configure``: the suite then never
samples a forced eos, and the request runs to ``max_tokens``.
"""

from __future__ import annotations

import dataclasses

from refserve.conformance.adapter import EngineConfig, RequestSpec
from refserve.conformance.adapters.ref import REF_PROPERTIES, RefAdapter
from refserve.conformance.runner import RunResult, run_workload
from refserve.conformance.workload import EOS, RequestPlan, Workload

WORKLOAD = Workload(
    config=EngineConfig(
        block_size=4, num_blocks=8, max_num_batched_tokens=16, max_num_seqs=2, eos_token_id=EOS
    ),
    requests=(RequestPlan("A", (6, 29, 45, 61, 15), max_tokens=4, stop_at=2),),
)


class EosOffOnceConfigured(RefAdapter):
    """Declares eos until configured, then declares that it has none."""

    def __init__(self) -> None:
        super().__init__()
        self.properties = REF_PROPERTIES

    def configure(self, config: EngineConfig) -> None:
        super().configure(config)
        self.properties = dataclasses.replace(REF_PROPERTIES, eos=False)

    def add_request(self, request: RequestSpec) -> None:
        # Keeps the promise it makes once configured: no eos handling at all.
        super().add_request(dataclasses.replace(request, eos_token_id=None))


def _reasons(res: RunResult) -> dict[str, int]:
    assert not res.findings, [str(f) for f in res.findings]
    return dict(res.observed.finish_reasons)


def test_the_suite_follows_the_properties_declared_once_configured() -> None:
    assert _reasons(run_workload(EosOffOnceConfigured(), WORKLOAD)) == {"length": 1}


def test_the_properties_declared_from_the_start_still_hold() -> None:
    """The control: with eos declared throughout, the forced eos stops the request."""
    assert _reasons(run_workload(RefAdapter(), WORKLOAD)) == {"stop": 1}


def test_placeholder_drafts_follow_the_proposed_ones_and_are_typed() -> None:
    import pytest

    from refserve.conformance.adapter import PLACEHOLDER_DRAFT, EngineProperties, StepReport
    from refserve.conformance.instance import with_placeholders
    from refserve.spec.snapshot import ScheduledRequest

    def entry(rid: str, drafts: int) -> ScheduledRequest:
        n = 1 + drafts
        return ScheduledRequest(
            rid, n, tuple(range(n)), tuple(range(n)), (0,), True, num_draft_tokens=drafts
        )

    plan = StepReport(scheduled=(entry("a", 2), entry("b", 2), entry("c", 0)))
    assert with_placeholders(plan, {"a": (7, 8)}) == {
        "a": (7, 8),
        "b": (PLACEHOLDER_DRAFT, PLACEHOLDER_DRAFT),
    }
    with pytest.raises(ValueError, match="placeholder_drafts must be a bool, got 1"):
        EngineProperties(placeholder_drafts=1)  # type: ignore[arg-type]
    assert EngineProperties().placeholder_drafts is False
