"""The kernel grid: paged-attention cases, generated from tiling boundaries, run against
a float64 oracle one case at a time in an isolated worker (docs/KERNELS.md).

A paged-attention kernel goes wrong at known edges (docs/KERNELS.md). The grid
holds the hand-named cases of that list plus cases *generated* from boundary rules
(:data:`BOUNDARY_RULES`, docs/KERNELS.md "Boundary rules"): every tiling edge kernels in
the field use (key tiles of 16/32/64/128 positions, query tiles crossing key tiles,
sliding-window edges on and off tile edges, split-KV segment counts that do and do not
divide a sequence, a single key tile, KV length 1). Each :class:`GridCase` names the
boundary it exercises. A case builds its inputs deterministically from a seed
(:func:`build_inputs`) in the vLLM-style layout (``kernels.validation``), with traps:

- physical blocks are shuffled (non-contiguous) and the pool holds spare blocks;
- every cache slot that is not live (past a sequence's length, in spare blocks) is NaN,
  and every unused block-table entry points at an all-NaN block, so a kernel that reads
  any of them produces NaN and fails loudly;
- if the function accepts an ``out=`` tensor, it gets a strided view into a larger
  buffer filled with a canary value, and any write outside the view fails the case.

The reference is ``kernels.oracle.paged_attention_f64`` (float64 on the CPU), so the
tolerance of ``kernels.tolerances`` is spent on the kernel alone; the fp32 oracle's own
error is measured and reported beside it (``oracle_fp32_err``).

A kernel declares what it supports with a ``refserve_capabilities`` attribute
(:class:`KernelCapabilities` or a plain dict of its fields); a case outside that is
``NOT_SUPPORTED``, never a failure. :func:`run_case` / :func:`run_grid` run in this
process; :func:`check_kernel_main` (``refserve check-kernel``) runs each case in a
persistent worker subprocess that is restarted after a crash or a timeout, so a kernel
that segfaults or hangs fails that case and the run goes on. This module needs torch and
``kernels.oracle`` only (no triton), so a kernel author's checker never needs our kernels.

Beyond that kernel: ``beyond_design`` cases check features other engines' kernels have
(fp8 KV, sinks, ALiBi, per-request windows, non-causal, a different V head size, the
log-sum-exp) against ``kernels.oracle.paged_attention_extended_f64``, and ``--op
write_kv`` / ``--op copy_blocks`` run grids of their own (:data:`GRIDS`).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import fnmatch
import importlib
import inspect
import json
import math
import os
import platform
import selectors
import signal
import subprocess
import sys
import tempfile
import time
import traceback as traceback_module
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from types import MappingProxyType
from typing import IO, Any, Protocol

import torch

from kernels import oracle
from kernels.tolerances import Tolerance, attention_tolerance

__all__ = [
    "BOUNDARY_RULES",
    "CASES",
    "COPY_BLOCKS_GRID",
    "FEATURES",
    "GRID",
    "GRIDS",
    "WRITE_KV_GRID",
    "AttentionInputs",
    "CaseResult",
    "GridCase",
    "GridHarnessError",
    "KernelCapabilities",
    "PagedAttentionFn",
    "build_inputs",
    "capabilities_of",
    "check_kernel_main",
    "format_table",
    "report_json",
    "run_case",
    "run_grid",
    "select_cases",
    "unsupported_reason",
]

#: Value written around the ``out=`` view; a kernel that writes outside it changes it.
CANARY = 12345.0

#: Exit codes of ``refserve check-kernel`` (docs/KERNELS.md, "Running the grid").
EXIT_PASSED, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

#: Case outcomes. NOT_SUPPORTED and SKIPPED never make a run fail.
PASS, FAIL, TIMEOUT, NOT_SUPPORTED, SKIPPED = "PASS", "FAIL", "TIMEOUT", "NOT_SUPPORTED", "SKIPPED"


class GridHarnessError(RuntimeError):
    """The grid itself could not run (worker would not start, bad capabilities): exit 2."""


class PagedAttentionFn(Protocol):
    """The signature every kernel under test has (that of ``kernels.paged_attention``)."""

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


#: Cache layouts the grid can hand a kernel. ``nhd``: ``[blocks, block_size, Hkv, D]``
#: (vLLM's, and ours); ``hnd``: ``[blocks, Hkv, block_size, D]`` (FlashInfer's HND).
LAYOUTS = ("nhd", "hnd")


@dataclass(frozen=True)
class GridCase:
    """One batch shape. ``seqs`` holds ``(context_len, q_len)`` per sequence.

    ``context_len`` tokens are already in the cache; this step adds ``q_len`` queries, so
    the KV length is ``context_len + q_len`` (``seq_lens``). ``q_len == 1`` is a decode,
    ``context_len == 0`` a whole prompt, anything else a mid-prompt chunk.
    ``logit_scale`` multiplies the queries (large values give extreme logits).
    ``num_blocks`` forces a large pool whose *last* blocks hold the data (int32 offset
    overflow); ``gpu_only`` cases are too big for the interpreter. ``boundary`` names the
    rule of :data:`BOUNDARY_RULES` the case exercises; ``num_kv_splits`` is passed to a
    kernel that takes that keyword (split-KV); ``layout`` and ``kv_view`` choose how the
    caches are handed over (``strided``: a view of a wider tensor, not contiguous).
    """

    name: str
    seqs: tuple[tuple[int, int], ...]
    num_q_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    sliding_window: int | None = None
    softcap: float | None = None
    scale: float | None = None
    logit_scale: float = 1.0
    quick: bool = False
    gpu_only: bool = False
    num_blocks: int | None = None
    spare_blocks: int = 2
    boundary: str = "named"
    num_kv_splits: int | None = None
    layout: str = "nhd"
    kv_view: str = "contiguous"
    # Beyond our kernel (oracle-only for ours; docs/KERNELS.md "Beyond our kernel").
    causal: bool = True
    alibi: bool = False
    sinks: bool = False
    fp8_kv: bool = False
    v_head_size: int | None = None
    window_per_seq: tuple[int, ...] | None = None
    return_lse: bool = False
    # Which operation the case checks (docs/KERNELS.md, "write_kv and copy_blocks"):
    # paged_attention, write_kv (this step's tokens into their slots, ``pad_tokens``
    # slot -1 rows among them) or copy_blocks (each sequence's last block to a spare
    # block; ``two_pools``: into a second pool, a swap).
    op: str = "paged_attention"
    pad_tokens: int = 0
    int32_index: bool = False
    two_pools: bool = False

    @property
    def features(self) -> frozenset[str]:
        """The :data:`FEATURES` this case needs from a kernel."""
        wanted = {
            "non_causal": not self.causal,
            "alibi": self.alibi,
            "sinks": self.sinks,
            "fp8_kv": self.fp8_kv,
            "v_head_size": self.v_head_size is not None,
            "per_request_window": self.window_per_seq is not None,
            "lse": self.return_lse,
        }
        return frozenset(k for k, v in wanted.items() if v)

    @property
    def kv_lens(self) -> tuple[int, ...]:
        return tuple(c + q for c, q in self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(q for _, q in self.seqs)

    @property
    def decode_only(self) -> bool:
        """One query per sequence (what a decode-only kernel handles)."""
        return all(q == 1 for _, q in self.seqs)

    @property
    def shape(self) -> str:
        """Compact description for the report: sizes and (context+q) per sequence."""
        seqs = ",".join(f"{c}+{q}" for c, q in self.seqs)
        extras = ""
        if self.sliding_window is not None:
            extras += f" win={self.sliding_window}"
        if self.softcap is not None:
            extras += f" cap={self.softcap:g}"
        if self.scale is not None:
            extras += f" scale={self.scale:g}"
        if self.logit_scale != 1.0:
            extras += f" qx{self.logit_scale:g}"
        if self.num_blocks is not None:
            extras += f" blocks={self.num_blocks}"
        if self.num_kv_splits is not None:
            extras += f" splits={self.num_kv_splits}"
        if self.layout != "nhd":
            extras += f" layout={self.layout}"
        if self.kv_view != "contiguous":
            extras += f" kv={self.kv_view}"
        if self.v_head_size is not None:
            extras += f" Dv={self.v_head_size}"
        if self.window_per_seq is not None:
            extras += f" wins={','.join(map(str, self.window_per_seq))}"
        shown = self.features - {"v_head_size", "per_request_window"}  # shown above
        extras += "".join(f" {f}" for f in sorted(shown))
        return (
            f"T={self.num_tokens} Hq={self.num_q_heads} Hkv={self.num_kv_heads} "
            f"D={self.head_size} bs={self.block_size} seqs=[{seqs}]{extras}"
        )

    def params(self) -> dict[str, Any]:
        """The case's parameters as structured fields (the JSON report's ``params``)."""
        row = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "name"}
        row["seqs"] = [list(s) for s in self.seqs]
        row["features"] = sorted(self.features)
        row["kv_lens"] = list(self.kv_lens)
        row["num_tokens"] = self.num_tokens
        return row


@dataclass(frozen=True)
class AttentionInputs:
    """Arguments of one ``paged_attention`` call, in ``kernels.paged_attention``'s order.

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


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _empty_cache(
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
    blocks_per_seq = [_cdiv(kv, bs) for kv in case.kv_lens]
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
    key_cache = _empty_cache(case, num_blocks, cache_dtype, device, d)
    value_cache = _empty_cache(case, num_blocks, cache_dtype, device, dv)
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


# ----------------------------------------------------------------------------- the cases
#: Key-tile sizes kernels in the field use (vLLM's unified attention: 16/32/64; FA2-style
#: kernels: 64/128; ours: 32 interpreted, 64 compiled). Every tiling rule below is
#: generated once per size, because the grid cannot know which one a kernel picked.
TILE_SIZES = (16, 32, 64, 128)

#: Boundary rules, in report order (docs/KERNELS.md, "Boundary rules"). Every case's
#: ``boundary`` is one of these names.
BOUNDARY_RULES: Mapping[str, str] = MappingProxyType(
    {
        "named": "hand-picked edge cases (block edges, head sizes, GQA, options)",
        "kv_len_1": "a sequence of exactly one key (prompt of one token, first decode)",
        "single_key_tile": "every sequence fits in one key tile of 16",
        "kv_tile_edge": "KV lengths T-1, T, T+1 for each key-tile size T",
        "query_tile_crosses_key_tile": "a chunk's queries straddle key-tile edge T, with GQA",
        "window_edge": "the first visible key of a windowed query at T*k-1, T*k, T*k+1",
        "small_window_crosses_tile": "a query group crosses tile edge T under a window of 4: "
        "later rows see none of the first tile (online-softmax rescale with max -inf)",
        "split_kv": "split-KV for every block size and option; segments that do and do "
        "not divide the key tiles, and more segments than tiles",
        "layout": "cache layouts and non-contiguous K/V views",
        "write_kv": "write_kv: block edges, block size 1, odd heads, slot -1, int32 slots, "
        "strided and HND caches",
        "copy_blocks": "copy_blocks: copy-on-write within a pool, swap between pools, "
        "block size 1, odd heads, strided and HND caches",
        "beyond_design": "oracle-only surface: fp8 KV with per-tensor scales, sinks, ALiBi, "
        "per-request windows, non-causal, V head size != K head size, log-sum-exp",
    }
)

_MIXED = ((20, 1), (0, 9), (13, 6), (40, 1))  # decode, prompt, mid-chunk, decode


def _named_cases() -> list[GridCase]:
    mixed = _MIXED
    return [
        # KV length around block boundaries (block 16): 1, bs - 1, bs, bs + 1, 3 bs - 6.
        GridCase("kv_len_1", ((0, 1),), 2, 1, 64, 16, quick=True, boundary="kv_len_1"),
        GridCase("kv_len_bs_minus_1", ((14, 1),), 2, 1, 64, 16, boundary="single_key_tile"),
        GridCase("kv_len_bs", ((15, 1),), 2, 1, 64, 16, quick=True, boundary="single_key_tile"),
        GridCase("kv_len_bs_plus_1", ((16, 1),), 2, 1, 64, 16, quick=True),
        GridCase("kv_len_3bs_minus_6", ((41, 1),), 2, 1, 64, 16, quick=True),
        GridCase("prompt_bs_plus_1", ((0, 17),), 2, 1, 64, 16),
        # Head sizes: 80 and 96 are not powers of two, 40 not a multiple of 16.
        GridCase("head_64", ((5, 3), (17, 1)), 2, 1, 64, 16),
        GridCase("head_80", ((5, 3), (17, 1)), 2, 1, 80, 16),
        GridCase("head_96", ((5, 3), (17, 1)), 2, 1, 96, 16),
        GridCase("head_128", ((5, 3), (17, 1)), 2, 1, 128, 16),
        GridCase("head_40", ((5, 3), (17, 1)), 2, 1, 40, 16, quick=True),
        # Block sizes 1, 5, 16, 32 on the mixed batch.
        GridCase("block_1", mixed, 2, 1, 32, 1),
        GridCase("block_5", mixed, 2, 1, 32, 5, quick=True),
        GridCase("block_16", mixed, 2, 1, 32, 16),
        GridCase("block_32", mixed, 2, 1, 32, 32),
        # GQA: query heads per KV head 1, 2, 5, 7, 8 (two KV heads for some).
        GridCase("gqa_1", mixed, 2, 2, 32, 16),
        GridCase("gqa_2", mixed, 4, 2, 32, 16),
        GridCase("gqa_5", mixed, 5, 1, 32, 16, quick=True),
        GridCase("gqa_7", mixed, 14, 2, 32, 16),
        GridCase("gqa_8", mixed, 8, 1, 32, 16),
        # Decode, whole prompts and mid-prompt chunks in one call, more sequences.
        GridCase(
            "mixed_batch",
            ((0, 1), (31, 1), (0, 23), (9, 7), (16, 16), (47, 2)),
            4,
            2,
            48,
            8,
            quick=True,
        ),
        # Options.
        GridCase("sliding_window_7", mixed, 4, 2, 32, 4, sliding_window=7, quick=True),
        GridCase("sliding_window_1", mixed, 2, 1, 32, 4, sliding_window=1),
        GridCase("softcap_5", mixed, 2, 1, 32, 16, softcap=5.0, logit_scale=4.0, quick=True),
        GridCase("window_and_softcap", mixed, 4, 2, 32, 5, sliding_window=10, softcap=20.0),
        GridCase("custom_scale", mixed, 4, 2, 32, 16, scale=0.37),
        # Scores of tens: softmax is sharp but not one-hot, so score errors show.
        GridCase("large_logits", mixed, 2, 1, 64, 16, logit_scale=12.0),
        # Scores in the hundreds: exp overflows fp32 past 88 without the max shift.
        GridCase("extreme_logits", mixed, 2, 1, 64, 16, logit_scale=100.0, quick=True),
        # A longer decode, where split-KV kernels split.
        GridCase("long_decode", ((300, 1), (129, 1)), 4, 1, 64, 16, quick=True),
        # More than 2**31 cache elements, data in the last blocks: int32 offsets overflow.
        GridCase(
            "int32_offset_overflow",
            ((40, 1), (7, 9)),
            2,
            1,
            128,
            16,
            num_blocks=(1 << 31) // (16 * 128) + 64,
            gpu_only=True,
        ),
    ]


#: Generated cases in the quick subset: one per rule, at the interpreter's tile size 32
#: (the rule is still exercised at every size in the full grid).
_QUICK_GENERATED = frozenset(
    {
        "kv_len_1_batch",
        "tile32_kv_edge",
        "tile32_q_cross",
        "tile32_window_edge_m1",
        "tile32_small_window_cross",
        "split3_bs5_plain",
        "kv_strided_view",
        "ext_sinks_window",
        "ext_alibi_softcap_lse",
    }
)


def _boundary_cases() -> list[GridCase]:
    """The cases the rules of :data:`BOUNDARY_RULES` generate (docs/KERNELS.md)."""
    cases: list[GridCase] = [
        # Several one-key sequences in one call, GQA 4: a kernel's "first tile" and "last
        # tile" are the same tile, and its first partial block is its last.
        GridCase("kv_len_1_batch", ((0, 1), (0, 1), (4, 1)), 4, 1, 64, 16, boundary="kv_len_1"),
        GridCase("single_tile_prompt", ((0, 16), (3, 9)), 8, 1, 64, 16,
                 boundary="single_key_tile"),
    ]  # fmt: skip
    for t in TILE_SIZES:
        cases.append(
            GridCase(f"tile{t}_kv_edge", ((t - 2, 1), (t - 1, 1), (t, 1)), 4, 1, 64, 16,
                     boundary="kv_tile_edge")
        )  # fmt: skip
        # Queries at t-5 .. t+4 straddle key tile edge t; a whole prompt of t+1 ends one
        # key into the next tile. GQA 4 makes query-group rows = 4 x tokens.
        cases.append(
            GridCase(f"tile{t}_q_cross", ((t - 5, 10), (0, t + 1)), 4, 1, 64, 16,
                     boundary="query_tile_crosses_key_tile")
        )  # fmt: skip
        for delta, tag in ((-1, "m1"), (0, "0"), (1, "p1")):
            # Window = t exactly when the edge falls on a tile edge, else off every size.
            w = t if delta == 0 else t // 2 + 3
            first_kv = 2 * t + delta  # first visible key of the first query
            decode_ctx = first_kv + w - 1  # a decode at position first_kv + w - 1
            chunk_ctx = first_kv + w - 1  # a chunk whose first query sits there too
            cases.append(
                GridCase(f"tile{t}_window_edge_{tag}", ((decode_ctx, 1), (chunk_ctx, 6)),
                         2, 1, 64, 16, sliding_window=w, boundary="window_edge")
            )  # fmt: skip
        # Twelve queries at 2t-6 .. 2t+5 under a window of 4: the group's first key tile
        # ends before the last rows' windows start.
        cases.append(
            GridCase(f"tile{t}_small_window_cross", ((2 * t - 6, 12),), 2, 1, 64, 16,
                     sliding_window=4, boundary="small_window_crosses_tile")
        )  # fmt: skip
    # Split-KV for every block size and option. KV lengths 96, 64, 7 and a chunk to 25:
    # with tiles of 16/32/64 the segment counts divide some and not others, and 7 keys
    # leave most segments empty.
    split_seqs = ((95, 1), (63, 1), (6, 1), (20, 5))
    options: tuple[tuple[str, dict[str, Any]], ...] = (
        ("plain", {}),
        ("window", {"sliding_window": 40}),
        ("softcap", {"softcap": 10.0, "logit_scale": 3.0}),
        ("gqa5", {}),
    )
    for i, bs in enumerate((1, 5, 16, 32)):
        for j, (opt, kw) in enumerate(options):
            splits = (2, 3)[(i + j) % 2]
            hq = 5 if opt == "gqa5" else 2
            cases.append(
                GridCase(f"split{splits}_bs{bs}_{opt}", split_seqs, hq, 1, 64, bs,
                         num_kv_splits=splits, boundary="split_kv", **kw)
            )  # fmt: skip
    for splits in (4, 7, 16):
        cases.append(
            GridCase(f"split{splits}_long", ((300, 1), (129, 1), (40, 8)), 4, 1, 64, 16,
                     num_kv_splits=splits, boundary="split_kv")
        )  # fmt: skip
    cases += [
        GridCase("kv_strided_view", _MIXED, 4, 2, 32, 16, kv_view="strided", boundary="layout"),
        GridCase("layout_hnd", _MIXED, 4, 2, 32, 16, layout="hnd", boundary="layout"),
        GridCase("layout_hnd_strided", _MIXED, 4, 2, 32, 5, layout="hnd", kv_view="strided",
                 boundary="layout"),
    ]  # fmt: skip
    beyond: tuple[tuple[str, dict[str, Any]], ...] = (
        ("ext_non_causal", {"causal": False}),
        ("ext_alibi", {"alibi": True}),
        ("ext_sinks", {"sinks": True}),
        ("ext_sinks_window", {"sinks": True, "sliding_window": 7}),
        ("ext_fp8_kv", {"fp8_kv": True}),
        ("ext_v_head_size", {"v_head_size": 48}),
        ("ext_window_per_seq", {"window_per_seq": (3, 0, 8, 1)}),
        ("ext_lse", {"return_lse": True}),
        ("ext_alibi_softcap_lse", {"alibi": True, "softcap": 20.0, "return_lse": True}),
    )
    for name, kw in beyond:
        cases.append(GridCase(name, _MIXED, 4, 2, 32, 16, boundary="beyond_design", **kw))
    return [replace(c, quick=c.name in _QUICK_GENERATED) for c in cases]


def _grid() -> tuple[GridCase, ...]:
    cases = _named_cases() + _boundary_cases()
    names = [c.name for c in cases]
    assert len(set(names)) == len(names), "grid case names must be unique"
    assert all(c.boundary in BOUNDARY_RULES for c in cases)
    return tuple(cases)


#: The grid, in report order: named cases, then generated ones.
GRID: tuple[GridCase, ...] = _grid()


#: The grid by name (the public case list: ``CASES["tile32_q_cross"]``).
def _memory_op_cases() -> tuple[GridCase, ...]:
    """The write_kv and copy_blocks grids: block edges, block size 1, odd head sizes,
    padding slots, int32 slots, swaps between pools, strided and HND caches."""
    mixed = _MIXED
    w, c = "write_kv", "copy_blocks"
    cases = [
        GridCase("wkv_mixed", mixed, 2, 1, 32, 16, op=w, quick=True),
        GridCase("wkv_block_1", mixed, 2, 1, 32, 1, op=w),
        GridCase("wkv_block_5_head_40", mixed, 4, 2, 40, 5, op=w),
        GridCase("wkv_padding", mixed, 2, 2, 32, 16, op=w, pad_tokens=3, quick=True),
        GridCase("wkv_int32_slots", mixed, 2, 1, 32, 16, op=w, int32_index=True),
        GridCase("wkv_strided", mixed, 2, 2, 32, 8, op=w, kv_view="strided"),
        GridCase("wkv_layout_hnd", mixed, 2, 2, 32, 8, op=w, layout="hnd"),
        GridCase("cb_copy_on_write", mixed, 2, 1, 32, 16, op=c, quick=True),
        GridCase("cb_block_1", mixed, 2, 1, 32, 1, op=c),
        GridCase("cb_block_5_head_40", mixed, 4, 2, 40, 5, op=c),
        GridCase("cb_swap_two_pools", mixed, 2, 2, 32, 16, op=c, two_pools=True, quick=True),
        GridCase("cb_strided", mixed, 2, 2, 32, 8, op=c, kv_view="strided"),
        GridCase("cb_layout_hnd", mixed, 2, 2, 32, 8, op=c, layout="hnd"),
    ]
    return tuple(replace(x, boundary=x.op, spare_blocks=len(x.seqs) + 1) for x in cases)


#: The grids of the other two operations, and every grid by operation.
WRITE_KV_GRID: tuple[GridCase, ...] = tuple(c for c in _memory_op_cases() if c.op == "write_kv")
COPY_BLOCKS_GRID: tuple[GridCase, ...] = tuple(
    c for c in _memory_op_cases() if c.op == "copy_blocks"
)
GRIDS: Mapping[str, tuple[GridCase, ...]] = MappingProxyType(
    {"paged_attention": GRID, "write_kv": WRITE_KV_GRID, "copy_blocks": COPY_BLOCKS_GRID}
)

#: Every case by name (the public case list: ``CASES["tile32_q_cross"]``).
CASES: Mapping[str, GridCase] = MappingProxyType(
    {c.name: c for grid in GRIDS.values() for c in grid}
)


# ---------------------------------------------------------------------- capabilities
_DTYPE_NAMES = ("float32", "float16", "bfloat16")

#: Attention features beyond our kernel's that a kernel may declare (docs/KERNELS.md).
FEATURES = ("non_causal", "alibi", "sinks", "fp8_kv", "v_head_size", "per_request_window", "lse")


@dataclass(frozen=True)
class KernelCapabilities:
    """What a kernel under test supports (docs/KERNELS.md, "Capabilities").

    Declare it as ``fn.refserve_capabilities = {...}`` (a dict of these fields, so a
    kernel need not import refserve) or as an instance. ``None`` means "any" for the
    sets. ``split_kv`` ``None``: detected from a ``num_kv_splits`` keyword.
    """

    decode_only: bool = False
    sliding_window: bool = True
    softcap: bool = True
    dtypes: frozenset[str] | None = None
    block_sizes: frozenset[int] | None = None
    head_sizes: frozenset[int] | None = None
    layouts: frozenset[str] = frozenset({"nhd"})
    noncontiguous_kv: bool = True
    split_kv: bool | None = None
    features: frozenset[str] = frozenset()

    @classmethod
    def from_declared(cls, declared: object) -> KernelCapabilities:
        """Parse a declaration; raise :class:`GridHarnessError` naming a bad field."""
        if declared is None:
            return cls()
        if isinstance(declared, KernelCapabilities):
            return declared
        if not isinstance(declared, Mapping):
            raise GridHarnessError(
                f"refserve_capabilities must be a dict or KernelCapabilities; got "
                f"{type(declared).__name__}"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(map(str, declared)) - known)
        if unknown:
            raise GridHarnessError(
                f"refserve_capabilities: unknown field(s) {unknown}; known: {sorted(known)}"
            )
        kw: dict[str, Any] = {}
        for name, value in declared.items():
            if name in ("dtypes", "block_sizes", "head_sizes", "layouts", "features") and (
                value is not None
            ):
                value = frozenset(str(v).removeprefix("torch.") if name == "dtypes" else v
                                  for v in value)  # fmt: skip
            kw[str(name)] = value
        caps = cls(**kw)
        if caps.layouts - set(LAYOUTS):
            raise GridHarnessError(f"refserve_capabilities: layouts must be within {LAYOUTS}")
        if caps.features - set(FEATURES):
            raise GridHarnessError(f"refserve_capabilities: features must be within {FEATURES}")
        if caps.dtypes is not None and caps.dtypes - set(_DTYPE_NAMES):
            raise GridHarnessError(f"refserve_capabilities: dtypes must be within {_DTYPE_NAMES}")
        return caps

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = sorted(value) if isinstance(value, frozenset) else value
        return out


def capabilities_of(fn: Callable[..., Any]) -> KernelCapabilities:
    """``fn``'s declared capabilities, with ``split_kv`` resolved from its signature."""
    caps = KernelCapabilities.from_declared(getattr(fn, "refserve_capabilities", None))
    if caps.split_kv is None:
        # Only a named keyword: a **kwargs wrapper may not mean split-KV by it.
        caps = replace(caps, split_kv="num_kv_splits" in _signature_names(fn))
    return caps


def unsupported_reason(case: GridCase, dtype: str, caps: KernelCapabilities) -> str | None:
    """Why ``caps`` excludes ``case`` at ``dtype`` (the NOT_SUPPORTED reason), or None."""
    if caps.decode_only and case.op == "paged_attention" and not case.decode_only:
        return "decode-only kernel; case has prefill/chunk queries"
    if case.sliding_window is not None and not caps.sliding_window:
        return "no sliding window"
    if case.softcap is not None and not caps.softcap:
        return "no softcap"
    if caps.dtypes is not None and dtype not in caps.dtypes:
        return f"dtype {dtype} not in {sorted(caps.dtypes)}"
    if caps.block_sizes is not None and case.block_size not in caps.block_sizes:
        return f"block size {case.block_size} not in {sorted(caps.block_sizes)}"
    if caps.head_sizes is not None and case.head_size not in caps.head_sizes:
        return f"head size {case.head_size} not in {sorted(caps.head_sizes)}"
    if case.layout not in caps.layouts:
        return f"layout {case.layout} not in {sorted(caps.layouts)}"
    if case.kv_view != "contiguous" and not caps.noncontiguous_kv:
        return "needs contiguous K/V caches"
    if case.num_kv_splits is not None and not caps.split_kv:
        return "no split-KV (no num_kv_splits keyword)"
    missing = case.features - caps.features
    if missing:
        return f"feature(s) {sorted(missing)} not declared"
    return None


# --------------------------------------------------------------------------- results
@dataclass(frozen=True)
class CaseResult:
    """Outcome of one (case, dtype) run (docs/KERNELS.md, "Report").

    ``status`` is PASS, FAIL, TIMEOUT, NOT_SUPPORTED or SKIPPED; ``error`` says why a case
    did not pass. ``tolerance`` is the bound ``atol + rtol * max|ref|``; ``worst`` locates
    the largest error (token, head, dim, sequence, output and reference values);
    ``oracle_fp32_err`` is the fp32 oracle's own error against the float64 reference.
    """

    case: str
    shape: str
    dtype: str
    device: str
    max_abs_err: float
    tolerance: float
    status: str
    error: str | None = None
    boundary: str = ""
    params: dict[str, Any] = field(default_factory=dict)
    atol: float = math.nan
    rtol: float = math.nan
    worst: dict[str, Any] | None = None
    oracle_fp32_err: float | None = None
    time_s: float = 0.0
    traceback: str | None = None
    note: str | None = None

    @property
    def passed(self) -> bool:
        return self.status == PASS

    @property
    def counts_as_failure(self) -> bool:
        return self.status in (FAIL, TIMEOUT)

    def to_json(self) -> dict[str, Any]:
        """A strict-JSON record: non-finite numbers become ``null``."""
        row = asdict(self)
        for key in ("max_abs_err", "tolerance", "atol", "rtol", "oracle_fp32_err"):
            value = row[key]
            if isinstance(value, float) and not math.isfinite(value):
                row[key] = None
        return row

    @classmethod
    def from_json(cls, row: Mapping[str, Any]) -> CaseResult:
        kw = dict(row)
        for key in ("max_abs_err", "tolerance", "atol", "rtol"):
            if kw.get(key) is None:
                kw[key] = math.nan
        return cls(**kw)


def select_cases(
    device: torch.device | str, *, quick: bool = False, cases: Sequence[GridCase] = GRID
) -> list[GridCase]:
    """Cases that run on ``device`` (GPU-only cases need CUDA), the quick subset if asked."""
    on_cuda = torch.device(device).type == "cuda"
    return [c for c in cases if (on_cuda or not c.gpu_only) and (c.quick or not quick)]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") not in ("", "0")


def _bf16_note(dtype: torch.dtype, dev: torch.device) -> str | None:
    if dtype == torch.bfloat16 and dev.type == "cpu":
        return (
            "bf16 in the Triton interpreter: its bf16 tl.dot is wrong, so only a kernel "
            "that upcasts before tl.dot can pass (ours does)"
        )
    return None


def _worst(
    diff: torch.Tensor, out: torch.Tensor, ref: torch.Tensor, starts: list[int]
) -> dict[str, Any]:
    """Location and values of the largest error (NaN counts as largest)."""
    score = torch.where(torch.isnan(diff), torch.full_like(diff, math.inf), diff)
    flat = int(score.argmax())
    t, h, d = (int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape))
    seq = max(i for i, s in enumerate(starts[:-1]) if s <= t)
    return {
        "token": t,
        "head": h,
        "dim": d,
        "seq": seq,
        "out": _finite_or_str(float(out[t, h, d])),
        "ref": _finite_or_str(float(ref[t, h, d])),
    }


