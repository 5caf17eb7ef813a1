"""One paged-attention case against the float64 oracle (docs/KERNELS.md): the output's
shape and dtype, no non-finite value (a read of a NaN-poisoned slot), no write outside
the ``out=`` view (the canary), the error within the tolerance, and the log-sum-exp when
the case asks for it."""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from refserve.conformance.kernel_grid.capabilities import signature_names
from refserve.conformance.kernel_grid.cases import GridCase
from refserve.conformance.kernel_grid.inputs import CANARY, AttentionInputs, build_inputs
from refserve.conformance.kernel_grid.results import FAIL, PASS, CaseResult, Verdict
from refserve.kernels import oracle
from refserve.kernels.tolerances import Tolerance


@dataclass(frozen=True)
class _Reference:
    """The float64 oracle's answer: the output, the log-sum-exp (extended cases only),
    and the fp32 oracle's own error against it (None: the extended oracle has no fp32
    twin)."""

    out: torch.Tensor
    lse: torch.Tensor | None
    fp32_err: float | None


def run_attention_case(
    fn: Callable[..., Any],
    case: GridCase,
    dtype: torch.dtype,
    dev: torch.device,
    seed: int,
    base: CaseResult,
    tol: Tolerance,
    with_traceback: bool,
) -> CaseResult:
    """Call ``fn`` on the case's inputs (an ``out=`` view inside a canary buffer when it
    takes one; ``num_kv_splits`` when the case splits) and judge its output."""
    started = time.perf_counter()
    inputs = build_inputs(case, dtype, dev, seed ^ zlib.crc32(case.name.encode()))
    ref = _reference(case, inputs)
    bound = tol.bound(float(ref.out.abs().max()) if ref.out.numel() else 0.0)
    base = replace(base, tolerance=bound, oracle_fp32_err=ref.fp32_err)
    t, hq, d = ref.out.shape
    buffer = None
    extra: dict[str, Any] = {}
    if "out" in signature_names(fn):
        # One extra token row and three extra columns per head around the view.
        buffer = torch.full((t + 1, hq, d + 3), CANARY, dtype=dtype, device=dev)
        extra["out"] = buffer[:t, :, :d]
    if case.num_kv_splits is not None:
        extra["num_kv_splits"] = case.num_kv_splits
    try:
        out = inputs.call(fn, **extra)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    except Exception as exc:  # a kernel under test may raise anything; report it
        return Verdict.raised(exc, with_traceback).result(base, started)
    return _judge(out, ref, case, dtype, tol, bound, buffer, inputs).result(base, started)


def _reference(case: GridCase, inputs: AttentionInputs) -> _Reference:
    if case.features:
        # Oracle-only surface: the extended float64 reference (no fp32 twin to compare).
        out, lse = oracle.paged_attention_extended_f64(
            inputs.query, inputs.key_cache, inputs.value_cache, inputs.block_table,
            inputs.seq_lens, inputs.query_start_loc, scale=case.scale,
            sliding_window=case.window_per_seq or case.sliding_window, softcap=case.softcap,
            **{k: v for k, v in inputs.extra.items() if k != "return_lse"},
        )  # fmt: skip
        return _Reference(out, lse, None)
    out = inputs.call_oracle(oracle.paged_attention_f64)
    out32 = inputs.call_oracle(oracle.paged_attention).to("cpu", torch.float64)
    return _Reference(out, None, float((out32 - out).abs().max()) if out.numel() else 0.0)


def _judge(
    out: object,
    ref: _Reference,
    case: GridCase,
    dtype: torch.dtype,
    tol: Tolerance,
    bound: float,
    buffer: torch.Tensor | None,
    inputs: AttentionInputs,
) -> Verdict:
    """The verdict on what ``fn`` returned, the first failure in the order of the
    module docstring."""
    lse_error = None
    if ref.lse is not None and case.return_lse:
        # return_lse=True: the kernel returns (out [T, Hq, Dv], lse [T, Hq]).
        if not (isinstance(out, tuple) and len(out) == 2):
            return Verdict(f"return_lse=True: expected (out, lse), got {type(out).__name__}")
        out, lse = out
        lse_error = _check_lse(lse, ref.lse, tol)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(ref.out.shape):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        return Verdict(f"returned {shape}, expected shape {tuple(ref.out.shape)}")
    if out.dtype != dtype:
        return Verdict(f"returned dtype {out.dtype}, expected {dtype}")
    out64 = out.to("cpu", torch.float64)
    diff = (out64 - ref.out).abs()
    err = float(diff.max()) if diff.numel() else 0.0
    starts = inputs.query_start_loc.tolist()
    worst = _worst(diff, out64, ref.out, starts) if diff.numel() else None
    bad = int((~torch.isfinite(out)).sum())
    if bad:
        return Verdict(
            f"{bad} non-finite outputs (a read of a NaN-poisoned slot, or exp of "
            "-inf - -inf in an online-softmax rescale?)",
            math.nan,
            worst,
        )
    error = _canary_error(buffer, ref.out.shape) or (
        f"max abs error {err:.3e} > tolerance {bound:.3e}" if err > bound else lse_error
    )
    return Verdict(error, err, worst, PASS if error is None else FAIL)


def _canary_error(buffer: torch.Tensor | None, shape: torch.Size) -> str | None:
    """A write outside the ``out=`` view changed the canary around it."""
    if buffer is None:
        return None
    t, _, d = shape
    outside = buffer.clone()
    outside[:t, :, :d] = CANARY
    if bool((outside == CANARY).all()):
        return None
    return "wrote outside its output view (canary changed)"


def _check_lse(lse: object, ref: torch.Tensor, tol: Tolerance) -> str | None:
    """Why a returned log-sum-exp ``[T, Hq]`` is wrong, or None (same tolerance rule)."""
    if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != tuple(ref.shape):
        shape = tuple(lse.shape) if isinstance(lse, torch.Tensor) else type(lse).__name__
        return f"lse: returned {shape}, expected {tuple(ref.shape)}"
    got = lse.to("cpu", torch.float64)
    if not bool(torch.isfinite(got).all()):
        return "lse: non-finite values"
    err = float((got - ref).abs().max()) if ref.numel() else 0.0
    bound = tol.bound(float(ref.abs().max()) if ref.numel() else 0.0)
    return None if err <= bound else f"lse: max abs error {err:.3e} > tolerance {bound:.3e}"


def _worst(
    diff: torch.Tensor, out: torch.Tensor, ref: torch.Tensor, starts: list[int]
) -> dict[str, Any]:
    """Location and values of the largest error (NaN counts as largest)."""
    score = torch.where(torch.isnan(diff), torch.full_like(diff, math.inf), diff)
    flat = int(score.argmax())
    t, h, d = (int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape))
    seq = max(i for i, s in enumerate(starts[:-1]) if s <= t)
    return {
        "token": t,
        "head": h,
        "dim": d,
        "seq": seq,
        "out": _finite_or_str(float(out[t, h, d])),
        "ref": _finite_or_str(float(ref[t, h, d])),
    }


def _finite_or_str(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)
