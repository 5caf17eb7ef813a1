"""The prefill share of a step: the reserve that bounds starvation and the TBT SLO cap.

Decode-first starves prefill when decodes fill the budget (example 2d of
docs/ARCHITECTURE.md): :class:`PrefillBacklog` knows how long the longest waiting prefill
has gone without tokens, and past ``prefill_reserve_after_steps`` steps the decodes leave
``prefill_reserve_tokens`` of the budget to prefill (PROGRESS). :func:`prefill_cap` bounds
the prefill tokens a step may take so the tightest decode still meets its TBT SLO, and
:func:`chunk` cuts a prefill to what is left.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import KeysView, Sequence

from refserve.core.config import SchedulerConfig
from refserve.core.request import Request
from refserve.spec.arith import chunk_size


class PrefillBacklog:
    """Requests with prefill work left -> the last step in which they got any tokens (or
    were queued). Kept in order of that step (each update moves the entry to the end), so
    the longest waiting one is the first; counted per tenant for the policy."""

    def __init__(self) -> None:
        self._since: OrderedDict[str, int] = OrderedDict()
        self._per_tenant: Counter[str] = Counter()

    def mark(self, r: Request, step_index: int) -> None:
        """``r`` has prefill work left and got tokens (or was queued) in this step."""
        rid = r.request_id
        if rid not in self._since:
            self._per_tenant[r.tenant] += 1
        self._since[rid] = step_index
        self._since.move_to_end(rid)  # steps only grow: the order stays sorted

    def clear(self, r: Request) -> None:
        """``r`` has no prefill work left (it decodes, or it left the scheduler)."""
        if self._since.pop(r.request_id, None) is not None:
            self._per_tenant[r.tenant] -= 1
            assert self._per_tenant[r.tenant] >= 0, "a tenant counted as it was marked"
            if not self._per_tenant[r.tenant]:
                del self._per_tenant[r.tenant]

    @property
    def tenants(self) -> KeysView[str]:
        """The tenants with prefill work left: a live view, O(1) however many wait."""
        return self._per_tenant.keys()

    def reserve(self, config: SchedulerConfig, step_index: int) -> int:
        """Tokens the decodes of this step leave to prefill: the configured reserve once
        the longest waiting prefill has gone ``prefill_reserve_after_steps`` steps
        without tokens, else none."""
        if not self._since:
            return 0
        longest = next(iter(self._since.values()))  # the smallest: kept in order
        starving = step_index - longest >= config.prefill_reserve_after_steps
        return config.prefill_reserve_tokens if starving else 0


def prefill_cap(
    config: SchedulerConfig, decoded: Sequence[Request], now_ms: float, reserve: int
) -> int:
    """Prefill tokens this step may take so the tightest decode meets its TBT SLO.

    Example 3 of docs/ARCHITECTURE.md: with the decodes placed, the step's predicted time
    ``a + b*P + c*D (+ e*K)`` must end before the earliest next-token deadline
    (last token time + ``tbt_slo_ms``), so ``P <= (slack - a - c*D - e*K) / b``. A
    prefill starving past the reserve threshold still gets its reserved share.
    """
    model = config.step_cost
    if config.tbt_slo_ms is None or model is None or not decoded:
        return config.max_num_batched_tokens
    last = min(r.token_times_ms[-1] if r.token_times_ms else now_ms for r in decoded)
    slack = last + config.tbt_slo_ms - now_ms
    kv_read = sum(r.num_computed_tokens + 1 for r in decoded)
    # No slack: the reserve alone (>= 0).
    return max(reserve, model.prefill_room(slack, len(decoded), kv_read))


def chunk(config: SchedulerConfig, remaining: int, avail: int, num_computed: int) -> int:
    """Tokens of a prefill with ``remaining`` tokens left that fit ``avail`` ("Chunk size
    rules" in docs/ARCHITECTURE.md); without chunked prefill, all of them or none."""
    return prefill_chunk(
        remaining,
        avail,
        config.block_size,
        num_computed,
        chunked=config.enable_chunked_prefill,
        align_to_block=config.align_chunks_to_blocks,
    )


def prefill_chunk(
    num_remaining: int,
    budget_left: int,
    block_size: int,
    num_computed: int,
    *,
    chunked: bool,
    align_to_block: bool,
) -> int:
    """:func:`chunk` on plain numbers (PROGRESS; docs/ARCHITECTURE.md, "Chunk size rules").

    The contract: a chunk never exceeds the budget nor the tokens left; without chunked
    prefill a prompt runs whole or not at all; and a chunk is 0 ("not this step") exactly
    when nothing is left, no budget is, or the prompt does not fit whole (unchunked) or
    cannot reach the next block boundary (aligned). A chunk of 0 when the request could
    have run is the starvation bug; a chunk past the budget breaks the step's limit.

    pre: num_remaining >= 0
    pre: budget_left >= 0
    pre: block_size > 0
    pre: num_computed >= 0
    post: 0 <= __return__ <= min(num_remaining, budget_left)
    post: chunked or __return__ in (0, num_remaining)
    post: (__return__ == 0) == (num_remaining == 0 or budget_left == 0 or (budget_left < num_remaining and (not chunked or (align_to_block and num_computed % block_size + budget_left < block_size))))
    """  # noqa: E501 (CrossHair reads one condition per line)
    if not chunked:
        return num_remaining if num_remaining <= budget_left else 0
    return chunk_size(num_remaining, budget_left, block_size, align_to_block, num_computed)
