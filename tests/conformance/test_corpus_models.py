"""The corpus's models of bugs in engines that cannot run here (conformance/corpus/models/).

Each buggy model is caught by its detector under the rule its entry names, and its fixed
model runs the same scenarios with zero findings; the pieces swapped into refserve's
engine (the modelled cache keys) are checked on their own, the modelled TensorRT-LLM
block manager passes the whole KV level once fixed, and the CLI selects the models.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from refserve.conformance.adapter import RequestSpec, load_factory
from refserve.conformance.cli import conformance_main
from refserve.conformance.corpus import report
from refserve.conformance.corpus.catalogue import ENTRIES
from refserve.conformance.corpus.entry import Entry, Reproduction
from refserve.conformance.corpus.models import lmcache_2961, trtllm_12673, trtllm_13793
from refserve.conformance.corpus.run import run_entry
from refserve.conformance.kv.machine import kv_scenarios, replay_kv, run_kv_suite
from refserve.conformance.kv.protocol import KVConfig, NoSpace
from refserve.conformance.kv.suite import load_kv_factory
from refserve.conformance.runner import run_fresh
from refserve.conformance.scenarios import by_name

MODELS = [e for e in ENTRIES if e.reproduction is Reproduction.MODEL]


def _rules(spec: str, entry: Entry) -> list[str]:
    """The rules of the findings ``spec`` gives on the entry's detector scenarios."""
    rules: list[str] = []
    for name in entry.detector.scenarios:
        r = run_fresh(load_factory(spec), by_name()[name].workload)
        assert not r.not_supported, r.not_supported
        rules += [f.violation.rule or str(f.violation.invariant) for f in r.findings]
    kv = {s.name: s for s in kv_scenarios()}
    for name in entry.detector.kv_scenarios:
        found = replay_kv(load_kv_factory(spec), kv[name].workload.to_json())
        rules += [f.violation.rule or str(f.violation.invariant) for f in found]
    return rules


def test_the_catalogue_holds_three_models_from_two_trackers_that_need_no_engine() -> None:
    assert len(MODELS) == 3
    assert {e.bug.split("#")[0] for e in MODELS} == {"LMCache/LMCache", "NVIDIA/TensorRT-LLM"}
    for e in MODELS:
        assert e.environment == "" and e.requires == "refserve"
        assert e.buggy.startswith("refserve.conformance.corpus.models.")


@pytest.mark.parametrize("entry", MODELS, ids=[e.bug for e in MODELS])
def test_the_buggy_model_is_caught_by_its_rule_and_the_fixed_model_is_clean(entry: Entry) -> None:
    buggy = _rules(entry.buggy, entry)
    assert buggy and set(buggy) == {str(entry.rule)}
    assert _rules(entry.clean, entry) == []


def test_the_kv_model_runs_as_a_corpus_entry_and_the_suite_of_before_missed_it() -> None:
    entry = next(e for e in MODELS if e.bug == "NVIDIA/TensorRT-LLM#12673")
    r = run_entry(entry)
    assert r.ok and r.caught_by == ["PREFIX"] and r.buggy is not None and r.buggy.steps == 3
    assert "position 3: shared or cached block 1" in r.buggy.findings[0].message
    assert r.missed_before and r.before_other == []


def _spec(lora: str = "", salt: str = "") -> RequestSpec:
    return RequestSpec("r", (1, 2), 1, lora=lora, cache_salt=salt)


def test_lmcache_key_drops_the_adapter_and_the_fix_folds_it_into_the_salt() -> None:
    assert lmcache_2961.lmcache_key(_spec("l1", "s")) == lmcache_2961.lmcache_key(_spec("", "s"))
    fold = lmcache_2961.folded_key
    keys = [fold(_spec()), fold(_spec("l1")), fold(_spec("l2")), fold(_spec(salt="l1"))]
    assert len({k.root_key() for k in keys}) == 4  # an adapter never passes for a salt
    assert fold(_spec("l1", "s")) == fold(_spec("l1", "s"))


def test_the_v2_seed_drops_the_salt_and_the_fix_keeps_it() -> None:
    assert trtllm_13793.v2_seed(_spec("l", "t1")) == trtllm_13793.v2_seed(_spec("l", "t2"))
    salted = trtllm_13793.salted_seed
    assert salted(_spec("l", "t1")) != salted(_spec("l", "t2"))
    assert salted(_spec("l")) == trtllm_13793.v2_seed(_spec("l"))  # no salt: seed unchanged


def test_the_trt_release_path_stores_what_the_fix_stores_once_the_prompt_is_computed() -> None:
    """Mid-prefill the buggy release keys a half-written block; after the whole prompt
    (and a decode) both versions store the same blocks."""
    for fixed, stored_mid in ((False, 2), (True, 1)):
        m = trtllm_12673.TrtKVModel(fixed=fixed)
        m.configure(KVConfig(8, 2))
        m.allocate("a", [1, 2, 3, 4, 5, 6], 3)
        m.free("a")
        assert len(m.snapshot().cache_entries) == stored_mid
        m.configure(KVConfig(8, 2))
        m.allocate("b", [1, 2, 3, 4, 5, 6], 6)
        m.allocate("b", [1, 2, 3, 4, 5, 6, 7], 1)
        m.free("b")
        assert len(m.snapshot().cache_entries) == 3
        assert sorted(m.snapshot().free_queue) == list(range(8))


def test_the_trt_model_refuses_without_room_and_changes_nothing() -> None:
    m = trtllm_12673.make_kv()
    m.configure(KVConfig(2, 2))
    m.allocate("a", [1, 2, 3], 3)
    before = m.snapshot()
    with pytest.raises(NoSpace):
        m.allocate("b", [4], 1)
    assert m.snapshot() == before


def test_the_fixed_trt_model_passes_the_kv_level_and_the_buggy_one_does_not() -> None:
    spec = "refserve.conformance.corpus.models.trtllm_12673:make_kv"
    failed = {}
    for factory, name in ((trtllm_12673.make_kv_fixed, "fixed"), (trtllm_12673.make_kv, "buggy")):
        pairs = run_kv_suite(factory, spec, max_examples=20)
        failed[name] = {r.scenario for rs, _ in pairs for r in rs if r.failures}
    assert failed["fixed"] == set()
    assert "kv-free-mid-prefill" in failed["buggy"]


def test_the_cli_runs_only_the_models_and_refuses_a_bad_reproduction(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert conformance_main(["--corpus", "--reproduction", "modelled"]) == 2
    assert "--reproduction must be one of released, reapplied, model" in capsys.readouterr().err
    assert conformance_main(["--reproduction", "model"]) == 2
    out = tmp_path / "models.json"
    args = ["--corpus", "--reproduction", "model", "--engine", "tensorrt-llm"]
    assert conformance_main([*args, "--report", str(out), "--no-progress"]) == 0
    doc = json.loads(out.read_text())
    assert [e["bug"] for e in doc["entries"]] == [
        "NVIDIA/TensorRT-LLM#13793",
        "NVIDIA/TensorRT-LLM#12673",
    ]
    assert all(e["reproduction"] == "model" and e["caught"] for e in doc["entries"])


def test_the_document_counts_the_models_apart() -> None:
    root = Path(__file__).resolve().parents[2]
    docs = report.load(sorted((root / "docs" / "corpus").glob("*.json")))
    text = report.render(docs)
    assert "- **3 models** of bugs in engines whose code cannot run here" in text
    assert "3 of 3 run are caught on the buggy model" in text
    real = sum(1 for e in ENTRIES if e.reproduction is not Reproduction.MODEL)
    assert f"of {real} run** on real code" in text
