"""A block's key is one function of its parent key and token ids (PREFIX invariant),
whichever way it is computed: ``block_key`` one block at a time, or the pool's bulk
decode step, which encodes all the blocks it fills in one call (``packed_token_ids``)
and hashes a slice per block (``packed_block_key``)."""

from __future__ import annotations

import hashlib
import struct

from hypothesis import given
from hypothesis import strategies as st

from refserve.spec.hashing import block_key, packed_block_key, packed_token_ids

_ids = st.lists(st.integers(-(2**63), 2**63 - 1), max_size=40)
_parents = st.binary(min_size=32, max_size=32)


@given(_parents, _ids)
def test_the_packed_key_is_the_block_key(parent: bytes, ids: list[int]) -> None:
    assert packed_block_key(parent, packed_token_ids(ids)) == block_key(parent, ids)


@given(_parents, st.lists(_ids.filter(bool), min_size=1, max_size=5), st.integers(1, 8))
def test_a_slice_of_many_blocks_encoded_at_once_is_each_blocks_encoding(
    parent: bytes, blocks: list[list[int]], width: int
) -> None:
    rows = [(b * width)[:width] for b in blocks]  # equal lengths, as a step's blocks are
    packed = packed_token_ids(t for row in rows for t in row)
    for j, row in enumerate(rows):
        chunk = packed[j * 8 * width : (j + 1) * 8 * width]
        assert packed_block_key(parent, chunk) == block_key(parent, row)


def test_token_ids_are_hashed_as_signed_64_bit_little_endian() -> None:
    ids = [1, -1, 2**63 - 1]
    payload = b"\x01" + b"\x00" * 7 + b"\xff" * 8 + b"\xff" * 7 + b"\x7f"
    assert packed_token_ids(ids) == payload == struct.pack("<3q", *ids)
    assert block_key(b"p" * 32, ids) == hashlib.sha256(b"p" * 32 + payload).digest()
