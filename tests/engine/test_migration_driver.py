"""What ``migrate`` reports and decides, and the guards of its protocol objects
(ref/engine/migration.py; docs/MIGRATION.md, "The protocol" and "The cost rule")."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from refserve.core.cost import StepCost
from refserve.core.migration_cost import KVMode, MigrationCost
from refserve.engine.llm_engine import LLMEngine
from refserve.engine.migration import MigrationAborted, migrate
from refserve.model.sampler import SamplingParams
from tests.engine.migration_helpers import make_engine, one_torch_thread

PROMPT = "a prompt long enough to fill some blocks of K/V"


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    yield from one_torch_thread()


def _decoding(src: LLMEngine, rid: str = "r", steps: int = 14) -> None:
    src.add_request(PROMPT, SamplingParams(max_tokens=12), request_id=rid)
    for _ in range(steps):
        src.step()


def test_the_report_counts_the_bytes_that_travelled() -> None:
    src, dst = make_engine(block_size=4), make_engine(block_size=8)
    _decoding(src)
    kv = src.scheduler.requests["r"].num_computed_tokens
    report = migrate(src, dst, "r", kv="transfer")
    assert report.kv_bytes == kv * dst.cache.bytes_per_token
    back = migrate(dst, src, "r", kv="recompute")
    assert back.kv_bytes == 0


def test_the_rule_is_told_the_destination_hit_and_the_given_cost() -> None:
    src, dst = make_engine(block_size=4), make_engine(block_size=4)
    dst.add_request(PROMPT, SamplingParams(max_tokens=1), request_id="warm")
    while dst.has_unfinished:
        dst.step()  # the prompt's full blocks stay cached on the destination
    _decoding(src)
    expected_hit = dst.prefix_hit_tokens(src.scheduler.requests["r"].token_ids[:16])
    assert expected_hit > 0
    slow_link = MigrationCost(
        kv_bytes_per_token=src.cache.bytes_per_token,
        link_gb_per_s=1e-6,
        latency_ms=7.0,
        iteration=StepCost(b=0.25),
    )
    report = migrate(src, dst, "r", kv="auto", cost=slow_link)
    d = report.decision
    assert d.mode is KVMode.RECOMPUTE  # the slow link loses to the destination's prefill
    assert (d.latency_ms, d.link_gb_per_s) == (7.0, 1e-6)
    assert d.hit_tokens >= expected_hit > 0  # the rule priced only what was missing


def test_a_source_that_steps_during_the_transfer_cancels_the_move() -> None:
    """One more token on the source, in the same state (decoding): the ticket is stale."""
    src, dst = make_engine(block_size=4), make_engine(block_size=8)
    _decoding(src)
    before = src.scheduler.requests["r"].status

    def step_source(point: str) -> None:
        if point == "mid_stream":
            src.step()

    with pytest.raises(MigrationAborted, match="changed on the source during the transfer"):
        migrate(src, dst, "r", kv="transfer", chunk_blocks=1, fault=step_source)
    assert src.scheduler.requests["r"].status is before and "r" not in dst.scheduler.requests


def test_a_resumed_turn_keeps_its_turn_number_across_the_move() -> None:
    src, dst = make_engine(block_size=4), make_engine(block_size=8)
    _decoding(src)
    src.pause("r", "device")
    src.step()
    src.resume("r", [5, 6, 7])
    src.step()
    migrate(src, dst, "r", kv="transfer")
    assert dst.export_request("r").turn == 1  # the destination's books know the turn
    outs = []
    while dst.has_unfinished:
        outs += dst.step()
    assert {o.turn for o in outs if o.request_id == "r"} == {1}
    assert dst.num_migrations_in == 1


def test_a_staged_import_commits_once() -> None:
    src, dst = make_engine(block_size=4), make_engine(block_size=8)
    _decoding(src)
    staged = dst.stage_import(src.export_request("r", kv="transfer"))
    staged.ack()
    src.release_request("r")
    assert staged.commit() == ["r"]
    with pytest.raises(AssertionError, match=r"^commit needs the ack, once(\n|$)"):
        staged.commit()
