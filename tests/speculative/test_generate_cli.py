"""``refserve generate --speculative``: the same tokens as without it, and the
acceptance rate reported (docs/SPECULATIVE.md; bad values are in tests/cli's table)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from refserve.cli.main import main

TINY = Path(__file__).resolve().parents[2] / "ref" / "model" / "tiny"
ARGV = ["generate", "--prompt", "the cat sat on the mat, the cat sat on the", "--max-tokens", "24"]


def _json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert main([*argv, "--json"]) == 0
    doc: dict[str, Any] = json.loads(capsys.readouterr().out)
    return doc


@pytest.mark.parametrize(
    "speculative", ["ngram", f"draft:{TINY}"], ids=["ngram", "the model as its own draft"]
)
def test_speculation_keeps_the_tokens_and_reports_acceptance(
    speculative: str, capsys: pytest.CaptureFixture[str]
) -> None:
    plain = _json(ARGV, capsys)
    spec = _json([*ARGV, "--speculative", speculative, "--num-speculative-tokens", "4"], capsys)
    assert "speculation" not in plain
    (out,) = spec["outputs"]
    assert out["token_ids"] == plain["outputs"][0]["token_ids"]
    stats = spec["speculation"]
    assert isinstance(stats, dict)
    assert stats["num_draft_tokens"] > 0
    assert stats["num_draft_tokens"] == out["metrics"]["num_draft_tokens"]
    assert stats["num_accepted_tokens"] == out["metrics"]["num_accepted_tokens"]
    rate = stats["num_accepted_tokens"] / stats["num_draft_tokens"]
    assert stats["acceptance_rate"] == rate
    if speculative.startswith("draft:"):
        assert rate == 1.0  # greedy: the model's drafts are its own argmax


def test_the_text_report_names_the_acceptance_rate(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*ARGV, "--speculative", "ngram"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("speculation: ") and "drafts accepted (" in last
