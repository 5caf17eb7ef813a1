"""Dense PyTorch oracle for the kernels of this package (DESIGN.md, "Kernels").

Everything here is written to be checked by reading, not to be fast: one sequence at a
time, K/V gathered through the block table into dense tensors, scores materialised in
fp32, a plain ``softmax``. The Triton kernels (``kernels.attention``, ``kernels.kv_write``,
``kernels.copy``) are tested against these functions, and ``refserve check-kernel`` runs
other people's kernels against :func:`paged_attention`.

This module needs only torch: ``import kernels.oracle`` works without triton.
"""

from __future__ import annotations

import math

import torch

from kernels.validation import (
    validate_copy_blocks_inputs,
    validate_paged_attention_inputs,
    validate_write_kv_inputs,
)

__all__ = ["copy_blocks", "paged_attention", "write_kv"]


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

    Layout (DESIGN.md "Kernels", checked by ``kernels.validation``): ``query`` ``[T, Hq, D]``;
    caches ``[num_blocks, block_size, Hkv, D]``; ``block_table`` int32 ``[S, max_blocks]``;
    ``seq_lens`` int32 ``[S]``, the KV length of each sequence including this step's
    tokens (their K/V are already written); ``query_start_loc`` int32 ``[S + 1]``.

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
    if scale is None:
        scale = 1.0 / math.sqrt(dims.head_size)
    starts = query_start_loc.tolist()
    kv_lens = seq_lens.tolist()
    out = torch.empty_like(query)
    for s in range(dims.num_seqs):
        q_begin, q_end = starts[s], starts[s + 1]
        q_len, kv_len = q_end - q_begin, kv_lens[s]
        if q_len == 0:
            continue

        # Gather this sequence's keys and values, position by position, through its
        # block table: slot of position p = block_table[p // bs] * bs + p % bs.
        positions = torch.arange(kv_len, device=query.device)
        blocks = block_table[s, positions // dims.block_size].long()
        offsets = positions % dims.block_size
        k = key_cache[blocks, offsets].float()  # [kv_len, Hkv, D]
        v = value_cache[blocks, offsets].float()

        # GQA: each KV head serves `group_size` consecutive query heads.
        k = k.repeat_interleave(dims.group_size, dim=1)  # [kv_len, Hq, D]
        v = v.repeat_interleave(dims.group_size, dim=1)
        q = query[q_begin:q_end].float()  # [q_len, Hq, D]

        scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [Hq, q_len, kv_len]
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)

        # Causal mask aligned to the end of the sequence.
        q_pos = (kv_len - q_len) + torch.arange(q_len, device=query.device)
        k_pos = positions
        visible = k_pos[None, :] <= q_pos[:, None]  # [q_len, kv_len]
        if sliding_window is not None:
            visible &= k_pos[None, :] > q_pos[:, None] - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))

        probs = torch.softmax(scores, dim=-1)
        out[q_begin:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write token ``t``'s ``key[t]``/``value[t]`` ``[Hkv, D]`` into slot ``slot_mapping[t]``.

    Slot ``p`` is block ``p // block_size``, offset ``p % block_size`` (DESIGN.md
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
    block is duplicated before it is written, DESIGN.md invariant PREFIX) or two pools,
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