def _finite_or_str(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)


def run_case(
    fn: Callable[..., torch.Tensor],
    case: GridCase,
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    seed: int = 0,
    tolerance: Tolerance | None = None,
    capabilities: KernelCapabilities | None = None,
    with_traceback: bool = False,
) -> CaseResult:
    """Run ``fn`` on one case in this process and compare with the float64 oracle.

    Exceptions become FAIL results; a case outside ``capabilities`` (default: what ``fn``
    declares) is NOT_SUPPORTED without calling ``fn``. ``tolerance`` overrides the
    per-dtype one of ``kernels.tolerances`` (``--atol/--rtol``).
    """
    dev = torch.device(device)
    caps = capabilities_of(fn) if capabilities is None else capabilities
    base, decided = _undecided_or_verdict(case, dtype, dev, caps, tolerance)
    if decided is not None:
        return decided
    tol = tolerance or attention_tolerance(dtype, dev)
    if case.op != "paged_attention":
        return _run_memory_case(fn, case, dtype, dev, seed, base, with_traceback)

    started = time.perf_counter()
    inputs = build_inputs(case, dtype, dev, seed ^ zlib.crc32(case.name.encode()))
    ref_lse: torch.Tensor | None = None
    oracle_err: float | None = None
    if case.features:
        # Oracle-only surface: the extended float64 reference (no fp32 twin to compare).
        ref, ref_lse = oracle.paged_attention_extended_f64(
            inputs.query, inputs.key_cache, inputs.value_cache, inputs.block_table,
            inputs.seq_lens, inputs.query_start_loc, scale=case.scale,
            sliding_window=case.window_per_seq or case.sliding_window, softcap=case.softcap,
            **{k: v for k, v in inputs.extra.items() if k != "return_lse"},
        )  # fmt: skip
    else:
        ref = inputs.call_oracle(oracle.paged_attention_f64)
        ref32 = inputs.call_oracle(oracle.paged_attention).to("cpu", torch.float64)
        oracle_err = float((ref32 - ref).abs().max()) if ref.numel() else 0.0
    bound = tol.bound(float(ref.abs().max()) if ref.numel() else 0.0)
    base = replace(base, tolerance=bound, oracle_fp32_err=oracle_err)

    t, hq, d = ref.shape
    buffer = None
    extra: dict[str, Any] = {}
    if "out" in _signature_names(fn):
        # One extra token row and three extra columns per head around the view.
        buffer = torch.full((t + 1, hq, d + 3), CANARY, dtype=dtype, device=dev)
        extra["out"] = buffer[:t, :, :d]
    if case.num_kv_splits is not None:
        extra["num_kv_splits"] = case.num_kv_splits

    def done(**kw: Any) -> CaseResult:
        return replace(base, time_s=round(time.perf_counter() - started, 4), **kw)

    try:
        out = inputs.call(fn, **extra)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    except Exception as exc:  # a kernel under test may raise anything; report it
        tb = traceback_module.format_exc() if with_traceback else None
        return done(error=f"raised {type(exc).__name__}: {exc}", traceback=tb)
    lse_error = None
    if ref_lse is not None and case.return_lse:
        # return_lse=True: the kernel returns (out [T, Hq, Dv], lse [T, Hq]).
        if not (isinstance(out, tuple) and len(out) == 2):
            return done(error=f"return_lse=True: expected (out, lse), got {type(out).__name__}")
        out, lse = out
        lse_error = _check_lse(lse, ref_lse, tol)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(ref.shape):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        return done(error=f"returned {shape}, expected shape {tuple(ref.shape)}")
    if out.dtype != dtype:
        return done(error=f"returned dtype {out.dtype}, expected {dtype}")
    out64 = out.to("cpu", torch.float64)
    diff = (out64 - ref).abs()
    err = float(diff.max()) if diff.numel() else 0.0
    worst = _worst(diff, out64, ref, inputs.query_start_loc.tolist()) if diff.numel() else None
    bad = int((~torch.isfinite(out)).sum())
    if bad:
        return done(
            max_abs_err=math.nan, worst=worst,
            error=f"{bad} non-finite outputs (a read of a NaN-poisoned slot, or exp of "
            "-inf - -inf in an online-softmax rescale?)",
        )  # fmt: skip
    if buffer is not None:
        outside = buffer.clone()
        outside[:t, :, :d] = CANARY
        if not bool((outside == CANARY).all()):
            return done(max_abs_err=err, worst=worst,
                        error="wrote outside its output view (canary changed)")  # fmt: skip
    if err > bound:
        return done(max_abs_err=err, worst=worst,
                    error=f"max abs error {err:.3e} > tolerance {bound:.3e}")  # fmt: skip
    if lse_error is not None:
        return done(max_abs_err=err, worst=worst, error=lse_error)
    return done(max_abs_err=err, worst=worst, status=PASS)


