"""Dense PyTorch oracle for the kernels of this package (docs/ARCHITECTURE.md, "Kernels").

Everything here is written to be checked by reading, not to be fast: one sequence at a
time, K/V gathered through the block table into dense tensors, scores materialised in
fp32, a plain ``softmax``. The Triton kernels (``refserve.kernels.attention``,
``refserve.kernels.kv_write``,
``refserve.kernels.copy``) are tested against these functions, and ``refserve check-kernel`` runs
other people's kernels against :func:`paged_attention`.

This module needs only torch: ``import refserve.kernels.oracle`` works without triton.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from refserve.kernels.validation import (
    validate_copy_blocks_inputs,
    validate_paged_attention_inputs,
    validate_write_kv_inputs,
)

__all__ = [
    "copy_blocks",
    "paged_attention",
    "paged_attention_extended_f64",
    "paged_attention_f64",
    "write_kv",
]


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal paged attention over a packed batch, computed densely in fp32.

    Layout (docs/ARCHITECTURE.md "Kernels", checked by ``refserve.kernels.validation``): ``query``
    ``[T, Hq, D]``; caches ``[num_blocks, block_size, Hkv, D]``; ``block_table`` int32
    ``[S, max_blocks]``; ``seq_lens`` int32 ``[S]``, the KV length of each sequence
    including this step's tokens (their K/V are already written); ``query_start_loc``
    int32 ``[S + 1]``.

    Sequence ``s`` has ``q_len`` queries and ``kv_len = seq_lens[s]`` keys. Its queries are
    its *last* ``q_len`` tokens, so query ``i`` sits at position ``kv_len - q_len + i`` and
    sees keys ``0 .. kv_len - q_len + i`` (causal mask aligned to the end). A decode token
    has ``q_len == 1``; a whole prompt ``q_len == kv_len``; a mid-prompt chunk anything
    in between.

    Options: ``scale`` multiplies the scores (default ``1 / sqrt(D)``); ``softcap`` ``c``
    maps a scaled score ``x`` to ``c * tanh(x / c)``; ``sliding_window`` ``w`` lets a
    query at position ``p`` see only keys in ``(p - w, p]`` (``w`` keys, itself included).
    Query head ``h`` reads KV head ``h // (Hq // Hkv)`` (GQA by head grouping).

    Returns ``[T, Hq, D]`` in the query's dtype. Only cache slots at positions
    ``< seq_lens[s]`` are read.
    """
    dims = validate_paged_attention_inputs(
        query,
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        query_start_loc,
        scale=scale,
        sliding_window=sliding_window,
        softcap=softcap,
        function="oracle.paged_attention",
    )
    return _attend(
        query,
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        query_start_loc,
        scale=1.0 / math.sqrt(dims.head_size) if scale is None else scale,
        sliding_window=sliding_window,
        softcap=softcap,
        block_size=dims.block_size,
        group_size=dims.group_size,
        compute=torch.float32,
        compute_device=query.device,
        out_dtype=query.dtype,
    )


