"""The kernel grid and ``check_kernel_main`` (docs/ARCHITECTURE.md, "Kernels").

The grid must fail kernels with classic bugs (``broken_kernel.py``) exactly where the
bug shows, and pass the Triton kernel; its inputs must carry the traps it promises.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import broken_kernel
import extended_kernel
import pytest
import torch
from kernel_testing import DEVICE

from refserve.conformance.kernel_grid import (
    BOUNDARY_RULES,
    CANARY,
    CASES,
    FAIL,
    GRID,
    GRIDS,
    NOT_SUPPORTED,
    PASS,
    TILE_SIZES,
    CaseResult,
    GridCase,
    build_inputs,
    check_kernel_main,
    format_table,
    report_json,
    run_grid,
    select_cases,
)
from refserve.kernels import oracle
from refserve.kernels.tolerances import Tolerance, attention_tolerance

CPU_CASES = select_cases("cpu")


def _failed(results: list[CaseResult]) -> set[str]:
    return {r.case for r in results if r.status == FAIL}


def _ran(results: list[CaseResult]) -> set[str]:
    """Cases the kernel was run on (not NOT_SUPPORTED: e.g. split-KV for a dense kernel)."""
    return {r.case for r in results if r.status != NOT_SUPPORTED}


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
    ran = _ran(results)
    assert _failed(results) == {c.name for c in CPU_CASES if _has_partial_block(c)} & ran
    assert {"kv_len_bs", "block_1"} <= {r.case for r in results if r.passed}


def test_reading_dead_slots_is_caught_by_the_nan_poison() -> None:
    results = run_grid(broken_kernel.reads_whole_blocks, device="cpu", dtypes=[torch.float16])
    ran = _ran(results)
    assert _failed(results) == {c.name for c in CPU_CASES if _has_partial_block(c)} & ran
    assert all("non-finite" in (r.error or "") for r in results if r.status == FAIL)


def test_causal_mask_from_the_start_is_caught() -> None:
    results = run_grid(broken_kernel.causal_from_start, device="cpu", dtypes=[torch.float32])
    # Only a batch made solely of whole prompts survives this bug.
    ran = _ran(results)
    assert (
        _failed(results) == {c.name for c in CPU_CASES if any(ctx > 0 for ctx, _ in c.seqs)} & ran
    )


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
    # Measured against the float64 oracle, the fp32 oracle's error is exactly its own.
    results = run_grid(oracle.paged_attention, device="cpu", dtypes=[torch.float32])
    ran = [r for r in results if r.status != NOT_SUPPORTED]
    assert ran and all(r.passed and r.max_abs_err == r.oracle_fp32_err for r in ran)
    reasons = {r.error or "" for r in results if r.status == NOT_SUPPORTED}
    assert {r for r in reasons if "not declared" not in r} <= {
        "layout hnd not in ['nhd']",
        "no split-KV (no num_kv_splits keyword)",
    }


def test_check_kernel_passes_the_triton_kernel(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report.json"
    code = check_kernel_main(
        [
            "refserve.kernels.attention:paged_attention",
            "--quick",
            "--dtype",
            "float32",
            "--json",
            str(out),
            "--device",
            str(DEVICE),
        ]
    )
    table = capsys.readouterr().out
    assert code == 0, table
    report = json.loads(out.read_text())
    assert report["failed"] == [] and report["passed"] > 0
    unsupported = [c for c in GRID if c.quick and (c.layout == "hnd" or c.features)]
    assert report["counts"]["NOT_SUPPORTED"] == len(unsupported)
    assert report["passed"] + report["counts"]["NOT_SUPPORTED"] == report["total"]
    assert "case" in table.splitlines()[0] and "PASS" in table
    assert {"torch", "triton", "refserve", "seed", "mode", "capabilities"} <= set(report)
    row = report["results"][0]
    assert {"params", "atol", "rtol", "worst", "time_s", "boundary"} <= set(row)


def test_check_kernel_fails_the_broken_kernel(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _kernels_dir_on_path(monkeypatch)
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
            "-k",
            "kv_len",
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
    [
        ["no_such_module_xyz:fn"],
        ["refserve.kernels.oracle:no_such_fn"],
        ["refserve.kernels.oracle"],
        [],
    ],
    ids=["module", "function", "no_colon", "no_target"],
)
def test_check_kernel_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert check_kernel_main(argv) == 2
    capsys.readouterr()


def test_report_is_strict_json_and_table_is_readable() -> None:
    results = [
        CaseResult("a", "T=1", "float32", "cpu", 1e-7, 1e-5, PASS),
        CaseResult("b", "T=2", "float16", "cpu", math.nan, 1e-3, FAIL, "raised X"),
        CaseResult("c", "T=2", "float16", "cpu", math.nan, math.nan, NOT_SUPPORTED, "no"),
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
        "time",
        "result",
    ]
    assert table[2].endswith("PASS") and table[3].endswith("FAIL: raised X")
    assert table[4].endswith("NOT_SUPPORTED: no")
    assert table[-1] == "1/3 passed (1 fail, 1 not_supported)"


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


# ------------------------------------------------------------ v2: rules, isolation, caps
KERNELS_DIR = Path(__file__).parent
ROOT = KERNELS_DIR.parents[1]


def _kernels_dir_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``broken_kernel`` importable here and in the grid's worker subprocess."""
    monkeypatch.syspath_prepend(str(KERNELS_DIR))
    old = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", str(KERNELS_DIR) + (os.pathsep + old if old else ""))


