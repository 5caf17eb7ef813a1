"""Verification of drafted tokens: greedy matching and rejection sampling.

docs/SPECULATIVE.md. A proposer drafts ``k`` tokens after a sequence; the target model
scores the sequence's last token and the ``k`` drafts in one pass, which gives ``k + 1``
rows of logits: row ``i`` is the target's distribution for the token at draft position
``i`` (row ``k`` the one after every draft). :func:`verify` turns those rows into the
tokens the step emits: the accepted prefix of the drafts, then one token of the
target's own (a correction where a draft was rejected, or the "bonus" token after all
``k`` were accepted). So a step emits between 1 and ``k + 1`` tokens.

- Greedy (``temperature == 0``): draft ``i`` is accepted while it equals the argmax of
  row ``i``; the token after the accepted prefix is that row's argmax. The output is
  the greedy output without speculation, token for token.
- Sampling: the standard speculative sampling rule. Draft ``x`` at a position where the
  target gives ``p`` and the proposer gave ``q`` is accepted with probability
  ``min(1, p(x) / q(x))``; at the first rejection the emitted token is drawn from the
  normalised residual ``max(p - q, 0)``, and nothing after it is used. Each emitted
  token is then distributed exactly as ``p``. A proposer that drafts without a
  distribution (n-gram lookup) is the point mass ``q = onehot(x)``: acceptance with
  probability ``p(x)``, residual ``p`` without ``x``.

``p`` is the distribution :mod:`refserve.model.sampler` samples from (temperature, then
top-k and top-p), so speculation changes how many forward passes a sequence takes,
never what it samples from. Randomness follows the sampler's rule: every draw for output
index ``j`` comes from a generator seeded from ``(seed, j)`` alone (one stream for the
acceptance test, one for the residual; the bonus token is the sampler's own draw at its
index), so the result does not depend on the batch.

A row with a non-finite logit is reported as the sampler reports it
(:data:`~refserve.model.sampler.FAILED_TOKEN`, ``failed``): the tokens accepted before it
stand, nothing after it is emitted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from refserve.errors import InvalidArgument
from refserve.model.sampler import FAILED_TOKEN, SampleSpec, filter_logits, mix64

# Stream tags mixed into the per-index seed, so the acceptance test and the residual
# draw at one output index never reuse the sampler's own draw there.
_ACCEPT_STREAM = 0x5A_CC
_RESIDUAL_STREAM = 0x5E_51


@dataclass(frozen=True)
class Verification:
    """What one sequence emits after verification.

    ``tokens`` are the accepted drafts then one token of the target's (``num_accepted + 1``
    tokens); if the row after the accepted drafts could not be sampled (``failed``), that
    last token is :data:`~refserve.model.sampler.FAILED_TOKEN`. ``logprobs`` (if asked) are of
    the raw logits, one per emitted token (NaN for a failed one), as the sampler reports
    them.
    """

    tokens: tuple[int, ...]
    num_accepted: int
    failed: bool = False
    logprobs: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        assert len(self.tokens) == self.num_accepted + 1, "accepted drafts, then one token"


def target_probs(logits: torch.Tensor, spec: SampleSpec) -> torch.Tensor:
    """The distribution the sampler draws from for one fp32 logits row (temperature, top-k,
    top-p); a point mass at the argmax when greedy."""
    if spec.temperature == 0:
        return torch.nn.functional.one_hot(torch.argmax(logits), logits.shape[-1]).to(logits)
    return torch.softmax(filter_logits(logits / spec.temperature, spec.top_k, spec.top_p), -1)


def verify(
    logits: torch.Tensor,
    drafts: Sequence[int],
    spec: SampleSpec,
    output_index: int,
    draft_probs: torch.Tensor | None = None,
) -> Verification:
    """Accept a prefix of ``drafts`` against the target's ``logits`` ``[k + 1, V]`` (fp32).

    ``output_index`` is the output index of the first draft position (the number of
    tokens the sequence has output so far); ``draft_probs`` ``[k, V]`` is the proposer's
    distribution at each draft position, or None for a proposer that drafts without one
    (the point mass at each draft).
    """
    k = len(drafts)
    if logits.ndim != 2 or logits.shape[0] != k + 1:
        raise InvalidArgument(
            f"verify: {k} drafts need {k + 1} rows of logits, got shape {tuple(logits.shape)}"
        )
    vocab = logits.shape[1]
    if any(not 0 <= x < vocab for x in drafts):
        raise InvalidArgument(f"verify: a draft token is outside the vocabulary of {vocab}")
    if draft_probs is not None and tuple(draft_probs.shape) != (k, vocab):
        raise InvalidArgument(
            f"verify: draft_probs must have shape {(k, vocab)}, got {tuple(draft_probs.shape)}"
        )
    finite = torch.isfinite(logits).all(dim=-1).tolist()
    tokens: list[int] = []
    for i in range(k + 1):
        if not finite[i]:
            return _ending(tokens, FAILED_TOKEN, logits, spec, failed=True)
        if spec.temperature == 0:
            best = int(torch.argmax(logits[i]))
            if i == k or drafts[i] != best:
                return _ending(tokens, best, logits, spec)
            tokens.append(best)
            continue
        p = target_probs(logits[i], spec)
        if not bool((torch.isfinite(p).all() & (p.sum() > 0)).item()):
            return _ending(tokens, FAILED_TOKEN, logits, spec, failed=True)
        index = output_index + i
        if i == k:  # every draft accepted: the sampler's own draw at this index
            g = torch.Generator(device=p.device).manual_seed(mix64(spec.seed, index))
            return _ending(tokens, int(torch.multinomial(p, 1, generator=g)), logits, spec)
        x = drafts[i]
        q = _draft_row(draft_probs, i, x, vocab, p)
        if not _accept(p[x], q[x], spec.seed, index):
            return _ending(tokens, _residual(p, q, spec.seed, index), logits, spec)
        tokens.append(x)
    raise AssertionError("unreachable: row k always ends the loop")


def _draft_row(
    draft_probs: torch.Tensor | None, i: int, x: int, vocab: int, p: torch.Tensor
) -> torch.Tensor:
    if draft_probs is None:
        return torch.nn.functional.one_hot(torch.tensor(x), vocab).to(p)
    q = draft_probs[i].to(p)
    if not bool(q[x] > 0):
        # A draft sampled from q has q(x) > 0: the proposer and its distribution disagree.
        raise InvalidArgument(f"verify: draft {i} (token {x}) has probability 0 under its q")
    return q


def _accept(px: torch.Tensor, qx: torch.Tensor, seed: int, index: int) -> bool:
    """Accept with probability ``min(1, p(x) / q(x))`` (``q(x) > 0``)."""
    g = torch.Generator().manual_seed(mix64(mix64(seed, index), _ACCEPT_STREAM))
    u = float(torch.rand((), generator=g))
    return u * float(qx) < float(px)  # u < p/q without dividing by a tiny q


def _residual(p: torch.Tensor, q: torch.Tensor, seed: int, index: int) -> int:
    """A token from ``max(p - q, 0)`` normalised (never empty after a rejection: a
    rejection needs ``q(x) > p(x)``, so ``p`` puts its mass elsewhere too)."""
    r = torch.clamp(p - q, min=0)
    total = float(r.sum())
    if not total > 0:  # p == q up to rounding: a rejection had probability ~0
        r, total = p, float(p.sum())
    g = torch.Generator(device=p.device).manual_seed(mix64(mix64(seed, index), _RESIDUAL_STREAM))
    return int(torch.multinomial(r / total, 1, generator=g))


def _ending(
    tokens: list[int], last: int, logits: torch.Tensor, spec: SampleSpec, *, failed: bool = False
) -> Verification:
    emitted = (*tokens, last)
    logprobs = None
    if spec.logprobs:
        rows = torch.log_softmax(logits[: len(emitted)], dim=-1)
        logprobs = tuple(
            float("nan") if failed and i == len(emitted) - 1 else float(rows[i, t])
            for i, t in enumerate(emitted)
        )
    return Verification(emitted, len(tokens), failed, logprobs)