def _check_lse(lse: object, ref: torch.Tensor, tol: Tolerance) -> str | None:
    """Why a returned log-sum-exp ``[T, Hq]`` is wrong, or None (same tolerance rule)."""
    if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != tuple(ref.shape):
        shape = tuple(lse.shape) if isinstance(lse, torch.Tensor) else type(lse).__name__
        return f"lse: returned {shape}, expected {tuple(ref.shape)}"
    got = lse.to("cpu", torch.float64)
    if not bool(torch.isfinite(got).all()):
        return "lse: non-finite values"
    err = float((got - ref).abs().max()) if ref.numel() else 0.0
    bound = tol.bound(float(ref.abs().max()) if ref.numel() else 0.0)
    return None if err <= bound else f"lse: max abs error {err:.3e} > tolerance {bound:.3e}"


def _slots_of_step(case: GridCase, inputs: AttentionInputs) -> list[int]:
    """This step's slots: the last ``q_len`` positions of every sequence, through the
    block table, with ``pad_tokens`` slot -1 rows spread among them."""
    table = inputs.block_table.tolist()
    bs = case.block_size
    slots = [
        table[s][p // bs] * bs + p % bs
        for s, (ctx, q) in enumerate(case.seqs)
        for p in range(ctx, ctx + q)
    ]
    for i in range(case.pad_tokens):
        slots.insert((i * 7) % (len(slots) + 1), -1)
    return slots


def _same(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, float]:
    """Bitwise-equal up to NaN == NaN (copies are exact); and the max abs difference."""
    a64, b64 = a.to("cpu", torch.float64), b.to("cpu", torch.float64)
    both_nan = a64.isnan() & b64.isnan()
    equal = bool(((a64 == b64) | both_nan).all())
    diff = (a64 - b64).abs().masked_fill(both_nan, 0.0).nan_to_num(math.inf)
    return equal, float(diff.max()) if diff.numel() else 0.0


def _storage(cache: torch.Tensor) -> torch.Tensor:
    """The whole tensor a cache view was cut from (a write outside the view shows)."""
    return cache._base if cache._base is not None else cache


def _kernel_view(cache: torch.Tensor, layout: str) -> torch.Tensor:
    return cache.transpose(1, 2) if layout == "hnd" else cache


def _run_memory_case(
    fn: Callable[..., Any],
    case: GridCase,
    dtype: torch.dtype,
    dev: torch.device,
    seed: int,
    base: CaseResult,
    with_traceback: bool,
) -> CaseResult:
    """write_kv / copy_blocks: run the kernel and the oracle on identical copies of the
    inputs (built twice from the seed) and require the caches to match exactly."""
    started = time.perf_counter()
    case_seed = seed ^ zlib.crc32(case.name.encode())
    ref_in = build_inputs(case, dtype, dev, case_seed)
    ker_in = build_inputs(case, dtype, dev, case_seed)
    gen = torch.Generator().manual_seed(case_seed + 1)
    if case.op == "write_kv":
        slots = _slots_of_step(case, ref_in)
        shape = (len(slots), case.num_kv_heads, case.head_size)
        key = torch.randn(shape, generator=gen).to(dtype).to(dev)
        value = torch.randn(shape, generator=gen).to(dtype).to(dev)
        index = torch.tensor(slots, dtype=torch.int32 if case.int32_index else torch.int64,
                             device=dev)  # fmt: skip
        oracle.write_kv(key, value, ref_in.key_cache, ref_in.value_cache, index)
        args: tuple[Any, ...] = (key, value, _kernel_view(ker_in.key_cache, case.layout),
                                 _kernel_view(ker_in.value_cache, case.layout), index)  # fmt: skip
        checked = [(ref_in.key_cache, ker_in.key_cache), (ref_in.value_cache, ker_in.value_cache)]
    else:
        table = ref_in.block_table.tolist()
        used = [table[s][_cdiv(kv, case.block_size) - 1] for s, kv in enumerate(case.kv_lens)]
        bs = case.block_size
        live = {b for s, kv in enumerate(case.kv_lens) for b in table[s][: _cdiv(kv, bs)]}
        poison = table[0][-1]
        pool = _storage(ref_in.key_cache).shape[0]
        spare = [b for b in range(pool) if b not in live and b != poison]
        mapping = torch.tensor(list(zip(used, spare, strict=False)), dtype=torch.int64,
                               device=dev)  # fmt: skip
        ref_dst: tuple[torch.Tensor, ...] = (ref_in.key_cache, ref_in.value_cache)
        ker_dst: tuple[torch.Tensor, ...] = (ker_in.key_cache, ker_in.value_cache)
        if case.two_pools:
            n = ref_in.key_cache.shape[0]
            ref_dst = tuple(_empty_cache(case, n, dtype, dev, case.head_size) for _ in "kv")
            ker_dst = tuple(_empty_cache(case, n, dtype, dev, case.head_size) for _ in "kv")
        oracle.copy_blocks(ref_in.key_cache, ref_in.value_cache, ref_dst[0], ref_dst[1], mapping)
        args = (_kernel_view(ker_in.key_cache, case.layout),
                _kernel_view(ker_in.value_cache, case.layout),
                *(_kernel_view(c, case.layout) for c in ker_dst), mapping)  # fmt: skip
        checked = list(zip(ref_dst, ker_dst, strict=True))
        checked += [(ref_in.key_cache, ker_in.key_cache), (ref_in.value_cache, ker_in.value_cache)]

    def done(**kw: Any) -> CaseResult:
        return replace(base, time_s=round(time.perf_counter() - started, 4), tolerance=0.0,
                       atol=0.0, rtol=0.0, **kw)  # fmt: skip

    try:
        fn(*args)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    except Exception as exc:  # a kernel under test may raise anything; report it
        tb = traceback_module.format_exc() if with_traceback else None
        return done(error=f"raised {type(exc).__name__}: {exc}", traceback=tb)
    worst = 0.0
    for ref_cache, ker_cache in checked:
        equal, diff = _same(_storage(ref_cache), _storage(ker_cache))
        worst = max(worst, diff)
        if not equal:
            why = "a write to the wrong slot or outside the view?"
            return done(max_abs_err=diff, error=f"caches differ from the oracle's ({why})")
    return done(max_abs_err=worst, status=PASS)


def _signature_names(fn: Callable[..., Any]) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def run_grid(
    fn: Callable[..., torch.Tensor],
    *,
    device: torch.device | str,
    dtypes: Sequence[torch.dtype],
    cases: Sequence[GridCase] | None = None,
    quick: bool = False,
    seed: int = 0,
    tolerance: Tolerance | None = None,
) -> list[CaseResult]:
    """Run ``fn`` in this process over ``cases`` (default: the grid for ``device``) x
    ``dtypes``. No isolation: use ``refserve check-kernel`` for a kernel that may crash."""
    chosen = select_cases(device, quick=quick) if cases is None else list(cases)
    caps = capabilities_of(fn)
    return [
        run_case(fn, c, dt, device, seed=seed, tolerance=tolerance, capabilities=caps)
        for c in chosen
        for dt in dtypes
    ]


# ---------------------------------------------------------------------------- report
def run_info(*, target: str, device: torch.device | str, seed: int) -> dict[str, Any]:
    """The report header: versions, interpreter or compiled, seed (docs/KERNELS.md)."""
    try:
        from importlib.metadata import version

        refserve_version = version("refserve")
    except Exception:  # not installed as a distribution (a source checkout)
        refserve_version = "unknown"
    triton_version = "not installed"
    with contextlib.suppress(Exception):
        from importlib.metadata import version as _v

        triton_version = _v("triton")
    dev = torch.device(device)
    return {
        "target": target,
        "layout": "vllm",
        "refserve": refserve_version,
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "mode": "compiled" if dev.type == "cuda" else "triton-interpreter",
        "reference": "kernels.oracle.paged_attention_f64 (float64 on the CPU)",
        "seed": seed,
    }


def report_json(
    results: Sequence[CaseResult], *, target: str = "", info: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """A JSON-able report: run info, a summary and one record per result.

    Non-finite errors (NaN, inf) become ``null``: strict JSON has no NaN.
    """
    failed = [r.case + "/" + r.dtype for r in results if r.counts_as_failure]
    statuses = (PASS, FAIL, TIMEOUT, NOT_SUPPORTED, SKIPPED)
    counts = {s: sum(r.status == s for r in results) for s in statuses}
    return {
        **(dict(info) if info else {"target": target, "layout": "vllm"}),
        "total": len(results),
        "passed": counts[PASS],
        "counts": counts,
        "failed": failed,
        "results": [r.to_json() for r in results],
    }


_HEADER = ("case", "shape", "dtype", "max abs err", "tolerance", "time", "result")


def _row(r: CaseResult) -> tuple[str, ...]:
    result = r.status + (f": {r.error}" if r.error and r.status != PASS else "")
    return (
        r.case,
        r.shape,
        r.dtype,
        f"{r.max_abs_err:.2e}",
        f"{r.tolerance:.2e}",
        f"{r.time_s:.2f}s",
        result,
    )


def format_table(results: Sequence[CaseResult]) -> str:
    """A plain-text table: case, shape, dtype, max abs error, tolerance, time, result."""
    rows = [_row(r) for r in results]
    widths = [max(len(row[i]) for row in (_HEADER, *rows)) for i in range(len(_HEADER) - 1)]

    def line(row: Sequence[str]) -> str:
        cells = [cell.ljust(w) for cell, w in zip(row, widths, strict=False)]
        return "  ".join([*cells, row[-1]]).rstrip()

    return "\n".join(
        [line(_HEADER), line(["-" * w for w in widths] + ["------"])]
        + [line(row) for row in rows]
        + [summary_line(results)]
    )


def summary_line(results: Sequence[CaseResult]) -> str:
    """``P/N passed`` plus the other outcomes that occurred."""
    passed = sum(r.passed for r in results)
    others = [
        f"{sum(r.status == s for r in results)} {s.lower()}"
        for s in (FAIL, TIMEOUT, NOT_SUPPORTED, SKIPPED)
        if any(r.status == s for r in results)
    ]
    return f"{passed}/{len(results)} passed" + (f" ({', '.join(others)})" if others else "")


_DTYPES = MappingProxyType(
    {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
)


def _load_function(target: str) -> Callable[..., torch.Tensor]:
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"expected MODULE:FUNCTION, got {target!r}")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{target} is not callable")
    fn: Callable[..., torch.Tensor] = obj
    return fn


# ---------------------------------------------------------------------------- worker
# Protocol (one JSON object per line): the parent writes {"case", "dtype"}; the worker
# answers first {"event": "ready", "capabilities"} or {"event": "load_error", "error"},
# then one CaseResult record per request. The worker's fd 1 is pointed at its stderr, so
# a kernel that prints cannot corrupt the protocol, which uses a private dup of stdout.


def _worker_main(args: argparse.Namespace) -> int:
    proto = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)
    faulthandler.enable()  # a segfaulting kernel leaves its Python stack in the report
    try:
        fn = _load_function(args.target)
        caps = capabilities_of(fn)
    except Exception as exc:  # anything the target's import raises is a harness error
        proto.write(json.dumps({"event": "load_error", "error": f"{type(exc).__name__}: "
                                f"{exc}"}) + "\n")  # fmt: skip
        return EXIT_USAGE
    proto.write(json.dumps({"event": "ready", "capabilities": caps.to_json()}) + "\n")
    tol = _override(args.atol, args.rtol)
    device = torch.device(args.device)
    for line in sys.stdin:
        req = json.loads(line)
        dtype = _DTYPES[req["dtype"]]
        result = run_case(
            fn, CASES[req["case"]], dtype, device, seed=args.seed,
            tolerance=tol(dtype, device), capabilities=caps, with_traceback=args.traceback,
        )  # fmt: skip
        proto.write(json.dumps(result.to_json()) + "\n")
    return EXIT_PASSED


def _override(
    atol: float | None, rtol: float | None
) -> Callable[[torch.dtype, torch.device], Tolerance | None]:
    """Per-dtype tolerance with ``--atol``/``--rtol`` replacing the part they name."""

    def pick(dtype: torch.dtype, device: torch.device) -> Tolerance | None:
        if atol is None and rtol is None:
            return None
        base = attention_tolerance(dtype, device)
        return Tolerance(
            atol=base.atol if atol is None else atol, rtol=base.rtol if rtol is None else rtol
        )

    return pick


class _Worker:
    """One persistent worker subprocess, restarted after a crash or a timeout."""

    READY_TIMEOUT_S = 600.0  # importing torch + triton + the kernel, on a loaded machine

    def __init__(self, argv: list[str], env: Mapping[str, str]) -> None:
        self._argv = argv
        self._env = dict(env)
        self._proc: subprocess.Popen[bytes] | None = None
        self._buf = b""
        self._stderr: IO[bytes] | None = None
        self.capabilities: KernelCapabilities | None = None

    def _start(self) -> None:
        # Closed in stop(): it outlives this method (the crash report reads its tail).
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115
        self._buf = b""
        self._proc = subprocess.Popen(
            self._argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=self._env,
            start_new_session=True,  # its own group: a timeout kills its children too
        )
        line = self._read_line(self.READY_TIMEOUT_S)
        msg = json.loads(line) if line else None
        if not msg or msg.get("event") != "ready":
            detail = msg.get("error") if msg else self._describe_exit()
            self.stop()
            raise GridHarnessError(f"worker did not start: {detail}")
        self.capabilities = KernelCapabilities.from_declared(
            {k: v for k, v in msg["capabilities"].items()}
        )

    def ensure_started(self) -> KernelCapabilities:
        if self._proc is None:
            self._start()
        assert self.capabilities is not None
        return self.capabilities

    def _read_line(self, timeout: float) -> bytes | None:
        """The next protocol line, or None on EOF (the worker died) or after ``timeout``."""
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buf:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    return None
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    return None
                self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    def _stderr_tail(self, limit: int = 3000) -> str:
        if self._stderr is None:
            return ""
        self._stderr.seek(0)
        text = self._stderr.read().decode("utf-8", "replace")
        return text[-limit:]

    def _describe_exit(self) -> str:
        assert self._proc is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=10)
        code = self._proc.returncode
        if code is None:
            how = "stopped answering"
        elif code < 0:
            how = f"killed by {signal.Signals(-code).name}"
        else:
            how = f"exited with status {code}"
        tail = self._stderr_tail()
        return how + (f"; stderr tail:\n{tail}" if tail.strip() else "")

    def stop(self) -> None:
        """Kill the worker's process group (ours: started with a new session) and reap it."""
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None

    def run(self, case: GridCase, dtype: str, timeout: float, base: CaseResult) -> CaseResult:
        """Run one case; a crash is FAIL and a hang TIMEOUT, and the worker is restarted."""
        self.ensure_started()
        assert self._proc is not None and self._proc.stdin is not None
        started = time.perf_counter()
        try:
            self._proc.stdin.write((json.dumps({"case": case.name, "dtype": dtype}) + "\n")
                                   .encode())  # fmt: skip
            self._proc.stdin.flush()
        except BrokenPipeError:
            pass  # it died between cases; the read below reports how
        line = self._read_line(timeout)
        elapsed = round(time.perf_counter() - started, 4)
        if line is not None:
            return CaseResult.from_json(json.loads(line))
        if self._proc.poll() is None and self._proc_alive_after_timeout():
            self.stop()
            return replace(base, status=TIMEOUT, time_s=elapsed,
                           error=f"no result after {timeout:g}s; worker killed")  # fmt: skip
        detail = self._describe_exit()
        self.stop()
        return replace(base, status=FAIL, time_s=elapsed, error=f"worker crashed: {detail}")

    def _proc_alive_after_timeout(self) -> bool:
        # EOF and a timeout both return None; a live process means it was the timeout.
        assert self._proc is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=0.5)
        return self._proc.returncode is None


