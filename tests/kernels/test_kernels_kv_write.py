"""``write_kv`` (Triton) against ``refserve.kernels.oracle.write_kv`` (docs/ARCHITECTURE.md,
"Kernels").

Caches start all-NaN, so a comparison with ``equal_nan`` checks both that the right
slots got the right values *and* that no other slot was touched.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_testing import DEVICE, DTYPES

from refserve import kernels
from refserve.kernels import oracle
from refserve.kernels.kv_write import write_kv, write_kv_torch
from refserve.kernels.validation import KernelInputError


def _setup(
    num_tokens: int,
    num_heads: int,
    head_size: int,
    block_size: int,
    num_blocks: int,
    dtype: torch.dtype,
    seed: int,
    skip_every: int = 3,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # key/value as non-contiguous slices of one fused [T, 2, Hkv, D] projection.
    kv = torch.randn(num_tokens, 2, num_heads, head_size, generator=gen).to(dtype).to(DEVICE)
    key, value = kv[:, 0], kv[:, 1]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::skip_every] = -1  # padding tokens
    cache = torch.full((num_blocks, block_size, num_heads, head_size), float("nan"), dtype=dtype)
    return key, value, cache.to(DEVICE), cache.clone().to(DEVICE), slots.to(DEVICE)


def _check(
    fn: object,
    key: torch.Tensor,
    value: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    ref_k, ref_v = kc.clone(), vc.clone()
    oracle.write_kv(key, value, ref_k, ref_v, slots)
    fn(key, value, kc, vc, slots)  # type: ignore[operator]
    torch.testing.assert_close(kc, ref_k, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(vc, ref_v, atol=0, rtol=0, equal_nan=True)
    assert int((~ref_k.isnan()).sum()) == int((slots >= 0).sum()) * key.shape[1] * key.shape[2]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("heads", "head_size", "block_size"), [(1, 64, 16), (3, 80, 5), (2, 40, 1), (8, 128, 32)]
)
def test_write_kv_matches_oracle(
    dtype: torch.dtype, heads: int, head_size: int, block_size: int
) -> None:
    args = _setup(9, heads, head_size, block_size, 12, dtype, seed=heads + block_size)
    _check(write_kv, *args)


def test_public_entry_point_and_int32_slots() -> None:
    key, value, kc, vc, slots = _setup(7, 2, 24, 4, 5, torch.float16, seed=1)
    assert kernels.write_kv is write_kv
    _check(kernels.write_kv, key, value, kc, vc, slots.int())


def test_torch_fallback_matches_oracle() -> None:
    _check(write_kv_torch, *_setup(11, 2, 24, 3, 8, torch.float32, seed=2))


def test_all_padding_writes_nothing() -> None:
    key, value, kc, vc, slots = _setup(4, 2, 16, 4, 2, torch.float32, seed=3, skip_every=1)
    write_kv(key, value, kc, vc, slots)
    assert bool(kc.isnan().all()) and bool(vc.isnan().all())


@settings(deadline=None, max_examples=15)
@given(
    tokens=st.integers(1, 12),
    heads=st.integers(1, 5),
    head_size=st.sampled_from([8, 24, 40, 64]),
    block_size=st.sampled_from([1, 2, 5, 16]),
    seed=st.integers(0, 2**16),
    skip_every=st.integers(1, 5),
)
def test_random_writes_match_oracle(
    tokens: int, heads: int, head_size: int, block_size: int, seed: int, skip_every: int
) -> None:
    num_blocks = -(-tokens // block_size) + 2
    args = _setup(tokens, heads, head_size, block_size, num_blocks, torch.float32, seed, skip_every)
    _check(write_kv, *args)


@pytest.mark.parametrize(
    ("slots", "match"),
    [([0, 0, -1], "twice"), ([0, 99, 1], "99"), ([0, -2, 1], "-2")],
    ids=["duplicate", "past_the_end", "negative"],
)
def test_rejects_bad_slots(slots: list[int], match: str) -> None:
    key, value, kc, vc, _ = _setup(3, 1, 8, 4, 2, torch.float32, seed=0)
    with pytest.raises(KernelInputError, match=match) as info:
        write_kv(key, value, kc, vc, torch.tensor(slots, device=DEVICE))
    assert info.value.argument == "slot_mapping"


def test_rejects_mismatched_shapes_and_dtypes() -> None:
    key, value, kc, vc, slots = _setup(3, 2, 8, 4, 2, torch.float32, seed=0)
    with pytest.raises(KernelInputError) as info:
        write_kv(key, value, kc.half(), vc, slots)
    assert info.value.argument == "key_cache"
    with pytest.raises(KernelInputError) as info:
        write_kv(key, value[:, :1], kc, vc, slots)
    assert info.value.argument == "value"
    with pytest.raises(KernelInputError) as info:
        write_kv(key, value, kc, vc, slots.float())
    assert info.value.argument == "slot_mapping"
