"""nano-vllm#144 (its second bug) fixed on nano-vllm-fork 20260210: a block-aligned prompt
whose blocks are all cached no longer schedules zero tokens.

The fork ships the bug (conformance/FINDINGS_nanovllm.md, finding 2), so this module is
the other side of the pair: the released fork is the buggy adapter, and this module puts
upstream's fix in, on its own objects only.

* Tracker: https://github.com/GeeeekExplorer/nano-vllm/issues/144 ("Two bugs", item 2:
  a prompt whose length is a multiple of the block size and whose every block hits the
  prefix cache gets ``seqlen_q == 0``, and flash-attn's varlen kernel raises). A
  community fix, PR #199 (fall back to ``len - 1`` cached tokens), was closed.
* Fix upstream: commit f64d821c2057e2f45d0accccf5b39fd6c1438473 ("fix chunked prefill
  bugs and refactor", PR #218): the prefix lookup moved into ``can_allocate`` and stops
  one block short, so the last block is never a hit (abridged)::

      -    def can_allocate(self, seq: Sequence) -> bool:
      -        return len(self.free_block_ids) >= seq.num_blocks
      +    def can_allocate(self, seq: Sequence) -> int:
               h = -1
      -        for i in range(seq.num_blocks):
      +        num_cached_blocks = 0
      +        num_new_blocks = seq.num_blocks
      +        for i in range(seq.num_blocks - 1):
                   token_ids = seq.block(i)
      -            h = self.compute_hash(token_ids, h) if len(token_ids) == self.block_size else -1
      +            h = self.compute_hash(token_ids, h)
                   block_id = self.hash_to_block_id.get(h, -1)
                   if block_id == -1 or self.blocks[block_id].token_ids != token_ids:
      -                cache_miss = True
      +                break
      +            num_cached_blocks += 1

  with ``allocate(seq, num_cached_blocks)`` taking that count (and
  ``seq.num_cached_tokens = num_cached_blocks * self.block_size``).

The fork's code, ``nanovllm/engine/block_manager.py`` as installed in
``.venv-nanovllm``, ``BlockManager.allocate``, lines 59-82: the lookup runs over every
block, the last included::

    63          for i in range(seq.num_blocks):
    64              token_ids = seq.block(i)
    65              h = self.compute_hash(token_ids, h) if len(token_ids) == self.block_size else -1
    66              block_id = self.hash_to_block_id.get(h, -1)
    67              if block_id == -1 or self.blocks[block_id].token_ids != token_ids:
    68                  cache_miss = True
    ...
    73                  seq.num_cached_tokens += self.block_size

and ``ModelRunner.prepare_prefill`` (``model_runner.py`` lines 251-253) computes
``seqlen_q = seqlen - seq.num_cached_tokens``: 0 for a fully cached aligned prompt.

How the fix is applied here. Upstream's hunk comes with upstream's new scheduler
(``can_allocate`` returns a count, ``allocate`` takes it, hashes are registered after the
step in ``hash_blocks``), which the fork's ``Scheduler.schedule`` (``scheduler.py`` lines
71-75: ``not self.block_manager.can_allocate(seq)`` then ``allocate(seq)``) cannot call.
So the fix is ported into the fork's own interface: :class:`BlockManager144Fixed`'s
``allocate`` is the fork's, line for line, except that the lookup ends where upstream's
``range(seq.num_blocks - 1)`` ends: the last block is always taken as a miss (a fresh
block, its hash still indexed when it is full, as the fork does for every miss). The
fork's ``can_allocate`` (all ``num_blocks`` free, cache hits not deducted) and its
allocation-time indexing (nano-vllm#208's behaviour, a declared convention here) stay.

How it matches the tracker: with the fork, the suite's ``bug-fully-cached-prompt-concurrent``
(bs 4; A an 8-token prompt still running when B repeats it) schedules B with 0 tokens,
``num_cached_tokens`` 8 of 8 (TOKEN "scheduled with no tokens", PREFIX "cache hit covers
the last known token"), the issue's ``seqlen_q == 0``; with this module B hits block 0
only and computes positions 4-7.

Only the objects this module's factory builds change: the adapter subclass gives its
scheduler a :class:`BlockManager144Fixed` through the adapter's ``make_block_manager``
hook; nano-vllm's module and class are never touched.
"""

from __future__ import annotations

from typing import Any

from refserve.conformance.adapters import nanovllm as released
from refserve.conformance.corpus.hunk import require_lines

BUGGY = "refserve.conformance.adapters.nanovllm:make"
FIXED = "refserve.conformance.corpus.patches.nanovllm_144_fixed:make"

# The fork's lookup over every block, which the fix stops one block short.
_BUGGY_LINES = (
    "for i in range(seq.num_blocks):",
    "seq.num_cached_tokens += self.block_size",
)


# Refuse unless the installed ``allocate`` is the fork's (the code ported below).
require_lines("nano-vllm#144's fix", released.BlockManager.allocate, _BUGGY_LINES)


class BlockManager144Fixed(released.BlockManager):  # type: ignore[misc]
    """The fork's ``BlockManager`` whose prefix lookup never takes the last block."""

    def allocate(self, seq: Any) -> None:
        assert not seq.block_table
        h = -1
        cache_miss = False
        for i in range(seq.num_blocks):
            token_ids = seq.block(i)
            h = self.compute_hash(token_ids, h) if len(token_ids) == self.block_size else -1
            block_id = self.hash_to_block_id.get(h, -1)
            # f64d821: the lookup covers range(seq.num_blocks - 1), so the last block
            # (which holds the last prompt token, whose logit is sampled) is computed.
            if (
                i == seq.num_blocks - 1
                or block_id == -1
                or self.blocks[block_id].token_ids != token_ids
            ):
                cache_miss = True
            if cache_miss:
                block_id = self.free_block_ids[0]
                block = self._allocate_block(block_id)
            else:
                seq.num_cached_tokens += self.block_size
                if block_id in self.used_block_ids:
                    block = self.blocks[block_id]
                    block.ref_count += 1
                else:
                    block = self._allocate_block(block_id)
            if h != -1:
                block.update(h, token_ids)
                self.hash_to_block_id[h] = block_id
            seq.block_table.append(block_id)


class NanoVllm144FixedAdapter(released.NanoVllmAdapter):
    """The nano-vllm adapter whose scheduler runs :class:`BlockManager144Fixed`."""

    @property
    def name(self) -> str:
        return f"{super().name} + nano-vllm#144 fix (f64d821) applied"

    def make_block_manager(self, num_blocks: int, block_size: int) -> Any:
        return BlockManager144Fixed(num_blocks, block_size)


def make() -> NanoVllm144FixedAdapter:
    """Factory for ``--adapter refserve.conformance.corpus.patches.nanovllm_144_fixed:make``."""
    return NanoVllm144FixedAdapter()
