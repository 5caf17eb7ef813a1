"""Results and reports: one :class:`CaseResult` per (case, dtype), the JSON report and
the plain-text table (docs/KERNELS.md, "Report")."""

from __future__ import annotations

import contextlib
import math
import platform
import time
import traceback as traceback_module
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

#: Exit codes of ``refserve check-kernel`` (docs/KERNELS.md, "Running the grid").
EXIT_PASSED, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

#: Case outcomes. NOT_SUPPORTED and SKIPPED never make a run fail.
PASS, FAIL, TIMEOUT, NOT_SUPPORTED, SKIPPED = "PASS", "FAIL", "TIMEOUT", "NOT_SUPPORTED", "SKIPPED"


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


@dataclass(frozen=True)
class Verdict:
    """What one kernel call showed against its oracle: the fields of a
    :class:`CaseResult` the call decides (a FAIL unless ``status`` says PASS)."""

    error: str | None = None
    max_abs_err: float = math.nan
    worst: dict[str, Any] | None = None
    status: str = FAIL
    traceback: str | None = None

    @staticmethod
    def raised(exc: Exception, with_traceback: bool) -> Verdict:
        """The kernel raised ``exc`` (call while handling it, for its traceback)."""
        tb = traceback_module.format_exc() if with_traceback else None
        return Verdict(error=f"raised {type(exc).__name__}: {exc}", traceback=tb)

    def result(self, base: CaseResult, started: float) -> CaseResult:
        """``base`` with this verdict, timed from ``started`` (``time.perf_counter``)."""
        return replace(
            base,
            time_s=round(time.perf_counter() - started, 4),
            error=self.error,
            max_abs_err=self.max_abs_err,
            worst=self.worst,
            status=self.status,
            traceback=self.traceback,
        )


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
        "reference": "refserve.kernels.oracle.paged_attention_f64 (float64 on the CPU)",
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


TABLE_HEADER = ("case", "shape", "dtype", "max abs err", "tolerance", "time", "result")


def table_row(r: CaseResult) -> tuple[str, ...]:
    """One result's cells under :data:`TABLE_HEADER`."""
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
    rows = [table_row(r) for r in results]
    widths = [
        max(len(row[i]) for row in (TABLE_HEADER, *rows)) for i in range(len(TABLE_HEADER) - 1)
    ]

    def line(row: Sequence[str]) -> str:
        cells = [cell.ljust(w) for cell, w in zip(row, widths, strict=False)]
        return "  ".join([*cells, row[-1]]).rstrip()

    return "\n".join(
        [line(TABLE_HEADER), line(["-" * w for w in widths] + ["------"])]
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
