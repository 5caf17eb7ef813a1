"""Running one (case, dtype) in this process: the verdicts decided without calling the
kernel (NOT_SUPPORTED, SKIPPED), then the operation's own run against its oracle
(:mod:`.attention`, :mod:`.memory`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from refserve.conformance.kernel_grid.attention import run_attention_case
from refserve.conformance.kernel_grid.capabilities import (
    KernelCapabilities,
    capabilities_of,
    unsupported_reason,
)
from refserve.conformance.kernel_grid.cases import GridCase, select_cases
from refserve.conformance.kernel_grid.memory import run_memory_case
from refserve.conformance.kernel_grid.results import FAIL, NOT_SUPPORTED, SKIPPED, CaseResult
from refserve.kernels.tolerances import Tolerance, attention_tolerance


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
    per-dtype one of ``refserve.kernels.tolerances`` (``--atol/--rtol``).
    """
    dev = torch.device(device)
    caps = capabilities_of(fn) if capabilities is None else capabilities
    base, decided = undecided_or_verdict(case, dtype, dev, caps, tolerance)
    if decided is not None:
        return decided
    if case.op != "paged_attention":
        return run_memory_case(fn, case, dtype, dev, seed, base, with_traceback)
    tol = tolerance or attention_tolerance(dtype, dev)
    return run_attention_case(fn, case, dtype, dev, seed, base, tol, with_traceback)


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


def undecided_or_verdict(
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
        params=case.params(), atol=tol.atol, rtol=tol.rtol, note=bf16_note(dtype, dev),
    )  # fmt: skip
    reason = unsupported_reason(case, base.dtype, caps)
    if reason is not None:
        return base, replace(base, status=NOT_SUPPORTED, error=reason)
    if case.gpu_only and dev.type != "cuda":
        return base, replace(base, status=SKIPPED, error="needs CUDA (too big for the interpreter)")
    return base, None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def bf16_note(dtype: torch.dtype, dev: torch.device) -> str | None:
    """The note a bf16 result on the CPU carries (why only some kernels can pass)."""
    if dtype == torch.bfloat16 and dev.type == "cpu":
        return (
            "bf16 in the Triton interpreter: its bf16 tl.dot is wrong, so only a kernel "
            "that upcasts before tl.dot can pass (ours does)"
        )
    return None
