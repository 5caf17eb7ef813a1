"""The grid's cases: :class:`GridCase`, the hand-named edge cases and the ones the
boundary rules generate (docs/KERNELS.md, "Boundary rules"), and the grids of the three
operations (:data:`GRIDS`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from types import MappingProxyType
from typing import Any

import torch

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


def select_cases(
    device: torch.device | str, *, quick: bool = False, cases: Sequence[GridCase] = GRID
) -> list[GridCase]:
    """Cases that run on ``device`` (GPU-only cases need CUDA), the quick subset if asked."""
    on_cuda = torch.device(device).type == "cuda"
    return [c for c in cases if (on_cuda or not c.gpu_only) and (c.quick or not quick)]
