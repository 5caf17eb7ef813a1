"""The sampler: greedy, temperature, top-k, top-p, per-request seeds, n > 1 forks."""

from __future__ import annotations

import pytest
import torch

from refserve.core.config import SchedulerConfig
from refserve.engine.llm_engine import LLMEngine
from refserve.model.sampler import (
    InvalidSamplingParams,
    SampleSpec,
    SamplingParams,
    derive_seed,
    filter_logits,
    sample,
    sample_row,
)


def test_filters() -> None:
    logits = torch.tensor([1.0, 3.0, 2.0, 0.0])
    assert filter_logits(logits, 2, 1.0).isinf().tolist() == [True, False, False, True]
    # softmax(3, 2, 1, 0) ~ (.64, .24, .09, .03): top_p 0.7 keeps the first two.
    assert filter_logits(logits, 0, 0.7).isinf().tolist() == [True, False, False, True]
    assert filter_logits(logits, 0, 0.5).isinf().tolist() == [True, False, True, True]
    assert not filter_logits(logits, 0, 1.0).isinf().any()


def test_sample_rows() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g)
    greedy = sample(logits, [SampleSpec()] * 4, [0] * 4)
    assert [t for t, _ in greedy] == logits.argmax(-1).tolist()
    top1 = [
        sample_row(logits[i], SampleSpec(temperature=1.5, top_k=1, seed=3), 0)[0] for i in range(4)
    ]
    assert top1 == logits.argmax(-1).tolist()
    spec = SampleSpec(temperature=1.0, seed=11, logprobs=True)
    a = sample_row(logits[0], spec, 5)
    assert a == sample_row(logits[0], spec, 5)  # same seed and index: same draw
    draws = {sample_row(logits[0], spec, k)[0] for k in range(40)}
    assert len(draws) > 5  # the index changes the draw
    assert a[1] == pytest.approx(float(torch.log_softmax(logits[0], -1)[a[0]]))


def test_sampling_params_validation() -> None:
    for bad in (
        {"temperature": -0.1},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"max_tokens": 0},
        {"n": 0},
        {"top_k": -2},
        {"seed": -1},
        {"stop": [""]},
        {"logprobs": 1},
    ):
        with pytest.raises(InvalidSamplingParams):
            SamplingParams(**bad)
    with pytest.raises(InvalidSamplingParams, match=r"unknown sampling option.*'best_of'"):
        SamplingParams.from_dict({"max_tokens": 3, "best_of": 2})
    assert SamplingParams(stop="x").stop == ("x",)  # type: ignore[arg-type]


def _tiny(**kw: object) -> LLMEngine:
    cfg = SchedulerConfig(max_num_batched_tokens=16, block_size=4, num_blocks=256)
    return LLMEngine("tiny", scheduler_config=cfg, check_invariants=True, **kw)  # type: ignore[arg-type]


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    sp = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, top_k=50, seed=42)
    (alone,) = _tiny().generate(["hello there"], sp)
    crowd = _tiny(seed=7).generate(
        ["a long neighbouring prompt " * 3, "hello there", "x"],
        [SamplingParams(max_tokens=20, temperature=0.7), sp, SamplingParams(max_tokens=5)],
    )
    assert crowd[1].outputs[0].token_ids == alone.outputs[0].token_ids
    (other,) = _tiny().generate(["hello there"], SamplingParams(**{**sp.__dict__, "seed": 43}))
    assert other.outputs[0].token_ids != alone.outputs[0].token_ids


def test_n_samples_equal_single_requests_with_derived_seeds() -> None:
    sp = SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=5)
    (res,) = _tiny().generate(["fork me"], sp)
    assert [o.index for o in res.outputs] == [0, 1, 2]
    singles = _tiny().generate(
        ["fork me"] * 3,
        [SamplingParams(max_tokens=10, temperature=1.0, seed=derive_seed(5, i)) for i in range(3)],
    )
    assert [o.token_ids for o in res.outputs] == [s.outputs[0].token_ids for s in singles]
    assert len({o.token_ids for o in res.outputs}) > 1


def test_n_samples_stop_like_single_requests_after_their_first_token() -> None:
    """Sample 0 of an n > 1 request samples its first token without stop conditions (the
    others fork off it); the real ones must reach the bulk decode path after it: its
    batch row, not only the request, so the stop below is seen on the decode fast path."""
    single = SamplingParams(max_tokens=10, temperature=1.0, seed=derive_seed(5, 0))
    (probe,) = _tiny().generate(["fork me"], single)
    tokens = probe.outputs[0].token_ids
    at = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
    stop = (tokens[at],)
    (alone,) = _tiny().generate(
        ["fork me"], SamplingParams(**{**single.__dict__, "stop_token_ids": stop})
    )
    assert alone.outputs[0].token_ids == tokens[: at + 1]
    sp = SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=5, stop_token_ids=stop)
    (res,) = _tiny().generate(["fork me"], sp)
    assert res.outputs[0].token_ids == tokens[: at + 1]
    assert (res.outputs[0].finish_reason, res.outputs[0].stop_reason) == ("stop", stop[0])


def test_n_with_one_token_and_with_an_immediate_stop() -> None:
    engine = _tiny()
    (res,) = engine.generate(["abc"], SamplingParams(n=4, max_tokens=1, temperature=1.0, seed=1))
    assert [len(o.token_ids) for o in res.outputs] == [1, 1, 1, 1]
    assert {o.finish_reason for o in res.outputs} == {"length"}
    assert engine.num_forks == 0
    # Sample 0's first token is a stop token: the other samples still run.
    (probe,) = _tiny().generate(["abc"], SamplingParams(max_tokens=1, seed=2, temperature=1.0))
    first = probe.outputs[0].token_ids[0]
    sp = SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=2, stop_token_ids=(first,))
    engine = _tiny()
    (res,) = engine.generate(["abc"], sp)
    assert res.outputs[0].token_ids == (first,) and res.outputs[0].finish_reason == "stop"
    assert res.outputs[0].stop_reason == first
    assert engine.scheduler.pool.num_free_blocks == engine.scheduler.pool.num_blocks


def test_fork_that_can_never_fit_finishes_with_capacity() -> None:
    # Block size 1, 12 blocks, a 12-token prompt: the prompt fills the pool. With
    # max_num_seqs=1, sample 1 cannot run beside sample 0 and waits like a preempted
    # request, but recomputing its 13 tokens needs 13 blocks: it can never run.
    cfg = SchedulerConfig(max_num_batched_tokens=16, block_size=1, num_blocks=12, max_num_seqs=1)
    engine = LLMEngine("tiny", scheduler_config=cfg, check_invariants=True)
    (res,) = engine.generate([[256, *range(60, 71)]], SamplingParams(n=2, max_tokens=8))
    assert [o.finish_reason for o in res.outputs] == ["capacity", "capacity"]
    assert [len(o.token_ids) for o in res.outputs] == [1, 1]
    assert engine.scheduler.pool.num_free_blocks == engine.scheduler.pool.num_blocks
