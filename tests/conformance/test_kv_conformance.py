"""The KV-manager level of the conformance suite (refserve.conformance.kv.machine).

refserve's pool passes with zero findings, and so does a second correct manager with
other design choices (LIFO free stack, no prefix caching, eager eviction, no cache
index); each broken manager is caught under the invariant that names its bug, with a
shrunk, replayable workload; a hanging or garbage-returning adapter is a finding, never
a crash or a hang of the suite.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from typing import Any

import kv_broken_adapters as K
import pytest

from refserve.conformance.adapters.ref_kv import RefKVAdapter, make_kv
from refserve.conformance.kv.machine import (
    GENERATED_NAME,
    KVFinding,
    KVWorkload,
    kv_scenario_names,
    kv_scenarios,
    load_kv_factory,
    replay_kv,
    run_kv_suite,
)
from refserve.conformance.kv.protocol import ALL_KV_FEATURES, KVAdapter, KVAdapterFactory
from refserve.conformance.report import Failure, Result, ScenarioInfo
from refserve.spec.violation import Invariant, violation

REF_SPEC = "refserve.conformance.adapters.ref_kv:make_kv"
# The seeded search's budget per broken manager. Under its seed every planted bug below
# is found at 60 examples (at 40 the unreported copies were not). The search is random:
# of seeds 0 to 3, all find the others at 60, while the untagged namespace needs a rare
# draw (two seeds miss it at 60, two at 100); its named scenarios catch it every time
# (test_fixed_scenario_catches_its_bug, below).
BROKEN_EXAMPLES = 60

Run = tuple[list[Result], list[ScenarioInfo]]


def _suite(factory: KVAdapterFactory, spec: str, **kw: Any) -> Run:
    """run_kv_suite's (results, info) pairs, flattened as a report holds them."""
    pairs = run_kv_suite(factory, spec, **kw)
    assert all(r.scenario == info.name for rs, info in pairs for r in rs)
    return [r for rs, _ in pairs for r in rs], [info for _, info in pairs]


def _failures(results: list[Result], scenario: str | None = None) -> dict[str, list[Failure]]:
    out: dict[str, list[Failure]] = {}
    for r in results:
        if scenario is None or r.scenario == scenario:
            for f in r.failures:
                out.setdefault(r.invariant, []).append(f)
    return out


def _describe(results: list[Result]) -> list[str]:
    return [
        f"{r.scenario}/{r.invariant}: {f.subject}: {f.message}" for r in results for f in r.failures
    ]


@pytest.fixture(scope="module")
def ref_run() -> Run:
    return _suite(make_kv, REF_SPEC, max_examples=100)


# ------------------------------------------------------------------------ the reference
def test_ref_kv_adapter_is_a_kv_adapter() -> None:
    a = make_kv()
    assert isinstance(a, KVAdapter)
    assert isinstance(a, RefKVAdapter)
    assert a.features == ALL_KV_FEATURES
    assert load_kv_factory(REF_SPEC) is make_kv


def test_load_kv_factory_rejects_bad_specs() -> None:
    with pytest.raises(ValueError, match="MODULE:FACTORY"):
        load_kv_factory("refserve.conformance.adapters.ref_kv")
    with pytest.raises(ValueError, match="no callable"):
        load_kv_factory("refserve.conformance.adapters.ref_kv:nothing_here")


def test_ref_passes_every_kv_scenario(ref_run: Run) -> None:
    results, infos = ref_run
    assert _describe(results) == []
    assert {r.status for r in results} == {"pass"}
    assert [i.name for i in infos] == kv_scenario_names()
    # ATOMIC is reported once an allocation was refused: the no-space scenario and the
    # search both refuse some.
    atomic = {r.scenario for r in results if r.invariant == "ATOMIC"}
    assert {"kv-no-space", GENERATED_NAME} <= atomic
    for r in results:
        json.dumps(r.to_json())


def test_generated_search_reaches_the_rare_paths(ref_run: Run) -> None:
    info = ref_run[1][-1]
    assert info.name == GENERATED_NAME and info.kind == "generated"
    assert info.observed["examples"] == 100
    cov = info.observed["coverage"]
    for key in (
        "forks",
        "forks_partial_block",
        "cow_copies",
        "cache_hits",
        "revived_hits",
        "no_space",
        "evictions",
        "reused_blocks",
    ):
        assert cov.get(key, 0) > 0, (key, cov)


