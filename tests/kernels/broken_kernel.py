"""Deliberately wrong paged-attention kernels, for showing that the kernel grid catches bugs.

Each has the documented signature and is a dense computation like ``refserve.kernels.oracle``
with one classic paged-attention bug switched on (docs/ARCHITECTURE.md, "Kernels"):

- :func:`ignores_last_partial_block`: reads ``seq_len // block_size`` blocks (floor
  instead of ceil), dropping the keys of a sequence's last, partial block;
- :func:`reads_whole_blocks`: reads every slot of every used block and masks the
  extra ones by multiplying with 0 (NaN * 0 is NaN: the poisoned slots show);
- :func:`causal_from_start`: aligns the causal mask to the *start* of the sequence, as
  if every call were a whole prompt (wrong for decodes and chunks);
- :func:`writes_past_output`: right values, but also writes one row past ``out``.

And three that exercise the harness rather than the math (docs/KERNELS.md, "Running the
grid"): :func:`segfaults_on_prompts` and :func:`hangs_on_prompts` crash the process or
never return when a batch holds a whole prompt (only ever run them through
``refserve check-kernel``, which isolates each case in a worker), and
:func:`decode_only` declares ``refserve_capabilities`` and handles decodes only.
"""

from __future__ import annotations

import ctypes
import math
import time

import torch


def _dense(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float | None,
    sliding_window: int | None,
    softcap: float | None,
    *,
    floor_blocks: bool = False,
    whole_blocks: bool = False,
    causal_from_start: bool = False,
) -> torch.Tensor:
    _, hq, d = query.shape
    bs, hkv = key_cache.shape[1], key_cache.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.zeros_like(query)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for s, kv_len in enumerate(lens):
        q0, q1 = starts[s], starts[s + 1]
        if q1 == q0:
            continue
        n_blocks = kv_len // bs if floor_blocks else -(-kv_len // bs)
        n_read = n_blocks * bs if whole_blocks else min(kv_len, n_blocks * bs)
        pos = torch.arange(n_read)
        blocks = block_table[s, pos // bs].long()
        k = key_cache[blocks, pos % bs].float().repeat_interleave(hq // hkv, dim=1)
        v = value_cache[blocks, pos % bs].float().repeat_interleave(hq // hkv, dim=1)
        q = query[q0:q1].float()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(q1 - q0) + (0 if causal_from_start else kv_len - (q1 - q0))
        visible = (pos[None, :] <= q_pos[:, None]) & (pos[None, :] < kv_len)
        if sliding_window is not None:
            visible &= pos[None, :] > q_pos[:, None] - sliding_window
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        if whole_blocks:
            # "Masking" by multiplication: a NaN in a dead slot survives it.
            weights = probs.nan_to_num(0.0) * visible.float()
            o = torch.einsum("hqk,khd->qhd", weights, v)
        else:
            o = torch.einsum("hqk,khd->qhd", probs, v).nan_to_num(0.0)
        out[q0:q1] = o.to(query.dtype)
    return out


def ignores_last_partial_block(
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
    """Bug: ``seq_len // block_size`` blocks are read; a last partial block is skipped."""
    return _dense(
        query,
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        query_start_loc,
        scale,
        sliding_window,
        softcap,
        floor_blocks=True,
    )


def reads_whole_blocks(
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
    """Bug: reads dead slots of the last block and masks them by multiplying with 0."""
    return _dense(
        query,
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        query_start_loc,
        scale,
        sliding_window,
        softcap,
        whole_blocks=True,
    )


def causal_from_start(
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
    """Bug: query ``i`` sees keys ``0 .. i`` instead of ``0 .. kv_len - q_len + i``."""
    return _dense(
        query,
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        query_start_loc,
        scale,
        sliding_window,
        softcap,
        causal_from_start=True,
    )


def writes_past_output(
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
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bug: correct values, then one stray row written just past ``out``."""
    result = _dense(
        query,
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        query_start_loc,
        scale,
        sliding_window,
        softcap,
    )
    if out is None:
        return result
    out.copy_(result)
    t, hq, d = out.shape
    past = out.as_strided((t + 1, hq, d), out.stride(), out.storage_offset())
    past[t] = 0.0
    return out


def _has_prompt(seq_lens: torch.Tensor, query_start_loc: torch.Tensor) -> bool:
    q_lens = query_start_loc.diff().tolist()
    return any(q > 1 and q == kv for q, kv in zip(q_lens, seq_lens.tolist(), strict=True))


def segfaults_on_prompts(
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
    """Bug: dereferences NULL (SIGSEGV) when the batch holds a whole prompt; else right."""
    if _has_prompt(seq_lens, query_start_loc):
        ctypes.string_at(0)  # reads address 0: the process dies with SIGSEGV
    return _dense(
        query, key_cache, value_cache, block_table, seq_lens, query_start_loc,
        scale, sliding_window, softcap,
    )  # fmt: skip


def hangs_on_prompts(
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
    """Bug: never returns when the batch holds a whole prompt (a deadlocked kernel)."""
    while _has_prompt(seq_lens, query_start_loc):
        time.sleep(3600)
    return _dense(
        query, key_cache, value_cache, block_table, seq_lens, query_start_loc,
        scale, sliding_window, softcap,
    )  # fmt: skip


def decode_only(
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
    """A correct decode-only kernel without sliding window, and saying so."""
    if query.shape[0] != seq_lens.shape[0] or sliding_window is not None:
        raise NotImplementedError("decode-only, no sliding window")
    return _dense(
        query, key_cache, value_cache, block_table, seq_lens, query_start_loc,
        scale, sliding_window, softcap,
    )  # fmt: skip


# What the grid reads (docs/KERNELS.md, "Capabilities"): a plain dict, no refserve import.
decode_only.__dict__["refserve_capabilities"] = {"decode_only": True, "sliding_window": False}
