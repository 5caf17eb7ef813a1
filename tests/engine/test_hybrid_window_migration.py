"""A hybrid sliding-window request migrated mid-decode between engines is token-for-token
transformers' (the protocol of ref/engine/migration.py on the model of
tests/engine/test_hybrid_window_equivalence.py).

The model is the ``hybrid`` oracle (conftest.py): transformers' Qwen2 with per-layer
``layer_types``, sliding:full 1:1 with a window ``W`` of 8 and 5:1 with ``W`` = 13. A
request with a 30-token prompt and 24 output tokens starts on an engine with blocks of 4
and moves back and forth to one with blocks of 8 (both chunked prefill, different token
budgets): once mid-prefill with more than ``W`` tokens of KV computed, then after 10, 13
and 17 output tokens, every time with the window slid well past the prompt's start. It
moves by transfer (inline, and streamed one block at a time) and by recompute; the
destination also runs a neighbour sharing the first 20 prompt tokens, so a transfer
takes the destination's own cached prefix and only the rest of the K/V travels. Every
move is checked on the spot by ``migration_helpers.move`` (the source holds nothing, both
pools pass spec's pool checks, the received K/V reads back the source's bytes), and
every engine runs ``check_invariants``.

The checks can fail: a destination whose layers attend differently (every layer full, or
another window) refuses the ticket, naming both layers' attention, and with that refusal
planted away the same runs moved only while decoding give transformers' first 10 tokens
and then others, by transfer and by recompute.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch
from hf_oracle import HFOracle, random_prompt
from migration_helpers import (
    INLINE,
    RECOMPUTE,
    STREAM1,
    How,
    Plan,
    Trace,
    assert_delivered_once,
    drive,
    make_engine,
    move,
    one_torch_thread,
)

from refserve.engine import migration
from refserve.engine.llm_engine import LLMEngine
from refserve.engine.ticket import MigrationTicket, ModelMismatch
from refserve.model.checkpoint import ModelSource
from refserve.model.config import FULL_ATTENTION, ModelConfig
from refserve.model.sampler import SamplingParams
from refserve.model.weights import load_checkpoint
from refserve.spec.snapshot import RequestStatus

PROMPT_LEN = 30
MAX_TOKENS = 24
MID_PREFILL_TICK = 4  # engine 0 (budget 5) has 20 of the 30 prompt tokens' KV by then
AFTER_OUTPUTS = (10, 13, 17)  # output tokens before each move while decoding
SHARED = 20  # the neighbour's prompt starts with the request's first 20 tokens


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    yield from one_torch_thread()


def _delivered(trace: Trace, rid: str) -> int:
    return sum(len(o.new_token_ids) for o in trace.of(rid))


def _moves_after_outputs(trace: Trace, rid: str, how: How, mid_prefill: bool) -> Plan:
    """Move ``rid`` at tick ``MID_PREFILL_TICK`` (if ``mid_prefill``) and at the first
    boundary at which it has delivered each count of ``AFTER_OUTPUTS``."""
    pending = list(AFTER_OUTPUTS)

    def plan(tick: int) -> How | None:
        if mid_prefill and tick == MID_PREFILL_TICK:
            return how
        if pending and _delivered(trace, rid) >= pending[0]:
            pending.pop(0)
            return how
        return None

    return plan


def _run(
    hybrid: HFOracle, how: How, dst_model: ModelSource | None = None, *, mid_prefill: bool = True
) -> tuple[Trace, dict[str, tuple[list[int], int]]]:
    """``r`` on engine 0 moved round robin between the two engines (module doc; the move
    mid-prefill only if ``mid_prefill``); engine 1 (built from ``dst_model``, the hybrid
    checkpoint by default) runs neighbour ``n``."""
    path = str(hybrid.path)
    engines = [
        make_engine(path, block_size=4, num_blocks=48, budget=5),
        make_engine(
            path if dst_model is None else dst_model, block_size=8, num_blocks=24, budget=7
        ),
    ]
    g = torch.Generator().manual_seed(41)
    prompt = random_prompt(g, PROMPT_LEN)
    jobs = {"r": (prompt, MAX_TOKENS), "n": (prompt[:SHARED] + random_prompt(g, 5)[1:], 6)}
    for e, (rid, (p, m)) in zip(engines, jobs.items(), strict=True):
        e.add_request(p, SamplingParams(max_tokens=m), request_id=rid)
    trace = Trace()
    plan = _moves_after_outputs(trace, "r", how, mid_prefill)
    drive(engines, "r", plan, trace=trace)
    for e in engines:
        pool = e.scheduler.pool
        assert pool.num_free_blocks == pool.num_blocks, "a block leaked"
    return trace, jobs


def _assert_matches_hf(
    hybrid: HFOracle, trace: Trace, jobs: dict[str, tuple[list[int], int]]
) -> None:
    for rid, (p, m) in jobs.items():
        got, want = trace.finals(rid)[0].token_ids, hybrid.greedy(p, m)
        assert got == want, f"{rid}: {got} != transformers' {want}"


@pytest.mark.parametrize("how", [INLINE, STREAM1, RECOMPUTE], ids=str)
def test_migrated_mid_decode_matches_transformers(hybrid: HFOracle, how: How) -> None:
    window = hybrid.config.sliding_window
    assert window is not None and hybrid.config.is_hybrid
    trace, jobs = _run(hybrid, how)
    _assert_matches_hf(hybrid, trace, jobs)
    assert_delivered_once(trace.of("r"))
    first, *decoding = trace.moves
    assert first.status is RequestStatus.PREFILLING and window < first.kv_length < PROMPT_LEN
    assert [m.num_output_tokens for m in decoding] == list(AFTER_OUTPUTS)
    # Every decoding move came with the window slid past the whole prompt but its tail.
    assert all(m.kv_length >= PROMPT_LEN + AFTER_OUTPUTS[0] - 1 > window for m in decoding)
    if how.kv == "transfer":
        assert any(m.report.decision.hit_tokens >= 16 for m in trace.moves), "no prefix hit used"
    final = trace.finals("r")[0]
    assert final.metrics.migrations == tuple(m.report.decision for m in trace.moves)


# ---------------------------------------------------------------- the checks can fail
def _other_layers(hybrid: HFOracle, kind: str) -> ModelSource:
    """The hybrid checkpoint's weights with every layer full, or a window 3 shorter."""
    cfg, weights = load_checkpoint(hybrid.path)
    window = cfg.sliding_window
    assert window is not None
    other: ModelConfig
    if kind == "all full":
        other = dataclasses.replace(cfg, layer_types=(FULL_ATTENTION,) * cfg.num_layers)
    else:
        other = dataclasses.replace(cfg, sliding_window=window - 3)
    return other, weights


