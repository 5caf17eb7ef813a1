"""The decode-heavy workload every engine of ``make bench-peers`` runs.

N running requests (``SIZES``), block 16, prompts of 100 to 128 tokens (request ``i``:
``100 + i % 29`` tokens, distinct ids, so no prefix is shared), every request prefilled
and decoding before the first timed step, ``max_tokens`` out of reach, no eos. The pool
holds 64 blocks (1,024 tokens) per request, so no step ever preempts, and the token
budget is ``max(2048, 2 N)``. One timed step decodes one token for each of the N
requests; the sampled token is always ``SAMPLED`` (the model's output, built outside the
timed region by every worker).
"""

from __future__ import annotations

from dataclasses import dataclass

SIZES: tuple[int, ...] = (64, 256, 1024)
BLOCK_SIZE = 16
BLOCKS_PER_REQUEST = 64
MIN_PROMPT = 100
MAX_PROMPT = 128
MAX_TOKENS = 1 << 20
PREFILL_TOKEN = 5
"""The token sampled after each prompt (setup, untimed)."""
SAMPLED = 7
"""The token sampled in every timed step."""


@dataclass(frozen=True)
class Shape:
    """The engine limits of one configuration."""

    n: int
    prefix_caching: bool

    @property
    def key(self) -> str:
        return f"n{self.n}-{'cache' if self.prefix_caching else 'nocache'}"

    @property
    def num_blocks(self) -> int:
        return self.n * BLOCKS_PER_REQUEST

    @property
    def max_num_batched_tokens(self) -> int:
        return max(2048, 2 * self.n)

    @property
    def max_num_seqs(self) -> int:
        return self.n


def prompt_len(i: int) -> int:
    """Request ``i``'s prompt length: 100 to 128 tokens."""
    return MIN_PROMPT + i % (MAX_PROMPT - MIN_PROMPT + 1)


def prompt(i: int) -> list[int]:
    """Request ``i``'s prompt: distinct token ids in 1..30000 (no shared prefix)."""
    return [(i * 31 + j) % 30000 + 1 for j in range(prompt_len(i))]


def request_id(i: int) -> str:
    return f"r{i}"


def shapes(sizes: tuple[int, ...] = SIZES) -> list[Shape]:
    """Every configuration: each N with prefix caching off, then on."""
    return [Shape(n, caching) for n in sizes for caching in (False, True)]


# ------------------------------------------------------------------ the block pool
POOL_BLOCKS = 4096
"""Blocks in each engine's pool for the block-pool measurement."""
POOL_K = 32
"""Fresh blocks allocated (then freed) per timed round."""
POOL_REPS = 100
"""Timed rounds per message, so one message's protocol cost is spread over many."""


def pool_key(prefix_caching: bool, hashing: str) -> str:
    """The configuration key of a block-pool cell (``hashing``: ``same`` or ``native``)."""
    return f"pool-{'cache' if prefix_caching else 'nocache'}-{hashing}"


def pool_tokens(round_index: int) -> list[int]:
    """Round ``round_index``'s token ids: ``POOL_K`` full blocks no other round shares, so
    no round finds another's blocks in the prefix cache."""
    n = POOL_K * BLOCK_SIZE
    start = 1 + round_index * n
    return list(range(start, start + n))


def pool_warm_tokens(num_blocks: int) -> list[int]:
    """Token ids that fill ``num_blocks`` blocks before the rounds, with prefix caching on,
    so every free block is cached and each pop of a round evicts (negative: no round's)."""
    return list(range(-1, -(num_blocks * BLOCK_SIZE) - 1, -1))
