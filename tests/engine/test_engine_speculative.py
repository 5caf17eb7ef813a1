"""Speculative decoding changes no greedy token (docs/SPECULATIVE.md): the engine with
a proposer gives transformers' ``generate`` output token for token, under the batching
stresses of test_engine_equivalence.py, with every spec invariant checked after every
step (``check_invariants=True``: the verification rules of TOKEN, KVLEN, POS and CAP).

Two proposers: n-gram prompt lookup, with outputs long enough (32 tokens) that the small
random model's greedy text falls into loops, so that its drafts are often right and
often wrong; and the target checkpoint as its own draft model, which must have every
draft accepted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from hf_oracle import HFOracle, random_prompt
from test_engine_equivalence import Job, assert_matches_hf, make_jobs, run_jobs

from refserve.core.config import SchedulerConfig
from refserve.engine.llm_engine import LLMEngine
from refserve.errors import InvalidArgument
from refserve.model.attention import TorchAttention
from refserve.model.config import ModelConfig
from refserve.model.llama import LlamaModel
from refserve.model.proposers import Draft, DraftModelProposer, NgramProposer
from refserve.model.sampler import SampleSpec, SamplingParams
from refserve.model.weights import load_checkpoint, random_weights

TINY = Path(__file__).resolve().parents[2] / "ref" / "model" / "tiny"


def _looping_jobs(seed: int, n: int) -> list[Job]:
    """Staggered requests with 32-token outputs: n-gram drafts have loops to find."""
    g = torch.Generator().manual_seed(seed)
    return [Job(f"p{i}", random_prompt(g, 6 + 3 * i), 32, arrive_step=i) for i in range(n)]


def _self_draft(hf: HFOracle, k: int) -> DraftModelProposer:
    cfg, weights = load_checkpoint(hf.path)
    return DraftModelProposer(LlamaModel(cfg, weights, TorchAttention()), k)


def _verified(run_engine: LLMEngine) -> tuple[int, int]:
    """(drafts verified, drafts accepted) over every step of the run."""
    drafted = accepted = 0
    for record in run_engine.steps:
        for v in record.outcome.verified.values():
            drafted += v.num_drafts
            accepted += v.num_accepted
    return drafted, accepted


@pytest.mark.parametrize("budget", [1, 3, 7, 64])
def test_ngram_speculation_matches_transformers_under_token_budgets(
    hf: HFOracle, budget: int
) -> None:
    jobs = _looping_jobs(7, 4)
    cfg = SchedulerConfig(max_num_batched_tokens=budget, block_size=4, num_blocks=128)
    run = run_jobs(hf, jobs, cfg, proposer=NgramProposer(3))
    assert_matches_hf(hf, run, jobs)
    drafted, accepted = _verified(run.engine)
    if budget > 1:  # a budget of one token leaves no room for a draft
        assert 0 < accepted < drafted  # some drafts right, some wrong
    else:
        assert drafted == 0


def test_ngram_speculation_matches_transformers_through_preemption_and_prefix_hits(
    hf: HFOracle,
) -> None:
    jobs = _looping_jobs(8, 5)
    system = jobs[0].prompt[:8]
    for j in jobs[1:3]:
        j.prompt = system + j.prompt  # whole blocks of a shared prefix
    cfg = SchedulerConfig(max_num_batched_tokens=16, block_size=4, num_blocks=16)
    run = run_jobs(hf, jobs, cfg, proposer=NgramProposer(4))
    assert_matches_hf(hf, run, jobs)
    assert run.engine.num_preemptions >= 1
    assert run.engine.num_prefix_hit_tokens > 0
    assert _verified(run.engine)[0] > 0


def test_ngram_speculation_matches_transformers_with_forks_and_aborts(hf: HFOracle) -> None:
    jobs = _looping_jobs(9, 4)
    jobs[0].n = 2
    jobs[3].abort_step = 6
    cfg = SchedulerConfig(max_num_batched_tokens=16, block_size=4, num_blocks=128)
    run = run_jobs(hf, jobs, cfg, proposer=NgramProposer(2))
    assert_matches_hf(hf, run, jobs)
    assert run.finals[("p3", 0)].finish_reason == "abort"
    assert _verified(run.engine)[0] > 0


def test_the_target_as_its_own_draft_has_every_draft_accepted(hf: HFOracle) -> None:
    jobs = make_jobs(10, [9, 17, 5], [12, 9, 14])
    for i, j in enumerate(jobs):
        j.arrive_step = 2 * i
    cfg = SchedulerConfig(max_num_batched_tokens=16, block_size=4, num_blocks=128)
    run = run_jobs(hf, jobs, cfg, proposer=_self_draft(hf, 3))
    assert_matches_hf(hf, run, jobs)
    drafted, accepted = _verified(run.engine)
    assert drafted > 0 and accepted == drafted
    plain = run_jobs(hf, jobs, cfg)
    assert len(run.engine.steps) < len(plain.engine.steps)  # fewer steps for the same tokens


def test_a_proposer_the_engine_cannot_use_is_refused(hf: HFOracle) -> None:
    other = dataclasses.replace(hf.config, vocab_size=hf.config.vocab_size + 1)
    draft = DraftModelProposer(LlamaModel(other, random_weights(other, 0), TorchAttention()), 2)
    with pytest.raises(InvalidArgument, match=r"vocabulary \(321\) differs from the target's"):
        LLMEngine(str(hf.path), proposer=draft)
    proto = r"must implement refserve\.model\.proposers\.Proposer"
    with pytest.raises(InvalidArgument, match=proto):
        LLMEngine(str(hf.path), proposer=object())  # type: ignore[arg-type]


def test_a_stop_among_accepted_drafts_keeps_each_tokens_logprob() -> None:
    # The target as its own draft on the embedded model: the stop token comes as an
    # accepted draft, and the commit cuts the verification there. Every kept token's
    # logprob must be its own, not the cut-off target token's.
    cfg, weights = load_checkpoint(TINY)
    prompt = "the cat sat on the"
    plain = LLMEngine("tiny-trained").generate([prompt], SamplingParams(max_tokens=24))
    stop = plain[0].outputs[0].token_ids[6]
    params = SamplingParams(max_tokens=24, logprobs=True, stop_token_ids=(stop,))
    want = LLMEngine("tiny-trained").generate([prompt], params)[0].outputs[0]
    draft = DraftModelProposer(LlamaModel(cfg, weights, TorchAttention()), 4)
    engine = LLMEngine("tiny-trained", proposer=draft)
    got = engine.generate([prompt], params)[0].outputs[0]
    assert engine.speculation.num_accepted_tokens > 0
    assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason)
    assert got.logprobs is not None and want.logprobs is not None
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)


class _RepeatLast:
    """A proposer the engine was never told about: it drafts the last token again."""

    num_speculative_tokens = 3

    def check_target(self, target: ModelConfig) -> None:
        pass

    def draft(
        self, token_ids: Sequence[int], spec: SampleSpec, output_index: int, limit: int
    ) -> Draft:
        return Draft(tuple(token_ids[-1:]) * min(limit, self.num_speculative_tokens))


def test_a_new_proposer_needs_only_the_protocol() -> None:
    # Proposers are chosen by the Proposer protocol, not by type (docs/SPECULATIVE.md,
    # "The engine"): one the engine never heard of drafts, and no greedy token changes.
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = ["the cat sat on the", "a a a a"]
    want = [r.outputs[0].token_ids for r in LLMEngine("tiny").generate(prompts, params)]
    engine = LLMEngine("tiny", proposer=_RepeatLast())
    got = [r.outputs[0].token_ids for r in engine.generate(prompts, params)]
    assert got == want
    assert engine.speculation.num_draft_tokens > 0