def test_fixed_scenarios_replay_clean_on_ref() -> None:
    for sc in kv_scenarios():
        assert replay_kv(make_kv, sc.workload.to_json()) == [], sc.name
        text = json.dumps(sc.workload.to_json())
        assert KVWorkload.from_json(text) == KVWorkload.from_json(sc.workload.to_json())


def test_fixed_scenarios_exercise_what_they_name() -> None:
    """Copy-on-write, a cache hit on revived blocks, eviction and refusals happen."""
    _, infos = _suite(make_kv, REF_SPEC, names=[s.name for s in kv_scenarios()])
    cov = {i.name: i.observed["coverage"] for i in infos}
    assert cov["kv-fork-cow"]["cow_copies"] >= 2
    assert cov["kv-prefix-reuse"]["evictions"] >= 2
    assert cov["kv-prefix-reuse"]["revived_hits"] >= 1
    assert cov["kv-double-free"]["cow_copies"] >= 1
    assert cov["kv-no-space"]["no_space"] == 3
    # The same adapter's second request reuses the first's K/V; no other request may.
    assert cov["kv-keys-adapter-named-like-salt"]["cache_hits"] == 1
    assert cov["kv-keys-split-fields"].get("cache_hits", 0) == 0


def test_malformed_workload_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="unknown op"):
        replay_kv(make_kv, {"kv_config": {"num_blocks": 2, "block_size": 1}, "ops": [{"op": "x"}]})
    with pytest.raises(ValueError, match="num_blocks"):
        replay_kv(make_kv, {"kv_config": {"num_blocks": 0, "block_size": 1}, "ops": []})
    with pytest.raises(ValueError, match="unknown KV scenarios"):
        _suite(make_kv, REF_SPEC, names=["kv-nope"])


# ------------------------------------------------------ correct managers, other choices
@pytest.mark.parametrize(
    "factory",
    [K.tiny_lifo, K.tiny_no_caching, K.tiny_fifo_eager_no_index],
    ids=["lifo-lazy-eviction", "no-prefix-caching", "fifo-eager-eviction-no-index"],
)
def test_correct_manager_with_other_design_choices_passes(factory: KVAdapterFactory) -> None:
    results, infos = _suite(factory, "kv_broken_adapters:tiny", max_examples=60)
    assert _describe(results) == []
    assert infos[-1].observed["examples"] == 60
    if factory is K.tiny_no_caching:
        unsupported = {r.scenario for r in results if r.status == "not_supported"}
        assert unsupported == {"kv-prefix-reuse", *KEY_SCENARIOS}
        assert next(i for i in infos if i.name == "kv-prefix-reuse").not_supported


KEY_SCENARIOS = ("kv-keys-adapter-named-like-salt", "kv-keys-split-fields")


def test_key_scenarios_need_the_key_domains_feature() -> None:
    """A manager without namespaces is not asked to keep them apart: not_supported,
    and a replayed namespaced op is skipped, never run in the default namespace."""
    results, infos = _suite(K.tiny_lifo, "kv_broken_adapters:tiny", names=list(KEY_SCENARIOS))
    assert {r.status for r in results} == {"not_supported"}
    assert all("key_domains" in i.not_supported for i in infos)
    sc = next(s for s in kv_scenarios() if s.name == KEY_SCENARIOS[1])
    assert replay_kv(K.tiny_lifo, sc.workload.to_json()) == []


def test_key_domain_finding_names_the_rule_and_both_domains() -> None:
    sc = next(s for s in kv_scenarios() if s.name == KEY_SCENARIOS[1])
    found = replay_kv(K.UntaggedNamespaceKV, sc.workload.to_json())
    assert [(f.invariant, f.violation.rule, f.op) for f in found] == [
        (Invariant.PREFIX, "key-domains", "new")
    ]
    v = found[0].violation
    assert "computed in another key domain" in v.message
    assert v.expected == "token 1 in lora='c' salt='ab'"
    assert v.seen == "token 1 in lora='bc' salt='a'"


