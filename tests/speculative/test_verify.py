"""Verification of drafts (ref/model/rejection.py): greedy matching is exact, and
rejection sampling emits tokens distributed as the target's (chi-square, fixed seeds),
which the same check shows failing on two planted wrong samplers."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterator

import pytest
import torch

import refserve.model.rejection as rejection
from refserve.errors import InvalidArgument
from refserve.model.rejection import target_probs, verify
from refserve.model.sampler import FAILED_TOKEN, SampleSpec, mix64

V = 6  # a small vocabulary, so every token is drawn often enough for chi-square
K = 3
DRAWS = 3000


def _logits(seed: int, rows: int = K + 1) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 1.5


def test_greedy_accepts_the_drafts_that_match_the_argmax_then_corrects() -> None:
    logits = _logits(1)
    best = logits.argmax(-1).tolist()
    wrong = (best[1] + 1) % V
    out = verify(logits, [best[0], wrong, best[2]], SampleSpec(), 0)
    assert out.tokens == (best[0], best[1]) and out.num_accepted == 1 and not out.failed


def test_greedy_target_as_its_own_draft_accepts_everything_plus_a_bonus() -> None:
    logits = _logits(2)
    best = logits.argmax(-1).tolist()
    out = verify(logits, best[:K], SampleSpec(), 0)
    assert out.tokens == tuple(best) and out.num_accepted == K


def test_no_drafts_is_a_plain_sample() -> None:
    logits = _logits(3, rows=1)
    assert verify(logits, [], SampleSpec(), 0).tokens == (int(logits.argmax()),)
    spec = SampleSpec(temperature=1.0, seed=9)
    g = torch.Generator().manual_seed(mix64(9, 4))
    expected = int(torch.multinomial(target_probs(logits[0], spec), 1, generator=g))
    assert verify(logits, [], spec, 4).tokens == (expected,)


def test_sampling_with_the_target_as_its_own_draft_accepts_everything() -> None:
    logits = _logits(4)
    spec = SampleSpec(temperature=0.8, seed=5)
    probs = torch.stack([target_probs(row, spec) for row in logits[:K]])
    for seed in range(50):
        s = SampleSpec(temperature=0.8, seed=seed)
        drafts = [
            int(torch.multinomial(p, 1, generator=torch.Generator().manual_seed(seed)))
            for p in probs
        ]
        assert verify(logits, drafts, s, 0, draft_probs=probs).num_accepted == K


def test_same_seed_and_index_give_the_same_tokens_and_another_index_may_not() -> None:
    logits = _logits(5)
    spec = SampleSpec(temperature=1.0, seed=17)
    a = [verify(logits, [0, 1, 2], spec, j).tokens for j in range(20)]
    assert a == [verify(logits, [0, 1, 2], spec, j).tokens for j in range(20)]
    assert len(set(a)) > 1


def test_a_non_finite_row_ends_the_sequence_as_failed_after_the_accepted_drafts() -> None:
    logits = _logits(6)
    best = logits.argmax(-1).tolist()
    logits[1, 2] = math.nan
    out = verify(logits, best[:K], SampleSpec(logprobs=True), 0)
    assert out.failed and out.tokens == (best[0], FAILED_TOKEN) and out.num_accepted == 1
    assert out.logprobs is not None and math.isnan(out.logprobs[1])
    assert out.logprobs[0] == pytest.approx(float(torch.log_softmax(logits[0], -1)[best[0]]))


def test_logprobs_are_of_the_raw_logits_of_each_emitted_token() -> None:
    logits = _logits(7)
    out = verify(logits, [0, 1, 2], SampleSpec(temperature=2.0, top_k=3, seed=1, logprobs=True), 0)
    rows = torch.log_softmax(logits, -1)
    assert out.logprobs == pytest.approx([float(rows[i, t]) for i, t in enumerate(out.tokens)])


@pytest.mark.parametrize(
    ("logits", "drafts", "q", "named"),
    [
        (torch.zeros(2, V), [0, 1], None, "2 drafts need 3 rows"),
        (torch.zeros(3, V), [0, V], None, "outside the vocabulary"),
        (torch.zeros(3, V), [0, -1], None, "outside the vocabulary"),
        (torch.zeros(3, V), [0, 1], torch.full((1, V), 1 / V), "draft_probs must have shape"),
        (torch.zeros(3, V), [0, 1], torch.eye(V)[[1, 1]], "has probability 0 under its q"),
    ],
)
def test_bad_input_is_a_typed_error_naming_it(
    logits: torch.Tensor, drafts: list[int], q: torch.Tensor | None, named: str
) -> None:
    with pytest.raises(InvalidArgument, match=named):
        verify(logits, drafts, SampleSpec(temperature=1.0), 0, draft_probs=q)


# ---------------------------------------------------------------- the distribution


def chi_square_pvalue(counts: Counter[int], probs: torch.Tensor) -> float:
    """P-value of Pearson's chi-square test that ``counts`` were drawn from ``probs``
    (categories of expected count below 5 pooled into one; a draw of a token of
    probability 0 gives 0)."""
    n = sum(counts.values())
    expected = (probs.double() * n).tolist()
    if any(counts[t] and not expected[t] for t in range(len(expected))):
        return 0.0  # a token the target never gives
    big = [t for t in range(len(expected)) if expected[t] >= 5]
    small = [t for t in range(len(expected)) if 0 < expected[t] < 5]
    cells = [(counts[t], expected[t]) for t in big]
    if small:
        cells.append((sum(counts[t] for t in small), sum(expected[t] for t in small)))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    df = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))


def _draws(draft_model: bool) -> Iterator[tuple[int, ...]]:
    """Emitted tokens of DRAWS verifications of one fixed target (temperature 0.9, top-k
    5), drafts sampled from a different fixed q (or fixed n-gram drafts)."""
    logits = _logits(11)
    q_logits = _logits(12)
    spec0 = SampleSpec(temperature=0.9, top_k=5)
    q = torch.softmax(q_logits[:K], -1)
    for seed in range(DRAWS):
        spec = SampleSpec(temperature=0.9, top_k=5, seed=seed)
        if draft_model:
            g = torch.Generator().manual_seed(10_000 + seed)
            drafts = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(K)]
            yield verify(logits, drafts, spec, 0, draft_probs=q).tokens
        else:
            # A point-mass proposer: the same drafts every time, chosen likely under p.
            drafts = [int(target_probs(logits[i], spec0).argmax()) for i in range(K)]
            yield verify(logits, drafts, spec, 0).tokens


def _check_distribution(draft_model: bool) -> list[float]:
    """The p-value per position: the first emitted token against row 0's distribution,
    and each later one, given it was emitted, against its own row's."""
    logits = _logits(11)
    spec = SampleSpec(temperature=0.9, top_k=5)
    by_position: list[Counter[int]] = [Counter() for _ in range(2)]
    for tokens in _draws(draft_model):
        for i, t in enumerate(tokens[:2]):
            by_position[i][t] += 1
    assert sum(by_position[1].values()) > 300, "too few second tokens to test"
    return [chi_square_pvalue(c, target_probs(logits[i], spec)) for i, c in enumerate(by_position)]


@pytest.mark.parametrize("draft_model", [True, False], ids=["draft-model", "n-gram"])
def test_emitted_tokens_are_distributed_as_the_target(draft_model: bool) -> None:
    assert min(_check_distribution(draft_model)) > 1e-3


def _always_accept(px: torch.Tensor, qx: torch.Tensor, seed: int, index: int) -> bool:
    return True


def _residual_is_p(p: torch.Tensor, q: torch.Tensor, seed: int, index: int) -> int:
    g = torch.Generator().manual_seed(mix64(seed, index))
    return int(torch.multinomial(p, 1, generator=g))


@pytest.mark.parametrize(
    ("name", "planted"),
    [("_accept", _always_accept), ("_residual", _residual_is_p)],
    ids=["accept-always", "resample-from-p"],
)
def test_the_distribution_check_catches_a_wrong_sampler(
    monkeypatch: pytest.MonkeyPatch, name: str, planted: Callable[..., object]
) -> None:
    monkeypatch.setattr(rejection, name, planted)
    assert min(_check_distribution(draft_model=True)) < 1e-6
