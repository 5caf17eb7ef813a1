"""Where speculative decoding's counts are reported besides ``refserve generate``: the
server's ``/metrics`` (vLLM's ``spec_decode`` counter names) and the demo's summary."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from refserve.cli.main import main
from refserve.engine.llm_engine import LLMEngine
from refserve.model.proposers import NgramProposer
from refserve.model.sampler import SamplingParams
from refserve.serve.metrics import ServerMetrics


def _counter(text: str, name: str) -> float:
    m = re.search(rf'^{re.escape(name)}_total{{model_name="m"}} (\S+)$', text, re.M)
    assert m is not None, f"{name} missing from /metrics"
    return float(m.group(1))


def test_metrics_export_the_engines_draft_counts() -> None:
    engine = LLMEngine("tiny-trained", proposer=NgramProposer(4))
    metrics = ServerMetrics("m")
    for _ in range(2):  # the counters follow the engine's totals, never count twice
        engine.generate(
            ["the cat sat on the mat, the cat sat on the"], SamplingParams(max_tokens=24)
        )
        metrics.after_step(engine, [])
    text = metrics.render().decode()
    s = engine.speculation
    assert s.num_draft_tokens > 0
    assert _counter(text, "vllm:spec_decode_num_drafts") == s.num_verifications
    assert _counter(text, "vllm:spec_decode_num_draft_tokens") == s.num_draft_tokens
    assert _counter(text, "vllm:spec_decode_num_accepted_tokens") == s.num_accepted_tokens


def test_the_demo_summary_gives_the_acceptance_rate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    timeline = tmp_path / "t.html"
    assert main(["demo", "--speculative", "ngram", "--timeline", str(timeline)]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("speculation: "))
    assert re.fullmatch(
        r"speculation: \d+ of \d+ drafts accepted \(\d+\.\d %\) in \d+ verifications", line
    )