# ------------------------------------------------------------------------------- CLI
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="refserve check-kernel",
        description="Check a paged-attention kernel against the float64 oracle over the "
        "kernel grid, one case at a time in a worker subprocess (docs/KERNELS.md). "
        "Exit 0: all passed; 1: a case failed or timed out; 2: usage or harness error.",
    )
    parser.add_argument(
        "target", nargs="?", help="MODULE:FUNCTION with the signature of kernels.paged_attention"
    )
    parser.add_argument("--layout", choices=["vllm"], default="vllm", help="cache layout")
    parser.add_argument(
        "--op",
        choices=sorted(GRIDS),
        default="paged_attention",
        help="which operation's grid TARGET implements (default paged_attention)",
    )
    parser.add_argument("--json", dest="json_path", help="write the JSON report here")
    parser.add_argument("--jsonl", help="stream one JSON record per result here ('-': stdout)")
    parser.add_argument("--quick", action="store_true", help="run the quick subset")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    parser.add_argument(
        "-k",
        dest="patterns",
        action="append",
        metavar="PATTERN",
        help="run cases whose name or boundary matches (glob or substring)",
    )
    parser.add_argument(
        "--case",
        dest="case_names",
        action="append",
        metavar="NAME",
        help="run this case (repeatable)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds per case before it is a TIMEOUT (default 600)",
    )
    parser.add_argument(
        "--traceback", action="store_true", help="include the traceback of a kernel that raised"
    )
    parser.add_argument("--atol", type=float, help="override every dtype's atol")
    parser.add_argument("--rtol", type=float, help="override every dtype's rtol")
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="run cases in this process (no crash isolation; debugging)",
    )
    parser.add_argument("--device", help="cuda or cpu (default: cuda if available)")
    parser.add_argument(
        "--dtype",
        action="append",
        choices=sorted(_DTYPES),
        help="repeatable; default float32, float16 (+ bfloat16 on cuda)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the cases' random inputs (default 0)"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser  # fmt: skip


def _matches(case: GridCase, patterns: Sequence[str]) -> bool:
    for p in patterns:
        for text in (case.name, case.boundary):
            if p in text or fnmatch.fnmatchcase(text, p):
                return True
    return False


def _choose(args: argparse.Namespace) -> list[GridCase]:
    if args.case_names:
        unknown = [n for n in args.case_names if n not in CASES or CASES[n].op != args.op]
        if unknown:
            raise ValueError(f"unknown case(s) {unknown}; see --list")
        chosen = [CASES[n] for n in args.case_names]
    else:
        chosen = list(GRIDS[args.op])
        if args.quick:
            chosen = [c for c in chosen if c.quick]
    if args.patterns:
        chosen = [c for c in chosen if _matches(c, args.patterns)]
    if not chosen:
        raise ValueError("no case matches the selection; see --list")
    return chosen


def _list_cases(cases: Sequence[GridCase]) -> str:
    width = max(len(c.name) for c in cases)
    lines = [
        f"{c.name.ljust(width)}  {c.boundary:<28} {'quick' if c.quick else '     '} "
        f"{'gpu ' if c.gpu_only else '    '}{c.shape}"
        for c in cases
    ]
    return "\n".join([*lines, f"{len(cases)} cases"])


def _usage(message: str) -> int:
    print(f"refserve check-kernel: {message}", file=sys.stderr)
    return EXIT_USAGE


def check_kernel_main(argv: list[str]) -> int:
    """``refserve check-kernel MODULE:FUNCTION [options]`` (docs/KERNELS.md).

    Runs each selected (case, dtype) in a worker subprocess against the float64 oracle,
    streams one line per result (and one JSON record with ``--jsonl``), writes the JSON
    report with ``--json``. Returns 0 when nothing failed or timed out, 1 when something
    did, 2 on a usage or harness error.
    """
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help and on usage errors
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if args.worker:
        return _worker_main(args)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        chosen = _choose(args)
    except ValueError as exc:
        return _usage(str(exc))
    if args.list:
        print(_list_cases(chosen))
        return EXIT_PASSED
    if not args.target:
        return _usage("the following arguments are required: target (MODULE:FUNCTION)")
    if args.timeout <= 0:
        return _usage("--timeout must be > 0")
    if device.type == "cpu" and "TRITON_INTERPRET" not in os.environ:
        # Triton kernels run on CPU tensors only in interpreter mode, which must be on
        # before the kernel's module is imported (docs/KERNELS.md).
        os.environ["TRITON_INTERPRET"] = "1"
        print("note: CPU run; TRITON_INTERPRET=1 set for Triton kernels", file=sys.stderr)
    try:
        module_name, sep, attr = args.target.partition(":")
        if not (sep and module_name and attr):
            raise ValueError(f"expected MODULE:FUNCTION, got {args.target!r}")
        fn = _load_function(args.target) if args.in_process else None
    except (ImportError, AttributeError, ValueError) as exc:
        print(f"refserve check-kernel: cannot load {args.target}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.dtype:
        dtypes = [_DTYPES[name] for name in args.dtype]
    else:
        dtypes = [torch.float32, torch.float16]
        if device.type == "cuda":
            dtypes.append(torch.bfloat16)
    if device.type == "cpu" and torch.bfloat16 in dtypes:
        print(f"note: {_bf16_note(torch.bfloat16, device)}", file=sys.stderr)

    info = run_info(target=args.target, device=device, seed=args.seed)
    info["tolerance_override"] = {"atol": args.atol, "rtol": args.rtol}
    info["isolation"] = "in-process" if args.in_process else "worker subprocess per run"
    info["timeout_s"] = args.timeout
    info["selection"] = {"quick": args.quick, "k": args.patterns, "case": args.case_names}
    jsonl: IO[str] | None = None
    worker: _Worker | None = None
    results: list[CaseResult] = []
    try:
        if args.jsonl:
            # Closed in the finally below: results stream into it as they finish.
            jsonl = sys.stdout if args.jsonl == "-" else open(args.jsonl, "w", encoding="utf-8")  # noqa: SIM115
        text = sys.stderr if jsonl is sys.stdout else sys.stdout
        if fn is not None:
            caps = capabilities_of(fn)
        else:
            worker = _Worker(_worker_argv(args, device), os.environ)
            caps = worker.ensure_started()
        info["capabilities"] = caps.to_json()
        # Fixed widths known up front, so streamed lines line up like format_table's.
        widths = [max(len(c.name) for c in chosen), max(len(c.shape) for c in chosen),
                  8, 11, 9, 8]  # fmt: skip

        def stream(row: Sequence[str]) -> None:
            cells = [cell.ljust(w) for cell, w in zip(row, widths, strict=False)]
            print("  ".join([*cells, row[-1]]).rstrip(), file=text, flush=True)

        stream(_HEADER)
        tol = _override(args.atol, args.rtol)
        for case, dtype in ((c, d) for c in chosen for d in dtypes):
            result = _run_one(fn, worker, case, dtype, device, args, caps, tol(dtype, device))
            results.append(result)
            stream(_row(result))
            if jsonl is not None:
                jsonl.write(json.dumps(result.to_json()) + "\n")
                jsonl.flush()
        print(summary_line(results), file=text)
        gpu_only = [c.name for c in chosen if c.gpu_only and device.type != "cuda"]
        if gpu_only:
            print(f"skipped (need CUDA): {', '.join(gpu_only)}", file=text)
        if args.quick:
            print(f"quick subset: {len(chosen)} of {len(GRIDS[args.op])} cases", file=text)
    except GridHarnessError as exc:
        return _usage(f"{args.target}: {exc}")
    finally:
        if worker is not None:
            worker.stop()
        if jsonl is not None and jsonl is not sys.stdout:
            jsonl.close()
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as fh:
            json.dump(report_json(results, info=info), fh, indent=2)
            fh.write("\n")
    failed = any(r.counts_as_failure for r in results)
    return EXIT_FAILED if failed or not results else EXIT_PASSED


def _run_one(
    fn: Callable[..., torch.Tensor] | None,
    worker: _Worker | None,
    case: GridCase,
    dtype: torch.dtype,
    device: torch.device,
    args: argparse.Namespace,
    caps: KernelCapabilities,
    tolerance: Tolerance | None,
) -> CaseResult:
    """One (case, dtype): decided here when unsupported or skipped, else run."""
    if fn is not None:
        return run_grid(fn, device=device, dtypes=[dtype], cases=[case], seed=args.seed,
                        tolerance=tolerance)[0]  # fmt: skip
    assert worker is not None
    base, decided = _undecided_or_verdict(case, dtype, device, caps, tolerance)
    if decided is not None:
        return decided
    return worker.run(case, base.dtype, args.timeout, base)


def _undecided_or_verdict(
    case: GridCase,
    dtype: torch.dtype,
    dev: torch.device,
    caps: KernelCapabilities,
    tolerance: Tolerance | None,
) -> tuple[CaseResult, CaseResult | None]:
    """The result skeleton of one (case, dtype) (a FAIL until the kernel's output says
    otherwise), and its verdict when it is decided without calling the kernel: outside
    the declared capabilities (NOT_SUPPORTED) or needing CUDA (SKIPPED). One place for
    both the in-process run and the isolated worker's front end."""
    tol = tolerance or attention_tolerance(dtype, dev)
    base = CaseResult(
        case=case.name, shape=case.shape, dtype=_dtype_name(dtype), device=str(dev),
        max_abs_err=math.nan, tolerance=math.nan, status=FAIL, boundary=case.boundary,
        params=case.params(), atol=tol.atol, rtol=tol.rtol, note=_bf16_note(dtype, dev),
    )  # fmt: skip
    reason = unsupported_reason(case, base.dtype, caps)
    if reason is not None:
        return base, replace(base, status=NOT_SUPPORTED, error=reason)
    if case.gpu_only and dev.type != "cuda":
        return base, replace(base, status=SKIPPED, error="needs CUDA (too big for the interpreter)")
    return base, None


def _worker_argv(args: argparse.Namespace, device: torch.device) -> list[str]:
    argv = [sys.executable, "-m", "conformance.kernel_grid", args.target, "--worker",
            "--device", str(device), "--seed", str(args.seed)]  # fmt: skip
    if args.atol is not None:
        argv += ["--atol", repr(args.atol)]
    if args.rtol is not None:
        argv += ["--rtol", repr(args.rtol)]
    if args.traceback:
        argv.append("--traceback")
    return argv


if __name__ == "__main__":  # python -m conformance.kernel_grid MODULE:FUNCTION ...
    sys.exit(check_kernel_main(sys.argv[1:]))
