"""The block rules of invariant CAP (docs/ARCHITECTURE.md, "Invariants"), each written once.

:func:`never_fits`: a request whose tokens need more blocks than the whole device pool
has can never run here. It is asked when a request arrives or a tool turn resumes
(rejected), when a fork or a recompute victim would wait to recompute (finished with
``capacity``), and before a victim is swapped (it would never be swapped back in).

:func:`admission_blocks`: the free blocks a waiting request must find before it is
admitted, by ``config.admission`` (example 2e: admission with growth headroom).

Their arithmetic is in two pure functions, :func:`exceeds_pool` and
:func:`whole_request_blocks`, whose CrossHair contracts ``make crosshair`` proves
(docs/ARCHITECTURE.md, "Verification practice").
"""

from __future__ import annotations

from refserve.core.config import Admission, SchedulerConfig
from refserve.core.request import Request
from refserve.errors import ExceedsCapacity
from refserve.kv import BlockPool, PrefixHit
from refserve.spec.arith import blocks_needed
from refserve.spec.groups import layout_blocks, layout_peak


def exceeds_pool(num_tokens: int, block_size: int, num_blocks: int) -> bool:
    """``num_tokens`` tokens of KV need more blocks than a pool of ``num_blocks`` holds (CAP).

    The rule counts whole blocks; the contract compares with the pool's slots directly,
    so rounding up to blocks neither lets through a request one token too long nor
    refuses one that fills the last slot exactly.

    pre: num_tokens >= 0
    pre: block_size > 0
    pre: num_blocks >= 0
    post: __return__ == (num_tokens > num_blocks * block_size)
    """
    return blocks_needed(num_tokens, block_size) > num_blocks


def whole_request_blocks(
    first: int, num_held: int, num_new: int, num_total: int, block_size: int
) -> int:
    """Free blocks to find before admitting a request whose whole ``num_total`` tokens
    must fit (CAP, example 2e), when its first chunk of ``num_new`` tokens after a prefix
    hit of ``num_held`` blocks asks ``first`` of the pool.

    ``first`` is the fresh blocks of the first chunk plus the hit's cached blocks that
    leave the free queue (revived, so they count against the free blocks too). Once
    admitted the request holds ``blocks_needed(num_held * block_size + num_new)`` blocks,
    so ``__return__ - first`` more make it hold the whole request: the second condition
    says they cover ``num_total`` tokens, the third that no fewer would, the first that
    the first chunk is never asked less than it takes.

    pre: block_size > 0
    pre: num_held >= 0
    pre: num_new >= 0
    pre: num_total >= num_held * block_size + num_new
    pre: first >= blocks_needed(num_held * block_size + num_new, block_size) - num_held
    post: __return__ >= first
    post: (__return__ - first + blocks_needed(num_held * block_size + num_new, block_size)) * block_size >= num_total
    post: __return__ == first or (__return__ - first + blocks_needed(num_held * block_size + num_new, block_size) - 1) * block_size < num_total
    """  # noqa: E501 (CrossHair reads one condition per line)
    fresh_first = max(0, blocks_needed(num_held * block_size + num_new, block_size) - num_held)
    revived = first - fresh_first  # cached blocks that leave the free queue on a hit
    return max(first, blocks_needed(num_total, block_size) - num_held + revived)


def never_fits(config: SchedulerConfig, num_tokens: int) -> bool:
    """``num_tokens`` tokens of KV need more blocks than the device pool holds (over
    every layer group at their peak, when there are several)."""
    if config.grouped:
        return peak(config, num_tokens) > config.num_blocks
    return exceeds_pool(num_tokens, config.block_size, config.num_blocks)


def require_fit(config: SchedulerConfig, request_id: str, num_tokens: int) -> None:
    """Raise :class:`ExceedsCapacity` when ``num_tokens`` tokens can never fit."""
    if never_fits(config, num_tokens):
        raise ExceedsCapacity(request_id, peak(config, num_tokens), config.num_blocks)


def peak(config: SchedulerConfig, num_tokens: int) -> int:
    """The most blocks ``num_tokens`` tokens of KV hold at once, in steps of at most the
    token budget (spec/groups.py ``peak_blocks``: a window group holds a step's every
    block; the whole prompt is one step without chunked prefill, and within the budget)."""
    c = config
    return layout_peak(c.kv_groups, num_tokens, c.block_size, c.max_num_batched_tokens)


def admission_blocks(
    config: SchedulerConfig, pool: BlockPool, r: Request, n: int, hit: PrefixHit | None
) -> int:
    """Free blocks waiting ``r`` must find to be admitted with ``n`` tokens after ``hit``."""
    first = pool.blocks_to_allocate(r.request_id, n, hit)
    if config.admission is Admission.FIRST_CHUNK:
        return first
    if config.admission is Admission.PROMPT:
        total = r.num_tokens
    else:
        total = min(r.num_prompt_tokens + r.stop.max_tokens, config.max_len)
    if config.grouped:  # from what its first chunk holds to its peak, on top of ``first``
        held = layout_blocks(config.kv_groups, hit.num_tokens if hit else 0, n, config.block_size)
        return max(first, first + peak(config, total) - held)
    held = len(hit.block_ids) if hit else 0
    return whole_request_blocks(first, held, n, total, config.block_size)