OTHER = ["all full", "window - 3"]


@pytest.mark.parametrize("kind", OTHER)
@pytest.mark.parametrize("how", [INLINE, RECOMPUTE], ids=str)
def test_a_destination_attending_otherwise_refuses_the_ticket(
    hybrid: HFOracle, how: How, kind: str
) -> None:
    """Its KV (transfer) and its tokens so far (recompute) came from the hybrid model;
    the destination's network is another one, and the source keeps the request."""
    src = make_engine(str(hybrid.path), block_size=4, num_blocks=48, budget=5)
    dst = make_engine(_other_layers(hybrid, kind), block_size=8, num_blocks=24, budget=7)
    g = torch.Generator().manual_seed(41)
    src.add_request(random_prompt(g, PROMPT_LEN), SamplingParams(max_tokens=4), request_id="r")
    src.step()
    with pytest.raises(ModelMismatch, match="attend"):
        move(src, dst, "r", how)
    assert src.books.has_request("r") and not dst.books.has_request("r")


@pytest.mark.parametrize("kind", OTHER)
@pytest.mark.parametrize("how", [STREAM1, RECOMPUTE], ids=str)
def test_planted_destination_attending_otherwise_is_caught(
    hybrid: HFOracle, monkeypatch: pytest.MonkeyPatch, how: How, kind: str
) -> None:
    """With the model check planted away, the destination's other layers continue the
    request with other tokens than transformers': moved only while decoding, its first
    10 tokens (all on the source) are transformers' and a later one is not."""

    def unchecked(engine: LLMEngine, t: MigrationTicket) -> None:
        return None

    monkeypatch.setattr(migration, "_check_model", unchecked)
    trace, jobs = _run(hybrid, how, _other_layers(hybrid, kind), mid_prefill=False)
    with pytest.raises(AssertionError, match=r"r: .* != transformers'"):
        _assert_matches_hf(hybrid, trace, {"r": jobs["r"]})
    got, want = trace.finals("r")[0].token_ids, hybrid.greedy(*jobs["r"])
    assert got[: AFTER_OUTPUTS[0]] == want[: AFTER_OUTPUTS[0]]
