"""SGLang 0.5.23's radix cache under the KV-level suite (conformance/adapters/sglang_kv.py).

The import check runs everywhere; the rest only where SGLang is importable, i.e. in
``.venv-sglang`` (``make conformance-sglang`` builds it):
``.venv-sglang/bin/python -m pytest tests/conformance/test_sglang_kv.py``.
sglang#24638 (key namespaces) is tested at the end: 0.5.23 ships it.
"""

from __future__ import annotations

import importlib
import importlib.util
from array import array
from typing import Any

import pytest

from refserve.conformance.kv.protocol import KVConfig
from refserve.conformance.kv.run import replay_kv
from refserve.conformance.kv.scenarios import kv_scenarios
from refserve.conformance.kv.suite import run_kv_suite
from refserve.spec.block import check_block
from refserve.spec.hashing import DEFAULT_NAMESPACE, Namespace

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
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        # A .venv-sglang built before the adapter needed SGLang's Req (which imports
        # the OpenAI types): the message names the make target that completes it.
        pytest.skip(str(e))


def _failed(factory: Any, spec: str) -> list[tuple[str, str]]:
    """(scenario, invariant) of every failed check of a small KV-suite run."""
    runs = run_kv_suite(factory, spec, max_examples=15)
    return [(r.scenario, r.invariant) for results, _ in runs for r in results if r.status == "fail"]


def _rules(factory: Any, spec: str) -> set[tuple[str, str]]:
    """(scenario, rule) of every finding of a small KV-suite run."""
    runs = run_kv_suite(factory, spec, max_examples=15)
    return {(r.scenario, f.rule) for results, _ in runs for r in results for f in r.failures}


@needs_sglang
def test_fixed_adapter_passes_the_kv_suite() -> None:
    """SGLang 0.5.23 passes everything but the key-namespace rule, which it breaks
    (sglang#24638, below); with the caller's key as SGLang's cache_salt it passes all."""
    m = _module(ADAPTER)
    assert _failed(m.make_kv_cache_salt, f"{ADAPTER}:make_kv_cache_salt") == []
    for factory in (m.make_kv, m.make_kv_dllm):
        rules = _rules(factory, f"{ADAPTER}:{factory.__name__}")
        assert rules and {rule for _, rule in rules} == {"key-domains"}


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


# sglang#24638: the radix namespace is the caller's key and the LoRA id joined end to end.
FIX_24638 = "refserve.conformance.corpus.patches.sglang_24638_fixed"
KEY_SCENARIOS = ("kv-keys-adapter-named-like-salt", "kv-keys-split-fields")


@needs_sglang
def test_installed_sglang_joins_the_lora_id_to_the_callers_key() -> None:
    """The adapter's namespaces are what SGLang's own Req makes of them: 0.5.23 still
    concatenates (the plain adapter), the proposed fix tags the parts."""
    m, fix = _module(ADAPTER), _module(FIX_24638)
    ids = array("q", [1, 2, 3])

    def keys(adapter: Any, lora: str, salt: str) -> tuple[Any, Any]:
        ns = adapter._radix_namespace("r", ids, Namespace(adapter=lora, cache_salt=salt))
        return ns.extra_key, ns.cache_salt

    plain, salted, fixed = m.make_kv(), m.make_kv_cache_salt(), fix.make_kv()
    assert keys(plain, "x", "") == keys(plain, "", "x") == ("x", None)
    assert keys(plain, "bc", "a") == keys(plain, "c", "ab") == ("abc", None)
    assert keys(salted, "x", "") == ("x", None) and keys(salted, "", "x") == (None, "x")
    assert keys(fixed, "", "x") == ("x", None)  # a base request's key is left as it was
    assert keys(fixed, "x", "") != keys(fixed, "", "x")
    assert keys(fixed, "bc", "a") != keys(fixed, "c", "ab")
    assert type(fixed._radix_namespace("r", ids, DEFAULT_NAMESPACE)) is m.RadixNamespace


@needs_sglang
def test_24638_caught_on_the_release_and_clean_under_the_fix() -> None:
    m, fix = _module(ADAPTER), _module(FIX_24638)
    by_name = {s.name: s for s in kv_scenarios()}
    split = replay_kv(m.make_kv, by_name["kv-keys-split-fields"].workload.to_json())
    assert [(f.violation.rule, f.op, f.violation.message) for f in split] == [
        (
            "key-domains",
            "new",
            "KV read back at position 0: block 0 holds this token's K/V computed in another "
            "key domain",
        )
    ]
    named = replay_kv(m.make_kv, by_name["kv-keys-adapter-named-like-salt"].workload.to_json())
    assert {f.violation.rule for f in named} == {"key-domains"}
    for name in KEY_SCENARIOS:
        assert replay_kv(fix.make_kv, by_name[name].workload.to_json()) == [], name
        assert replay_kv(m.make_kv_cache_salt, by_name[name].workload.to_json()) == [], name
    assert _failed(fix.make_kv, fix.FIXED) == []
    assert ("kv-generated", "key-domains") in _rules(m.make_kv, fix.BUGGY)
