"""The block rules of invariant CAP (docs/ARCHITECTURE.md, "Invariants"), each written once.

:func:`never_fits`: a request whose tokens need more blocks than the whole device pool
has can never run here. It is asked when a request arrives or a tool turn resumes
(rejected), when a fork or a recompute victim would wait to recompute (finished with
``capacity``), and before a victim is swapped (it would never be swapped back in).

:func:`admission_blocks`: the free blocks a waiting request must find before it is
admitted, by ``config.admission`` (example 2e: admission with growth headroom).

With layer groups (``config.kv_groups``) a request's blocks are not a function of its
length alone: a window group holds the blocks from its window on, so a chunk of many
tokens holds more than the same tokens computed one at a time. :func:`peak` counts the
latter (spec/groups.py's ``peak_blocks``), and :func:`chunk_limit` cuts every prefill
chunk so a request never holds more than that: the count behind the capacity refusal
and admission is then the most blocks the request ever holds.

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
from refserve.spec.groups import layout_blocks, most_new_tokens, peak_blocks


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


def peak(config: SchedulerConfig, num_tokens: int) -> int:
    """The most blocks ``num_tokens`` tokens of KV hold at once, over every layer group
    (one group: a block per ``block_size`` tokens)."""
    if config.grouped:
        return peak_blocks(config.kv_groups, max(1, num_tokens), config.block_size)
    return blocks_needed(num_tokens, config.block_size)


def fewest_blocks(config: SchedulerConfig, num_tokens: int) -> int:
    """The fewest blocks a pool must have to compute ``num_tokens`` tokens of KV: their
    :func:`peak`, or without chunked prefill, where a prompt (or a recompute) takes all
    its tokens in one step, every group's blocks for all of them at once."""
    if config.grouped and not config.enable_chunked_prefill:
        return layout_blocks(config.kv_groups, 0, max(1, num_tokens), config.block_size)
    return peak(config, num_tokens)


def never_fits(config: SchedulerConfig, num_tokens: int) -> bool:
    """``num_tokens`` tokens of KV need more blocks than the device pool holds."""
    if config.grouped:
        return fewest_blocks(config, num_tokens) > config.num_blocks
    return exceeds_pool(num_tokens, config.block_size, config.num_blocks)


def require_fit(config: SchedulerConfig, request_id: str, num_tokens: int) -> None:
    """Raise :class:`ExceedsCapacity` when ``num_tokens`` tokens can never fit."""
    if never_fits(config, num_tokens):
        raise ExceedsCapacity(request_id, fewest_blocks(config, num_tokens), config.num_blocks)


def chunk_limit(config: SchedulerConfig, num_computed: int, num_tokens: int) -> int:
    """The most tokens a prefill chunk from ``num_computed`` may take, in a grouped
    layout, so its request of ``num_tokens`` tokens holds no more than their
    :func:`peak` (at least 1 while ``num_computed < num_tokens``: the peak counts the
    next token alone).

    Without it a chunk's window blocks could make a request that :func:`never_fits`
    accepted unable to run in its pool, and admission's count short of what it holds.
    """
    limit = peak(config, num_tokens)
    return most_new_tokens(config.kv_groups, num_computed, limit, config.block_size)


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
    if config.grouped:
        return _grouped_request_blocks(config, first, n, total, hit)
    held = len(hit.block_ids) if hit else 0
    return whole_request_blocks(first, held, n, total, config.block_size)


def _grouped_request_blocks(
    config: SchedulerConfig, first: int, n: int, total: int, hit: PrefixHit | None
) -> int:
    """:func:`whole_request_blocks` over layer groups: the request's peak over every
    group, less what its first chunk holds after the hit, on top of ``first``."""
    cached = hit.num_tokens if hit else 0
    held_first = layout_blocks(config.kv_groups, cached, n, config.block_size)
    return max(first, first + peak(config, total) - held_first)
