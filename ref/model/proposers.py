"""Draft proposers for speculative decoding (docs/SPECULATIVE.md, "Proposers").

A proposer looks at a sequence's tokens and drafts up to ``k`` tokens that might come
next; :func:`refserve.model.rejection.verify` then keeps the prefix the target model agrees
with. A proposer can only change how many tokens a step emits, never which (greedy) or
from what distribution (sampling), so a bad proposer is slow, not wrong.

:class:`NgramProposer` is prompt lookup: it needs no model. If the last ``n`` tokens of
the sequence occurred before, the tokens that followed that earlier occurrence are the
draft. Repetitive text (code, quoted context, lists) is where it pays.

:class:`DraftModelProposer` samples the draft from a smaller model that shares the
target's vocabulary, and hands :func:`~refserve.model.rejection.verify` its distributions.

The engine knows neither: it talks to a :class:`Proposer`, the protocol both implement
(its number of drafts, a check against the target model, and :meth:`Proposer.draft`), so
a new proposer needs no edit of the engine (docs/SPECULATIVE.md, "The engine").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from refserve.errors import InvalidArgument
from refserve.model.attention import AttentionMetadata
from refserve.model.config import ModelConfig
from refserve.model.llama import KVCache, LlamaModel
from refserve.model.rejection import target_probs
from refserve.model.sampler import SampleSpec, mix64
from refserve.spec.arith import blocks_needed
from refserve.values import is_int

# Mixed into the per-index seed: the draft's own draw never reuses the target's.
_DRAFT_STREAM = 0xD2_AF


@dataclass(frozen=True)
class Draft:
    """Drafted tokens and the proposer's distribution ``[len(tokens), V]`` at each, which
    :func:`~refserve.model.rejection.verify` needs to keep the target's distribution; ``None``
    for a proposer whose drafts are point masses (n-gram lookup)."""

    tokens: tuple[int, ...]
    probs: torch.Tensor | None = None


@runtime_checkable
class Proposer(Protocol):
    """What the engine asks of a draft proposer (docs/SPECULATIVE.md, "The engine").

    A proposer changes how many tokens a step emits, never which (module doc), so the
    engine checks only the shape of its answer: ``Scheduler.propose`` refuses more than
    ``num_speculative_tokens`` drafts or a negative one, verification a draft outside
    the vocabulary, and decides which of the rest are kept.
    """

    @property
    def num_speculative_tokens(self) -> int:
        """The most drafts per step: the scheduler's ``num_speculative_tokens``."""
        ...

    def check_target(self, target: ModelConfig) -> None:
        """Raise :class:`InvalidArgument` if this proposer cannot draft for ``target``
        (drafts must be the target's token ids)."""
        ...

    def draft(
        self, token_ids: Sequence[int], spec: SampleSpec, output_index: int, limit: int
    ) -> Draft:
        """At most ``limit`` drafts after a decoding sequence's ``token_ids``, under its
        sampling ``spec``; ``output_index`` is the output index of the first draft (the
        seed's counter, as in :func:`~refserve.model.rejection.verify`)."""
        ...


def check_proposer(proposer: object, target: ModelConfig) -> Proposer:
    """``proposer`` if it implements :class:`Proposer` and accepts ``target``, else
    :class:`InvalidArgument`."""
    if not isinstance(proposer, Proposer):
        raise InvalidArgument(
            "proposer must implement refserve.model.proposers.Proposer (num_speculative_tokens, "
            f"check_target, draft), such as an NgramProposer; got {type(proposer).__name__}"
        )
    proposer.check_target(target)
    return proposer


@dataclass(frozen=True)
class NgramProposer:
    """Prompt-lookup drafts: ``num_speculative_tokens`` tokens after an earlier occurrence
    of the sequence's last ``n`` tokens, ``n`` from ``max_n`` down to ``min_n``.

    Choices (vLLM's n-gram proposer makes others; both are valid, see docs): the longest
    matching suffix wins, and among its earlier occurrences the latest one, the nearest
    context; the occurrence may overlap the suffix itself (a run ``a a a`` drafts
    ``a``). A draft may be shorter than ``k`` when the occurrence is near the end.
    """

    num_speculative_tokens: int
    min_n: int = 1
    max_n: int = 3

    def __post_init__(self) -> None:
        for name, low in (("num_speculative_tokens", 1), ("min_n", 1), ("max_n", 1)):
            value = getattr(self, name)
            if not is_int(value) or value < low:
                raise InvalidArgument(
                    f"NgramProposer: {name} must be an int >= {low}, got {value!r}"
                )
        if self.max_n < self.min_n:
            raise InvalidArgument(
                f"NgramProposer: max_n ({self.max_n}) is below min_n ({self.min_n})"
            )

    def propose(self, token_ids: Sequence[int], limit: int | None = None) -> tuple[int, ...]:
        """The draft after ``token_ids`` (empty if no suffix occurred before), at most
        ``limit`` tokens if given (what the request may still output)."""
        k = self.num_speculative_tokens
        if limit is not None:
            k = min(k, limit)
        tokens = list(token_ids)
        end = len(tokens)
        if k <= 0:
            return ()
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            suffix = tokens[end - n :]
            first = suffix[0]
            # Latest start j < end - n whose n tokens equal the suffix (at least one
            # token follows it).
            for j in range(end - n - 1, -1, -1):
                if tokens[j] == first and tokens[j : j + n] == suffix:
                    return tuple(tokens[j + n : j + n + k])
        return ()

    def check_target(self, target: ModelConfig) -> None:
        """Any target: the drafts are tokens of the sequence itself."""

    def draft(
        self, token_ids: Sequence[int], spec: SampleSpec, output_index: int, limit: int
    ) -> Draft:
        """:meth:`propose`; lookup needs neither the sampling spec nor the index."""
        return Draft(self.propose(token_ids, limit))


