"""The paged KV cache. The spine: the block pool (``pool``) over the allocator
(``allocator``: ref counts, free queue), the prefix index (``prefix_index``), the block
tables (``tables``) and one undo journal (``journal``). The attachments, each over the
pool's public surface: the bulk decode step (``decode_runs``), forks (``forks``),
rejected drafts given back (``truncation``), the host pool for swaps (``host_pool``),
cache events (``events``) and a hybrid model's layer groups (``groups``)."""

from refserve.kv.decode_runs import DecodeGrowth, DecodeRun
from refserve.kv.forks import fork
from refserve.kv.host_pool import HostPool
from refserve.kv.pool import Allocation, BlockCopy, BlockPool
from refserve.kv.prefix_index import PrefixHit
from refserve.kv.truncation import truncate

__all__ = [
    "Allocation",
    "BlockCopy",
    "BlockPool",
    "DecodeGrowth",
    "DecodeRun",
    "HostPool",
    "PrefixHit",
    "fork",
    "truncate",
]
