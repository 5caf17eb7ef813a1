"""SGLang 0.5.23's radix cache under the KV-level suite (conformance/adapters/sglang_kv.py).

The import check runs everywhere; the rest only where SGLang is importable, i.e. in
``.venv-sglang`` (``make conformance-sglang`` builds it):
``.venv-sglang/bin/python -m pytest tests/conformance/test_sglang_kv.py``.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import pytest

from refserve.conformance.kv.protocol import KVConfig
from refserve.conformance.kv.run import replay_kv
from refserve.conformance.kv.suite import run_kv_suite
from refserve.spec.block import check_block

ADAPTER = "refserve.conformance.adapters.sglang_kv"
PATCH = "refserve.conformance.corpus.patches.sglang_35270"
HAS_SGLANG = importlib.util.find_spec("sglang") is not None

# One dLLM request: its 8-token block is checkpointed in flight, then resolves when the
# request grows; the buggy checkpoint keys the same two pages twice (sglang#35270).
RE_KEYED = {
    "kv_config": {"num_blocks": 8, "block_size": 4, "enable_prefix_caching": True},
    "ops": [
        {"op": "new", "rid": "r1", "prompt": list(range(8)), "n": 8},
        {"op": "grow", "rid": "r1", "append": [50], "n": 1},
        {"op": "free", "rid": "r1"},
    ],
}


@pytest.mark.skipif(HAS_SGLANG, reason="SGLang is installed here")
def test_import_without_sglang_names_the_make_target() -> None:
    with pytest.raises(ModuleNotFoundError, match="make conformance-sglang"):
        importlib.import_module(ADAPTER)


needs_sglang = pytest.mark.skipif(
    not HAS_SGLANG,
    reason="SGLang is not installed; `make conformance-sglang` builds .venv-sglang, run there",
)


def _module(name: str) -> Any:
    pytest.importorskip(
        "sglang",
        reason="SGLang is not installed; `make conformance-sglang` builds .venv-sglang",
    )
    return importlib.import_module(name)


def _failed(factory: Any, spec: str) -> list[tuple[str, str]]:
    """(scenario, invariant) of every failed check of a small KV-suite run."""
    runs = run_kv_suite(factory, spec, max_examples=15)
    return [(r.scenario, r.invariant) for results, _ in runs for r in results if r.status == "fail"]


@needs_sglang
def test_fixed_adapter_passes_the_kv_suite() -> None:
    m = _module(ADAPTER)
    assert _failed(m.make_kv, f"{ADAPTER}:make_kv") == []
    assert _failed(m.make_kv_dllm, f"{ADAPTER}:make_kv_dllm") == []


@needs_sglang
def test_buggy_adapter_is_caught() -> None:
    p = _module(PATCH)
    assert ("kv-generated", "BLOCK") in _failed(p.make_kv, p.BUGGY)
    findings = replay_kv(p.make_kv, RE_KEYED)
    assert [f.violation.message for f in findings][:1] == ["referenced block is in the free queue"]
    assert replay_kv(importlib.import_module(ADAPTER).make_kv_dllm, RE_KEYED) == []


@needs_sglang
def test_buggy_stated_count_exceeds_the_blocks_as_the_tracker_says() -> None:
    """The tracker's symptom: available + evictable is whole pages above the pool."""
    m, p = _module(ADAPTER), _module(PATCH)
    for factory, excess in ((m.make_kv_dllm, 0), (p.make_kv, 2)):
        a = factory()
        a.configure(KVConfig(8, 4))
        a.allocate("r1", list(range(8)), 8)
        a.allocate("r1", [*range(8), 50], 1)
        a.free("r1")
        snap = a.snapshot()
        assert snap.stated_free == 8 + excess
        rules = [v.message for v in check_block(snap)]
        assert any("own count" in r for r in rules) == bool(excess)