def paged_attention_f64(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """:func:`paged_attention` computed in float64 on the CPU; returns float64 on the CPU.

    The kernel grid's reference (docs/KERNELS.md, "The float64 oracle"): an fp32 oracle
    rounds too, and on sharp softmaxes (scores in the hundreds) its own rounding is about
    half of the error a correct fp32 kernel shows against it. Inputs are the same rounded
    values the kernel sees; only the live K/V slots are gathered before moving to the CPU,
    so a huge cache on a GPU is never copied whole.
    """
    dims = validate_paged_attention_inputs(
        query,
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        query_start_loc,
        scale=scale,
        sliding_window=sliding_window,
        softcap=softcap,
        function="oracle.paged_attention_f64",
    )
    return _attend(
        query,
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        query_start_loc,
        scale=1.0 / math.sqrt(dims.head_size) if scale is None else scale,
        sliding_window=sliding_window,
        softcap=softcap,
        block_size=dims.block_size,
        group_size=dims.group_size,
        compute=torch.float64,
        compute_device=torch.device("cpu"),
        out_dtype=torch.float64,
    )


def _attend(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    block_size: int,
    group_size: int,
    compute: torch.dtype,
    compute_device: torch.device,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The dense computation shared by both oracles, in ``compute`` on ``compute_device``."""
    starts = query_start_loc.tolist()
    kv_lens = seq_lens.tolist()
    out = torch.empty(query.shape, dtype=out_dtype, device=compute_device)
    for s in range(len(kv_lens)):
        q_begin, q_end = starts[s], starts[s + 1]
        q_len, kv_len = q_end - q_begin, kv_lens[s]
        if q_len == 0:
            continue

        # Gather this sequence's keys and values, position by position, through its
        # block table: slot of position p = block_table[p // bs] * bs + p % bs.
        positions = torch.arange(kv_len, device=query.device)
        blocks = block_table[s, positions // block_size].long()
        offsets = positions % block_size
        k = key_cache[blocks, offsets].to(compute_device, compute)  # [kv_len, Hkv, D]
        v = value_cache[blocks, offsets].to(compute_device, compute)
        positions = positions.to(compute_device)

        # GQA: each KV head serves `group_size` consecutive query heads.
        k = k.repeat_interleave(group_size, dim=1)  # [kv_len, Hq, D]
        v = v.repeat_interleave(group_size, dim=1)
        q = query[q_begin:q_end].to(compute_device, compute)  # [q_len, Hq, D]

        scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [Hq, q_len, kv_len]
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)

        # Causal mask aligned to the end of the sequence.
        q_pos = (kv_len - q_len) + torch.arange(q_len, device=compute_device)
        k_pos = positions
        visible = k_pos[None, :] <= q_pos[:, None]  # [q_len, kv_len]
        if sliding_window is not None:
            visible &= k_pos[None, :] > q_pos[:, None] - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))

        probs = torch.softmax(scores, dim=-1)
        out[q_begin:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(out_dtype)
    return out


def paged_attention_extended_f64(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float | None = None,
    sliding_window: int | Sequence[int] | None = None,
    softcap: float | None = None,
    causal: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention surface beyond our kernel, in float64 on the CPU.

    Reference for the grid's oracle-only cases (docs/KERNELS.md, "Beyond our kernel"): the
    same gather and mask as :func:`paged_attention`, plus

    - ``sliding_window`` per sequence (a sequence of ints, ``0``: no window);
    - ``causal=False``: every query sees all ``seq_len`` keys (no window then);
    - ``alibi_slopes`` ``[Hq]``: adds ``slope[h] * (k_pos - q_pos)`` to scaled scores;
    - ``sinks`` ``[Hq]``: one extra logit per head in the softmax denominator, attached
      to no value (``exp(sink)`` joins the sum);
    - fp8 caches (any dtype) dequantised by per-tensor ``k_scale`` / ``v_scale``;
    - a value head size different from the key head size.

    Returns ``(out [T, Hq, Dv], lse [T, Hq])`` in float64 on the CPU; ``lse`` is the
    natural log of the softmax denominator (sink included) over scaled, capped scores.
    Only the layout checks a caller of this reference needs are made (shapes agree).
    """
    num_tokens, num_q_heads, head_size = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    if value_cache.shape[:3] != key_cache.shape[:3]:
        raise ValueError(f"value_cache {tuple(value_cache.shape)} vs key_cache "
                         f"{tuple(key_cache.shape)}: only the head size may differ")  # fmt: skip
    if not causal and sliding_window is not None:
        raise ValueError("a sliding window needs causal attention")
    group = num_q_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_size) if scale is None else scale
    cpu, f64 = torch.device("cpu"), torch.float64
    starts, kv_lens = query_start_loc.tolist(), seq_lens.tolist()
    windows: list[int | None]
    if sliding_window is None or isinstance(sliding_window, int):
        windows = [sliding_window] * len(kv_lens)
    else:
        windows = [w or None for w in sliding_window]
    out = torch.zeros(num_tokens, num_q_heads, value_cache.shape[3], dtype=f64)
    lse = torch.full((num_tokens, num_q_heads), -math.inf, dtype=f64)
    for s, kv_len in enumerate(kv_lens):
        q_begin, q_end = starts[s], starts[s + 1]
        q_len = q_end - q_begin
        if q_len == 0:
            continue
        positions = torch.arange(kv_len, device=query.device)
        blocks = block_table[s, positions // block_size].long()
        offsets = positions % block_size
        k = key_cache[blocks, offsets].to(cpu).to(f64) * k_scale
        v = value_cache[blocks, offsets].to(cpu).to(f64) * v_scale
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        q = query[q_begin:q_end].to(cpu, f64)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = (kv_len - q_len) + torch.arange(q_len)
        k_pos = torch.arange(kv_len)
        if alibi_slopes is not None:
            rel = (k_pos[None, :] - q_pos[:, None]).to(f64)  # [q_len, kv_len], <= 0 if causal
            scores = scores + alibi_slopes.to(cpu, f64)[:, None, None] * rel[None]
        visible = torch.ones(q_len, kv_len, dtype=torch.bool)
        if causal:
            visible &= k_pos[None, :] <= q_pos[:, None]
        if windows[s] is not None:
            visible &= k_pos[None, :] > q_pos[:, None] - windows[s]
        scores = scores.masked_fill(~visible, -math.inf)
        if sinks is not None:
            sink = sinks.to(cpu, f64)[:, None, None].expand(num_q_heads, q_len, 1)
            scores = torch.cat([scores, sink], dim=-1)
            v = torch.cat([v, torch.zeros_like(v[:1])], dim=0)  # the sink's value is 0
        lse[q_begin:q_end] = torch.logsumexp(scores, dim=-1).transpose(0, 1)
        probs = torch.softmax(scores, dim=-1)
        out[q_begin:q_end] = torch.einsum("hqk,khd->qhd", probs, v)
    return out, lse


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write token ``t``'s ``key[t]``/``value[t]`` ``[Hkv, D]`` into slot ``slot_mapping[t]``.

    Slot ``p`` is block ``p // block_size``, offset ``p % block_size`` (docs/ARCHITECTURE.md,
    "Vocabulary"); slot ``-1`` skips the token (e.g. padding). Writes in place.
    """
    validate_write_kv_inputs(
        key, value, key_cache, value_cache, slot_mapping, function="oracle.write_kv"
    )
    block_size = key_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot == -1:
            continue
        key_cache[slot // block_size, slot % block_size] = key[t]
        value_cache[slot // block_size, slot % block_size] = value[t]


def copy_blocks(
    src_key_cache: torch.Tensor,
    src_value_cache: torch.Tensor,
    dst_key_cache: torch.Tensor,
    dst_value_cache: torch.Tensor,
    block_mapping: torch.Tensor,
) -> None:
    """For each row ``(src, dst)`` of ``block_mapping`` copy block ``src`` to block ``dst``.

    The source and destination pools may be the same tensors (copy-on-write: a shared
    block is duplicated before it is written, invariant PREFIX) or two pools,
    possibly on different devices (swap between tiers). Writes in place.
    """
    validate_copy_blocks_inputs(
        src_key_cache,
        src_value_cache,
        dst_key_cache,
        dst_value_cache,
        block_mapping,
        function="oracle.copy_blocks",
    )
    for src, dst in block_mapping.tolist():
        dst_key_cache[dst] = src_key_cache[src].to(dst_key_cache.device)
        dst_value_cache[dst] = src_value_cache[src].to(dst_value_cache.device)
