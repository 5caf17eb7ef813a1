"""The paged KV cache: the block pool (``pool``) over the allocator (``allocator``: ref
counts, free queue) and the prefix index (``prefix_index``), one undo journal, and the
host pool for swaps."""

from ref.kv.pool import Allocation, BlockCopy, BlockPool, DecodeGrowth, DecodeRun
from ref.kv.prefix_index import PrefixHit

__all__ = ["Allocation", "BlockCopy", "BlockPool", "DecodeGrowth", "DecodeRun", "PrefixHit"]
