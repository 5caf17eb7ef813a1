"""The prefix-cache hash chain (PREFIX invariant).

A full block's key is ``sha256(parent_key || token ids)``; the chain starts from a root
key derived from the namespace (model, adapter, cache salt), so two requests share a block
only when every token before it and the namespace are identical. The engine uses these
functions to build its keys and the checkers use them to verify the keys, so a stale or
forged entry is caught by recomputation, not by trusting stored state. A real hash is
used on purpose: Python's ``hash()`` is salted per process and collides easily.
"""

from __future__ import annotations

import functools
import hashlib
import struct
import sys
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Namespace:
    """What must match, besides token ids, for KV to be reusable across requests."""

    model: str = "default"
    adapter: str = ""
    cache_salt: str = ""
    layer_group: int = 0
    """A hybrid model's layer group (ref/kv/groups.py) past the first: the K/V of other
    layers, so other keys in the one index. No request sets it; the first group's keys
    are the namespace's own, the ones a router reading cache events computes."""

    def root_key(self) -> bytes:
        """The hash-chain root for this namespace (PREFIX invariant).

        Each field is encoded as its UTF-8 length (8 bytes, little-endian) then its bytes,
        so the encoding is injective: no choice of field values, NUL bytes included, gives
        another namespace's payload. (v1 joined the fields with NUL, and model ``"a\\0b"``
        shared its root with model ``"a"`` + adapter ``"b\\0"``: one tenant's KV could be
        served to another's prompt.) A layer group past the first adds a fourth field, so
        its payload is longer than any plain namespace's and no salt reaches it.
        """
        payload = bytearray(b"refserve-prefix-v2\x00")
        fields = [self.model, self.adapter, self.cache_salt]
        if self.layer_group:
            fields.append(f"layer-group {self.layer_group}")
        for f in fields:
            data = f.encode("utf-8", "surrogatepass")  # total: a lone surrogate too
            payload += struct.pack("<Q", len(data))
            payload += data
        return hashlib.sha256(bytes(payload)).digest()


DEFAULT_NAMESPACE = Namespace()


def block_key(parent_key: bytes, token_ids: Sequence[int]) -> bytes:
    """Key of a full block given its parent's key and its own token ids.

    pre: all(-(2**63) <= t < 2**63 for t in token_ids)
    post: len(__return__) == 32
    """
    # Token ids are packed as signed 64-bit little-endian so the key does not depend on
    # how a tokenizer's ids happen to print.
    return packed_block_key(parent_key, _packer(len(token_ids)).pack(*token_ids))


def packed_block_key(parent_key: bytes, packed: bytes) -> bytes:
    """:func:`block_key` of a block whose token ids :func:`packed_token_ids` encoded.

    post: len(__return__) == 32
    """
    return hashlib.sha256(parent_key + packed).digest()


def packed_token_ids(token_ids: Iterable[int]) -> bytes:
    """Token ids encoded as :func:`block_key` hashes them, 8 bytes each: many blocks
    encoded in one call, then hashed a slice each (:func:`packed_block_key`).
    OverflowError for an id outside int64."""
    packed = array("q", token_ids)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


@functools.lru_cache(maxsize=64)
def _packer(n: int) -> struct.Struct:
    # A block is hashed every block_size decode steps per request: parse the format once.
    return struct.Struct(f"<{n}q")


def chain_keys(
    root: bytes, token_ids: Sequence[int], block_size: int, num_blocks: int
) -> list[bytes]:
    """Keys of the first ``num_blocks`` full blocks of ``token_ids``.

    pre: block_size > 0
    pre: 0 <= num_blocks <= 4
    pre: num_blocks * block_size <= len(token_ids)
    pre: all(0 <= t < 2**31 for t in token_ids)
    post: len(__return__) == num_blocks
    post: all(len(k) == 32 for k in __return__)
    """
    if num_blocks * block_size > len(token_ids):
        raise ValueError(
            f"chain_keys: {num_blocks} blocks of {block_size} need "
            f"{num_blocks * block_size} tokens, got {len(token_ids)}"
        )
    keys: list[bytes] = []
    parent = root
    for i in range(num_blocks):
        parent = block_key(parent, token_ids[i * block_size : (i + 1) * block_size])
        keys.append(parent)
    return keys