def test_key_domains_without_set_namespace_is_a_progress_finding() -> None:
    results, _ = _suite(K.NoSetNamespaceKV, "x", names=[KEY_SCENARIOS[0]])
    progress = _failures(results).get("PROGRESS", [])
    assert [f.message for f in progress] == [
        "declares feature key_domains but has no set_namespace()"
    ]


def test_namespace_fields_are_validated_and_round_trip() -> None:
    cfg = {"num_blocks": 2, "block_size": 1}
    with pytest.raises(ValueError, match="lora must be a string"):
        KVWorkload.from_json(
            {"kv_config": cfg, "ops": [{"op": "new", "rid": "r", "prompt": [1], "n": 1, "lora": 3}]}
        )
    op = {"op": "new", "rid": "r", "prompt": [1], "n": 1, "lora": "x", "cache_salt": ""}
    w = KVWorkload.from_json({"kv_config": cfg, "ops": [op]})
    assert w.ops[0] == {"op": "new", "lora": "x", "rid": "r", "prompt": [1], "n": 1}
    assert KVWorkload.from_json(w.to_json()) == w


# ------------------------------------------------------------------- broken managers
BROKEN: list[tuple[str, Callable[[], KVAdapter], str, str]] = [
    ("copies-not-reported", K.NoCopiesKV, "BLOCK", "never received this KV"),
    ("fork-without-incref", K.fork_no_incref, "BLOCK", "ref_cnt differs"),
    ("double-free", K.double_free, "BLOCK", "referenced block is in the free queue"),
    (
        "stale-cache-entry",
        K.StaleCacheKV,
        "PREFIX",
        "cache entry points at a block|reused under a different chain|cached block",
    ),
    ("refuses-with-room", K.RefusesWithRoomKV, "CAP", r"refused \(NoSpace\) while the pool"),
    ("table-wrong-length", K.reserve_ahead, "POS", "does not cover the KV length"),
    ("no-copy-on-write", K.no_cow, "PREFIX", "shared by several requests"),
    ("dirty-refusal", K.dirty_refusal, "ATOMIC", "changed by a failed operation"),
    ("hit-covers-last-token", K.greedy_hit, "PREFIX", "cache hit covers the last known token"),
    ("snapshot-raises", K.SnapshotRaisesKV, "PROGRESS", r"snapshot\(\) raised RuntimeError"),
    ("snapshot-garbage", K.GarbageSnapshotKV, "PROGRESS", r"ref_cnt\[0\] is str"),
    ("snapshot-none", K.NoneSnapshotKV, "PROGRESS", "None, not a PoolSnapshot"),
    ("checker-chokes", K.HugeTokenSnapshotKV, "PROGRESS", "cannot read the adapter's snapshot"),
    ("untagged-namespace", K.UntaggedNamespaceKV, "PREFIX", "computed in another key domain"),
]


@pytest.mark.parametrize(
    ("factory", "invariant", "words"), [b[1:] for b in BROKEN], ids=[b[0] for b in BROKEN]
)
def test_broken_manager_is_caught(factory: KVAdapterFactory, invariant: str, words: str) -> None:
    results, infos = _suite(factory, "kv_broken_adapters:x", max_examples=BROKEN_EXAMPLES)
    found = _failures(results, GENERATED_NAME).get(invariant, [])
    hits = [f for f in found if re.search(words, f.message)]
    assert hits, _describe(results)
    f = min(hits, key=lambda x: len(x.workload["ops"]))
    assert f.phase == "kv" and f.signature.startswith(f"{invariant} ")
    # Shrunk: a handful of ops on a small pool, and it replays to the same signature.
    assert len(f.workload["ops"]) <= 6, f.workload
    assert f.step <= len(f.workload["ops"])
    assert f.trace, f
    replayed = replay_kv(factory, json.dumps(f.workload))
    assert f.signature in {x.signature for x in replayed}
    # The report form round-trips (more_failures included).
    for r in results:
        assert Result.from_json(json.loads(json.dumps(r.to_json()))) == r
    assert infos[-1].observed["distinct_findings"] >= 1