def test_generated_cases_cover_every_tile_size_and_rule() -> None:
    every = [c for grid in GRIDS.values() for c in grid]
    assert {c.boundary for c in every} == set(BOUNDARY_RULES)
    assert {c.boundary for c in every if c.quick} == set(BOUNDARY_RULES)
    for t in TILE_SIZES:
        assert {t - 1, t, t + 1} <= set(CASES[f"tile{t}_kv_edge"].kv_lens)
        ctx, q = CASES[f"tile{t}_q_cross"].seqs[0]
        assert ctx < t < ctx + q  # the chunk's queries straddle the key tile edge
        for delta, tag in ((-1, "m1"), (0, "0"), (1, "p1")):
            case = CASES[f"tile{t}_window_edge_{tag}"]
            assert case.sliding_window is not None
            for ctx, _ in case.seqs:  # first visible key of the first query
                assert ctx - case.sliding_window + 1 == 2 * t + delta
    split = [c for c in GRID if c.boundary == "split_kv"]
    assert {c.block_size for c in split} == {1, 5, 16, 32}
    assert any(c.sliding_window for c in split) and any(c.softcap for c in split)
    assert {2, 3} <= {c.num_kv_splits for c in split}


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = check_kernel_main(argv)
    return code, capsys.readouterr().out


def test_list_k_and_case_select_cases(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _cli(["--list"], capsys)
    assert code == 0 and out.splitlines()[-1] == f"{len(GRID)} cases"
    code, out = _cli(["--list", "-k", "window_edge"], capsys)
    assert code == 0 and out.splitlines()[-1] == f"{3 * len(TILE_SIZES)} cases"
    code, out = _cli(["--list", "--case", "kv_len_1", "--case", "split4_long"], capsys)
    assert code == 0 and out.splitlines()[-1] == "2 cases"
    assert check_kernel_main(["refserve.kernels.oracle:paged_attention", "--case", "nope"]) == 2
    assert check_kernel_main(["refserve.kernels.oracle:paged_attention", "-k", "zzz_none"]) == 2
    capsys.readouterr()


def test_a_crashing_kernel_fails_that_case_and_the_run_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _kernels_dir_on_path(monkeypatch)
    out, lines = tmp_path / "r.json", tmp_path / "r.jsonl"
    cases = ["kv_len_1", "prompt_bs_plus_1", "kv_len_bs", "single_tile_prompt", "kv_len_bs_plus_1"]
    argv = ["broken_kernel:segfaults_on_prompts", "--device", "cpu", "--dtype", "float32"]
    argv += [x for c in cases for x in ("--case", c)]
    code, text = _cli([*argv, "--json", str(out), "--jsonl", str(lines)], capsys)
    assert code == 1, text
    report = json.loads(out.read_text())
    status = {r["case"]: r["status"] for r in report["results"]}
    assert list(status) == cases  # complete, in order
    assert status == {
        "kv_len_1": PASS,
        "prompt_bs_plus_1": FAIL,
        "kv_len_bs": PASS,
        "single_tile_prompt": FAIL,
        "kv_len_bs_plus_1": PASS,
    }
    crashed = report["results"][1]
    assert "SIGSEGV" in crashed["error"] and "Fatal Python error" in crashed["error"]
    streamed = [json.loads(line) for line in lines.read_text().splitlines()]
    assert [r["case"] for r in streamed] == cases


def test_a_hanging_kernel_times_out_and_the_run_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _kernels_dir_on_path(monkeypatch)
    out = tmp_path / "r.json"
    argv = ["broken_kernel:hangs_on_prompts", "--device", "cpu", "--dtype", "float32"]
    argv += ["--case", "prompt_bs_plus_1", "--case", "kv_len_1", "--timeout", "3"]
    code, text = _cli([*argv, "--json", str(out)], capsys)
    assert code == 1, text
    results = json.loads(out.read_text())["results"]
    assert [(r["case"], r["status"]) for r in results] == [
        ("prompt_bs_plus_1", "TIMEOUT"),
        ("kv_len_1", PASS),
    ]


def test_a_decode_only_kernel_reports_not_supported_not_failures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    results = run_grid(broken_kernel.decode_only, device="cpu", dtypes=[torch.float32])
    by_status = {s: {r.case for r in results if r.status == s} for s in (PASS, FAIL)}
    assert by_status[FAIL] == set()
    assert by_status[PASS] == {
        c.name
        for c in CPU_CASES
        if c.decode_only and c.sliding_window is None and c.layout == "nhd"
        and c.num_kv_splits is None
    }  # fmt: skip
    reasons = {r.error for r in results if r.status == NOT_SUPPORTED}
    assert "decode-only kernel; case has prefill/chunk queries" in reasons
    # Through the CLI (worker reports the capabilities): exit 0, nothing failed.
    _kernels_dir_on_path(monkeypatch)
    out = tmp_path / "r.json"
    argv = ["broken_kernel:decode_only", "--device", "cpu", "--dtype", "float32", "--quick"]
    code, text = _cli([*argv, "--json", str(out)], capsys)
    report = json.loads(out.read_text())
    assert code == 0, text
    assert report["capabilities"]["decode_only"] is True
    assert report["counts"]["NOT_SUPPORTED"] > 0 and report["counts"]["FAIL"] == 0


def test_tolerance_overrides_are_recorded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.json"
    argv = [
        "refserve.kernels.oracle:paged_attention",
        "--case",
        "extreme_logits",
        "--dtype",
        "float32",
    ]
    code, _ = _cli([*argv, "--atol", "0", "--rtol", "0", "--in-process", "--json", str(out)],
                   capsys)  # fmt: skip
    report = json.loads(out.read_text())
    assert report["tolerance_override"] == {"atol": 0.0, "rtol": 0.0}
    [row] = report["results"]
    # The fp32 oracle is not exact: against float64 with zero tolerance it fails.
    assert code == 1 and row["status"] == FAIL and row["atol"] == 0.0
    assert row["worst"]["seq"] in range(4) and row["oracle_fp32_err"] > 0


def _plugin_installed() -> bool:
    eps = importlib.metadata.entry_points(group="pytest11")
    return any(ep.name == "refserve_kernels" for ep in eps)


@pytest.mark.skipif(
    not _plugin_installed(),
    reason="refserve is not installed here (a bare GPU image running tests/kernels from the "
    "checkout): the pytest11 entry point this test drives does not exist; `make test` "
    "installs refserve, so there it runs",
)
def test_pytest_entry_point_runs_the_grid(tmp_path: Path) -> None:
    (tmp_path / "test_nothing.py").write_text("")
    # The plugin comes from the installed pytest11 entry point, as it does for a user.
    argv = [sys.executable, "-m", "pytest", "-p",
            "no:cacheprovider", "-q", str(tmp_path), "--rootdir", str(tmp_path),
            "--refserve-kernel", "broken_kernel:decode_only", "--refserve-kernel-quick",
            "--refserve-kernel-dtype", "float32", "-k", "kv_len or tile32_q_cross"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(KERNELS_DIR), str(ROOT)])}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "5 passed, 1 skipped" in proc.stdout, proc.stdout[-2000:]


