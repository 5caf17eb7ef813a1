"""The paged KV cache: block pool, free queue, prefix cache, fork and copy-on-write."""

from ref.kv.pool import Allocation, BlockCopy, BlockPool, DecodeGrowth, DecodeRun, PrefixHit

__all__ = ["Allocation", "BlockCopy", "BlockPool", "DecodeGrowth", "DecodeRun", "PrefixHit"]