@pytest.mark.parametrize(
    ("factory", "scenario", "invariant"),
    [
        (K.NoCopiesKV, "kv-fork-cow", "BLOCK"),
        (K.no_cow, "kv-fork-cow", "PREFIX"),
        (K.StaleCacheKV, "kv-prefix-reuse", "PREFIX"),
        (K.double_free, "kv-double-free", "BLOCK"),
        (K.fork_no_incref, "kv-double-free", "BLOCK"),
        (K.RefusesWithRoomKV, "kv-no-space", "CAP"),
        (K.dirty_refusal, "kv-no-space", "ATOMIC"),
        (K.UntaggedNamespaceKV, "kv-keys-adapter-named-like-salt", "PREFIX"),
        (K.UntaggedNamespaceKV, "kv-keys-split-fields", "PREFIX"),
        (K.NamespaceIgnoredKV, "kv-keys-adapter-named-like-salt", "PREFIX"),
        (K.NamespaceIgnoredKV, "kv-keys-split-fields", "PREFIX"),
    ],
)
def test_fixed_scenario_catches_its_bug(
    factory: KVAdapterFactory, scenario: str, invariant: str
) -> None:
    results, _ = _suite(factory, "kv_broken_adapters:x", names=[scenario])
    assert invariant in _failures(results, scenario), _describe(results)


def test_distinct_bugs_of_one_invariant_are_kept_apart() -> None:
    """A double free shows as two BLOCK signatures: both reported, each shrunk."""
    results, _ = _suite(K.double_free, "x", max_examples=BROKEN_EXAMPLES, names=[GENERATED_NAME])
    block = next(r for r in results if r.invariant == "BLOCK")
    assert block.status == "fail" and block.more_failures
    sigs = [f.signature for f in block.failures]
    assert len(sigs) == len(set(sigs))


def test_search_is_deterministic() -> None:
    a, _ = _suite(K.NoCopiesKV, "x", max_examples=20, names=[GENERATED_NAME])
    b, _ = _suite(K.NoCopiesKV, "x", max_examples=20, names=[GENERATED_NAME])
    assert a == b


def test_hanging_allocate_is_a_progress_finding_within_the_timeout() -> None:
    t0 = time.monotonic()
    results, infos = _suite(K.HangingKV, "x", max_examples=BROKEN_EXAMPLES, call_timeout=0.5)
    elapsed = time.monotonic() - t0
    # One timed-out call per scenario (5 x 0.5 s): a hang is neither retried nor shrunk,
    # and the first one ends the generated search.
    assert elapsed < 6, elapsed
    progress = _failures(results).get("PROGRESS", [])
    assert len(progress) == len(kv_scenario_names())
    assert all(
        "allocate(" in f.message and "did not return within 0.5 s" in f.message for f in progress
    )
    assert "timed out" in infos[-1].observed["stopped"]


def test_configure_not_supported_makes_the_kv_run_not_supported() -> None:
    results, infos = _suite(K.RefusesConfigKV, "x", max_examples=10)
    assert results and {r.status for r in results} == {"not_supported"}
    assert all(i.not_supported for i in infos)
    assert "only runs on a GPU" in infos[-1].not_supported


def test_unreadable_features_are_a_finding_in_every_scenario() -> None:
    """Not not_supported ("needs fork"): the fault itself is what each scenario reports."""
    results, _ = _suite(K.BadFeaturesKV, "x", max_examples=10)
    progress = _failures(results).get("PROGRESS", [])
    assert len(progress) == len(kv_scenario_names())
    assert all("'teleport' is not a valid KVFeature" in f.message for f in progress)
    assert not any(r.status == "not_supported" for r in results)


def test_baseline_signatures_are_suppressed_not_failed() -> None:
    results, _ = _suite(K.NoCopiesKV, "x", max_examples=BROKEN_EXAMPLES)
    known = frozenset(f.signature for r in results for f in r.failures)
    assert known
    again, infos = _suite(K.NoCopiesKV, "x", max_examples=BROKEN_EXAMPLES, known=known)
    assert _describe(again) == []
    assert any(i.observed.get("suppressed") for i in infos)
    assert any(r.note == "known findings suppressed by the baseline" for r in again)


def test_signature_blanks_numbers() -> None:
    a = KVFinding(violation(Invariant.BLOCK, "block 3", "ref_cnt 2 differs at 7"), 4, "grow")
    b = KVFinding(violation(Invariant.BLOCK, "block 11", "ref_cnt 5 differs at 0"), 0, "new")
    assert a.signature == b.signature == "BLOCK block: ref_cnt # differs at #"
