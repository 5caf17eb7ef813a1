"""Pure arithmetic of the paged KV cache, with CrossHair contracts.

These helpers are the single definition of the formulas in docs/ARCHITECTURE.md
("Vocabulary"): blocks needed for n tokens, the slot of a position, the cacheable prefix of
a prompt, how a prompt is split into chunks, and the decode rules (a token that starts or
fills a block, the length limit). ``make crosshair`` proves the ``post:``
conditions for all inputs satisfying the ``pre:`` conditions (or finds a counterexample).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ``a`` and positive ``b``.

    pre: a >= 0
    pre: b > 0
    post: __return__ * b >= a
    post: (__return__ - 1) * b < a or __return__ == 0
    """
    return -(-a // b)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks a block table must hold to store ``num_tokens`` tokens (example 0b: 17 -> 2).

    pre: num_tokens >= 0
    pre: block_size > 0
    post: __return__ * block_size >= num_tokens
    post: __return__ == 0 or (__return__ - 1) * block_size < num_tokens
    """
    # cdiv written out: the per-request path asks this several times per request per
    # step, and a nested call costs as much as the arithmetic.
    return -(-num_tokens // block_size)


def new_blocks_needed(num_stored: int, num_new_tokens: int, num_held: int, block_size: int) -> int:
    """Extra blocks to append so a table holding ``num_held`` blocks stores more tokens.

    pre: num_stored >= 0
    pre: num_new_tokens >= 0
    pre: block_size > 0
    pre: num_held * block_size >= num_stored
    post: __return__ >= 0
    post: (num_held + __return__) * block_size >= num_stored + num_new_tokens
    """
    return max(0, -(-(num_stored + num_new_tokens) // block_size) - num_held)  # blocks_needed


def slot_of(block_id: int, position: int, block_size: int) -> int:
    """Physical slot of ``position`` given the block holding it (POS invariant).

    The block table entry is ``block_table[position // block_size]``; callers pass it in
    so this stays a pure formula: ``block_id * block_size + position % block_size``.

    pre: block_id >= 0
    pre: position >= 0
    pre: block_size > 0
    post: __return__ // block_size == block_id
    post: __return__ % block_size == position % block_size
    """
    return block_id * block_size + position % block_size


def max_cacheable_tokens(num_prompt_tokens: int, block_size: int) -> int:
    """Most prompt tokens a prefix-cache hit may cover (PREFIX invariant).

    Only full blocks are cached, and the last prompt token is always recomputed so the
    step that finishes the prompt has a logit to sample from.

    pre: num_prompt_tokens >= 1
    pre: block_size > 0
    post: __return__ % block_size == 0
    post: 0 <= __return__ <= num_prompt_tokens - 1
    post: num_prompt_tokens - 1 - __return__ < block_size
    """
    return ((num_prompt_tokens - 1) // block_size) * block_size


def chunk_size(
    num_remaining: int, budget_left: int, block_size: int, align_to_block: bool, num_computed: int
) -> int:
    """Tokens a prefill chunk may take this step.

    Without alignment the chunk is whatever the budget leaves (example 1: B gets 7, then 5).
    With ``align_to_block`` a chunk that does not finish the prompt ends on a block
    boundary (example 3: budget 1021 left, chunk 1008 = 63 blocks), so no partial block is
    carried between steps.

    The last two conditions say what alignment may cost: a chunk is 0 ("not this step")
    only when nothing is left, no budget is, or an aligned chunk cannot reach the next
    block boundary; and cutting back to a boundary gives up less than one block.

    pre: num_remaining >= 0
    pre: budget_left >= 0
    pre: block_size > 0
    pre: num_computed >= 0
    post: 0 <= __return__ <= min(num_remaining, budget_left)
    post: __return__ in (0, num_remaining) or not align_to_block or (num_computed + __return__) % block_size == 0
    post: (__return__ == 0) == (num_remaining == 0 or budget_left == 0 or (align_to_block and budget_left < num_remaining and num_computed % block_size + budget_left < block_size))
    post: min(num_remaining, budget_left) - __return__ < block_size
    """
    n = min(num_remaining, budget_left)
    if align_to_block and n < num_remaining:
        end = ((num_computed + n) // block_size) * block_size
        n = max(0, end - num_computed)
    return n


# --------------------------------------------------------------- the decode rules
# Each rule below is written once, for one request, in operators numpy broadcasts: the
# persistent batch (ref/core/batch.py) applies the very same function to a column of
# rows (arrays in, arrays out), the per-request path to one request's ints. The
# ``*_rows`` names are those functions, typed for arrays (docs/ARCHITECTURE.md,
# "The persistent batch"); they are not second implementations.


def full_blocks(num_tokens: int, block_size: int) -> int:
    """Blocks that ``num_tokens`` tokens fill completely: the blocks a prefix cache may
    key (PREFIX: only full blocks are cached).

    pre: num_tokens >= 0
    pre: block_size > 0
    post: __return__ * block_size <= num_tokens < (__return__ + 1) * block_size
    post: __return__ <= blocks_needed(num_tokens, block_size) <= __return__ + 1
    """
    return num_tokens // block_size


def logical_block(position: int, block_size: int) -> int:
    """The index in a block table of the block holding ``position`` (POS:
    ``block_table[logical_block(p)]`` holds the K/V of position ``p``).

    pre: position >= 0
    pre: block_size > 0
    post: __return__ * block_size <= position < (__return__ + 1) * block_size
    post: __return__ < blocks_needed(position + 1, block_size)
    """
    return position // block_size


def block_offset(position: int, block_size: int) -> int:
    """The slot of ``position`` within its block (POS; :func:`slot_of` adds the block's
    first slot).

    pre: position >= 0
    pre: block_size > 0
    post: 0 <= __return__ < block_size
    post: (position - __return__) % block_size == 0
    post: (__return__ == 0) == (blocks_needed(position + 1, block_size) > blocks_needed(position, block_size))
    post: (__return__ == block_size - 1) == (blocks_needed(position + 1, block_size) * block_size == position + 1)
    """
    return position % block_size


def starts_block(offset: int) -> bool:
    """A token at block offset ``offset`` (:func:`block_offset`) is the first of a new
    block: storing it needs a fresh block (POS). A decode needs a block for this reason
    or to copy a shared last block before writing it (copy-on-write).

    pre: offset >= 0
    post: __return__ == (offset == 0)
    """
    return offset == 0


def fills_block(offset: int, block_size: int) -> bool:
    """A token at block offset ``offset`` takes its block's last slot: after it the block
    is full and, with prefix caching, indexed under its chain key (PREFIX).

    pre: block_size > 0
    pre: 0 <= offset < block_size
    post: __return__ == (offset + 1 == block_size)
    """
    return offset == block_size - 1


def length_limit(num_prompt_tokens: int, max_tokens: int, max_len: int) -> int:
    """The token count (prompt and outputs) at which a request stops for length: its
    ``max_tokens`` outputs, or ``max_len`` tokens in all (LENGTH).

    pre: num_prompt_tokens >= 1
    pre: max_tokens >= 1
    pre: max_len > num_prompt_tokens
    post: num_prompt_tokens < __return__ <= max_len
    post: __return__ - num_prompt_tokens <= max_tokens
    """
    return min(num_prompt_tokens + max_tokens, max_len)


def reaches_length(num_tokens: int, limit: int) -> bool:
    """A request holding ``num_tokens`` tokens has reached its :func:`length_limit`.

    pre: num_tokens >= 0
    post: __return__ == (num_tokens >= limit)
    """
    return num_tokens >= limit


if TYPE_CHECKING:
    Ints = npt.NDArray[np.int64]
    Bools = npt.NDArray[np.bool_]

blocks_needed_rows = cast("Callable[[Ints, int], Ints]", blocks_needed)
logical_block_rows = cast("Callable[[Ints, int], Ints]", logical_block)
block_offset_rows = cast("Callable[[Ints, int], Ints]", block_offset)
slot_of_rows = cast("Callable[[Ints, Ints, int], Ints]", slot_of)
starts_block_rows = cast("Callable[[Ints], Bools]", starts_block)
fills_block_rows = cast("Callable[[Ints, int], Bools]", fills_block)
reaches_length_rows = cast("Callable[[Ints, Ints], Bools]", reaches_length)
