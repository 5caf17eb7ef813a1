"""``refserve check-kernel`` (docs/KERNELS.md, "Running the grid"): choose the cases,
run each (case, dtype) in the isolated worker (or in this process with
``--in-process``), stream one line per result, write the reports."""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import IO

import torch

from refserve.conformance.kernel_grid.capabilities import (
    GridHarnessError,
    KernelCapabilities,
    capabilities_of,
)
from refserve.conformance.kernel_grid.cases import CASES, GRIDS, GridCase
from refserve.conformance.kernel_grid.results import (
    EXIT_FAILED,
    EXIT_PASSED,
    EXIT_USAGE,
    TABLE_HEADER,
    CaseResult,
    report_json,
    run_info,
    summary_line,
    table_row,
)
from refserve.conformance.kernel_grid.run import bf16_note, run_grid, undecided_or_verdict
from refserve.conformance.kernel_grid.worker import (
    DTYPES,
    Worker,
    load_function,
    tolerance_override,
    worker_argv,
    worker_main,
)
from refserve.kernels.tolerances import Tolerance


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="refserve check-kernel",
        description="Check a paged-attention kernel against the float64 oracle over the "
        "kernel grid, one case at a time in a worker subprocess (docs/KERNELS.md). "
        "Exit 0: all passed; 1: a case failed or timed out; 2: usage or harness error.",
    )
    parser.add_argument(
        "target",
        nargs="?",
        help="MODULE:FUNCTION with the signature of refserve.kernels.paged_attention",
    )
    parser.add_argument("--layout", choices=["vllm"], default="vllm", help="cache layout")
    parser.add_argument(
        "--op",
        choices=sorted(GRIDS),
        default="paged_attention",
        help="which operation's grid TARGET implements (default paged_attention)",
    )
    parser.add_argument("--json", dest="json_path", help="write the JSON report here")
    parser.add_argument("--jsonl", help="stream one JSON record per result here ('-': stdout)")
    parser.add_argument("--quick", action="store_true", help="run the quick subset")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    parser.add_argument(
        "-k",
        dest="patterns",
        action="append",
        metavar="PATTERN",
        help="run cases whose name or boundary matches (glob or substring)",
    )
    parser.add_argument(
        "--case",
        dest="case_names",
        action="append",
        metavar="NAME",
        help="run this case (repeatable)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds per case before it is a TIMEOUT (default 600)",
    )
    parser.add_argument(
        "--traceback", action="store_true", help="include the traceback of a kernel that raised"
    )
    parser.add_argument("--atol", type=float, help="override every dtype's atol")
    parser.add_argument("--rtol", type=float, help="override every dtype's rtol")
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="run cases in this process (no crash isolation; debugging)",
    )
    parser.add_argument("--device", help="cuda or cpu (default: cuda if available)")
    parser.add_argument(
        "--dtype",
        action="append",
        choices=sorted(DTYPES),
        help="repeatable; default float32, float16 (+ bfloat16 on cuda)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the cases' random inputs (default 0)"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser  # fmt: skip


def _matches(case: GridCase, patterns: Sequence[str]) -> bool:
    for p in patterns:
        for text in (case.name, case.boundary):
            if p in text or fnmatch.fnmatchcase(text, p):
                return True
    return False


def _choose(args: argparse.Namespace) -> list[GridCase]:
    if args.case_names:
        unknown = [n for n in args.case_names if n not in CASES or CASES[n].op != args.op]
        if unknown:
            raise ValueError(f"unknown case(s) {unknown}; see --list")
        chosen = [CASES[n] for n in args.case_names]
    else:
        chosen = list(GRIDS[args.op])
        if args.quick:
            chosen = [c for c in chosen if c.quick]
    if args.patterns:
        chosen = [c for c in chosen if _matches(c, args.patterns)]
    if not chosen:
        raise ValueError("no case matches the selection; see --list")
    return chosen


def _list_cases(cases: Sequence[GridCase]) -> str:
    width = max(len(c.name) for c in cases)
    lines = [
        f"{c.name.ljust(width)}  {c.boundary:<28} {'quick' if c.quick else '     '} "
        f"{'gpu ' if c.gpu_only else '    '}{c.shape}"
        for c in cases
    ]
    return "\n".join([*lines, f"{len(cases)} cases"])


def _usage(message: str) -> int:
    print(f"refserve check-kernel: {message}", file=sys.stderr)
    return EXIT_USAGE


def check_kernel_main(argv: list[str]) -> int:
    """``refserve check-kernel MODULE:FUNCTION [options]`` (docs/KERNELS.md).

    Runs each selected (case, dtype) in a worker subprocess against the float64 oracle,
    streams one line per result (and one JSON record with ``--jsonl``), writes the JSON
    report with ``--json``. Returns 0 when nothing failed or timed out, 1 when something
    did, 2 on a usage or harness error.
    """
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help and on usage errors
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if args.worker:
        return worker_main(args)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        chosen = _choose(args)
        if args.list:
            print(_list_cases(chosen))
            return EXIT_PASSED
        _check_run_arguments(args)
    except ValueError as exc:
        return _usage(str(exc))
    _interpret_on_cpu(device)
    try:
        fn = _load_target(args)
    except (ImportError, AttributeError, ValueError) as exc:
        print(f"refserve check-kernel: cannot load {args.target}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    dtypes = _dtypes(args, device)
    info = _info(args, device)
    try:
        results = _run_selected(args, chosen, dtypes, device, fn, info)
    except GridHarnessError as exc:
        return _usage(f"{args.target}: {exc}")
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as fh:
            json.dump(report_json(results, info=info), fh, indent=2)
            fh.write("\n")
    failed = any(r.counts_as_failure for r in results)
    return EXIT_FAILED if failed or not results else EXIT_PASSED


def _interpret_on_cpu(device: torch.device) -> None:
    if device.type == "cpu" and "TRITON_INTERPRET" not in os.environ:
        # Triton kernels run on CPU tensors only in interpreter mode, which must be on
        # before the kernel's module is imported (docs/KERNELS.md).
        os.environ["TRITON_INTERPRET"] = "1"
        print("note: CPU run; TRITON_INTERPRET=1 set for Triton kernels", file=sys.stderr)


def _check_run_arguments(args: argparse.Namespace) -> None:
    """What a run needs beyond a selection (``ValueError``: a usage error)."""
    if not args.target:
        raise ValueError("the following arguments are required: target (MODULE:FUNCTION)")
    if args.timeout <= 0:
        raise ValueError("--timeout must be > 0")


def _load_target(args: argparse.Namespace) -> Callable[..., torch.Tensor] | None:
    """The kernel itself with ``--in-process``; otherwise only its name is checked here
    (the worker imports it, so a crash on import cannot take this process down)."""
    module_name, sep, attr = args.target.partition(":")
    if not (sep and module_name and attr):
        raise ValueError(f"expected MODULE:FUNCTION, got {args.target!r}")
    return load_function(args.target) if args.in_process else None


def _dtypes(args: argparse.Namespace, device: torch.device) -> list[torch.dtype]:
    """``--dtype`` or the default (float32, float16, and bfloat16 on CUDA)."""
    if args.dtype:
        dtypes = [DTYPES[name] for name in args.dtype]
    else:
        dtypes = [torch.float32, torch.float16]
        if device.type == "cuda":
            dtypes.append(torch.bfloat16)
    if device.type == "cpu" and torch.bfloat16 in dtypes:
        print(f"note: {bf16_note(torch.bfloat16, device)}", file=sys.stderr)
    return dtypes


def _info(args: argparse.Namespace, device: torch.device) -> dict[str, object]:
    """The JSON report's header: :func:`run_info` plus how this run was asked for."""
    info = run_info(target=args.target, device=device, seed=args.seed)
    info["tolerance_override"] = {"atol": args.atol, "rtol": args.rtol}
    info["isolation"] = "in-process" if args.in_process else "worker subprocess per run"
    info["timeout_s"] = args.timeout
    info["selection"] = {"quick": args.quick, "k": args.patterns, "case": args.case_names}
    return info


class _Stream:
    """Where results go as they finish: one text line each (stdout, or stderr when the
    JSON lines take stdout) and, with ``--jsonl``, one JSON record each, flushed."""

    def __init__(self, jsonl: str | None, chosen: Sequence[GridCase]) -> None:
        self.jsonl: IO[str] | None = None
        if jsonl:
            # Closed in close(): results stream into it as they finish.
            self.jsonl = sys.stdout if jsonl == "-" else open(jsonl, "w", encoding="utf-8")  # noqa: SIM115
        self.text = sys.stderr if self.jsonl is sys.stdout else sys.stdout
        # Fixed widths known up front, so streamed lines line up like format_table's.
        self.widths = [max(len(c.name) for c in chosen), max(len(c.shape) for c in chosen),
                       8, 11, 9, 8]  # fmt: skip

    def line(self, row: Sequence[str]) -> None:
        cells = [cell.ljust(w) for cell, w in zip(row, self.widths, strict=False)]
        print("  ".join([*cells, row[-1]]).rstrip(), file=self.text, flush=True)

    def result(self, result: CaseResult) -> None:
        self.line(table_row(result))
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(result.to_json()) + "\n")
            self.jsonl.flush()

    def close(self) -> None:
        if self.jsonl is not None and self.jsonl is not sys.stdout:
            self.jsonl.close()


def _run_selected(
    args: argparse.Namespace,
    chosen: Sequence[GridCase],
    dtypes: Sequence[torch.dtype],
    device: torch.device,
    fn: Callable[..., torch.Tensor] | None,
    info: dict[str, object],
) -> list[CaseResult]:
    """Every (case, dtype), streamed as it finishes, then the summary lines. The worker
    (none with ``--in-process``) starts first: its capabilities go into ``info``."""
    results: list[CaseResult] = []
    worker: Worker | None = None
    out = _Stream(args.jsonl, chosen)
    try:
        if fn is not None:
            caps = capabilities_of(fn)
        else:
            worker = Worker(worker_argv(args, device), os.environ)
            caps = worker.ensure_started()
        info["capabilities"] = caps.to_json()
        out.line(TABLE_HEADER)
        tol = tolerance_override(args.atol, args.rtol)
        for case, dtype in ((c, d) for c in chosen for d in dtypes):
            result = _run_one(fn, worker, case, dtype, device, args, caps, tol(dtype, device))
            results.append(result)
            out.result(result)
        print(summary_line(results), file=out.text)
        gpu_only = [c.name for c in chosen if c.gpu_only and device.type != "cuda"]
        if gpu_only:
            print(f"skipped (need CUDA): {', '.join(gpu_only)}", file=out.text)
        if args.quick:
            print(f"quick subset: {len(chosen)} of {len(GRIDS[args.op])} cases", file=out.text)
    finally:
        if worker is not None:
            worker.stop()
        out.close()
    return results


def _run_one(
    fn: Callable[..., torch.Tensor] | None,
    worker: Worker | None,
    case: GridCase,
    dtype: torch.dtype,
    device: torch.device,
    args: argparse.Namespace,
    caps: KernelCapabilities,
    tolerance: Tolerance | None,
) -> CaseResult:
    """One (case, dtype): decided here when unsupported or skipped, else run."""
    if fn is not None:
        return run_grid(fn, device=device, dtypes=[dtype], cases=[case], seed=args.seed,
                        tolerance=tolerance)[0]  # fmt: skip
    assert worker is not None
    base, decided = undecided_or_verdict(case, dtype, device, caps, tolerance)
    if decided is not None:
        return decided
    return worker.run(case, base.dtype, args.timeout, base)
