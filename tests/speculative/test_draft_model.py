"""The draft-model proposer (ref/model/proposers.py) composed with verification: greedy
speculative generation gives exactly the target's greedy tokens, whether the draft is a
smaller random Llama or the target itself (which then has every draft accepted)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from refserve.errors import InvalidArgument
from refserve.model.attention import AttentionMetadata, TorchAttention
from refserve.model.config import tiny_config
from refserve.model.llama import KVCache, LlamaModel
from refserve.model.proposers import DraftModelProposer
from refserve.model.rejection import verify
from refserve.model.sampler import SampleSpec
from refserve.model.weights import random_state_dict, random_weights, weights_from_state_dict

PROMPTS = [[1, 72, 101, 108, 108, 111], [1, 40, 40, 40], [1, 200, 7, 99, 13, 13, 58, 2, 77]]
NEW_TOKENS = 12


def _model(seed: int, **smaller: Any) -> LlamaModel:
    cfg = dataclasses.replace(tiny_config(), **smaller)
    return LlamaModel(cfg, random_weights(cfg, seed), TorchAttention())


TARGET = _model(0)
DRAFT = _model(1, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1)


def _near_target() -> LlamaModel:
    """The target with noise on its head: it agrees with the target on some tokens only."""
    cfg = TARGET.config
    state = random_state_dict(cfg, 0)
    noise = torch.randn(state["lm_head.weight"].shape, generator=torch.Generator().manual_seed(5))
    state["lm_head.weight"] = state["lm_head.weight"] + 0.1 * noise
    return LlamaModel(cfg, weights_from_state_dict(cfg, state), TorchAttention())


NEAR = _near_target()


def _all_logits(model: LlamaModel, tokens: list[int]) -> torch.Tensor:
    """fp32 logits at every position of one dense forward (one sequence, no reuse)."""
    n = len(tokens)
    cache = KVCache(model.config, -(-n // 16), 16)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.arange(cache.num_blocks, dtype=torch.int32)[None],
        query_start_loc_host=(0, n),
        seq_lens_host=(n,),
    )
    hidden = model.forward(torch.tensor(tokens), torch.arange(n), meta, cache)
    return model.logits(hidden)


def _greedy(prompt: list[int]) -> list[int]:
    tokens = list(prompt)
    for _ in range(NEW_TOKENS):
        tokens.append(int(_all_logits(TARGET, tokens)[-1].argmax()))
    return tokens[len(prompt) :]


def _speculative(prompt: list[int], proposer: DraftModelProposer) -> tuple[list[int], int, int]:
    """Greedy generation by draft-and-verify; (tokens, drafted, accepted)."""
    spec = SampleSpec()
    tokens = list(prompt)
    drafted = accepted = 0
    while len(tokens) - len(prompt) < NEW_TOKENS:
        out = len(tokens) - len(prompt)
        draft = proposer.propose(tokens, spec, out, limit=NEW_TOKENS - out - 1)
        rows = _all_logits(TARGET, tokens + list(draft.tokens))[len(tokens) - 1 :]
        v = verify(rows, draft.tokens, spec, out, draft_probs=draft.probs)
        tokens.extend(v.tokens)
        drafted += len(draft.tokens)
        accepted += v.num_accepted
    return tokens[len(prompt) :], drafted, accepted


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_speculation_with_a_smaller_draft_gives_the_targets_tokens(
    prompt: list[int],
) -> None:
    tokens, drafted, accepted = _speculative(prompt, DraftModelProposer(DRAFT, 3))
    assert tokens == _greedy(prompt)
    assert drafted > 0 and accepted <= drafted


def test_a_draft_that_agrees_in_part_is_accepted_in_part_and_changes_no_token() -> None:
    totals = [0, 0]
    for prompt in PROMPTS:
        tokens, drafted, accepted = _speculative(prompt, DraftModelProposer(NEAR, 3))
        assert tokens == _greedy(prompt)
        totals[0] += drafted
        totals[1] += accepted
    drafted, accepted = totals
    assert 0 < accepted < drafted, "the test needs both accepted and rejected drafts"


@pytest.mark.parametrize("prompt", PROMPTS)
def test_the_target_as_its_own_draft_has_every_draft_accepted(prompt: list[int]) -> None:
    tokens, drafted, accepted = _speculative(prompt, DraftModelProposer(TARGET, 4))
    assert tokens == _greedy(prompt)
    assert accepted == drafted > 0


def test_a_draft_is_reproducible_and_its_probs_are_its_distribution() -> None:
    proposer = DraftModelProposer(DRAFT, 3)
    spec = SampleSpec(temperature=1.0, seed=4)
    a = proposer.propose(PROMPTS[0], spec, 2)
    b = proposer.propose(PROMPTS[0], spec, 2)
    assert a.tokens == b.tokens and torch.equal(a.probs, b.probs)
    assert a.probs.shape == (3, DRAFT.config.vocab_size)
    assert torch.allclose(a.probs.sum(-1), torch.ones(3))
    assert all(float(a.probs[i, t]) > 0 for i, t in enumerate(a.tokens))
    first = torch.softmax(_all_logits(DRAFT, PROMPTS[0])[-1], -1)
    assert torch.allclose(a.probs[0], first, atol=1e-5)


def test_limit_caps_the_draft() -> None:
    proposer = DraftModelProposer(DRAFT, 3)
    assert len(proposer.propose(PROMPTS[0], SampleSpec(), 0, limit=1).tokens) == 1
    assert proposer.propose(PROMPTS[0], SampleSpec(), 0, limit=0).tokens == ()


@pytest.mark.parametrize(
    ("call", "named"),
    [
        (lambda: DraftModelProposer(DRAFT, 0), "num_speculative_tokens must be an int >= 1"),
        (lambda: DraftModelProposer(DRAFT, 2, block_size=0), "block_size must be an int >= 1"),
        (lambda: DraftModelProposer(DRAFT, 2).propose([], SampleSpec(), 0), "token_ids is empty"),
        (
            lambda: DraftModelProposer(DRAFT, 2).propose([1, 10_000], SampleSpec(), 0),
            "outside the draft model's vocabulary",
        ),
    ],
)
def test_bad_input_is_a_typed_error_naming_it(call: object, named: str) -> None:
    with pytest.raises(InvalidArgument, match=named):
        call()  # type: ignore[operator]
