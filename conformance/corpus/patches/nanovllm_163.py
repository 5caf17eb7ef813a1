"""nano-vllm#163 re-applied on nano-vllm-fork 20260210: a freed block keeps its entry in
``hash_to_block_id``, so a later prompt can hit it after it was refilled behind another
prefix.

* Tracker: https://github.com/GeeeekExplorer/nano-vllm/issues/163 ("Stale hash mapping
  remains in ``hash_to_block_id`` when reallocating blocks in ``BlockManager``").
* Fix upstream: commit f64d821c2057e2f45d0accccf5b39fd6c1438473 ("fix chunked prefill
  bugs and refactor", PR #218) drops the old entry in ``_allocate_block`` before
  ``block.reset()``::

      +        if block.hash != -1 and self.hash_to_block_id.get(block.hash) == block_id:
      +            del self.hash_to_block_id[block.hash]

  and commit 9fa256a56d81101918aa4f763b66854196bab215 ("fix cache hit") moves the
  hand-out into ``_allocate_block`` (``free_block_ids.popleft()``) and revives a cached
  free block without resetting it. The fork fixes the same bug differently: it drops a
  block's entry when the block is freed (the approach of the unmerged PR #153).

The hunk this module puts back. The fork's ``nanovllm/engine/block_manager.py`` (as
installed in ``.venv-nanovllm``), ``BlockManager.deallocate``, lines 84-98::

    84      def deallocate(self, seq: Sequence):
    85          for block_id in reversed(seq.block_table):
    86              block = self.blocks[block_id]
    87              block.ref_count -= 1
    88              if block.ref_count == 0:
    89                  # Fix: Clean up hash_to_block_id mapping to prevent stale references
    90                  # This prevents CUDA illegal memory access when prefix cache tries to
    91                  # reuse a block_id that has already been freed
    92                  if block.hash != -1:
    93                      cached_id = self.hash_to_block_id.get(block.hash)
    94                      if cached_id == block_id:
    95                          del self.hash_to_block_id[block.hash]
    96                  self._deallocate_block(block_id)
    97          seq.num_cached_tokens = 0
    98          seq.block_table.clear()

Upstream's original, ``nanovllm/engine/block_manager.py`` at df99418 (2025-08-31, the
code the fork started from: its file is that one plus lines 89-95), lines 84-91::

    84      def deallocate(self, seq: Sequence):
    85          for block_id in reversed(seq.block_table):
    86              block = self.blocks[block_id]
    87              block.ref_count -= 1
    88              if block.ref_count == 0:
    89                  self._deallocate_block(block_id)
    90          seq.num_cached_tokens = 0
    91          seq.block_table.clear()

(82f5ca2 later added ``seq.prefilled = False`` there, an attribute the fork's
``Sequence`` does not have.) Everything else of the fork's ``BlockManager`` equals
upstream's original, ``_allocate_block`` included (lines 43-49, no cleanup), so with
this ``deallocate`` the manager is upstream's buggy one.

How it matches the tracker. The issue: a block taken from the free list for a new
sequence is reset and refilled, but ``hash_to_block_id`` still maps its old hash to it,
so a later request for the old content "returns a block that now contains
incorrect/unrelated data". ``allocate`` (lines 63-81) only guards the hit with
``self.blocks[block_id].token_ids != token_ids``: the block's own tokens, not its
prefix. A refilled block with other tokens therefore misses; one refilled with the
*same* tokens behind another prefix passes, and its K/V (computed at other positions,
after other tokens) is served. Checked on the installed fork, the manager alone
(``BlockManager(2, 4)``): X = a+b takes blocks 0 and 1 and is freed (free list
``[1, 0]``); Y = b+a puts b in block 1 and a in block 0; Z = a+b then finds
``H(a) -> 0`` and ``H(b|a) -> 1`` with matching tokens and gets
``num_cached_tokens == 8``, table ``[0, 1]``: Y's K/V. With the fork's ``deallocate``
Z gets no hit.

Re-applied on the objects this module's factory builds only: the adapter subclass
gives its scheduler a :class:`BlockManager163` (through the adapter's
``make_block_manager`` hook); ``nanovllm.engine.block_manager.BlockManager`` and the
scheduler module are never touched, so the fixed adapter in the same process keeps
the fork's ``deallocate``.
"""

from __future__ import annotations

from typing import Any

from refserve.conformance.adapters import nanovllm as fixed
from refserve.conformance.corpus.hunk import require_lines

FIXED = "refserve.conformance.adapters.nanovllm:make"
BUGGY = "refserve.conformance.corpus.patches.nanovllm_163:make"

# The fork's cleanup, which this module takes out again.
_FIXED_LINES = (
    "cached_id = self.hash_to_block_id.get(block.hash)",
    "del self.hash_to_block_id[block.hash]",
)


# Refuse unless the installed ``deallocate`` has the cleanup this patch removes and
# ``_allocate_block`` has none (else the patch would not bring the bug back).
require_lines("nano-vllm#163", fixed.BlockManager.deallocate, _FIXED_LINES)
require_lines("nano-vllm#163", fixed.BlockManager._allocate_block, (), absent=("hash_to_block_id",))


class BlockManager163(fixed.BlockManager):  # type: ignore[misc]
    """The fork's ``BlockManager`` with upstream's original ``deallocate``."""

    def deallocate(self, seq: Any) -> None:
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._deallocate_block(block_id)
        seq.num_cached_tokens = 0
        seq.block_table.clear()


class NanoVllm163Adapter(fixed.NanoVllmAdapter):
    """The nano-vllm adapter whose scheduler runs :class:`BlockManager163`."""

    @property
    def name(self) -> str:
        return f"{super().name} + nano-vllm#163 re-applied"

    def make_block_manager(self, num_blocks: int, block_size: int) -> Any:
        return BlockManager163(num_blocks, block_size)


def make() -> NanoVllm163Adapter:
    """Factory for ``--adapter refserve.conformance.corpus.patches.nanovllm_163:make``."""
    return NanoVllm163Adapter()
