"""More real vLLM bugs of the corpus, each on vLLM 0.33.0's own code: caught by the suite
with a named finding, and the fixed code passing the same scenarios with none.

* vllm#53495: ``ExampleConnector`` (shipped as is in 0.33.0) names a stored prefix by its
  prompt tokens only, so a request under another cache salt or LoRA adapter loads
  another tenant's K/V; the clean side applies the proposed fix (PR 53496, open).
* vllm#16928: the same connector saves a chunked prompt's first chunk only, then claims
  the whole prefix, and the worker fails on the shapes; the clean side applies the
  proposed fix (PR 53314, open), which the suite shows is incomplete when the first
  chunk ends inside a block.
* vllm#54193 (re-applied; 0.33.0 has the fix): the offloading connector stored a finished
  request's last block up to its last sampled token, whose K/V is never written, and
  the next turn of the conversation loaded it.
* vllm PR#49285 (re-applied; 0.33.0 has the fix): the same connector stored an aborted
  request's blocks up to its whole prompt, a block its first chunk half computed
  included.

Runs where vLLM imports (``.venv-vllm/bin/python -m pytest -p no:cacheprovider
tests/conformance/test_vllm_corpus_more.py``); skipped in refserve's venv.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import replace
from typing import TypeVar

import pytest

pytest.importorskip("vllm", reason="vLLM lives in .venv-vllm: make conformance-vllm")

from refserve.conformance.adapters import vllm_example, vllm_offload
from refserve.conformance.corpus.catalogue import ENTRIES
from refserve.conformance.corpus.hunk import HunkNotFound, with_statement_reversed
from refserve.conformance.corpus.patches import (
    vllm_16928_fixed,
    vllm_49285,
    vllm_53495_fixed,
    vllm_54193,
)
from refserve.conformance.run_result import RunResult
from refserve.conformance.runner import run_with
from refserve.conformance.scenarios import R, by_name
from refserve.conformance.workload import Workload, prompt
from refserve.spec.prefix import KEY_DOMAINS
from refserve.spec.violation import Invariant

A = TypeVar("A", bound=vllm_example.VllmExampleAdapter)


def _run(make: Callable[[], A], workload: Workload) -> tuple[RunResult, A]:
    built: list[A] = []

    def factory() -> A:
        built.append(make())
        return built[-1]

    return run_with(factory, workload), built[-1]


def _scenario(name: str, *, caching: bool = True) -> Workload:
    w = by_name()[name].workload
    return replace(w, config=replace(w.config, enable_prefix_caching=caching))


# ---------------------------------------------------------------- vllm#53495


@pytest.mark.parametrize(
    ("scenario", "expected", "seen"),
    [
        ("keys-cache-salt", "salt='t2'", "salt='t1'"),
        ("keys-lora", "lora='l2'", "lora='l1'"),
    ],
)
def test_example_connector_hands_c_another_domains_kv(
    scenario: str, expected: str, seen: str
) -> None:
    res, adapter = _run(vllm_example.make, _scenario(scenario))
    assert not res.not_supported
    assert res.findings
    first = res.findings[0].violation
    assert first.invariant is Invariant.PREFIX and first.rule == KEY_DOMAINS
    assert first.subject == "request C"
    assert "computed in another key domain" in first.message
    assert expected in str(first.expected) and seen in str(first.seen)
    # A and B stored one folder (the same tokens) in step 0; C loaded it.
    assert adapter.transfers["stores"] == 2
    assert adapter.transfers["loads"] == 1 and adapter.transfers["blocks_loaded"] == 2


@pytest.mark.parametrize("scenario", ["keys-cache-salt", "keys-lora"])
def test_fix_keeps_the_domains_apart(scenario: str) -> None:
    res, adapter = _run(vllm_53495_fixed.make, _scenario(scenario))
    assert not res.not_supported
    assert res.findings == []
    # Each domain stores its own folder; D repeats B's domain and hits B's blocks in
    # the device's prefix cache, so nothing is loaded.
    assert adapter.transfers["stores"] == 3 and adapter.transfers["loads"] == 0
    # The patch is on its own connector class: the shipped connector, in the same
    # process, still confuses the domains.
    again = run_with(vllm_example.make, _scenario(scenario))
    assert again.findings


def test_fix_still_loads_within_one_domain() -> None:
    """Without the device's prefix cache, D (salt t1, like B) loads B's folder: the fix
    keeps the connector's hits, it only stops the ones across domains."""
    res, adapter = _run(vllm_53495_fixed.make, _scenario("keys-cache-salt", caching=False))
    assert res.findings == []
    assert adapter.transfers["loads"] == 1 and adapter.transfers["blocks_loaded"] == 2
    buggy, shipped = _run(vllm_example.make, _scenario("keys-cache-salt", caching=False))
    assert buggy.findings and buggy.findings[0].violation.subject == "request C"
    assert shipped.transfers["loads"] == 2


