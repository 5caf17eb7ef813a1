# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Reason: triton ships no types; its @triton.jit kernels are untyped by construction.
#  Everything outside the kernels below is fully typed.)
"""Unified Triton paged attention (docs/ARCHITECTURE.md, "Kernels"; checked against the oracle).

One kernel serves a batch that mixes decode tokens, whole prompts and mid-prompt chunks,
in the vLLM-style layout described in ``refserve.kernels.validation``. Read it with
``kernels/oracle.py`` open beside it: the math is the same, done tile by tile.

How the work is cut (grid axes):

- axis 0, *query tiles*: each sequence's queries are cut into tiles of ``BLOCK_Q``
  tokens. The launch uses the upper bound ``T // BLOCK_Q + S`` tiles; sequence ``s``'s
  tiles start at ``query_start_loc[s] // BLOCK_Q + s`` (strictly increasing in ``s``), so a
  program finds its sequence by binary search and exits if it landed in a gap. This needs
  no host sync to count tiles.
- axis 1, *KV heads*: GQA without repeating K/V. A program takes the ``GROUP`` query heads
  that share one KV head and stacks them as rows: row ``m`` is token ``m // GROUP``,
  head ``m % GROUP`` of the tile, so ``BLOCK_M = BLOCK_Q * GROUP`` rows share every K/V
  tile loaded. ``GROUP`` need not be a power of two: leftover rows are masked.
- axis 2, *KV segments* (split-KV, "flash-decoding"): a decode has one query token, so
  axes 0-1 give only ``S * Hkv`` programs, too few to fill a GPU at small batch and long
  context. The KV range is then cut into ``NUM_SEGMENTS`` parts, each program writes an
  unnormalised partial result plus its running max and sum, and a second kernel merges
  them exactly (log-sum-exp rescaling).

Inside a program: the online softmax of the fused-attention tutorial, in fp32, over
``TILE_N`` key positions at a time. Tiles are in *positions*, not cache blocks, so any
block size >= 1 works: each position's physical block is looked up in the block table.
Head sizes that are not powers of two are padded to ``BLOCK_D`` and masked.

Never read beyond a sequence: every K/V load is masked to positions ``< kv_hi <=
seq_len``, and block-table entries are loaded under the same mask, so unused table
entries and cache slots (tests fill them with NaN or garbage) are never touched.
Offsets are computed in int64: ``block * stride`` overflows int32 once a cache holds more
than 2**31 elements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from refserve.kernels._runtime import is_interpreted, next_power_of_2, require_runnable
from refserve.kernels.validation import (
    AttentionDims,
    KernelInputError,
    validate_paged_attention_inputs,
)

__all__ = ["paged_attention"]


@triton.jit
def _find_seq(query_start_loc_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest s with ``query_start_loc[s] // BLOCK_Q + s <= tile`` (binary search)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _tanh(x):
    # Triton's tanh lives in per-backend libdevice modules the interpreter lacks; this
    # form is exact in real arithmetic and saturates to +-1 as exp over/underflows.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [T, Hq, D], the query's dtype (used when NUM_SEGMENTS == 1)
    part_acc_ptr,  # [T, Hq, NUM_SEGMENTS, D] fp32, unnormalised partial outputs
    part_max_ptr,  # [T, Hq, NUM_SEGMENTS] fp32, running max of each segment
    part_sum_ptr,  # [T, Hq, NUM_SEGMENTS] fp32, running sum of exp(s - max)
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    scale,
    softcap,
    sliding_window,
    num_seqs,
    num_q_heads,
    block_size,  # a runtime value: any block size >= 1 works
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_bt,
    stride_bb,
    stride_ot,
    stride_oh,
    stride_od,
    HEAD_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_SIZE rounded up to a power of two (>= 16 for tl.dot)
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_Q: tl.constexpr,  # query tokens per tile
    BLOCK_M: tl.constexpr,  # rows per tile: power of two >= BLOCK_Q * GROUP
    TILE_N: tl.constexpr,  # key positions per inner step
    NUM_SEGMENTS: tl.constexpr,  # 1: write the output; > 1: write partials for the merge
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    DOT_FP32: tl.constexpr,  # feed tl.dot fp32 (fp32 caches; bf16 in the interpreter)
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)

    # --- which sequence and which of its query tiles this program owns -----------------
    seq = _find_seq(query_start_loc_ptr, tile, num_seqs, BLOCK_Q)
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    q_tile = tile - (q_begin // BLOCK_Q + seq)
    if q_tile * BLOCK_Q >= q_len:
        return  # a gap in the upper-bound launch, not a real tile
    kv_len = tl.load(seq_lens_ptr + seq)
    # This step's queries are the last q_len tokens: query i sits at position
    # context_len + i and sees keys 0 .. context_len + i (the oracle's q_pos).
    context_len = kv_len - q_len

    # --- rows: (token, query head) pairs sharing one KV head ----------------------------
    rows = tl.arange(0, BLOCK_M)
    tok = q_tile * BLOCK_Q + rows // GROUP  # token index within the sequence
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows // GROUP < BLOCK_Q) & (tok < q_len)
    q_pos = context_len + tok
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_SIZE
    q_row = (q_begin + tok).to(tl.int64)  # int64: T * stride can pass 2**31

    q = tl.load(
        q_ptr
        + q_row[:, None] * stride_qt
        + head[:, None] * stride_qh
        + offs_d[None, :] * stride_qd,
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)

    # --- the key positions this tile can see: [kv_lo, kv_hi) ----------------------------
    # The tile's last query sees up to its own position, so nothing at or past kv_hi
    # is loaded; in particular nothing at or past seq_len.
    last_q_pos = context_len + tl.minimum((q_tile + 1) * BLOCK_Q, q_len) - 1
    kv_hi = last_q_pos + 1
    kv_lo = 0
    if USE_WINDOW:
        # The tile's first query sees keys > its position - window; earlier tiles of
        # keys are skipped entirely.
        kv_lo = tl.maximum(context_len + q_tile * BLOCK_Q - sliding_window + 1, 0)
    tile_lo = kv_lo // TILE_N
    tile_hi = tl.cdiv(kv_hi, TILE_N)
    # Split-KV: this program's segment is a contiguous run of key tiles (maybe empty).
    tiles_per_segment = tl.cdiv(tile_hi - tile_lo, NUM_SEGMENTS)
    seg_lo = tile_lo + segment * tiles_per_segment
    seg_hi = tl.minimum(seg_lo + tiles_per_segment, tile_hi)

    # --- online softmax (fused-attention tutorial), fp32 state per row -----------------
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of scores
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp(score - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)  # running sum of exp(...) * V
    block_table_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    for j in range(seg_lo, seg_hi):
        k_pos = j * TILE_N + tl.arange(0, TILE_N)
        k_ok = k_pos < kv_hi
        # Each key position's physical block (the oracle's block_table[s, p // bs]).
        block = tl.load(block_table_row + (k_pos // block_size) * stride_bb, mask=k_ok, other=0).to(
            tl.int64
        )
        in_block = k_pos % block_size
        # K is loaded transposed, [BLOCK_D, TILE_N], ready for q @ k.
        k = tl.load(
            k_cache_ptr
            + block[None, :] * stride_kb
            + in_block[None, :] * stride_ks
            + kv_head * stride_kh
            + offs_d[:, None] * stride_kd,
            mask=d_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        v = tl.load(
            v_cache_ptr
            + block[:, None] * stride_vb
            + in_block[:, None] * stride_vs
            + kv_head * stride_vh
            + offs_d[None, :] * stride_vd,
            mask=k_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        if DOT_FP32:  # noqa: SIM108 (two dot flavours, kept side by side for reading)
            s = tl.dot(q, k.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, k)  # fp16/bf16 inputs, fp32 accumulation
        s = s * scale
        if USE_SOFTCAP:
            s = softcap * _tanh(s / softcap)

        # The oracle's mask: causal aligned to the end, optional window, plus padding.
        visible = row_ok[:, None] & k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no visible key yet keeps max -inf; subtracting -inf would
        # give NaN, so shift by 0 instead (its scores are all -inf and exp gives 0).
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_shift[:, None])
        alpha = tl.exp(m_i - m_shift)  # rescales what was summed under the old max
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_FP32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            # Probabilities in [0, 1] go to V's dtype to use the fp16/bf16 tensor-core
            # dot; this rounding is part of the tolerance (refserve.kernels.tolerances).
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if NUM_SEGMENTS == 1:
        # Every live row saw at least its own key, so l_i > 0; padding rows are masked.
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / l_safe[:, None]
        tl.store(
            out_ptr
            + q_row[:, None] * stride_ot
            + head[:, None] * stride_oh
            + offs_d[None, :] * stride_od,
            o.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )
    else:
        # Always written, even for an empty segment (max -inf, sum 0): the merge reads
        # every segment of every row.
        part = (q_row * num_q_heads + head) * NUM_SEGMENTS + segment
        tl.store(part_max_ptr + part, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part, l_i, mask=row_ok)
        tl.store(
            part_acc_ptr + part[:, None] * HEAD_SIZE + offs_d[None, :],
            acc,
            mask=row_ok[:, None] & d_ok[None, :],
        )


@triton.jit
def _merge_segments_kernel(
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    num_q_heads,
    stride_ot,
    stride_oh,
    stride_od,
    HEAD_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    BLOCK_SEG: tl.constexpr,  # NUM_SEGMENTS rounded up to a power of two
):
    """out = sum_s exp(m_s - M) * acc_s / sum_s exp(m_s - M) * l_s, M = max_s m_s."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_SEG)
    s_ok = offs_s < NUM_SEGMENTS
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_SIZE
    part = (token * num_q_heads + head) * NUM_SEGMENTS + offs_s
    m = tl.load(part_max_ptr + part, mask=s_ok, other=float("-inf"))
    l_s = tl.load(part_sum_ptr + part, mask=s_ok, other=0.0)
    acc = tl.load(
        part_acc_ptr + part[:, None] * HEAD_SIZE + offs_d[None, :],
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    m_all = tl.max(m, 0)
    # Segments that saw no visible key have m = -inf and weight exp(-inf) = 0.
    w = tl.exp(m - tl.where(m_all == float("-inf"), 0.0, m_all))
    num = tl.sum(acc * w[:, None], 0)
    den = tl.sum(l_s * w, 0)
    o = num / tl.where(den > 0.0, den, 1.0)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + offs_d * stride_od,
        o.to(out_ptr.dtype.element_ty),
        mask=d_ok,
    )


