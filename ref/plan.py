"""What one step will compute: the scheduler's output and the executor's input."""

from __future__ import annotations

from dataclasses import dataclass

from ref.kv import BlockCopy
from ref.request import FinishReason


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


@dataclass(frozen=True)
class CapacityFinish:
    request_id: str
    reason: FinishReason


@dataclass(frozen=True)
class StepPlan:
    step_index: int
    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[str, ...]
    admitted: tuple[str, ...]
    # Lone requests that can never grow in this pool: they finish with reason capacity.
    finished: tuple[CapacityFinish, ...]
    copies: tuple[BlockCopy, ...]

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks if c.is_prefill)

    @property
    def num_decode_requests(self) -> int:
        return sum(1 for c in self.chunks if not c.is_prefill)

    @property
    def is_empty(self) -> bool:
        return not self.chunks and not self.finished and not self.preempted
