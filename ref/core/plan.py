"""What one step will compute: the scheduler's output and the executor's input.

A plan stores its scheduled requests as parallel tuples (one entry per request, in plan
order) so that a step with a thousand decodes costs a few list appends, not a thousand
record objects; :attr:`StepPlan.chunks` gives the same data as named records for readers
and checkers, built on first use.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from refserve.core.batch import DecodeRows
from refserve.core.request import FinishReason
from refserve.kv import BlockCopy


@dataclass(frozen=True)
class ScheduledChunk:
    """``num_new_tokens`` tokens of one request at positions ``[start, start + n)``.

    ``samples`` is true when the chunk reaches the end of the request's known tokens, so
    the step produces a logit to sample from (the last prefill chunk, or a decode).
    ``num_new_cached_tokens`` is the prefix-cache hit granted when the request was admitted
    in this step; ``start`` already counts it.
    """

    request_id: str
    start: int
    num_new_tokens: int
    samples: bool
    is_prefill: bool
    num_new_cached_tokens: int = 0
    draft_token_ids: tuple[int, ...] = ()
    """Speculative decoding: the drafts this decode verifies, its last ``len`` tokens
    (docs/SPECULATIVE.md); ``start + num_new_tokens - len`` is the request's length."""


@dataclass(frozen=True)
class PlannedFinish:
    """A request the plan finishes without computing: it can never fit (``capacity``) or
    it waited past the queue timeout (``timeout``)."""

    request_id: str
    reason: FinishReason


@dataclass(frozen=True)
class StepPlan:
    step_index: int
    request_ids: tuple[str, ...]
    starts: tuple[int, ...]
    num_new_tokens: tuple[int, ...]
    samples: tuple[bool, ...]
    is_prefill: tuple[bool, ...]
    num_new_cached_tokens: tuple[int, ...]
    preempted: tuple[str, ...] = ()
    admitted: tuple[str, ...] = ()
    finished: tuple[PlannedFinish, ...] = ()
    copies: tuple[BlockCopy, ...] = ()
    # Swap (ref/kv/host_pool.py). The executor applies, in this order: every
    # ``swap_out`` copy (device block ``src`` -> host block ``dst``), every ``swap_in``
    # copy (host ``src`` -> device ``dst``), the copy-on-write ``copies``, then the
    # forward. ``swapped_out``: requests whose KV this step moves to the host (preempted
    # victims, and paused turns retained on the host); ``swapped_in``: requests whose KV
    # comes back before their tokens are computed. ``dropped``: paused turns whose
    # device KV this step released because running or waiting work needed the blocks
    # and the host pool could not take it (they recompute when resumed).
    swap_out: tuple[BlockCopy, ...] = ()
    swap_in: tuple[BlockCopy, ...] = ()
    swapped_out: tuple[str, ...] = ()
    swapped_in: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()
    # The bulk decode path's rows of the persistent batch (ref/core/batch.py): the
    # first ``len(decode_rows.slots)`` entries. A cache for building inputs and
    # committing, not part of what the plan says (two plans equal without it).
    decode_rows: DecodeRows | None = field(default=None, compare=False, repr=False)
    # Speculative decoding: the draft tokens of each entry that verifies some, by id;
    # they are the entry's last tokens (docs/SPECULATIVE.md).
    drafts: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    @cached_property
    def chunks(self) -> tuple[ScheduledChunk, ...]:
        drafts = self.drafts
        return tuple(
            ScheduledChunk(rid, start, n, samples, is_prefill, cached, drafts.get(rid, ()))
            for rid, start, n, samples, is_prefill, cached in zip(
                self.request_ids,
                self.starts,
                self.num_new_tokens,
                self.samples,
                self.is_prefill,
                self.num_new_cached_tokens,
                strict=True,
            )
        )

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(n for n, p in zip(self.num_new_tokens, self.is_prefill, strict=True) if p)

    @property
    def num_decode_requests(self) -> int:
        return len(self.is_prefill) - sum(self.is_prefill)


@dataclass
class PlanBuilder:
    """Collects a step's entries; decodes are added in bulk."""

    step_index: int
    request_ids: list[str] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)
    is_prefill: list[bool] = field(default_factory=list)
    num_new_cached_tokens: list[int] = field(default_factory=list)
    decode_rows: DecodeRows | None = None  # the bulk decodes' batch rows (first entries)
    drafts: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def add(
        self,
        request_id: str,
        start: int,
        n: int,
        samples: bool,
        is_prefill: bool,
        cached: int = 0,
        drafts: tuple[int, ...] = (),
    ) -> None:
        """One entry of ``n`` tokens from ``start``; ``drafts``, if any, are its last."""
        if drafts:
            self.drafts[request_id] = drafts
        self.request_ids.append(request_id)
        self.starts.append(start)
        self.num_new_tokens.append(n)
        self.samples.append(samples)
        self.is_prefill.append(is_prefill)
        self.num_new_cached_tokens.append(cached)

    def add_decodes(self, rows: DecodeRows, starts: Sequence[int]) -> None:
        """The bulk decodes, before any other entry."""
        assert not self.request_ids, "bulk decodes come first in a plan"
        self.decode_rows = rows
        request_ids = rows.request_ids
        count = len(request_ids)
        self.request_ids.extend(request_ids)
        self.starts.extend(starts)
        self.num_new_tokens.extend([1] * count)
        self.samples.extend([True] * count)
        self.is_prefill.extend([False] * count)
        self.num_new_cached_tokens.extend([0] * count)

    def build(
        self,
        preempted: Sequence[str],
        admitted: Sequence[str],
        finished: Sequence[PlannedFinish],
        copies: Sequence[BlockCopy],
        swap_out: Sequence[BlockCopy] = (),
        swap_in: Sequence[BlockCopy] = (),
        swapped_out: Sequence[str] = (),
        swapped_in: Sequence[str] = (),
        dropped: Sequence[str] = (),
    ) -> StepPlan:
        return StepPlan(
            self.step_index,
            tuple(self.request_ids),
            tuple(self.starts),
            tuple(self.num_new_tokens),
            tuple(self.samples),
            tuple(self.is_prefill),
            tuple(self.num_new_cached_tokens),
            tuple(preempted),
            tuple(admitted),
            tuple(finished),
            tuple(copies),
            tuple(swap_out),
            tuple(swap_in),
            tuple(swapped_out),
            tuple(swapped_in),
            tuple(dropped),
            self.decode_rows,
            self.drafts,
        )