@dataclass(frozen=True)
class TileConfig:
    """Launch shape of :func:`paged_attention`; see the module docstring for the names."""

    block_q: int
    block_m: int
    tile_n: int
    block_d: int
    num_segments: int


# Most split-KV segments the heuristic picks; a merge reads them all for each row.
_MAX_SEGMENTS = 16


def choose_tiles(
    dims: AttentionDims, device: torch.device, *, interpreted: bool, num_kv_splits: int | None
) -> TileConfig:
    """Pick tile sizes for a launch (``num_kv_splits`` forces the number of KV segments).

    ``tl.dot`` needs every extent >= 16 on a GPU. In the interpreter each program costs
    about 10 ms whatever its size (docs/ARCHITECTURE.md, "Kernels"), so the CPU path uses
    few, wide tiles and
    never splits unless asked to.
    """
    block_d = max(16, next_power_of_2(dims.head_size))
    group = dims.group_size
    decode_only = dims.num_tokens == dims.num_seqs  # one query per sequence (a guess)
    rows = 16 if (decode_only or interpreted) else 64
    block_m = max(rows, next_power_of_2(group))
    block_q = block_m // group
    tile_n = 32 if interpreted else 64
    if num_kv_splits is not None:
        num_segments = num_kv_splits
    elif interpreted or not decode_only or device.type != "cuda":
        num_segments = 1
    else:
        # Split until the GPU has about two programs per SM, keeping >= 2 key tiles
        # per segment so the merge stays cheap next to the attention itself.
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        programs = dims.num_seqs * dims.num_kv_heads
        max_context = dims.max_blocks_per_seq * dims.block_size
        wanted = -(-2 * sms // max(programs, 1))
        num_segments = max(1, min(wanted, max_context // (2 * tile_n), _MAX_SEGMENTS))
    return TileConfig(block_q, block_m, tile_n, block_d, num_segments)


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
    out: torch.Tensor | None = None,
    num_kv_splits: int | None = None,
    check_values: bool = True,
) -> torch.Tensor:
    """Causal paged attention in Triton; same contract as
    ``refserve.kernels.oracle.paged_attention``.

    Extra keyword arguments (not part of the documented signature, all optional):
    ``out`` a ``[T, Hq, D]`` tensor (any strides) to write into instead of allocating;
    ``num_kv_splits`` forces the number of split-KV segments (``1`` disables the split
    path; default: a heuristic that splits long decode-only batches on a GPU);
    ``check_values=False`` skips the value checks that sync with the device.
    """
    fn = "paged_attention"
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
        check_values=check_values,
        function=fn,
    )
    require_runnable(_paged_attention_kernel, query.device, fn, "query")
    if num_kv_splits is not None and not (isinstance(num_kv_splits, int) and num_kv_splits >= 1):
        raise KernelInputError(fn, "num_kv_splits", f"must be an int >= 1; got {num_kv_splits!r}")
    if out is None:
        out = torch.empty_like(query)
    elif out.shape != query.shape or out.dtype != query.dtype or out.device != query.device:
        raise KernelInputError(
            fn,
            "out",
            f"must match query (shape={tuple(query.shape)} dtype={query.dtype} "
            f"device={query.device}); got shape={tuple(out.shape)} dtype={out.dtype} "
            f"device={out.device}",
        )
    if dims.num_tokens == 0:
        return out

    interpreted = is_interpreted(_paged_attention_kernel)
    cfg = choose_tiles(dims, query.device, interpreted=interpreted, num_kv_splits=num_kv_splits)
    if scale is None:
        scale = 1.0 / math.sqrt(dims.head_size)
    # fp32 caches always use fp32 dots; bf16 too in the interpreter, whose bf16 dot is
    # wrong (docs/ARCHITECTURE.md, "Kernels"). On a GPU, fp16/bf16 go to the tensor cores.
    dot_fp32 = query.dtype == torch.float32 or (interpreted and query.dtype == torch.bfloat16)

    split = cfg.num_segments > 1
    part_shape = (dims.num_tokens, dims.num_q_heads, cfg.num_segments) if split else (1, 1, 1)
    part_max = torch.empty(part_shape, dtype=torch.float32, device=query.device)
    part_sum = torch.empty(part_shape, dtype=torch.float32, device=query.device)
    part_acc = torch.empty(
        (*part_shape, dims.head_size if split else 1), dtype=torch.float32, device=query.device
    )
    grid = (
        dims.num_tokens // cfg.block_q + dims.num_seqs,
        dims.num_kv_heads,
        cfg.num_segments,
    )
    _paged_attention_kernel[grid](
        out,
        part_acc,
        part_max,
        part_sum,
        query,
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        query_start_loc,
        float(scale),
        float(softcap) if softcap is not None else 1.0,
        sliding_window if sliding_window is not None else 0,
        dims.num_seqs,
        dims.num_q_heads,
        dims.block_size,
        *query.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        *block_table.stride(),
        *out.stride(),
        HEAD_SIZE=dims.head_size,
        BLOCK_D=cfg.block_d,
        GROUP=dims.group_size,
        BLOCK_Q=cfg.block_q,
        BLOCK_M=cfg.block_m,
        TILE_N=cfg.tile_n,
        NUM_SEGMENTS=cfg.num_segments,
        USE_WINDOW=sliding_window is not None,
        USE_SOFTCAP=softcap is not None,
        DOT_FP32=dot_fp32,
    )
    if split:
        _merge_segments_kernel[(dims.num_tokens, dims.num_q_heads)](
            out,
            part_acc,
            part_max,
            part_sum,
            dims.num_q_heads,
            *out.stride(),
            HEAD_SIZE=dims.head_size,
            BLOCK_D=cfg.block_d,
            NUM_SEGMENTS=cfg.num_segments,
            BLOCK_SEG=next_power_of_2(cfg.num_segments),
        )
    return out


# What ``refserve check-kernel`` may ask of this kernel (docs/KERNELS.md, "Capabilities"):
# everything in the grid except the HND cache layout; split-KV is found from the
# ``num_kv_splits`` keyword. A plain dict, so the grid's dataclass is not imported here.
paged_attention.__dict__["refserve_capabilities"] = {"layouts": ["nhd"]}
