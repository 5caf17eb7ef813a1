"""The dense oracle itself (docs/ARCHITECTURE.md "Kernels"): checked against torch SDPA and by hand.

Everything else in the kernel tests trusts ``refserve.kernels.oracle``, so it is checked here
against independent computations: ``scaled_dot_product_attention`` on contiguous
inputs, with masks built from ``tril``/``triu`` rather than the oracle's position
arithmetic; a closed-form softcap case; and metamorphic properties (block layout does
not matter; a prompt in chunks gives the same outputs as in one piece).
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from refserve.conformance.kernel_grid import GridCase, build_inputs
from refserve.kernels import oracle
from refserve.kernels.validation import KernelInputError


def _contiguous_batch(
    seqs: list[tuple[int, int]], hq: int, hkv: int, d: int, bs: int, dtype: torch.dtype
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], tuple[torch.Tensor, ...]]:
    """Dense per-sequence q/k/v plus the same data in a paged cache with blocks in order."""
    gen = torch.Generator().manual_seed(1234)
    qs, ks, vs = [], [], []
    blocks_per_seq = [-(-(c + q) // bs) for c, q in seqs]
    max_blocks = max(blocks_per_seq)
    key_cache = torch.zeros(sum(blocks_per_seq), bs, hkv, d, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    table = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    first = 0
    for s, (c, q_len) in enumerate(seqs):
        kv = c + q_len
        k = torch.randn(kv, hkv, d, generator=gen).to(dtype)
        v = torch.randn(kv, hkv, d, generator=gen).to(dtype)
        qs.append(torch.randn(q_len, hq, d, generator=gen).to(dtype))
        ks.append(k)
        vs.append(v)
        n = blocks_per_seq[s]
        table[s, :n] = torch.arange(first, first + n, dtype=torch.int32)
        padded = torch.zeros(n * bs, hkv, d, dtype=dtype)
        padded[:kv] = k
        key_cache[first : first + n] = padded.view(n, bs, hkv, d)
        padded = torch.zeros(n * bs, hkv, d, dtype=dtype)
        padded[:kv] = v
        value_cache[first : first + n] = padded.view(n, bs, hkv, d)
        first += n
    starts = [0]
    for _, q_len in seqs:
        starts.append(starts[-1] + q_len)
    paged = (
        torch.cat(qs),
        key_cache,
        value_cache,
        table,
        torch.tensor([c + q for c, q in seqs], dtype=torch.int32),
        torch.tensor(starts, dtype=torch.int32),
    )
    return qs, ks, vs, paged


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> torch.Tensor:
    """SDPA for one sequence; the mask is end-aligned causal via tril(kv - q)."""
    q_len, hq, _ = q.shape
    kv_len, hkv, _ = k.shape
    mask = torch.ones(q_len, kv_len, dtype=torch.bool).tril(diagonal=kv_len - q_len)
    if window is not None:
        mask &= torch.ones(q_len, kv_len, dtype=torch.bool).triu(
            diagonal=kv_len - q_len - window + 1
        )
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1),
        k.float().repeat_interleave(hq // hkv, dim=1).transpose(0, 1),
        v.float().repeat_interleave(hq // hkv, dim=1).transpose(0, 1),
        attn_mask=mask,
    )
    return out.transpose(0, 1)


@pytest.mark.parametrize("window", [None, 1, 5])
@pytest.mark.parametrize(("hq", "hkv"), [(2, 2), (4, 2), (5, 1), (8, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_oracle_matches_sdpa(window: int | None, hq: int, hkv: int, dtype: torch.dtype) -> None:
    # whole prompt, mid-prompt chunk, decode, decode of a length-1 sequence
    seqs = [(0, 11), (7, 5), (20, 1), (0, 1)]
    qs, ks, vs, paged = _contiguous_batch(seqs, hq, hkv, 24, 4, dtype)
    out = oracle.paged_attention(*paged, sliding_window=window)
    assert out.dtype == dtype
    expected = torch.cat([_sdpa(q, k, v, window) for q, k, v in zip(qs, ks, vs, strict=True)])
    torch.testing.assert_close(out.float(), expected.to(dtype).float(), atol=2e-3, rtol=0)
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_oracle_scale_matches_sdpa_scale() -> None:
    qs, ks, vs, paged = _contiguous_batch([(3, 4)], 2, 1, 16, 4, torch.float32)
    out = oracle.paged_attention(*paged, scale=0.05)
    q, k, v = qs[0].transpose(0, 1), ks[0].repeat(1, 2, 1), vs[0].repeat(1, 2, 1)
    mask = torch.ones(4, 7, dtype=torch.bool).tril(diagonal=3)
    ref = F.scaled_dot_product_attention(
        q, k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=0.05
    )
    torch.testing.assert_close(out, ref.transpose(0, 1), atol=1e-6, rtol=1e-6)


def test_softcap_closed_form() -> None:
    # One query, two keys k = +1 / -1 and values 1 / 0, head size 1, scale 1:
    # out = softmax([c tanh(a/c), -c tanh(a/c)])[0] = sigmoid(2 c tanh(a / c)).
    a, cap = 3.0, 2.0
    key_cache = torch.tensor([[[[1.0]], [[-1.0]]]])  # [1 block, 2 slots, 1 head, 1]
    value_cache = torch.tensor([[[[1.0]], [[0.0]]]])
    out = oracle.paged_attention(
        torch.tensor([[[a]]]),
        key_cache,
        value_cache,
        torch.tensor([[0]], dtype=torch.int32),
        torch.tensor([2], dtype=torch.int32),
        torch.tensor([0, 1], dtype=torch.int32),
        scale=1.0,
        softcap=cap,
    )
    expected = 1.0 / (1.0 + math.exp(-2 * cap * math.tanh(a / cap)))
    assert out.item() == pytest.approx(expected, rel=1e-6)
    uncapped = oracle.paged_attention(
        torch.tensor([[[a]]]),
        key_cache,
        value_cache,
        torch.tensor([[0]], dtype=torch.int32),
        torch.tensor([2], dtype=torch.int32),
        torch.tensor([0, 1], dtype=torch.int32),
        scale=1.0,
    )
    assert uncapped.item() == pytest.approx(1.0 / (1.0 + math.exp(-2 * a)), rel=1e-6)


def test_oracle_never_reads_dead_slots() -> None:
    case = GridCase("t", ((0, 1), (14, 3), (5, 0), (31, 2)), 4, 2, 24, 8)
    inputs = build_inputs(case, torch.float32, "cpu", seed=3)
    assert bool(inputs.key_cache.isnan().any())  # the traps are there ...
    out = inputs.call(oracle.paged_attention)
    assert bool(torch.isfinite(out).all())  # ... and never reached


@st.composite
def _layouts(draw: st.DrawFn) -> tuple[GridCase, int, int]:
    kv = draw(st.integers(1, 30))
    q_len = draw(st.integers(1, kv))
    bs = draw(st.sampled_from([1, 3, 4, 8]))
    hkv = draw(st.sampled_from([1, 2]))
    case = GridCase(
        "layout",
        ((kv - q_len, q_len),),
        hkv * draw(st.sampled_from([1, 3])),
        hkv,
        8,
        bs,
        spare_blocks=draw(st.integers(0, 5)),
    )
    return case, draw(st.integers(0, 2**16)), draw(st.integers(0, 2**16))


@settings(deadline=None, max_examples=40)
@given(_layouts())
def test_block_layout_does_not_change_the_result(drawn: tuple[GridCase, int, int]) -> None:
    """Same values, two different shuffles of physical blocks: identical outputs."""
    case, seed_a, seed_b = drawn
    a = build_inputs(case, torch.float32, "cpu", seed_a)
    b = build_inputs(case, torch.float32, "cpu", seed_b)
    # Give b the values of a, placed through b's own block table.
    bs = case.block_size
    pos = torch.arange(case.kv_lens[0])
    slot_a = a.block_table[0, pos // bs].long(), pos % bs
    slot_b = b.block_table[0, pos // bs].long(), pos % bs
    b.key_cache[slot_b] = a.key_cache[slot_a]
    b.value_cache[slot_b] = a.value_cache[slot_a]
    b.query.copy_(a.query)
    assert torch.equal(a.call(oracle.paged_attention), b.call(oracle.paged_attention))


@settings(deadline=None, max_examples=40)
@given(
    n=st.integers(1, 40),
    cuts=st.lists(st.integers(1, 39), max_size=4),
    window=st.none() | st.integers(1, 12),
)
def test_chunked_prompt_equals_whole_prompt(n: int, cuts: list[int], window: int | None) -> None:
    """Prefill in chunks (each chunk sees the earlier ones through the cache) == one call."""
    case = GridCase("whole", ((0, n),), 4, 2, 16, 5)
    whole = build_inputs(case, torch.float32, "cpu", seed=n)
    expected = oracle.paged_attention(
        whole.query,
        whole.key_cache,
        whole.value_cache,
        whole.block_table,
        whole.seq_lens,
        whole.query_start_loc,
        sliding_window=window,
    )
    bounds = sorted({0, n, *(c for c in cuts if c < n)})
    pieces = []
    for lo, hi in itertools.pairwise(bounds):
        pieces.append(
            oracle.paged_attention(
                whole.query[lo:hi],
                whole.key_cache,
                whole.value_cache,
                whole.block_table,
                torch.tensor([hi], dtype=torch.int32),
                torch.tensor([0, hi - lo], dtype=torch.int32),
                sliding_window=window,
            )
        )
    torch.testing.assert_close(torch.cat(pieces), expected, atol=1e-6, rtol=1e-6)


def _valid_args() -> dict[str, Any]:
    inputs = build_inputs(GridCase("v", ((3, 2), (0, 4)), 4, 2, 8, 4), torch.float32, "cpu", 0)
    return {
        "query": inputs.query,
        "key_cache": inputs.key_cache,
        "value_cache": inputs.value_cache,
        "block_table": inputs.block_table,
        "seq_lens": inputs.seq_lens,
        "query_start_loc": inputs.query_start_loc,
    }


def _bad_inputs() -> list[tuple[str, str, object]]:
    """(id, argument the error must name, change) triples; change is a dict or kwargs."""
    args = _valid_args()
    return [
        ("query_2d", "query", {"query": args["query"][:, 0]}),
        ("query_int", "query", {"query": args["query"].int()}),
        ("cache_dtype", "key_cache", {"key_cache": args["key_cache"].half()}),
        ("value_shape", "value_cache", {"value_cache": args["value_cache"][:, :2]}),
        (
            "head_size",
            "key_cache",
            {"key_cache": args["key_cache"][..., :4], "value_cache": args["value_cache"][..., :4]},
        ),
        ("gqa_ratio", "key_cache", {"query": torch.zeros(6, 3, 8)}),
        ("table_int64", "block_table", {"block_table": args["block_table"].long()}),
        ("seq_lens_len", "seq_lens", {"seq_lens": args["seq_lens"][:1]}),
        ("qsl_end", "query_start_loc", {"query_start_loc": torch.tensor([0, 2, 5]).int()}),
        ("qsl_decreasing", "query_start_loc", {"query_start_loc": torch.tensor([0, 7, 6]).int()}),
        ("q_longer_than_kv", "seq_lens", {"seq_lens": torch.tensor([1, 4]).int()}),
        ("kv_past_table", "seq_lens", {"seq_lens": torch.tensor([5, 99]).int()}),
        (
            "block_id_range",
            "block_table",
            {"block_table": torch.tensor([[0, 999], [1, 2]]).int()},
        ),
        ("scale_nan", "scale", {"scale": float("nan")}),
        ("window_zero", "sliding_window", {"sliding_window": 0}),
        ("softcap_negative", "softcap", {"softcap": -1.0}),
    ]


@pytest.mark.parametrize(
    ("argument", "change"), [c[1:] for c in _bad_inputs()], ids=[c[0] for c in _bad_inputs()]
)
def test_oracle_rejects_bad_inputs(argument: str, change: dict[str, object]) -> None:
    kwargs: dict[str, Any] = {**_valid_args(), **change}
    with pytest.raises(KernelInputError) as info:
        oracle.paged_attention(**kwargs)
    assert info.value.argument == argument
    assert argument in str(info.value)
    assert isinstance(info.value, ValueError)


def test_error_message_names_the_shapes_seen() -> None:
    args = _valid_args()
    with pytest.raises(KernelInputError, match=r"shape=\(2, 3\) dtype=torch.int64"):
        oracle.paged_attention(**{**args, "block_table": torch.zeros(2, 3, dtype=torch.long)})


def test_unused_block_table_entries_may_hold_anything() -> None:
    args = _valid_args()
    table = args["block_table"].clone()
    table[table == table[0, -1]] = -1  # padding entries (all point at the poison block)
    out = oracle.paged_attention(**{**args, "block_table": table})
    assert bool(torch.isfinite(out).all())
