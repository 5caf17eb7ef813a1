"""The kernel grid: paged-attention cases, generated from tiling boundaries, run against
a float64 oracle one case at a time in an isolated worker (docs/KERNELS.md).

A paged-attention kernel goes wrong at known edges (docs/KERNELS.md). The grid
holds the hand-named cases of that list plus cases *generated* from boundary rules
(:data:`BOUNDARY_RULES`, docs/KERNELS.md "Boundary rules"): every tiling edge kernels in
the field use (key tiles of 16/32/64/128 positions, query tiles crossing key tiles,
sliding-window edges on and off tile edges, split-KV segment counts that do and do not
divide a sequence, a single key tile, KV length 1). Each :class:`GridCase` names the
boundary it exercises. A case builds its inputs deterministically from a seed
(:func:`build_inputs`) in the vLLM-style layout (``refserve.kernels.validation``), with traps:

- physical blocks are shuffled (non-contiguous) and the pool holds spare blocks;
- every cache slot that is not live (past a sequence's length, in spare blocks) is NaN,
  and every unused block-table entry points at an all-NaN block, so a kernel that reads
  any of them produces NaN and fails loudly;
- if the function accepts an ``out=`` tensor, it gets a strided view into a larger
  buffer filled with a canary value, and any write outside the view fails the case.

The reference is ``refserve.kernels.oracle.paged_attention_f64`` (float64 on the CPU), so the
tolerance of ``refserve.kernels.tolerances`` is spent on the kernel alone; the fp32 oracle's own
error is measured and reported beside it (``oracle_fp32_err``).

A kernel declares what it supports with a ``refserve_capabilities`` attribute
(:class:`KernelCapabilities` or a plain dict of its fields); a case outside that is
``NOT_SUPPORTED``, never a failure. :func:`run_case` / :func:`run_grid` run in this
process; :func:`check_kernel_main` (``refserve check-kernel``) runs each case in a
persistent worker subprocess that is restarted after a crash or a timeout, so a kernel
that segfaults or hangs fails that case and the run goes on. This package needs torch and
``refserve.kernels.oracle`` only (no triton), so a kernel author's checker never needs our kernels.

Beyond that kernel: ``beyond_design`` cases check features other engines' kernels have
(fp8 KV, sinks, ALiBi, per-request windows, non-causal, a different V head size, the
log-sum-exp) against ``refserve.kernels.oracle.paged_attention_extended_f64``, and ``--op
write_kv`` / ``--op copy_blocks`` run grids of their own (:data:`GRIDS`).

The package, one concept a module: :mod:`.cases` (the grid), :mod:`.inputs` (a case's
inputs and their traps), :mod:`.capabilities` (what a kernel declares), :mod:`.results`
(results and reports), :mod:`.run` with :mod:`.attention` and :mod:`.memory` (one case in
this process), :mod:`.worker` (the isolated worker) and :mod:`.cli` (``refserve
check-kernel``). Everything public is importable from here.
"""

from __future__ import annotations

from refserve.conformance.kernel_grid.capabilities import (
    FEATURES,
    GridHarnessError,
    KernelCapabilities,
    capabilities_of,
    unsupported_reason,
)
from refserve.conformance.kernel_grid.cases import (
    BOUNDARY_RULES,
    CASES,
    COPY_BLOCKS_GRID,
    GRID,
    GRIDS,
    LAYOUTS,
    TILE_SIZES,
    WRITE_KV_GRID,
    GridCase,
    select_cases,
)

# refserve.cli.main copies this parser's options behind its own usage errors.
from refserve.conformance.kernel_grid.cli import build_parser, check_kernel_main
from refserve.conformance.kernel_grid.inputs import (
    CANARY,
    AttentionInputs,
    PagedAttentionFn,
    build_inputs,
)
from refserve.conformance.kernel_grid.results import (
    EXIT_FAILED,
    EXIT_PASSED,
    EXIT_USAGE,
    FAIL,
    NOT_SUPPORTED,
    PASS,
    SKIPPED,
    TIMEOUT,
    CaseResult,
    format_table,
    report_json,
    run_info,
    summary_line,
)
from refserve.conformance.kernel_grid.run import run_case, run_grid

__all__ = [
    "BOUNDARY_RULES",
    "CANARY",
    "CASES",
    "COPY_BLOCKS_GRID",
    "EXIT_FAILED",
    "EXIT_PASSED",
    "EXIT_USAGE",
    "FAIL",
    "FEATURES",
    "GRID",
    "GRIDS",
    "LAYOUTS",
    "NOT_SUPPORTED",
    "PASS",
    "SKIPPED",
    "TILE_SIZES",
    "TIMEOUT",
    "WRITE_KV_GRID",
    "AttentionInputs",
    "CaseResult",
    "GridCase",
    "GridHarnessError",
    "KernelCapabilities",
    "PagedAttentionFn",
    "build_inputs",
    "build_parser",
    "capabilities_of",
    "check_kernel_main",
    "format_table",
    "report_json",
    "run_case",
    "run_grid",
    "run_info",
    "select_cases",
    "summary_line",
    "unsupported_reason",
]
