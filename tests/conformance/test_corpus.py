"""The corpus runner: a planted key-domain bug is caught, the clean engine passes, the
suite of before misses it, and someone else's broken code is reported, never raised."""

from __future__ import annotations

import inspect
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from refserve.conformance.cli import conformance_main
from refserve.conformance.corpus.catalogue import ENTRIES
from refserve.conformance.corpus.entry import Detector, Entry, Reproduction, Rule
from refserve.conformance.corpus.hunk import HunkNotFound, require_lines, with_statement_reversed
from refserve.conformance.corpus.report import document, table
from refserve.conformance.corpus.run import run_entry

ROOT = Path(__file__).resolve().parents[2]

PLANTED = Entry(
    bug="refserve/planted#1",
    url="https://example.invalid/planted/1",
    fix="https://example.invalid/planted/1/fix",
    engine="refserve",
    affected="planted",
    fixed="refserve",
    symptom="The engine never sees the cache salt or the adapter.",
    rule=Rule.KEY_DOMAINS,
    reproduction=Reproduction.MODEL,
    environment="",
    buggy="tests.conformance.corpus_fixtures:make_salt_blind",
    clean="refserve.conformance.adapters.ref:make",
    detector=Detector(scenarios=("keys-cache-salt", "keys-lora")),
    requires="refserve",
)


def test_a_planted_key_domain_bug_is_caught_and_the_clean_engine_passes() -> None:
    r = run_entry(PLANTED)
    assert r.skipped == ""
    assert r.caught and r.clean_passes and r.ok
    assert r.caught_by == ["key-domains"]
    assert r.buggy is not None and r.buggy.steps is not None and r.buggy.steps >= 1
    assert "another key domain" in r.buggy.findings[0].message
    # The old library never sent two domains: nothing of before tells the two apart.
    assert r.before == [] and r.missed_before


def test_the_clean_engine_as_the_buggy_side_is_not_caught() -> None:
    r = run_entry(replace(PLANTED, buggy=PLANTED.clean))
    assert not r.caught and not r.ok
    assert "NOT CAUGHT" in table([r])


def test_a_broken_factory_is_reported_not_raised() -> None:
    r = run_entry(replace(PLANTED, buggy="tests.conformance.corpus_fixtures:make_broken"))
    assert not r.ok and not r.caught
    assert r.buggy is not None and "broken on purpose" in r.buggy.error
    missing = run_entry(replace(PLANTED, buggy="tests.conformance.no_such_module:make"))
    assert missing.buggy is not None and "did not load: ModuleNotFoundError" in missing.buggy.error
    assert "NOT RUN" in table([missing])


def test_an_engine_that_is_not_installed_is_skipped_with_the_make_target() -> None:
    r = run_entry(replace(PLANTED, requires="no_such_engine_here", environment="corpus-x"))
    assert r.skipped == "no_such_engine_here is not installed here (it runs under make corpus-x)"
    assert document([r], "cmd", {})["entries"][0]["skipped"] == r.skipped


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("bug", "no-number", "tracker reference"),
        ("buggy", "no_colon", "MODULE:FACTORY"),
        ("rule", "not-a-rule", "not-a-rule"),
    ],
)
def test_a_malformed_entry_is_a_typed_error(field: str, value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        replace(PLANTED, **{field: value})
    with pytest.raises(ValueError, match="at least one scenario"):
        Detector()


def test_every_catalogue_entry_names_code_that_exists_in_the_repository() -> None:
    folders = {"refserve.conformance": ROOT / "conformance", "refserve": ROOT / "ref"}
    for e in ENTRIES:
        for spec in (e.buggy, e.clean):
            module = spec.partition(":")[0]
            prefix = next(p for p in folders if module.startswith(p + "."))
            rel = module[len(prefix) + 1 :].replace(".", "/") + ".py"
            assert (folders[prefix] / rel).is_file(), f"{e.bug}: {spec} has no module file"
    assert len({e.bug for e in ENTRIES}) == len(ENTRIES)


def test_the_cli_runs_the_corpus_and_refuses_a_bad_engine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert conformance_main(["--corpus", "--engine", "no-such-engine"]) == 2
    assert "--engine must be one of" in capsys.readouterr().err
    assert conformance_main(["--engine", "vllm"]) == 2
    out = tmp_path / "corpus.json"
    # Here no third-party engine is installed: every entry is listed as skipped, exit 0.
    code = conformance_main(["--corpus", "--report", str(out), "--no-progress"])
    text = capsys.readouterr().out
    doc = json.loads(out.read_text())
    ran = [e for e in doc["entries"] if not e["skipped"]]
    assert code == (0 if all(e["caught"] and e["clean_passes"] for e in ran) else 1)
    assert f"of {len(ENTRIES)} entries ran here" in text


def _engine_function() -> int:
    total = 0
    for i in range(3):
        total += i
    return total


def test_a_patch_refuses_code_it_was_not_written_against() -> None:
    require_lines("x#1", _engine_function, ("total += i",), absent=("del total",))
    with pytest.raises(HunkNotFound, match=r"x#1 cannot be applied: .*lacks \['total -= i'\]"):
        require_lines("x#1", _engine_function, ("total += i", "total -= i"))
    with pytest.raises(HunkNotFound, match=r"already has \['for i in range'\]"):
        require_lines("x#1", _engine_function, (), absent=("for i in range",))
    assert issubclass(HunkNotFound, ImportError)  # the corpus reports it as "did not load"


def test_a_one_statement_hunk_is_recompiled_against_the_live_module() -> None:
    module = sys.modules[__name__]
    buggy = with_statement_reversed(_engine_function, module, "total += i", "total -= i")
    assert (_engine_function(), buggy()) == (3, -3)
    assert buggy.__globals__ is vars(module)  # the module's own globals, not a copy
    assert "total -= i" not in inspect.getsource(_engine_function)  # the original stays
    with pytest.raises(HunkNotFound, match="exactly once"):
        with_statement_reversed(_engine_function, module, "total = 0\n    total", "x")
