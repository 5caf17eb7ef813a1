"""The kernel grid and ``check_kernel_main`` (DESIGN.md "Kernels", issue 5 item 5).

The grid must fail kernels with classic bugs (``broken_kernel.py``) exactly where the
bug shows, and pass the Triton kernel; its inputs must carry the traps it promises.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import broken_kernel
import pytest
import torch
from kernel_testing import DEVICE

from conformance.kernel_grid import (
    CANARY,
    GRID,
    CaseResult,
    GridCase,
    build_inputs,
    check_kernel_main,
    format_table,
    report_json,
    run_grid,
    select_cases,
)
from kernels import oracle
from kernels.tolerances import Tolerance, attention_tolerance

CPU_CASES = select_cases("cpu")


def _failed(results: list[CaseResult]) -> set[str]:
    return {r.case for r in results if not r.passed}


def _has_partial_block(case: GridCase) -> bool:
    return any(kv % case.block_size for kv in case.kv_lens)


def test_grid_covers_the_design_edge_cases() -> None:
    cases = {c.name: c for c in GRID}
    kv_lens = {kv for c in GRID if c.block_size == 16 for kv in c.kv_lens}
    assert {1, 15, 16, 17, 3 * 16 - 6} <= kv_lens
    assert {64, 80, 96, 128} <= {c.head_size for c in GRID}
    assert any(c.head_size % 16 for c in GRID)
    assert {1, 5, 16, 32} <= {c.block_size for c in GRID}
    assert {1, 2, 5, 7, 8} <= {c.num_q_heads // c.num_kv_heads for c in GRID}
    mixed = cases["mixed_batch"].seqs
    assert any(q == 1 for _, q in mixed)  # decode
    assert any(c == 0 and q > 1 for c, q in mixed)  # whole prompt
    assert any(c > 0 and q > 1 for c, q in mixed)  # mid-prompt chunk
    assert any(c.sliding_window for c in GRID) and any(c.softcap for c in GRID)
    assert any(c.logit_scale >= 100 for c in GRID)
    big = cases["int32_offset_overflow"]
    assert big.gpu_only and big.num_blocks is not None
    assert big.num_blocks * big.block_size * big.num_kv_heads * big.head_size > 2**31


def test_inputs_are_deterministic_and_poisoned() -> None:
    case = GRID[[c.name for c in GRID].index("mixed_batch")]
    a = build_inputs(case, torch.float32, "cpu", seed=7)
    b = build_inputs(case, torch.float32, "cpu", seed=7)
    c = build_inputs(case, torch.float32, "cpu", seed=8)
    assert torch.equal(a.block_table, b.block_table)
    torch.testing.assert_close(a.key_cache, b.key_cache, equal_nan=True, atol=0, rtol=0)
    assert not torch.equal(a.query, c.query)
    # Exactly the live slots hold numbers; everything else is NaN.
    live = int((~a.key_cache.isnan()).all(dim=(2, 3)).sum())
    assert live == sum(case.kv_lens)
    assert int((~a.value_cache.isnan()).all(dim=(2, 3)).sum()) == live
    # Unused table entries point at an all-NaN block; used blocks are not in order.
    used = {
        int(a.block_table[s, i])
        for s, kv in enumerate(case.kv_lens)
        for i in range(-(-kv // case.block_size))
    }
    unused = set(a.block_table.flatten().tolist()) - used
    assert len(unused) == 1 and bool(a.key_cache[unused.pop()].isnan().all())
    assert a.block_table[2, : 23 // 8 + 1].diff().ne(1).any()


def test_ignoring_the_last_partial_block_is_caught_exactly_where_it_shows() -> None:
    results = run_grid(
        broken_kernel.ignores_last_partial_block, device="cpu", dtypes=[torch.float32]
    )
    assert _failed(results) == {c.name for c in CPU_CASES if _has_partial_block(c)}
    assert {"kv_len_bs", "block_1"} <= {r.case for r in results if r.passed}


def test_reading_dead_slots_is_caught_by_the_nan_poison() -> None:
    results = run_grid(broken_kernel.reads_whole_blocks, device="cpu", dtypes=[torch.float16])
    assert _failed(results) == {c.name for c in CPU_CASES if _has_partial_block(c)}
    assert all("non-finite" in (r.error or "") for r in results if not r.passed)


def test_causal_mask_from_the_start_is_caught() -> None:
    results = run_grid(broken_kernel.causal_from_start, device="cpu", dtypes=[torch.float32])
    # Only a batch made solely of whole prompts survives this bug.
    assert _failed(results) == {c.name for c in CPU_CASES if any(ctx > 0 for ctx, _ in c.seqs)}


def test_writing_past_the_output_is_caught_by_the_canary() -> None:
    case = GRID[0]
    [result] = run_grid(
        broken_kernel.writes_past_output, device="cpu", dtypes=[torch.float32], cases=[case]
    )
    assert not result.passed and "canary" in (result.error or "")
    assert CANARY != 0.0


def test_exceptions_and_wrong_outputs_are_failures_not_crashes() -> None:
    def raises(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("boom")

    def wrong_dtype(*args: object, **kwargs: object) -> torch.Tensor:
        return oracle.paged_attention(*args, **kwargs).double()  # type: ignore[arg-type]

    [r1] = run_grid(raises, device="cpu", dtypes=[torch.float32], cases=[GRID[0]])
    [r2] = run_grid(wrong_dtype, device="cpu", dtypes=[torch.float32], cases=[GRID[0]])
    assert not r1.passed and "boom" in (r1.error or "") and math.isnan(r1.max_abs_err)
    assert not r2.passed and "dtype" in (r2.error or "")


def test_the_oracle_passes_its_own_grid() -> None:
    results = run_grid(oracle.paged_attention, device="cpu", dtypes=[torch.float32])
    assert results and all(r.passed and r.max_abs_err == 0.0 for r in results)


def test_check_kernel_passes_the_triton_kernel(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report.json"
    code = check_kernel_main(
        [
            "kernels.attention:paged_attention",
            "--quick",
            "--json",
            str(out),
            "--device",
            str(DEVICE),
        ]
    )
    table = capsys.readouterr().out
    assert code == 0, table
    report = json.loads(out.read_text())
    assert report["failed"] == [] and report["total"] == report["passed"] > 0
    assert "case" in table.splitlines()[0] and "PASS" in table


def test_check_kernel_fails_the_broken_kernel(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    out = tmp_path / "report.json"
    code = check_kernel_main(
        [
            "broken_kernel:ignores_last_partial_block",
            "--layout",
            "vllm",
            "--json",
            str(out),
            "--device",
            "cpu",
            "--dtype",
            "float32",
        ]
    )
    table = capsys.readouterr().out
    assert code == 1
    assert "FAIL" in table and "kv_len_bs_plus_1" in table
    report = json.loads(out.read_text())
    assert "kv_len_bs_plus_1/float32" in report["failed"]
    assert "kv_len_bs/float32" not in report["failed"]


@pytest.mark.parametrize(
    "argv",
    [["no_such_module_xyz:fn"], ["kernels.oracle:no_such_fn"], ["kernels.oracle"], []],
    ids=["module", "function", "no_colon", "no_target"],
)
def test_check_kernel_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert check_kernel_main(argv) == 2
    capsys.readouterr()


def test_report_is_strict_json_and_table_is_readable() -> None:
    results = [
        CaseResult("a", "T=1", "float32", "cpu", 1e-7, 1e-5, True),
        CaseResult("b", "T=2", "float16", "cpu", math.nan, 1e-3, False, "raised X"),
    ]
    text = json.dumps(report_json(results, target="m:f"), allow_nan=False)
    assert json.loads(text)["failed"] == ["b/float16"]
    table = format_table(results).splitlines()
    assert table[0].split() == [
        "case",
        "shape",
        "dtype",
        "max",
        "abs",
        "err",
        "tolerance",
        "result",
    ]
    assert table[2].endswith("PASS") and table[3].endswith("FAIL: raised X")
    assert table[-1] == "1/2 passed"


def test_tolerances_are_per_dtype_and_device() -> None:
    assert Tolerance(1e-3, 1e-2).bound(2.0) == pytest.approx(0.021)
    cpu16 = attention_tolerance(torch.float16, "cpu")
    assert attention_tolerance(torch.float32, "cpu").atol < cpu16.atol
    assert cpu16.atol < attention_tolerance(torch.bfloat16, "cpu").atol
    assert (
        attention_tolerance(torch.float32, "cuda").atol
        > attention_tolerance(torch.float32, "cpu").atol
    )  # TF32
    with pytest.raises(KeyError):
        attention_tolerance(torch.int8, "cpu")
