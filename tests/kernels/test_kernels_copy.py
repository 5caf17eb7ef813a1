"""``copy_blocks`` (Triton and torch paths) against ``refserve.kernels.oracle.copy_blocks``.

Covers copy-on-write within one pool (invariant PREFIX: a shared block is
copied before it is written) and swapping between two pools; a GPU<->CPU swap needs
two devices and runs only where CUDA exists.
"""

from __future__ import annotations

import pytest
import torch
from kernel_testing import DEVICE, DTYPES, needs_cuda

from refserve import kernels
from refserve.kernels import oracle
from refserve.kernels.copy import copy_blocks, copy_blocks_torch
from refserve.kernels.validation import KernelInputError


def _pool(
    num_blocks: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: str | torch.device = DEVICE,
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # Key and value caches as strided views of one [NB, 2, bs, H, D] allocation.
    kv = torch.randn(num_blocks, 2, 5, 3, 40, generator=gen).to(dtype).to(device)
    return kv[:, 0], kv[:, 1]


def _mapping(pairs: list[tuple[int, int]], device: str | torch.device = DEVICE) -> torch.Tensor:
    return torch.tensor(pairs, dtype=torch.int64, device=device)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_copy_on_write_within_one_pool(dtype: torch.dtype) -> None:
    k, v = _pool(8, dtype)
    ref_k, ref_v = k.clone(), v.clone()
    pairs = _mapping([(3, 7), (0, 2), (5, 6)])
    oracle.copy_blocks(ref_k, ref_v, ref_k, ref_v, pairs)
    copy_blocks(k, v, k, v, pairs)
    assert torch.equal(k, ref_k) and torch.equal(v, ref_v)
    assert torch.equal(k[7], k[3]) and not torch.equal(k[7], k[4])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_swap_between_two_pools(dtype: torch.dtype) -> None:
    src_k, src_v = _pool(6, dtype, seed=1)
    dst_k, dst_v = _pool(4, dtype, seed=2)
    ref_k, ref_v = dst_k.clone(), dst_v.clone()
    pairs = _mapping([(5, 0), (1, 3), (1, 1)])  # one source may go to two places
    oracle.copy_blocks(src_k, src_v, ref_k, ref_v, pairs)
    kernels.copy_blocks(src_k, src_v, dst_k, dst_v, pairs)
    assert torch.equal(dst_k, ref_k) and torch.equal(dst_v, ref_v)
    assert torch.equal(dst_v[3], src_v[1]) and torch.equal(dst_k[0], src_k[5])


def test_torch_path_matches_oracle() -> None:
    src_k, src_v = _pool(6, seed=3)
    dst_k, dst_v = _pool(5, seed=4)
    ref_k, ref_v = dst_k.clone(), dst_v.clone()
    pairs = _mapping([(0, 4), (2, 0)])
    oracle.copy_blocks(src_k, src_v, ref_k, ref_v, pairs)
    copy_blocks_torch(src_k, src_v, dst_k, dst_v, pairs)
    assert torch.equal(dst_k, ref_k) and torch.equal(dst_v, ref_v)


def test_empty_mapping_copies_nothing() -> None:
    k, v = _pool(3)
    before = k.clone()
    copy_blocks(k, v, k, v, torch.zeros(0, 2, dtype=torch.int64, device=DEVICE))
    assert torch.equal(k, before)


@needs_cuda
def test_swap_between_gpu_and_cpu() -> None:
    gpu_k, gpu_v = _pool(6, torch.float16, seed=5, device="cuda")
    cpu_k, cpu_v = _pool(4, torch.float16, seed=6, device="cpu")
    copy_blocks(gpu_k, gpu_v, cpu_k, cpu_v, _mapping([(5, 0), (2, 3)], device="cpu"))
    assert torch.equal(cpu_k[0], gpu_k[5].cpu()) and torch.equal(cpu_v[3], gpu_v[2].cpu())
    copy_blocks(cpu_k, cpu_v, gpu_k, gpu_v, _mapping([(1, 0)], device="cpu"))
    assert torch.equal(gpu_k[0].cpu(), cpu_k[1])


@pytest.mark.parametrize(
    ("pairs", "match"),
    [
        ([(0, 1), (2, 1)], "distinct"),
        ([(0, 1), (1, 2)], "both a source and a destination"),
        ([(0, 9)], "outside"),
        ([(-1, 2)], "outside"),
    ],
    ids=["duplicate_dst", "chained", "dst_range", "src_range"],
)
def test_rejects_bad_mappings(pairs: list[tuple[int, int]], match: str) -> None:
    k, v = _pool(4)
    with pytest.raises(KernelInputError, match=match) as info:
        copy_blocks(k, v, k, v, _mapping(pairs))
    assert info.value.argument == "block_mapping"


def test_rejects_mismatched_pools() -> None:
    k, v = _pool(4)
    other = torch.zeros(4, 5, 3, 8, device=DEVICE)
    with pytest.raises(KernelInputError) as info:
        copy_blocks(k, v, other, other, _mapping([(0, 1)]))
    assert info.value.argument == "dst_key_cache"
    with pytest.raises(KernelInputError) as info:
        copy_blocks(k, v, k, v, _mapping([(0, 1)]).int())
    assert info.value.argument == "block_mapping"
