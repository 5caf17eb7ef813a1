"""Model of NVIDIA/TensorRT-LLM#12673: a request released mid-prefill stores blocks whose
K/V was never computed for reuse.

* Tracker and fix: https://github.com/NVIDIA/TensorRT-LLM/pull/12673 ("[nvbugs/6025177]
  Fix KV cache issue", merged 2026-04; cherry-picked to release/1.2.1 and
  release/1.3.0rc5.post2): "fixes an issue that caused KV cache to become corrupted";
  the fix counts the tokens whose K/V is materialized from the request's context
  position, "instead of static assumptions", when it stores blocks for reuse during a
  chunked prefill.

The buggy code (``cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp`` on main before the
fix), quoted from ``WindowBlockManager::releaseBlocks``, which ``removeSequence`` calls
when a request leaves::

    // Only (length - 1) tokens of the sequence have their kv-state
    // recorded in kv-cache. We assume the last token's state is not filled yet.
    auto const usableSize = static_cast<runtime::SizeType32>(uniqueTokens.size()) - 1;
    auto blockedUniqueTokens
        = chopVectorIntoBlocks<UniqueToken>(uniqueTokens, usableSize, mTokensPerBlock,
                                            /*allowPartial=*/true);
    auto blockKeys = buildBlockKeys(blockedUniqueTokens, *llmRequest);
    ...
    auto [numBlocksStoredForReuse, pinnedBlockIds]
        = storeBlocks(std::move(blockKeys), cacheBlockIds);
    ...
    for (auto it = allocatedBlocks.rbegin(); ...)
    {   block->decRefCount(); if (!block->hasRefs()) mEvictionPolicy->releaseBlock(block); }

``uniqueTokens`` is every token the request knows, its whole prompt during a chunked
prefill; "length - 1" holds only once the prompt is computed. A request that leaves
mid-prefill (aborted, cancelled, finished by the client) has its not-yet-computed
blocks keyed by the prompt's tokens and put in the radix tree; the next request with
that prompt reuses them and attends to K/V nobody wrote.

What is modelled, line for line where it matters:

* :meth:`TrtWindowBlockManager.release_blocks` is ``releaseBlocks``: the store for reuse
  over ``usable`` tokens (``len(tokens) - 1``, or with the fix no more than the tokens
  whose K/V was written, the request's context position), then the reference counts
  released from the table's end, a block reaching zero appended to the free queue.
* :meth:`~TrtWindowBlockManager.store_blocks` is ``storeBlocks``: block keys paired
  with the table's blocks in order; while ``findMatchingBlock`` finds a key the walk
  follows the tree's block (the table's own is not stored), and from the first miss on
  (``needMatch = false``) every block is inserted under the one before it.
* :meth:`~TrtWindowBlockManager.get_free_block` is ``getFreeBlock`` without offloading:
  the eviction policy's free queue hands out its front block, and ``freeChildren``
  drops the block and everything below it from the tree.
* :meth:`~TrtWindowBlockManager.lookup` is the walk of ``loadOrAllocateBlocks``: one
  ``findMatchingBlock`` per full block from the root, up to the first miss.

Left out, as the KV protocol asks or as the bug does not need: partial-block reuse
(``enable_partial_reuse`` off; a partial key is never stored or matched), the secondary
(host) pool, beams, sliding windows, priorities, ``storeContextBlocks`` and
``storeNewBlock`` (they store only computed blocks; storing less is a correct choice).
The KV protocol allocates per chunk where TensorRT-LLM allocates a prompt's blocks at
once: the block the first chunk half fills is enough for the bug. Caught by
``kv-free-mid-prefill`` (PREFIX: a hit reads K/V never written).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from refserve.conformance.adapter import NotSupported
from refserve.conformance.kv.protocol import Allocation, KVConfig, KVFeature, NoSpace
from refserve.spec.arith import blocks_needed
from refserve.spec.hashing import block_key
from refserve.spec.snapshot import CacheEntry, PoolSnapshot, TableSnapshot

#: The tree's root key: the model has one reuse scope (no LoRA task, no salt).
ROOT = b""


@dataclass
class _Sequence:
    """``GenerationRequest``: the blocks a request holds and what they hold."""

    blocks: list[int]
    num_stored: int
    """Tokens whose K/V the executor wrote (the context position, then the KV length)."""
    tokens: tuple[int, ...]
    """``uniqueTokens``: every token the request knows."""


@dataclass(frozen=True)
class _Node:
    """One radix-tree node: the block holding a full block of tokens under a parent key."""

    block: int
    parent: bytes
    tokens: tuple[int, ...]


class TrtWindowBlockManager:
    """The modelled ``WindowBlockManager`` (one window, primary pool only)."""

    def __init__(self, num_blocks: int, tokens_per_block: int, *, reuse: bool, fixed: bool):
        self.tokens_per_block = tokens_per_block
        self.reuse = reuse
        self.fixed = fixed
        self.ref = [0] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))
        self.tree: dict[bytes, _Node] = {}
        self.key_of: dict[int, bytes] = {}
        self.sequences: dict[str, _Sequence] = {}

    # ------------------------------------------------------------------ the radix tree
    def lookup(self, tokens: Sequence[int], most_blocks: int) -> list[int]:
        """Blocks of the longest stored prefix of ``tokens``, at most ``most_blocks``."""
        bs, parent, out = self.tokens_per_block, ROOT, []
        for i in range(most_blocks):
            key = block_key(parent, tokens[i * bs : (i + 1) * bs])
            node = self.tree.get(key)
            if node is None:
                break
            out.append(node.block)
            parent = key
        return out

    def store_blocks(self, tokens: Sequence[int], usable: int, blocks: Sequence[int]) -> None:
        """``storeBlocks`` for the full blocks of ``tokens[:usable]`` on ``blocks``: while
        the walk matches, it follows the tree; from the first miss on, each block is
        inserted under the previous one (moved there if the tree held it elsewhere)."""
        bs, parent, need_match = self.tokens_per_block, ROOT, True
        for i, b in enumerate(blocks[: usable // bs]):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            key = block_key(parent, chunk)
            if not (need_match and key in self.tree):
                old = self.key_of.get(b)
                if old is not None:  # removeNextBlock from its old parent
                    del self.tree[old]
                self.tree[key] = _Node(b, parent, chunk)
                self.key_of[b] = key
                need_match = False
            parent = key

    def _free_children(self, key: bytes) -> None:
        """``freeChildren``: the node and every node below it leave the tree."""
        below = [k for k, n in self.tree.items() if n.parent == key]
        for k in below:
            self._free_children(k)
        node = self.tree.pop(key)
        del self.key_of[node.block]

    def get_free_block(self) -> int:
        """``getFreeBlock``: the free queue's front block, out of the tree, claimed."""
        b = self.free.popleft()
        key = self.key_of.get(b)
        if key is not None:
            self._free_children(key)
        self.ref[b] = 1
        return b

    # ------------------------------------------------------------------ sequences
    def add_sequence(self, rid: str, tokens: Sequence[int], num_new: int) -> int:
        """A first allocation: the longest affordable hit, then fresh blocks for
        ``num_new`` tokens; returns the hit in tokens. All or nothing."""
        bs = self.tokens_per_block
        most = (len(tokens) - num_new) // bs if self.reuse else 0
        hits = self.lookup(tokens, max(0, most))
        for k in range(len(hits), -1, -1):
            taken = hits[:k]
            revived = sum(1 for b in taken if self.ref[b] == 0)
            fresh = blocks_needed(k * bs + num_new, bs) - k
            if fresh <= len(self.free) - revived:
                break
        else:
            raise NoSpace(f"{fresh} blocks needed, {len(self.free)} free")
        for b in taken:
            if self.ref[b] == 0:
                self.free.remove(b)
            self.ref[b] += 1
        blocks = [*taken, *(self.get_free_block() for _ in range(fresh))]
        self.sequences[rid] = _Sequence(blocks, k * bs + num_new, tuple(tokens))
        return k * bs

    def add_tokens(self, rid: str, tokens: Sequence[int], num_new: int) -> None:
        """A later chunk or decode: blocks for ``num_new`` more tokens."""
        seq = self.sequences[rid]
        fresh = blocks_needed(seq.num_stored + num_new, self.tokens_per_block) - len(seq.blocks)
        if fresh > len(self.free):
            raise NoSpace(f"{fresh} blocks needed, {len(self.free)} free")
        seq.blocks.extend(self.get_free_block() for _ in range(max(0, fresh)))
        seq.num_stored += num_new
        seq.tokens = tuple(tokens)

    def release_blocks(self, rid: str) -> None:
        """``releaseBlocks``: store for reuse, then release from the table's end."""
        seq = self.sequences.pop(rid)
        if self.reuse:
            usable = len(seq.tokens) - 1
            if self.fixed:  # the fix: only what is materialized
                usable = min(usable, seq.num_stored)
            self.store_blocks(seq.tokens, usable, seq.blocks)
        for b in reversed(seq.blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free.append(b)


class TrtKVModel:
    """The modelled block manager behind the KV protocol."""

    name = "tensorrt-llm-kv-model"

    def __init__(self, *, fixed: bool) -> None:
        self._fixed = fixed
        self._mgr: TrtWindowBlockManager | None = None

    @property
    def features(self) -> frozenset[KVFeature]:
        return frozenset(
            {KVFeature.PREFIX_CACHING, KVFeature.PREFIX_CACHING_OPTIONAL, KVFeature.CACHE_INDEX}
        )

    @property
    def mgr(self) -> TrtWindowBlockManager:
        if self._mgr is None:
            raise NotSupported("configure() was not called")
        return self._mgr

    def configure(self, config: KVConfig) -> None:
        self._mgr = TrtWindowBlockManager(
            config.num_blocks,
            config.block_size,
            reuse=config.enable_prefix_caching,
            fixed=self._fixed,
        )

    def allocate(
        self, request_id: str, token_ids: Sequence[int], num_new_tokens: int
    ) -> Allocation:
        mgr = self.mgr
        hit = 0
        if request_id in mgr.sequences:
            mgr.add_tokens(request_id, token_ids, num_new_tokens)
        else:
            hit = mgr.add_sequence(request_id, token_ids, num_new_tokens)
        return Allocation(tuple(mgr.sequences[request_id].blocks), hit)

    def fork(self, parent: str, child: str) -> None:
        raise NotSupported("the model has no fork (beam search is left out)")

    def free(self, request_id: str) -> None:
        self.mgr.release_blocks(request_id)

    def snapshot(self) -> PoolSnapshot:
        mgr = self.mgr
        return PoolSnapshot(
            num_blocks=len(mgr.ref),
            block_size=mgr.tokens_per_block,
            ref_cnt=tuple(mgr.ref),
            free_queue=tuple(mgr.free),
            tables=tuple(
                TableSnapshot(rid, tuple(s.blocks), s.num_stored, s.tokens[: s.num_stored], ROOT)
                for rid, s in mgr.sequences.items()
            ),
            cache_entries=tuple(
                CacheEntry(key, n.block, n.parent, n.tokens) for key, n in mgr.tree.items()
            ),
        )


def make_kv() -> TrtKVModel:
    """The buggy model: a release stores ``len(tokens) - 1`` tokens' blocks."""
    return TrtKVModel(fixed=False)


def make_kv_fixed() -> TrtKVModel:
    """The fixed model: a release stores only blocks whose K/V was written."""
    return TrtKVModel(fixed=True)