class DraftModelProposer:
    """Drafts sampled from ``model``, a smaller Llama sharing the target's vocabulary.

    Each draft token is drawn from the draft model's distribution under the request's
    own sampling settings (temperature, top-k, top-p; the argmax when greedy), with a
    generator seeded from ``(seed, output index)`` in a stream of its own, so a draft
    does not depend on the batch either. The target as its own draft proposes exactly
    what it would sample greedily: everything is accepted.

    The draft's KV is recomputed from the tokens at every call (a prefill of the
    sequence, then ``k - 1`` one-token steps, in a private cache): nothing of the draft
    has to follow the target's preemptions, forks and rollbacks. That is the simple
    choice of a reference, O(sequence length) per step; an engine built for speed
    keeps the draft's KV paged beside the target's.
    """

    def __init__(
        self, model: LlamaModel, num_speculative_tokens: int, block_size: int = 16
    ) -> None:
        for name, value in (
            ("num_speculative_tokens", num_speculative_tokens),
            ("block_size", block_size),
        ):
            if not is_int(value) or value < 1:
                raise InvalidArgument(
                    f"DraftModelProposer: {name} must be an int >= 1, got {value!r}"
                )
        self.model = model
        self.num_speculative_tokens = num_speculative_tokens
        self.block_size = block_size

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def check_target(self, target: ModelConfig) -> None:
        """The draft model must share the target's vocabulary: its drafts are token ids."""
        if self.vocab_size != target.vocab_size:
            raise InvalidArgument(
                f"the draft model's vocabulary ({self.vocab_size}) differs from the "
                f"target's ({target.vocab_size}): its drafts would be other tokens"
            )

    def draft(
        self, token_ids: Sequence[int], spec: SampleSpec, output_index: int, limit: int
    ) -> Draft:
        """:meth:`propose`, with its distributions."""
        return self.propose(token_ids, spec, output_index, limit)

    def propose(
        self,
        token_ids: Sequence[int],
        spec: SampleSpec,
        output_index: int,
        limit: int | None = None,
    ) -> Draft:
        """Up to ``num_speculative_tokens`` (and ``limit``) tokens after ``token_ids``;
        ``output_index`` is the output index of the first (as in
        :func:`~refserve.model.rejection.verify`)."""
        k = (
            self.num_speculative_tokens
            if limit is None
            else min(limit, self.num_speculative_tokens)
        )
        n = len(token_ids)
        if n == 0:
            raise InvalidArgument("DraftModelProposer.propose: token_ids is empty")
        vocab = self.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise InvalidArgument(
                f"DraftModelProposer.propose: a token is outside the draft model's vocabulary "
                f"of {vocab}"
            )
        if k <= 0:
            return Draft((), torch.zeros(0, vocab))
        bs = self.block_size
        num_blocks = blocks_needed(n + k, bs)
        cache = KVCache(
            self.model.config, num_blocks, bs, dtype=self.model.dtype, device=self.model.device
        )
        logits = self._forward(list(token_ids), 0, cache)
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        for i in range(k):
            q = target_probs(logits, spec)
            if spec.temperature == 0:
                x = int(torch.argmax(q))
            else:
                seed = mix64(mix64(spec.seed, output_index + i), _DRAFT_STREAM)
                g = torch.Generator(device=q.device).manual_seed(seed)
                x = int(torch.multinomial(q, 1, generator=g))
            tokens.append(x)
            probs.append(q.cpu())
            if i + 1 < k:
                logits = self._forward([x], n + i, cache)
        return Draft(tuple(tokens), torch.stack(probs))

    def _forward(self, tokens: list[int], start: int, cache: KVCache) -> torch.Tensor:
        """The fp32 logits after ``tokens`` at positions ``start ..``, their K/V written
        into ``cache`` (blocks 0, 1, ... in order, so a slot is its position)."""
        dev = self.model.device
        t = len(tokens)
        end = start + t
        meta = AttentionMetadata(
            slot_mapping=torch.arange(start, end, device=dev),
            query_start_loc=torch.tensor([0, t], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([end], dtype=torch.int32, device=dev),
            block_tables=torch.arange(cache.num_blocks, dtype=torch.int32, device=dev)[None],
            query_start_loc_host=(0, t),
            seq_lens_host=(end,),
        )
        ids = torch.tensor(tokens, dtype=torch.int64, device=dev)
        positions = torch.arange(start, end, device=dev)
        hidden = self.model.forward(ids, positions, meta, cache)
        return self.model.logits(hidden[-1:])[0]
