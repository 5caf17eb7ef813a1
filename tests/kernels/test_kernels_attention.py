"""Triton paged attention against the dense oracle (docs/ARCHITECTURE.md, "Kernels").

Runs on CUDA when there is one, otherwise in Triton's interpreter on CPU tensors
(``conftest.py``). Every comparison uses ``refserve.kernels.tolerances`` through the grid's
``run_case`` or ``assert_attention_close``; every input carries the grid's traps (NaN in
each dead cache slot, unused block-table entries pointing at an all-NaN block, a canary
around the ``out=`` view).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_testing import DEVICE, DTYPES, HAS_CUDA, assert_attention_close, needs_cuda

from refserve import kernels
from refserve.conformance.kernel_grid import GRID, NOT_SUPPORTED, GridCase, build_inputs, run_case
from refserve.kernels import oracle
from refserve.kernels.attention import _paged_attention_kernel, choose_tiles, paged_attention
from refserve.kernels.validation import AttentionDims, KernelInputError


def _run(case: GridCase, dtype: torch.dtype, seed: int = 0, **kwargs: Any) -> None:
    fn = functools.partial(paged_attention, **kwargs) if kwargs else paged_attention
    result = run_case(fn, case, dtype, DEVICE, seed=seed)
    if result.status == NOT_SUPPORTED:
        pytest.skip(f"{case.name}: not supported by our kernel ({result.error})")
    detail = result.error or f"max abs err {result.max_abs_err:.3e} > {result.tolerance:.3e}"
    assert result.passed, f"{result.case} {result.dtype}: {detail}"


@pytest.mark.skipif(HAS_CUDA, reason="interpreter mode is only used without CUDA")
def test_interpreter_mode_is_on() -> None:
    # conftest.py set TRITON_INTERPRET before the kernel module was imported.
    assert type(_paged_attention_kernel).__name__ == "InterpretedFunction"


def _grid_params() -> list[Any]:
    """The hand-named cases and the quick generated ones (the full generated grid runs in
    ``make gpu-check`` / ``refserve check-kernel``: minutes in the interpreter)."""
    params = []
    for case in (c for c in GRID if c.boundary == "named" or c.quick):
        for dtype in DTYPES:
            marks = [needs_cuda] if case.gpu_only else []
            name = f"{case.name}-{str(dtype).removeprefix('torch.')}"
            params.append(pytest.param(case, dtype, id=name, marks=marks))
    return params


@pytest.mark.parametrize(("case", "dtype"), _grid_params())
def test_grid_case(case: GridCase, dtype: torch.dtype) -> None:
    """The whole grid, fp32/fp16/bf16 (bf16 in the interpreter: our kernel upcasts)."""
    _run(case, dtype)


def _split_params() -> list[Any]:
    """(case, number of KV segments): every quick grid case, plus cases with empty segments."""
    by_name = {c.name: c for c in GRID}
    params = [pytest.param(c, 3, id=f"{c.name}-3") for c in GRID if c.quick]
    extra = [
        (GridCase("split_prefill", ((0, 40), (25, 9)), 4, 2, 32, 4), 2),
        (GridCase("split_window", ((90, 1), (30, 7)), 2, 1, 32, 8, sliding_window=20), 4),
        (by_name["long_decode"], 16),  # more segments than most rows need
        (by_name["kv_len_1"], 16),  # 15 of 16 segments see no key at all
    ]
    params += [pytest.param(c, n, id=f"{c.name}-{n}") for c, n in extra]
    return params


@pytest.mark.parametrize(("case", "splits"), _split_params())
def test_split_kv_path(case: GridCase, splits: int) -> None:
    """Split-KV + merge gives the oracle's result, including segments with no keys."""
    _run(case, torch.float32, num_kv_splits=splits)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_split_kv_path_low_precision(dtype: torch.dtype) -> None:
    _run(GridCase("long", ((300, 1), (70, 1)), 8, 1, 80, 16), dtype, num_kv_splits=4)


def test_sequences_without_queries_this_step() -> None:
    # A sequence may have q_len 0 (it is in the batch but has nothing to compute).
    case = GridCase("idle", ((5, 0), (10, 3), (0, 0), (3, 1)), 4, 2, 32, 4)
    _run(case, torch.float32)
    _run(case, torch.float32, num_kv_splits=2)


def test_empty_batch_returns_empty() -> None:
    case = GridCase("empty", ((4, 0),), 2, 1, 16, 4)
    inputs = build_inputs(case, torch.float32, DEVICE, 0)
    out = inputs.call(paged_attention)
    assert out.shape == (0, 2, 16)


def test_public_entry_point_is_the_triton_kernel() -> None:
    assert kernels.paged_attention is paged_attention
    case = GridCase("pub", ((3, 2),), 2, 1, 16, 4)
    inputs = build_inputs(case, torch.float16, DEVICE, 1)
    assert_attention_close(
        inputs.call(kernels.paged_attention), inputs.call(oracle.paged_attention)
    )


def test_out_argument_is_written_and_returned() -> None:
    case = GridCase("out", ((6, 2), (0, 3)), 4, 2, 24, 4)
    inputs = build_inputs(case, torch.float32, DEVICE, 2)
    out = torch.full_like(inputs.query, float("nan"))
    result = inputs.call(paged_attention, out=out)
    assert result is out
    assert_attention_close(out, inputs.call(oracle.paged_attention))