def test_a_one_token_prompt_is_told_a_negative_count() -> None:
    """The issue's third symptom, reached with tokens: a prompt of at most a block saves
    the empty prefix, and a one-token prompt's lookup (``align_to_block_size(0, bs)``)
    finds it and is told ``-bs`` tokens are external; vLLM schedules it from ``-bs``."""
    base = _scenario("keys-cache-salt").config
    w = Workload(
        replace(base, block_size=2, num_blocks=2, max_num_batched_tokens=2, max_num_seqs=1),
        (R("A", (6,), 1), R("B", (3,), 1, 1)),
    )
    res, _ = _run(vllm_example.make, w)
    assert res.findings
    first = res.findings[0].violation
    assert first.invariant is Invariant.PROGRESS
    assert "positions[0]: -2 is negative" in first.message
    fixed, _ = _run(vllm_53495_fixed.make, w)
    assert fixed.findings == []


def test_catalogue_row_53495_names_these_sides() -> None:
    entry = next(e for e in ENTRIES if e.bug == "vllm-project/vllm#53495")
    assert entry.buggy == vllm_53495_fixed.BUGGY and entry.clean == vllm_53495_fixed.FIXED
    assert set(entry.detector.scenarios) == {"keys-cache-salt", "keys-lora"}


# ---------------------------------------------------------------- vllm#16928


def test_example_connector_claims_more_than_the_first_chunk_saved() -> None:
    res, adapter = _run(vllm_example.make, _scenario("pressure-chunked-prompt-again"))
    assert not res.not_supported
    assert len(res.findings) == 1
    first = res.findings[0].violation
    assert first.invariant is Invariant.PROGRESS
    assert "ExampleWorkerError" in first.message
    assert "loads 3 block(s)" in first.message and "that holds 2" in first.message
    # P's save was made in its first step: two blocks, the 8 tokens of its first chunk.
    assert adapter.transfers["stores"] == 2 and adapter.transfers["loads"] == 0


def test_fix_loads_what_was_saved_and_computes_the_rest() -> None:
    res, adapter = _run(vllm_16928_fixed.make, _scenario("pressure-chunked-prompt-again"))
    assert not res.not_supported
    assert res.findings == []
    assert adapter.transfers["loads"] == 1 and adapter.transfers["blocks_loaded"] == 2
    # Q computes from position 8, after the loaded first chunk.
    q_steps = [n for step in res.observed.rounds for rid, n in step if rid == "Q"]
    assert q_steps[0] == 6
    again = run_with(vllm_example.make, _scenario("pressure-chunked-prompt-again"))
    assert again.findings


def _first_chunk_inside_a_block() -> Workload:
    """R decodes beside P's first chunk, which gets 7 of the budget's 8 tokens: P's
    second block is saved with its last position not yet computed."""
    return Workload(
        # The detector's pool and budget (pressure-chunked-prompt-again).
        _scenario("pressure-chunked-prompt-again").config,
        (
            R("R", prompt(5, 4), 3, 0),
            R("P", prompt(51, 14), 1, 1),
            R("E", prompt(9, 31), 1, 4),
            R("Q", prompt(51, 14), 2, 9),
        ),
    )


def test_fix_is_incomplete_when_the_first_chunk_ends_inside_a_block() -> None:
    """The proposed fix caps the claim at the saved rows, and the last saved block holds a
    position the first chunk never computed: Q loads it and reads it back unwritten."""
    res, adapter = _run(vllm_16928_fixed.make, _first_chunk_inside_a_block())
    assert adapter.transfers["loads"] == 1
    assert [f.violation.invariant for f in res.findings] == [Invariant.POS]
    first = res.findings[0].violation
    assert first.subject == "request Q"
    assert "position 7" in first.message and "never written" in first.message


def test_catalogue_row_16928_names_these_sides() -> None:
    entry = next(e for e in ENTRIES if e.bug == "vllm-project/vllm#16928")
    assert entry.buggy == vllm_16928_fixed.BUGGY and entry.clean == vllm_16928_fixed.FIXED
    assert entry.detector.scenarios == ("pressure-chunked-prompt-again",)


