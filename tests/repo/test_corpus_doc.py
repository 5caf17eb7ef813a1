"""docs/CORPUS.md is rendered from the corpus runs' JSON in docs/corpus/, never typed.

``make corpus`` runs each engine's entries in its virtualenv, writes docs/corpus/*.json
and renders the document; here the committed document must equal what the committed
JSON renders, and the renderer is shown to react to a changed result.
"""

from __future__ import annotations

import copy
from pathlib import Path

from refserve.conformance.corpus import report
from refserve.conformance.corpus.catalogue import ENTRIES

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "CORPUS.md"
INPUTS = sorted((ROOT / "docs" / "corpus").glob("*.json"))


def test_the_committed_document_is_what_the_committed_json_renders() -> None:
    assert INPUTS, "docs/corpus/ holds no corpus run"
    rendered = report.render(report.load(INPUTS))
    assert DOC.read_text(encoding="utf-8") == rendered, (
        "docs/CORPUS.md is stale or was edited by hand: run `make corpus-report` "
        "(python -m refserve.conformance.corpus.report --out docs/CORPUS.md docs/corpus/*.json)"
    )


def test_every_entry_of_the_catalogue_was_run_in_a_committed_document() -> None:
    ran = {e["bug"] for _, doc in report.load(INPUTS) for e in doc["entries"] if not e["skipped"]}
    assert {e.bug for e in ENTRIES} <= ran


def test_a_changed_result_changes_the_document() -> None:
    docs = copy.deepcopy(report.load(INPUTS))
    entry = next(e for _, doc in docs for e in doc["entries"] if not e["skipped"])
    entry["clean_passes"] = False
    rendered = report.render(docs)
    assert rendered != DOC.read_text(encoding="utf-8")
    assert "| **no** |" in rendered