def test_rejects_bad_inputs_like_the_oracle() -> None:
    inputs = build_inputs(GridCase("bad", ((3, 2),), 2, 1, 16, 4), torch.float32, DEVICE, 0)
    bad_table = inputs.block_table.long()
    for fn in (paged_attention, oracle.paged_attention):
        with pytest.raises(KernelInputError) as info:
            fn(
                inputs.query,
                inputs.key_cache,
                inputs.value_cache,
                bad_table,
                inputs.seq_lens,
                inputs.query_start_loc,
            )
        assert info.value.argument == "block_table"


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"num_kv_splits": 0}, "num_kv_splits"),
        ({"out": torch.zeros(1, 2, 16)}, "out"),
        ({"out": torch.zeros(2, 2, 16, dtype=torch.float16)}, "out"),
    ],
    ids=["splits_zero", "out_shape", "out_dtype"],
)
def test_rejects_bad_extra_arguments(kwargs: dict[str, object], argument: str) -> None:
    inputs = build_inputs(GridCase("bad", ((3, 2),), 2, 1, 16, 4), torch.float32, DEVICE, 0)
    if "out" in kwargs:
        kwargs = {"out": kwargs["out"].to(DEVICE)}  # type: ignore[attr-defined]
    with pytest.raises(KernelInputError) as info:
        inputs.call(paged_attention, **kwargs)
    assert info.value.argument == argument


def test_cpu_tensors_without_the_interpreter_get_a_clear_error() -> None:
    from refserve.kernels._runtime import require_runnable

    compiled = object()  # stands in for a compiled (not interpreted) kernel
    with pytest.raises(KernelInputError, match="TRITON_INTERPRET=1"):
        require_runnable(compiled, torch.device("cpu"), "paged_attention", "query")
    require_runnable(compiled, torch.device("cuda"), "paged_attention", "query")


def _dims(tokens: int, seqs: int, hq: int, hkv: int, max_blocks: int = 4) -> AttentionDims:
    return AttentionDims(tokens, seqs, hq, hkv, 80, 100, 16, max_blocks)


@pytest.mark.parametrize(("hq", "hkv"), [(1, 1), (5, 1), (14, 2), (32, 1), (64, 2)])
def test_tile_shapes_fit_the_rows(hq: int, hkv: int) -> None:
    for interpreted in (True, False):
        cfg = choose_tiles(
            _dims(40, 3, hq, hkv), torch.device("cpu"), interpreted=interpreted, num_kv_splits=None
        )
        group = hq // hkv
        assert cfg.block_q >= 1 and cfg.block_q * group <= cfg.block_m
        assert cfg.block_m >= 16 and cfg.block_m & (cfg.block_m - 1) == 0
        assert cfg.block_d == 128  # head size 80 padded to a power of two
        assert cfg.num_segments == 1  # never split off a GPU unless forced
    forced = choose_tiles(
        _dims(3, 3, hq, hkv), torch.device("cpu"), interpreted=True, num_kv_splits=5
    )
    assert forced.num_segments == 5


@needs_cuda
def test_heuristic_splits_long_decodes_on_gpu() -> None:
    dev = torch.device("cuda")
    long_decode = choose_tiles(
        _dims(1, 1, 8, 1, max_blocks=2048), dev, interpreted=False, num_kv_splits=None
    )
    assert long_decode.num_segments > 1
    prefill = choose_tiles(
        _dims(500, 1, 8, 1, max_blocks=2048), dev, interpreted=False, num_kv_splits=None
    )
    assert prefill.num_segments == 1


@st.composite
def _batches(draw: st.DrawFn) -> GridCase:
    """Small random batches: lengths, chunk splits, GQA ratios, block sizes, options."""
    hkv = draw(st.integers(1, 2))
    group = draw(st.sampled_from([1, 2, 3, 5, 8]))
    seqs = tuple(
        (draw(st.integers(0, 40)), draw(st.integers(0, 10))) for _ in range(draw(st.integers(1, 4)))
    )
    if all(q == 0 for _, q in seqs):
        seqs = ((seqs[0][0], 1), *seqs[1:])
    return GridCase(
        "hypothesis",
        seqs,
        hkv * group,
        hkv,
        draw(st.sampled_from([8, 16, 24, 40, 64])),
        draw(st.sampled_from([1, 2, 3, 5, 8, 16])),
        sliding_window=draw(st.none() | st.integers(1, 24)),
        softcap=draw(st.none() | st.sampled_from([5.0, 30.0])),
        scale=draw(st.none() | st.sampled_from([0.1, 0.5])),
        logit_scale=draw(st.sampled_from([1.0, 1.0, 10.0])),
        spare_blocks=draw(st.integers(0, 4)),
    )


@settings(deadline=None, max_examples=25)
@given(
    case=_batches(),
    dtype=st.sampled_from([torch.float32, torch.float16]),
    splits=st.sampled_from([None, 1, 2, 3]),
    seed=st.integers(0, 2**16),
)
def test_random_batches_match_the_oracle(
    case: GridCase, dtype: torch.dtype, splits: int | None, seed: int
) -> None:
    _run(case, dtype, seed=seed, num_kv_splits=splits)
