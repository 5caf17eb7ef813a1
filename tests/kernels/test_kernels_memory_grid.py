"""The write_kv and copy_blocks grids (docs/KERNELS.md, "write_kv and copy_blocks").

Our kernels pass them exactly; buggy copies fail exactly the cases their bug shows in.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from refserve.conformance.kernel_grid import (
    COPY_BLOCKS_GRID,
    FAIL,
    NOT_SUPPORTED,
    PASS,
    WRITE_KV_GRID,
    CaseResult,
    check_kernel_main,
    run_grid,
)
from refserve.kernels import oracle


def _status(results: list[CaseResult]) -> dict[str, str]:
    return {r.case: r.status for r in results}


def _expected(grid: tuple[object, ...], failing: set[str]) -> dict[str, str]:
    out = {}
    for case in grid:
        name, layout = case.name, case.layout  # type: ignore[attr-defined]
        out[name] = NOT_SUPPORTED if layout == "hnd" else FAIL if name in failing else PASS
    return out


def test_our_write_kv_and_copy_blocks_pass_their_grids() -> None:
    from refserve.kernels.copy import copy_blocks
    from refserve.kernels.kv_write import write_kv

    for fn, grid in ((write_kv, WRITE_KV_GRID), (copy_blocks, COPY_BLOCKS_GRID)):
        results = run_grid(fn, device="cpu", dtypes=[torch.float16], cases=grid)
        assert _status(results) == _expected(grid, set()), [r.error for r in results]


def _writes_padding_to_last_slot(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Bug: slot -1 indexes from the end (the pool's last slot) instead of skipping."""
    flat_k, flat_v = key_cache.flatten(0, 1), value_cache.flatten(0, 1)  # views
    for t, slot in enumerate(slot_mapping.tolist()):
        flat_k[slot], flat_v[slot] = key[t], value[t]


def _swap_copies_within_source(
    src_key_cache: torch.Tensor,
    src_value_cache: torch.Tensor,
    dst_key_cache: torch.Tensor,
    dst_value_cache: torch.Tensor,
    block_mapping: torch.Tensor,
) -> None:
    """Bug: always copies within the source pool (a swap never reaches the other pool)."""
    oracle.copy_blocks(src_key_cache, src_value_cache, src_key_cache, src_value_cache,
                       block_mapping)  # fmt: skip


def test_memory_grid_mutants_are_caught_where_they_show() -> None:
    wkv = run_grid(_writes_padding_to_last_slot, device="cpu", dtypes=[torch.float32],
                   cases=WRITE_KV_GRID)  # fmt: skip
    assert _status(wkv) == _expected(WRITE_KV_GRID, {"wkv_padding"})
    cb = run_grid(_swap_copies_within_source, device="cpu", dtypes=[torch.float32],
                  cases=COPY_BLOCKS_GRID)  # fmt: skip
    assert _status(cb) == _expected(COPY_BLOCKS_GRID, {"cb_swap_two_pools"})


def test_check_kernel_op_runs_the_write_kv_grid(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.json"
    argv = ["refserve.kernels.kv_write:write_kv", "--op", "write_kv", "--quick", "--device", "cpu",
            "--dtype", "float32", "--json", str(out)]  # fmt: skip
    code = check_kernel_main(argv)
    text = capsys.readouterr().out
    assert code == 0, text
    assert "wkv_padding" in text and "2/2 passed" in text
    assert check_kernel_main(["refserve.kernels.kv_write:write_kv", "--op", "write_kv",
                              "--case", "kv_len_1"]) == 2  # fmt: skip
    capsys.readouterr()
