"""A case's inputs: built deterministically from a seed in the vLLM-style layout, with
the traps of docs/KERNELS.md (shuffled blocks, NaN in every slot that is not live, an
all-NaN block behind every unused table entry)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from refserve.conformance.kernel_grid.cases import GridCase

#: Value written around the ``out=`` view; a kernel that writes outside it changes it.
CANARY = 12345.0


class PagedAttentionFn(Protocol):
    """The signature every kernel under test has (that of ``refserve.kernels.paged_attention``)."""

    def __call__(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        *,
        scale: float | None = ...,
        sliding_window: int | None = ...,
        softcap: float | None = ...,
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class AttentionInputs:
    """Arguments of one ``paged_attention`` call, in ``refserve.kernels.paged_attention``'s order.

    ``key_cache``/``value_cache`` are always ``[blocks, block_size, Hkv, D]`` views (what
    the oracle reads); :meth:`call` hands a kernel the ``layout`` it asked for, a view of
    the same storage.
    """

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    scale: float | None
    sliding_window: int | None
    softcap: float | None
    layout: str = "nhd"
    #: Keywords beyond our kernel's signature (causal, alibi_slopes, sinks, k_scale,
    #: v_scale, return_lse; per-request windows go in ``sliding_window`` as int32 [S]).
    extra: Mapping[str, Any] = field(default_factory=dict)
    window_per_seq: torch.Tensor | None = None

    def call(self, fn: Callable[..., Any], **extra: Any) -> Any:
        """Call ``fn`` with these inputs in the signature's order, plus ``extra`` keywords."""
        k, v = self.key_cache, self.value_cache
        if self.layout == "hnd":
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        return fn(
            self.query,
            k,
            v,
            self.block_table,
            self.seq_lens,
            self.query_start_loc,
            scale=self.scale,
            sliding_window=self.sliding_window
            if self.window_per_seq is None
            else self.window_per_seq,
            softcap=self.softcap,
            **self.extra,
            **extra,
        )

    def call_oracle(self, fn: Callable[..., torch.Tensor]) -> torch.Tensor:
        """Call an oracle (always the ``nhd`` views)."""
        return fn(
            self.query,
            self.key_cache,
            self.value_cache,
            self.block_table,
            self.seq_lens,
            self.query_start_loc,
            scale=self.scale,
            sliding_window=self.sliding_window,
            softcap=self.softcap,
        )


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` in integers (blocks for ``a`` slots of ``b``)."""
    return -(-a // b)


def empty_cache(
    case: GridCase, num_blocks: int, dtype: torch.dtype, device: torch.device | str, d: int
) -> torch.Tensor:
    """A NaN cache seen as ``[blocks, bs, Hkv, d]``, stored as the case's layout/view asks."""
    bs, hkv = case.block_size, case.num_kv_heads
    # strided: 8 extra columns per head, so the view the kernel gets is not contiguous.
    width = d + 8 if case.kv_view == "strided" else d
    if case.layout == "hnd":
        store = torch.full((num_blocks, hkv, bs, width), math.nan, dtype=dtype, device=device)
        return store.transpose(1, 2)[..., :d]
    store = torch.full((num_blocks, bs, hkv, width), math.nan, dtype=dtype, device=device)
    return store[..., :d]


def build_inputs(
    case: GridCase, dtype: torch.dtype, device: torch.device | str, seed: int
) -> AttentionInputs:
    """Deterministic inputs for ``case`` (same seed, same tensors), with the traps above."""
    gen = torch.Generator().manual_seed(seed)
    bs, hkv, d = case.block_size, case.num_kv_heads, case.head_size
    blocks_per_seq = [cdiv(kv, bs) for kv in case.kv_lens]
    needed = sum(blocks_per_seq) + case.spare_blocks + 1  # + 1: the all-NaN padding block
    num_blocks = max(needed, case.num_blocks or 0)
    # The data lives in the pool's last `needed` blocks, in shuffled order.
    physical = (num_blocks - needed) + torch.randperm(needed, generator=gen)
    poison_block = int(physical[-1])
    max_blocks = max(blocks_per_seq, default=0) + 1  # >= 1 unused entry per row
    table = torch.full((len(case.seqs), max_blocks), poison_block, dtype=torch.int32)

    # fp8 caches hold x / scale (per-tensor scales, as vLLM's fp8 KV): the kernel gets the
    # scales as k_scale / v_scale and must multiply them back.
    cache_dtype = torch.float8_e4m3fn if case.fp8_kv else dtype
    k_scale, v_scale = (0.5, 0.25) if case.fp8_kv else (1.0, 1.0)
    dv = case.v_head_size or d
    key_cache = empty_cache(case, num_blocks, cache_dtype, device, d)
    value_cache = empty_cache(case, num_blocks, cache_dtype, device, dv)
    next_block = 0
    for s, kv_len in enumerate(case.kv_lens):
        ids = physical[next_block : next_block + blocks_per_seq[s]]
        next_block += blocks_per_seq[s]
        table[s, : len(ids)] = ids.to(torch.int32)
        # Live slots only: positions < kv_len, through the block table.
        pos = torch.arange(kv_len)
        blk, off = ids[pos // bs].to(device), (pos % bs).to(device)
        k = torch.randn(kv_len, hkv, d, generator=gen) / k_scale
        v = torch.randn(kv_len, hkv, dv, generator=gen) / v_scale
        key_cache[blk, off] = k.to(cache_dtype).to(device)
        value_cache[blk, off] = v.to(cache_dtype).to(device)

    query = torch.randn(case.num_tokens, case.num_q_heads, d, generator=gen) * case.logit_scale
    starts = [0]
    for _, q_len in case.seqs:
        starts.append(starts[-1] + q_len)
    return AttentionInputs(
        query=query.to(dtype).to(device),
        key_cache=key_cache,
        value_cache=value_cache,
        block_table=table.to(device),
        seq_lens=torch.tensor(case.kv_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        scale=case.scale,
        sliding_window=case.sliding_window,
        softcap=case.softcap,
        layout=case.layout,
        extra=_extra_keywords(case, gen, device, k_scale, v_scale),
        window_per_seq=None
        if case.window_per_seq is None
        else torch.tensor(case.window_per_seq, dtype=torch.int32, device=device),
    )


def _extra_keywords(
    case: GridCase,
    gen: torch.Generator,
    device: torch.device | str,
    k_scale: float,
    v_scale: float,
) -> dict[str, Any]:
    """Keywords a case beyond our kernel passes (names as in docs/KERNELS.md)."""
    extra: dict[str, Any] = {}
    hq = case.num_q_heads
    if not case.causal:
        extra["causal"] = False
    if case.alibi:
        # The standard ALiBi slopes 2**(-8 (h + 1) / Hq), fp32 [Hq].
        slopes = [2.0 ** (-8.0 * (h + 1) / hq) for h in range(hq)]
        extra["alibi_slopes"] = torch.tensor(slopes, dtype=torch.float32, device=device)
    if case.sinks:
        extra["sinks"] = torch.randn(hq, generator=gen).to(device)
    if case.fp8_kv:
        extra["k_scale"], extra["v_scale"] = k_scale, v_scale
    if case.return_lse:
        extra["return_lse"] = True
    return extra