# ------------------------------------------------------------ beyond our kernel (oracle)
BEYOND = [c for c in GRID if c.boundary == "beyond_design"]


def test_the_extended_oracle_agrees_with_the_oracle_on_the_design_surface() -> None:
    case = CASES["window_and_softcap"]
    inputs = build_inputs(case, torch.float32, "cpu", seed=3)
    ref = inputs.call_oracle(oracle.paged_attention_f64)
    ext, lse = oracle.paged_attention_extended_f64(
        inputs.query, inputs.key_cache, inputs.value_cache, inputs.block_table,
        inputs.seq_lens, inputs.query_start_loc, scale=case.scale,
        sliding_window=case.sliding_window, softcap=case.softcap,
    )  # fmt: skip
    torch.testing.assert_close(ext, ref, atol=1e-12, rtol=0)
    assert lse.shape == ext.shape[:2] and bool(torch.isfinite(lse).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_kernel_declaring_the_extended_surface_passes_it(dtype: torch.dtype) -> None:
    results = run_grid(extended_kernel.reference_extended, device="cpu", dtypes=[dtype],
                       cases=BEYOND)  # fmt: skip
    assert [r.status for r in results] == [PASS] * len(BEYOND), [r.error for r in results]


def test_our_kernel_is_not_supported_on_the_extended_surface() -> None:
    from refserve.kernels.attention import paged_attention

    results = run_grid(paged_attention, device="cpu", dtypes=[torch.float32], cases=BEYOND)
    assert {r.status for r in results} == {NOT_SUPPORTED}
    assert all("not declared" in (r.error or "") for r in results)


@pytest.mark.parametrize(
    ("fn", "caught_by"),
    [
        (extended_kernel.alibi_sign_flipped, {"ext_alibi", "ext_alibi_softcap_lse"}),
        (extended_kernel.sinks_dropped, {"ext_sinks", "ext_sinks_window"}),
        (extended_kernel.ignores_kv_scales, {"ext_fp8_kv"}),
        (extended_kernel.lse_base2, {"ext_lse", "ext_alibi_softcap_lse"}),
    ],
    ids=lambda x: getattr(x, "__name__", ""),
)
def test_extended_mutants_are_caught(fn: Any, caught_by: set[str]) -> None:
    results = run_grid(fn, device="cpu", dtypes=[torch.float32], cases=BEYOND)
    assert _failed(results) == caught_by
