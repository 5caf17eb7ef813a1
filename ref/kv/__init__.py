"""The paged KV cache: the block pool (``pool``) over the allocator (``allocator``: ref
counts, free queue) and the prefix index (``prefix_index``), one undo journal, and the
host pool for swaps."""

from refserve.kv.host_pool import HostPool
from refserve.kv.pool import Allocation, BlockCopy, BlockPool, DecodeGrowth, DecodeRun
from refserve.kv.prefix_index import PrefixHit

__all__ = [
    "Allocation",
    "BlockCopy",
    "BlockPool",
    "DecodeGrowth",
    "DecodeRun",
    "HostPool",
    "PrefixHit",
]
