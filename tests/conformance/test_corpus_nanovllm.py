"""nano-vllm's corpus entries on the installed fork: each bug's buggy side is caught with a
named finding and its fixed side passes the same workload with zero findings."""

from __future__ import annotations

import inspect

import pytest

nano = pytest.importorskip(
    "refserve.conformance.adapters.nanovllm",
    reason="nano-vllm-fork lives in .venv-nanovllm: make conformance-nanovllm",
    exc_type=ImportError,
)

from refserve.conformance.adapter import AdapterFactory  # noqa: E402
from refserve.conformance.adapters import ref  # noqa: E402
from refserve.conformance.corpus.patches import (  # noqa: E402
    nanovllm_144_fixed,
    nanovllm_163,
)
from refserve.conformance.run_result import Finding  # noqa: E402
from refserve.conformance.runner import run_with  # noqa: E402
from refserve.conformance.scenarios import by_name  # noqa: E402
from refserve.conformance.workload import Workload  # noqa: E402

# The library's keys-refill-behind-other-prefix never reaches the stale entry on
# nano-vllm (its freed blocks come back in reverse table order); keys-refill-reversed is
# built for that order.
REFILL_BEHIND_OTHER_PREFIX = by_name()["keys-refill-reversed"].workload


def _findings(factory: AdapterFactory, workload: Workload) -> list[Finding]:
    return run_with(factory, workload).findings


def _scenario(name: str) -> Workload:
    return by_name()[name].workload


def _summary(findings: list[Finding]) -> list[tuple[int, str, str, str, str]]:
    return [
        (f.step, str(f.invariant), f.violation.rule, f.violation.subject, f.violation.message)
        for f in findings
    ]


def test_163_stale_hash_entry_serves_kv_computed_behind_another_prefix() -> None:
    found = _findings(nanovllm_163.make, REFILL_BEHIND_OTHER_PREFIX)
    assert _summary(found) == [
        (
            2,
            "PREFIX",
            "key-domains",
            "request Z",
            "KV read back at position 0: block 0 holds this token's K/V computed behind "
            "another prefix",
        )
    ]
    assert _findings(nano.make, REFILL_BEHIND_OTHER_PREFIX) == []
    # A generic workload: refserve serves it without a finding too.
    assert _findings(ref.make, REFILL_BEHIND_OTHER_PREFIX) == []


def test_163_library_scenarios_do_not_reach_it_on_nanovllm() -> None:
    for name in ("keys-refill-behind-other-prefix", "bug-stale-hash-entry"):
        assert _findings(nanovllm_163.make, _scenario(name)) == [], name
        assert _findings(nano.make, _scenario(name)) == [], name


def test_163_patch_changes_only_its_own_objects() -> None:
    buggy, fixed = nanovllm_163.make(), nano.make()
    cfg = REFILL_BEHIND_OTHER_PREFIX.config
    buggy.configure(cfg)
    fixed.configure(cfg)
    assert type(buggy._sched.block_manager) is nanovllm_163.BlockManager163
    assert type(fixed._sched.block_manager) is nano.BlockManager
    assert "del self.hash_to_block_id[block.hash]" in inspect.getsource(
        nano.BlockManager.deallocate
    )
    assert nanovllm_163.BUGGY.endswith("nanovllm_163:make")
    assert nanovllm_163.FIXED == "refserve.conformance.adapters.nanovllm:make"


def test_144_fully_cached_prompt_is_caught_and_upstreams_fix_passes() -> None:
    found = _findings(nano.make, _scenario("bug-fully-cached-prompt-concurrent"))
    assert _summary(found) == [
        (1, "TOKEN", "", "request B", "scheduled with no tokens"),
        (1, "PREFIX", "", "request B", "cache hit covers the last known token (no logit)"),
    ]
    assert _findings(nanovllm_144_fixed.make, _scenario("bug-fully-cached-prompt-concurrent")) == []
    # The same hit in the double-free scenario (A and B, one prompt, one prefill batch).
    double = _scenario("bug-double-free-shared-blocks")
    assert {(f.step, str(f.invariant)) for f in _findings(nano.make, double)} >= {
        (0, "TOKEN"),
        (0, "PREFIX"),
    }
    assert _findings(nanovllm_144_fixed.make, double) == []
