"""Attention backends: write this step's K/V into the paged caches, then attend.

A backend sees one step's flattened tokens in the layout of ``kernels`` (docs/ARCHITECTURE.md):
query ``[T, Hq, D]``, caches ``[num_blocks, block_size, Hkv, D]``, ``block_tables`` int32
``[S, max_blocks]``, ``seq_lens`` int32 ``[S]`` (KV length including this step's tokens),
``query_start_loc`` int32 ``[S + 1]``; causal, each sequence's queries aligned to the end
of its KV. ``attend(..., sliding_window=w)`` (a sliding-attention layer) lets a query at
position ``p`` see only the keys at ``p - w < k <= p``, as ``refserve.kernels.oracle`` and
transformers' sliding mask do; the block tables still cover every token, and the keys
before the window are not read at all.

- ``torch``: gathers each sequence's K/V through its block table (from the first block
  any of its queries' windows reach) and runs a masked softmax in fp32. Readable,
  CPU-friendly, the default.
- ``triton``: ``refserve.kernels.paged_attention`` / ``write_kv`` / ``copy_blocks``. Imported only
  when selected; a missing triton or kernels package is a :class:`BackendUnavailable`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from refserve.errors import InvalidArgument, RefserveError
from refserve.kv import BlockCopy
from refserve.spec.arith import blocks_needed, logical_block

BACKENDS = ("torch", "triton")


class BackendUnavailable(RefserveError):
    """The selected attention backend cannot run here (triton or kernels missing)."""


@dataclass(frozen=True)
class AttentionMetadata:
    """One step's layout; the host-side lists are read once per step, not per layer."""

    slot_mapping: torch.Tensor  # int64 [T]
    query_start_loc: torch.Tensor  # int32 [S + 1]
    seq_lens: torch.Tensor  # int32 [S]
    block_tables: torch.Tensor  # int32 [S, max_blocks]
    query_start_loc_host: tuple[int, ...]
    seq_lens_host: tuple[int, ...]


class AttentionBackend(Protocol):
    name: str

    def copy_blocks(
        self, key_cache: torch.Tensor, value_cache: torch.Tensor, copies: Sequence[BlockCopy]
    ) -> None:
        """Copy-on-write: whole blocks ``src -> dst``, before this step's K/V is written."""
        ...

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None: ...

    def attend(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """``[T, Hq, D]``: causal attention, within ``sliding_window`` keys when given."""
        ...


class TorchAttention:
    """Dense math per sequence: gather by block table, causal mask, fp32 softmax."""

    name = "torch"

    def copy_blocks(
        self, key_cache: torch.Tensor, value_cache: torch.Tensor, copies: Sequence[BlockCopy]
    ) -> None:
        if not copies:
            return
        src = torch.tensor([c.src for c in copies], dtype=torch.int64, device=key_cache.device)
        dst = torch.tensor([c.dst for c in copies], dtype=torch.int64, device=key_cache.device)
        key_cache[dst] = key_cache[src]
        value_cache[dst] = value_cache[src]

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        nb, bs, h, d = key_cache.shape
        key_cache.view(nb * bs, h, d)[meta.slot_mapping] = key.to(key_cache.dtype)
        value_cache.view(nb * bs, h, d)[meta.slot_mapping] = value.to(value_cache.dtype)

    def attend(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        _, bs, hkv, d = key_cache.shape
        group = query.shape[1] // hkv
        out = torch.empty_like(query)
        qsl = meta.query_start_loc_host
        for s, kv_len in enumerate(meta.seq_lens_host):
            a, b = qsl[s], qsl[s + 1]
            q_len = b - a
            if q_len == 0:
                continue
            # Query i sits at position kv_len - q_len + i and sees keys 0 ..= that
            # position; in a window w, only those > position - w. Keys before the first
            # query's window are never read: gathering starts at its block.
            first_key = 0
            if sliding_window is not None:
                first_key = max(0, kv_len - q_len - sliding_window + 1)
            first_block = logical_block(first_key, bs)
            nblocks = blocks_needed(kv_len, bs)
            blocks = meta.block_tables[s, first_block:nblocks].long()
            base = first_block * bs  # the position of the first gathered slot
            k = key_cache[blocks].reshape(-1, hkv, d)[first_key - base : kv_len - base].float()
            v = value_cache[blocks].reshape(-1, hkv, d)[first_key - base : kv_len - base].float()
            if group > 1:
                k = k.repeat_interleave(group, dim=1)
                v = v.repeat_interleave(group, dim=1)
            q = query[a:b].float()
            scores = torch.einsum("qhd,khd->hqk", q, k) * scale
            qpos = torch.arange(kv_len - q_len, kv_len, device=query.device)
            kpos = torch.arange(first_key, kv_len, device=query.device)
            mask = kpos[None, :] > qpos[:, None]
            if sliding_window is not None:
                mask |= kpos[None, :] <= qpos[:, None] - sliding_window
            scores = scores.masked_fill(mask[None], float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[a:b] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
        return out


class TritonAttention:
    """The ``kernels`` package's Triton kernels (on CPU only under ``TRITON_INTERPRET=1``)."""

    name = "triton"

    def __init__(self) -> None:
        try:
            import refserve.kernels as kernels

            self._paged_attention: Any = kernels.paged_attention
            self._write_kv: Any = kernels.write_kv
            self._copy_blocks: Any = kernels.copy_blocks
        except Exception as e:  # ImportError, or a kernel module failing at import
            raise BackendUnavailable(
                f"attention backend 'triton' needs triton and the kernels package: {e!r}. "
                "Use --attention-backend torch, or install triton (set TRITON_INTERPRET=1 "
                "to run the kernels on CPU)."
            ) from e

    def copy_blocks(
        self, key_cache: torch.Tensor, value_cache: torch.Tensor, copies: Sequence[BlockCopy]
    ) -> None:
        if not copies:
            return
        mapping = torch.tensor(
            [[c.src, c.dst] for c in copies], dtype=torch.int64, device=key_cache.device
        )
        self._copy_blocks(key_cache, value_cache, key_cache, value_cache, mapping)

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        self._write_kv(
            key.to(key_cache.dtype).contiguous(),
            value.to(value_cache.dtype).contiguous(),
            key_cache,
            value_cache,
            meta.slot_mapping,
        )

    def attend(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        out: torch.Tensor = self._paged_attention(
            query.contiguous(),
            key_cache,
            value_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            scale=scale,
            sliding_window=sliding_window,
        )
        return out


def make_backend(name: str) -> AttentionBackend:
    if name == "torch":
        return TorchAttention()
    if name == "triton":
        return TritonAttention()
    raise InvalidArgument(f"attention backend must be one of {', '.join(BACKENDS)}; got {name!r}")


def default_scale(head_dim: int) -> float:
    return float(head_dim**-0.5)
