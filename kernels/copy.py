# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Reason: triton ships no types; its @triton.jit kernels are untyped by construction.)
"""Copy whole KV blocks: copy-on-write within a pool, swap between pools (docs/ARCHITECTURE.md).

``copy_blocks(src_key_cache, src_value_cache, dst_key_cache, dst_value_cache,
block_mapping)``: for each row ``(src, dst)`` of the int64 ``[N, 2]`` ``block_mapping``,
block ``src`` of the source pool is copied to block ``dst`` of the destination pool.

- Copy-on-write (invariant PREFIX: shared blocks are never written): pass the same
  pool as source and destination.
- Swap out / in between tiers (e.g. a GPU pool and a CPU pool): pass two pools. A
  Triton program cannot address two devices, so pools on different devices go through
  :func:`copy_blocks_torch` (indexed copies that torch moves between devices).

Checked against ``refserve.kernels.oracle.copy_blocks``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from refserve.kernels._runtime import is_interpreted
from refserve.kernels.validation import validate_copy_blocks_inputs

__all__ = ["copy_blocks", "copy_blocks_torch"]


@triton.jit
def _copy_one(
    src_ptr,
    dst_ptr,
    src_block,
    dst_block,
    s,
    h,
    d,
    mask,
    stride_sb,
    stride_ss,
    stride_sh,
    stride_sd,
    stride_db,
    stride_ds,
    stride_dh,
    stride_dd,
):
    x = tl.load(
        src_ptr + src_block * stride_sb + s * stride_ss + h * stride_sh + d * stride_sd, mask=mask
    )
    tl.store(
        dst_ptr + dst_block * stride_db + s * stride_ds + h * stride_dh + d * stride_dd,
        x,
        mask=mask,
    )


@triton.jit
def _copy_blocks_kernel(
    src_k_ptr,
    src_v_ptr,
    dst_k_ptr,
    dst_v_ptr,
    mapping_ptr,
    num_heads,
    head_size,
    block_numel,  # block_size * num_heads * head_size
    stride_skb,
    stride_sks,
    stride_skh,
    stride_skd,
    stride_svb,
    stride_svs,
    stride_svh,
    stride_svd,
    stride_dkb,
    stride_dks,
    stride_dkh,
    stride_dkd,
    stride_dvb,
    stride_dvs,
    stride_dvh,
    stride_dvd,
    BLOCK: tl.constexpr,  # elements per program
):
    pair = tl.program_id(0).to(tl.int64)
    src_block = tl.load(mapping_ptr + 2 * pair)  # int64: block * stride may pass 2**31
    dst_block = tl.load(mapping_ptr + 2 * pair + 1)
    # The block is [block_size, num_heads, head_size]; element e of it in row-major
    # order, mapped through each tensor's own strides (no contiguity assumed).
    e = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = e < block_numel
    s = e // (num_heads * head_size)
    h = (e // head_size) % num_heads
    d = e % head_size
    _copy_one(
        src_k_ptr, dst_k_ptr, src_block, dst_block, s, h, d, mask,
        stride_skb, stride_sks, stride_skh, stride_skd,
        stride_dkb, stride_dks, stride_dkh, stride_dkd,
    )  # fmt: skip
    _copy_one(
        src_v_ptr, dst_v_ptr, src_block, dst_block, s, h, d, mask,
        stride_svb, stride_svs, stride_svh, stride_svd,
        stride_dvb, stride_dvs, stride_dvh, stride_dvd,
    )  # fmt: skip


_BLOCK = 1024


def copy_blocks_torch(
    src_key_cache: torch.Tensor,
    src_value_cache: torch.Tensor,
    dst_key_cache: torch.Tensor,
    dst_value_cache: torch.Tensor,
    block_mapping: torch.Tensor,
) -> None:
    """Torch version of :func:`copy_blocks` (no checks); works across devices."""
    src = block_mapping[:, 0].to(src_key_cache.device)
    dst = block_mapping[:, 1].to(dst_key_cache.device)
    dst_key_cache[dst] = src_key_cache[src].to(dst_key_cache.device)
    dst_value_cache[dst] = src_value_cache[src].to(dst_value_cache.device)


def copy_blocks(
    src_key_cache: torch.Tensor,
    src_value_cache: torch.Tensor,
    dst_key_cache: torch.Tensor,
    dst_value_cache: torch.Tensor,
    block_mapping: torch.Tensor,
    *,
    check_values: bool = True,
) -> None:
    """Copy block ``src`` to block ``dst`` for each ``(src, dst)`` row of ``block_mapping``.

    Triton when all five tensors share one device it can run on (CUDA, or CPU in
    interpreter mode); :func:`copy_blocks_torch` otherwise (pools on two devices).
    ``check_values=False`` skips the checks that read ``block_mapping`` on the host.
    """
    validate_copy_blocks_inputs(
        src_key_cache,
        src_value_cache,
        dst_key_cache,
        dst_value_cache,
        block_mapping,
        check_values=check_values,
    )
    if block_mapping.shape[0] == 0:
        return
    devices = {
        t.device
        for t in (src_key_cache, src_value_cache, dst_key_cache, dst_value_cache, block_mapping)
    }
    device = next(iter(devices))
    runnable = device.type == "cuda" or is_interpreted(_copy_blocks_kernel)
    if len(devices) > 1 or not runnable:
        copy_blocks_torch(
            src_key_cache, src_value_cache, dst_key_cache, dst_value_cache, block_mapping
        )
        return
    _, block_size, num_heads, head_size = src_key_cache.shape
    block_numel = block_size * num_heads * head_size
    grid = (block_mapping.shape[0], triton.cdiv(block_numel, _BLOCK))
    _copy_blocks_kernel[grid](
        src_key_cache,
        src_value_cache,
        dst_key_cache,
        dst_value_cache,
        block_mapping.contiguous(),
        num_heads,
        head_size,
        block_numel,
        *src_key_cache.stride(),
        *src_value_cache.stride(),
        *dst_key_cache.stride(),
        *dst_value_cache.stride(),
        BLOCK=_BLOCK,
    )