# ---------------------------------------------------------------- vllm#54193


def _run_offload(
    make: Callable[[], vllm_offload.VllmOffloadAdapter], workload: Workload
) -> tuple[RunResult, vllm_offload.VllmOffloadAdapter]:
    built: list[vllm_offload.VllmOffloadAdapter] = []

    def factory() -> vllm_offload.VllmOffloadAdapter:
        built.append(make())
        return built[-1]

    return run_with(factory, workload), built[-1]


def test_54193_next_turn_loads_a_slot_never_written() -> None:
    res, adapter = _run_offload(vllm_54193.make, _scenario("pressure-next-turn"))
    assert not res.not_supported
    assert len(res.findings) == 1
    first = res.findings[0].violation
    assert first.invariant is Invariant.POS and first.subject == "request B"
    assert "position 7" in first.message and "never written" in first.message
    # A's two blocks went to the CPU (the second at A's finish) and B loaded both.
    assert adapter.transfers["loads"] == 1 and adapter.transfers["chunks_loaded"] == 2
    b_steps = [n for step in res.observed.rounds for rid, n in step if rid == "B"]
    assert b_steps[0] == 2


def test_54193_fixed_stores_only_what_was_computed() -> None:
    res, adapter = _run_offload(vllm_offload.make_outputs, _scenario("pressure-next-turn"))
    assert not res.not_supported
    assert res.findings == []
    assert adapter.transfers["loads"] == 1 and adapter.transfers["chunks_loaded"] == 1
    b_steps = [n for step in res.observed.rounds for rid, n in step if rid == "B"]
    assert b_steps[0] == 6
    # The patch is on one connector scheduler instance: vLLM's class keeps the fix.
    cls = importlib.import_module(
        "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler"
    ).OffloadingConnectorScheduler
    assert vllm_54193.FIXED_LINE in inspect.getsource(cls._build_store_jobs)
    again, _ = _run_offload(vllm_54193.make, _scenario("pressure-next-turn"))
    assert again.findings


def test_catalogue_row_54193_names_these_sides() -> None:
    entry = next(e for e in ENTRIES if e.bug == "vllm-project/vllm#54193")
    assert entry.buggy == vllm_54193.BUGGY and entry.clean == vllm_54193.FIXED
    assert entry.detector.scenarios == ("pressure-next-turn",)


# ---------------------------------------------------------------- vllm PR#49285


def test_49285_aborted_prompt_serves_positions_never_computed() -> None:
    res, adapter = _run_offload(vllm_49285.make, _scenario("pressure-aborted-prompt-again"))
    assert not res.not_supported
    assert res.findings
    first = res.findings[0].violation
    assert first.invariant is Invariant.POS and first.subject == "request Y"
    assert "position 6" in first.message and "never written" in first.message
    # X computed positions 0-5; both blocks of its first chunk were stored and loaded.
    assert adapter.transfers["chunks_loaded"] == 2
    assert [n for step in res.observed.rounds for rid, n in step if rid == "X"] == [6]


def test_49285_fixed_stores_the_computed_block_only() -> None:
    res, adapter = _run_offload(vllm_offload.make, _scenario("pressure-aborted-prompt-again"))
    assert res.findings == []
    assert adapter.transfers["loads"] == 1 and adapter.transfers["chunks_loaded"] == 1
    again, _ = _run_offload(vllm_49285.make, _scenario("pressure-aborted-prompt-again"))
    assert again.findings


def test_a_one_statement_hunk_must_be_there_once() -> None:
    mod = importlib.import_module(
        "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler"
    )
    method = mod.OffloadingConnectorScheduler._build_store_jobs
    with pytest.raises(HunkNotFound, match="exactly once"):
        with_statement_reversed(method, mod, "no such statement", "x = 1")
    # The running branch's statement starts like the aborted one's: only the aborted
    # one, with its line break, is a single statement.
    with pytest.raises(HunkNotFound, match="exactly once"):
        with_statement_reversed(
            method, mod, "num_tokens_after_batch = req.num_computed_tokens", "x = 1"
        )


def test_catalogue_row_49285_names_these_sides() -> None:
    entry = next(e for e in ENTRIES if e.bug == "vllm-project/vllm#49285")
    assert entry.buggy == vllm_49285.BUGGY and entry.clean == vllm_49285.FIXED
    assert entry.detector.scenarios == ("pressure-aborted-prompt-again",)
