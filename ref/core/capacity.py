"""The block rules of invariant CAP (docs/ARCHITECTURE.md, "Invariants"), each written once.

:func:`never_fits`: a request whose tokens need more blocks than the whole device pool
has can never run here. It is asked when a request arrives or a tool turn resumes
(rejected), when a fork or a recompute victim would wait to recompute (finished with
``capacity``), and before a victim is swapped (it would never be swapped back in).

:func:`admission_blocks`: the free blocks a waiting request must find before it is
admitted, by ``config.admission`` (example 2e: admission with growth headroom).
"""

from __future__ import annotations

from ref.core.config import Admission, SchedulerConfig
from ref.core.request import Request
from ref.errors import ExceedsCapacity
from ref.kv import BlockPool, PrefixHit
from spec.arith import blocks_needed


def never_fits(config: SchedulerConfig, num_tokens: int) -> bool:
    """``num_tokens`` tokens of KV need more blocks than the device pool holds."""
    return blocks_needed(num_tokens, config.block_size) > config.num_blocks


def require_fit(config: SchedulerConfig, request_id: str, num_tokens: int) -> None:
    """Raise :class:`ExceedsCapacity` when ``num_tokens`` tokens can never fit."""
    if never_fits(config, num_tokens):
        need = blocks_needed(num_tokens, config.block_size)
        raise ExceedsCapacity(request_id, need, config.num_blocks)


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
    held = len(hit.block_ids) if hit else 0
    fresh_first = max(0, blocks_needed(held * config.block_size + n, config.block_size) - held)
    revived = first - fresh_first  # cached blocks that leave the free queue on a hit
    return max(first, blocks_needed(total, config.block_size) - held + revived)
