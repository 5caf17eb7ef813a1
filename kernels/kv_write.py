# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Reason: triton ships no types; its @triton.jit kernels are untyped by construction.)
"""Write this step's keys and values into the paged cache (docs/ARCHITECTURE.md, "Kernels").

``write_kv(key, value, key_cache, value_cache, slot_mapping)``: token ``t``'s ``[Hkv, D]``
key and value go to slot ``slot_mapping[t]``, i.e. block ``slot // block_size``, offset
``slot % block_size`` (docs/ARCHITECTURE.md, "Vocabulary"); slot ``-1`` skips the token (padding).
Checked against ``refserve.kernels.oracle.write_kv``.

One program per (token, group of heads): a row copy with masks for head sizes that are
not powers of two. On CPU without the Triton interpreter a vectorised torch path does
the same thing, so the engine can write its cache anywhere.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from refserve.kernels._runtime import is_interpreted, next_power_of_2
from refserve.kernels.validation import validate_write_kv_inputs

__all__ = ["write_kv"]


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    num_heads,
    block_size,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    HEAD_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    # int64: slot * stride passes 2**31 in large caches.
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return  # -1: a padding token, nothing to write
    block = slot // block_size
    in_block = slot % block_size
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (heads < num_heads)[:, None] & (offs_d < HEAD_SIZE)[None, :]

    k = tl.load(
        key_ptr + token * stride_kt + heads[:, None] * stride_kh + offs_d[None, :] * stride_kd,
        mask=mask,
    )
    tl.store(
        k_cache_ptr
        + block * stride_kcb
        + in_block * stride_kcs
        + heads[:, None] * stride_kch
        + offs_d[None, :] * stride_kcd,
        k,
        mask=mask,
    )
    v = tl.load(
        value_ptr + token * stride_vt + heads[:, None] * stride_vh + offs_d[None, :] * stride_vd,
        mask=mask,
    )
    tl.store(
        v_cache_ptr
        + block * stride_vcb
        + in_block * stride_vcs
        + heads[:, None] * stride_vch
        + offs_d[None, :] * stride_vcd,
        v,
        mask=mask,
    )


# Elements one program moves at most (heads x padded head size).
_MAX_TILE = 4096


def write_kv_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Vectorised torch version of :func:`write_kv` (no checks; used where Triton can't run)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = key_cache.shape[1]
    key_cache[slots // block_size, slots % block_size] = key[keep]
    value_cache[slots // block_size, slots % block_size] = value[keep]


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    check_values: bool = True,
) -> None:
    """Write ``key``/``value`` ``[T, Hkv, D]`` into the caches at ``slot_mapping`` (in place).

    Triton on CUDA tensors, or on CPU tensors in interpreter mode; otherwise
    :func:`write_kv_torch`. ``check_values=False`` skips the checks that sync with the
    device (slots in range, no slot twice).
    """
    validate_write_kv_inputs(
        key, value, key_cache, value_cache, slot_mapping, check_values=check_values
    )
    if key.shape[0] == 0:
        return
    if key.device.type != "cuda" and not is_interpreted(_write_kv_kernel):
        write_kv_torch(key, value, key_cache, value_cache, slot_mapping)
        return
    num_heads, head_size = key.shape[1], key.shape[2]
    block_d = next_power_of_2(head_size)
    block_h = min(next_power_of_2(num_heads), max(1, _MAX_TILE // block_d))
    grid = (key.shape[0], triton.cdiv(num_heads, block_h))
    _write_kv_kernel[grid](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        num_heads,
        key_cache.shape[1],
        *key.stride(),
        *value.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        HEAD_SIZE=head_size,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
    )
