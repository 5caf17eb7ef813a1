"""The ``refserve`` command line: the top-level parser, ``simulate`` and ``demo``, and the
dispatch to every other subcommand (its module adds its own parser; ``refserve --help``
lists what is registered).

One error surface for every subcommand (:func:`run_cli`): a typed error (bad input, a bad
option, an output path that cannot be written) prints one line ``refserve: error: ...``
and exits 2; Ctrl-C prints ``refserve: interrupted`` and exits 130; anything else is an
internal error, also one line and exit 2; ``--debug`` (anywhere on the line) adds the
traceback. Exit 1 is reserved for a check that ran and failed (``check-kernel``,
``conformance``). Every input is validated and every output path checked before the work
starts; outputs are written to a temporary name and renamed, so an interrupted run leaves
no half-written file. ``check-kernel``, ``compare`` and ``conformance`` parse their whole
command line themselves.

The error surface, the exit statuses, the option types and their limits live in
:mod:`refserve.cli.args`; the scheduler's options in :mod:`refserve.cli.config_args`.

Heavy modules (torch, the engine) are imported inside the commands, after the error
surface is in place, so Ctrl-C during start-up is handled like Ctrl-C during the run.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from refserve.cli.args import (
    EXIT_OK,
    MAX_STEPS,
    PROG,
    ArgumentParser,
    add_command,
    add_speculative_args,
    check_device,
    clip,
    int_at_most,
    proposer_from_args,
    run_cli,
)
from refserve.cli.config_args import add_config_args, config_from_args
from refserve.errors import InvalidArgument, UsageError

if TYPE_CHECKING:
    from refserve.core.config import SchedulerConfig
    from refserve.core.cost import StepCost
    from refserve.sim.simulator import SimResult


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    # ``conformance`` owns its whole argument list, --debug included.
    if args[:1] == ["conformance"]:
        return _conformance_main(args[1:])
    debug = "--debug" in args
    args = [a for a in args if a != "--debug"]
    if args[:1] == ["conformance"]:  # refserve --debug conformance ...
        return _conformance_main([*args[1:], "--debug"])
    return run_cli(lambda: _dispatch(args), debug=debug)


def _dispatch(args: list[str]) -> int:
    # These own their whole argument list: argparse cannot hand options that come first
    # to a REMAINDER positional.
    if args[:1] == ["check-kernel"]:
        return _check_kernel_main(args[1:])
    if args[:1] == ["compare"]:
        from refserve.cli.compare import compare_cli

        return compare_cli(args[1:])
    ns = _parser().parse_args(args)
    code: int = ns.func(ns)
    return code


# --------------------------------------------------------------------- the parser
DESCRIPTION = "refserve: a reference LLM serving engine, every step checked against its spec."
EPILOG = f"Each command has its own options: {PROG} COMMAND --help."


def version() -> str:
    """The installed distribution's version; a checkout run without installing has none."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed(PROG)
    except PackageNotFoundError:
        return "unknown (not installed)"


class _VersionAction(argparse.Action):
    """``--version``, looked up only when asked: reading the package metadata costs about a
    tenth of a second, which every other command would pay if the parser computed it."""

    def __init__(self, option_strings: Sequence[str], dest: str) -> None:
        super().__init__(
            option_strings,
            dest,
            nargs=0,
            default=argparse.SUPPRESS,
            help="print the version and exit",
        )

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> NoReturn:
        print(f"{PROG} {version()}")
        parser.exit()


def _parser() -> argparse.ArgumentParser:
    from refserve.sim.trace import BUILTIN

    p = ArgumentParser(prog=PROG, description=DESCRIPTION, epilog=EPILOG)
    p.add_argument("--version", action=_VersionAction)
    p.add_argument(
        "--debug", action="store_true", help="show the traceback of an error (any position)"
    )
    sub = p.add_subparsers(required=True, metavar="COMMAND", help="what to run")

    demo = add_command(
        sub, "demo", "the main job: the tiny model on a mixed workload, every step checked"
    )
    demo.add_argument(
        "--timeline",
        type=Path,
        default=Path("out/demo-timeline.html"),
        metavar="HTML",
        help="write the timeline picture here, and a PNG beside it (default %(default)s)",
    )
    demo.add_argument(
        "--simulator", action="store_true", help="the seed scenarios on the simulator instead"
    )
    add_speculative_args(demo)
    demo.set_defaults(func=_demo)

    sim = add_command(sub, "simulate", "replay a JSONL trace on the cost-model simulator")
    sim.add_argument(
        "trace", help=f"path to a JSONL trace, or a built-in one: {', '.join(BUILTIN)}"
    )
    add_config_args(sim)
    sim.add_argument(
        "--json", type=Path, metavar="PATH", help="write timelines, iterations and summary here"
    )
    sim.add_argument("--quiet", action="store_true", help="summary only, no per-round table")
    sim.add_argument(
        "--timeline",
        type=Path,
        metavar="HTML",
        help="write a timeline picture here (self-contained HTML)",
    )
    from refserve.sim.simulator import DEFAULT_MAX_STEPS

    sim.add_argument(
        "--max-steps",
        type=int_at_most(MAX_STEPS, lo=1),
        default=None,
        metavar="N",
        help=f"stop after this many steps, write the partial result, exit 2 (default: "
        f"the trace's prompt and output tokens, at least {DEFAULT_MAX_STEPS:,}; at most "
        f"{MAX_STEPS:,})",
    )
    sim.set_defaults(func=_simulate)

    from refserve.cli.generate import add_generate_parser

    add_generate_parser(sub)
    from refserve.cli.serve import add_serve_parser

    add_serve_parser(sub)
    from refserve.cli.conformance_http import add_conformance_http_parser

    add_conformance_http_parser(sub)
    from refserve.cli.bench_serve import add_bench_serve_parser

    add_bench_serve_parser(sub)
    from refserve.cli.kv_layouts import add_kv_layouts_parser

    add_kv_layouts_parser(sub)

    # Listed for --help; main() hands their arguments over before this parser runs.
    ck = add_command(sub, "check-kernel", "run the kernel grid against the dense oracle")
    ck.add_argument(
        "rest",
        nargs=argparse.REMAINDER,
        help="MODULE:FUNCTION [--quick] [-k PATTERN] [--json OUT] [--list] (check-kernel --help)",
    )
    add_command(
        sub, "compare", "compare scheduling policies over built-in traces and a rate sweep"
    ).add_argument("rest", nargs=argparse.REMAINDER, help="[--out DIR] [--rates ...] [--quick]")
    add_command(
        sub, "conformance", "check an engine's scheduler and KV manager against the spec"
    ).add_argument(
        "rest",
        nargs=argparse.REMAINDER,
        help="--adapter MODULE:FACTORY [--scenarios ...] [--report R.json] [--markdown R.md] "
        "[--examples N] [--replay W.json] [--list]",
    )
    return p


# --------------------------------------------------------------------- commands
def _simulate(args: argparse.Namespace) -> int:
    import json

    from refserve.core.cost import StepCost
    from refserve.core.scheduler import Scheduler
    from refserve.files import atomic_write_text, check_output_file, shown
    from refserve.sim.simulator import StepLimitReached, simulate
    from refserve.sim.trace import load_trace

    # Everything is checked before the first step: options, the trace, the output paths.
    config = config_from_args(args)
    cost = StepCost.parse(args.cost)
    trace = load_trace(args.trace, max_model_len=config.max_model_len)
    json_path = check_output_file(args.json, "--json") if args.json else None
    timeline_path = check_output_file(args.timeline, "--timeline") if args.timeline else None
    trace_path = Path(args.trace) if os.path.exists(args.trace) else None  # else built-in
    _distinct_files({"trace": trace_path, "--json": json_path, "--timeline": timeline_path})
    stopped: StepLimitReached | None = None
    # The per-round table, the timeline and the JSON iterations read every step; without
    # them only the count is kept, so a large trace's memory does not grow with its steps.
    keep_steps = not args.quiet or timeline_path is not None or json_path is not None
    try:
        result = simulate(
            Scheduler(config),
            [t.to_request() for t in trace],
            cost,
            check_invariants=args.check,
            max_steps=args.max_steps,
            keep_steps=keep_steps,
        )
    except StepLimitReached as e:
        # Write what ran (marked incomplete), then end with the typed error.
        result, stopped = e.partial, e
    if not args.quiet:
        print(render_rounds(result))
        print()
    print(render_summary(result))
    if timeline_path is not None:
        from refserve.report.timeline import write_timeline_html

        write_timeline_html(
            timeline_path,
            result.steps,
            config.num_blocks,
            f"refserve simulate {shown(args.trace)}",
        )
        print(f"\ntimeline picture: {shown(args.timeline)}")
    if json_path is not None:
        doc = result_json(result, config, cost)
        doc["complete"] = stopped is None
        # allow_nan=False: the file is standard JSON or it is not written at all.
        atomic_write_text(json_path, json.dumps(doc, indent=2, allow_nan=False) + "\n", "--json")
        print(f"\nwrote {shown(args.json)}")
    if stopped is not None:
        if json_path is not None or timeline_path is not None:
            print("\n(partial result: the run was stopped by --max-steps)")
        raise stopped
    return EXIT_OK


def _distinct_files(paths: dict[str, Path | None]) -> None:
    """Refuse an output that names the input or another output: the atomic rename would
    replace the trace being read, or one output would silently overwrite the other."""
    seen: dict[tuple[int, int] | str, str] = {}
    for what, path in paths.items():
        if path is None:
            continue
        try:
            st = path.stat()
            key: tuple[int, int] | str = (st.st_dev, st.st_ino)
        except (OSError, ValueError):  # not there yet: compare by absolute name
            key = os.path.abspath(path)
        if key in seen:
            raise InvalidArgument(f"{what} and {seen[key]} name the same file")
        seen[key] = what


def _demo(args: argparse.Namespace) -> int:
    if args.simulator:
        return _simulator_demo()
    from refserve.files import check_output_file

    path = check_output_file(args.timeline, "--timeline")
    from refserve.cli.demo import demo_main

    return demo_main(path, proposer_from_args(args))


def _simulator_demo() -> int:
    import refserve.spec.checks as spec_checks
    from refserve.core.config import PolicyName, SchedulerConfig
    from refserve.core.cost import StepCost
    from refserve.core.scheduler import Scheduler
    from refserve.sim.simulator import simulate
    from refserve.sim.trace import load_trace

    print("refserve demo: example 2 (docs/ARCHITECTURE.md) on the cost-model simulator")
    print("(cost 2 + 0.5P + D ms, token budget 4, decode first, then FCFS prefill)\n")
    config = SchedulerConfig(max_num_batched_tokens=4, max_num_seqs=8, block_size=4, num_blocks=64)
    result = simulate(
        Scheduler(config),
        [t.to_request() for t in load_trace("seed002")],
        StepCost.parse("2+0.5P+D"),
        check_invariants=True,
    )
    print(render_rounds(result))
    print()
    print(render_summary(result))
    num_steps = result.num_steps
    print("\nexample 0: decode-only batch of A(2 steps), B(5), C(2, ready after round 2), 2 slots")
    for policy in (PolicyName.STATIC, PolicyName.DECODE_FIRST):
        cfg = SchedulerConfig(
            max_num_batched_tokens=64, max_num_seqs=2, block_size=16, num_blocks=16, policy=policy
        )
        r = simulate(
            Scheduler(cfg),
            [t.to_request() for t in load_trace("seed000_decode")],
            StepCost(1, 0, 0),
            check_invariants=True,
        )
        print(f"  {policy.value:>12}: {len(r.steps)} rounds")
        num_steps += r.num_steps
    # check_invariants raises on a violation, so reaching here means none.
    checks = len(spec_checks.STEP_CHECKS)
    print(
        f"\nchecked: all {num_steps} steps above against the {checks} invariant checks of "
        "refserve.spec.check_step, none violated"
    )
    return EXIT_OK


def _check_kernel_parser() -> argparse.ArgumentParser:
    """``refserve.conformance.kernel_grid``'s own options (copied from its parser, so the two
    never drift apart) behind this CLI's one-line usage errors."""
    from refserve.conformance.kernel_grid import build_parser

    return ArgumentParser(
        prog=f"{PROG} check-kernel", parents=[build_parser()], conflict_handler="resolve"
    )


def _check_kernel_main(argv: list[str]) -> int:
    """Check what can be checked before the grid runs (the target's form, the device,
    the numbers, the output paths), then hand the arguments to the grid unchanged but for
    ``--json``, which gets a temporary name renamed into place only when complete."""
    from refserve.conformance.kernel_grid import (
        check_kernel_main,  # lazy: the core never imports it
    )

    parser = _check_kernel_parser()
    if {"-h", "--help"} & set(argv):
        return check_kernel_main(argv)
    ns = parser.parse_args(argv)
    if getattr(ns, "worker", False) or getattr(ns, "list", False):
        return check_kernel_main(argv)
    if ns.target is None:
        raise UsageError("check-kernel: give the kernel to check as MODULE:FUNCTION")
    _check_kernel_target(ns.target)
    if getattr(ns, "device", None) is not None:
        check_device(ns.device)
    _check_kernel_numbers(ns)
    from refserve.files import check_output_file

    jsonl = getattr(ns, "jsonl", None)
    if jsonl and jsonl != "-":
        # Streamed one record per result, so a partial file is its design; checked only.
        check_output_file(Path(jsonl), "--jsonl")
    if ns.json_path is None:
        return check_kernel_main(argv)
    return _check_kernel_to_json(argv, check_output_file(Path(ns.json_path), "--json"))


def _check_kernel_numbers(ns: argparse.Namespace) -> None:
    """``--timeout`` finite and > 0, ``--atol`` and ``--rtol`` finite and >= 0."""
    for name, least in (("timeout", "> 0"), ("atol", ">= 0"), ("rtol", ">= 0")):
        value = getattr(ns, name, None)
        # NaN passes the grid's own ``<= 0`` check, and a NaN timeout never fires.
        if value is None:
            continue
        if not (math.isfinite(value) and (value > 0 if least == "> 0" else value >= 0)):
            raise InvalidArgument(
                f"check-kernel: --{name} must be a finite number {least}, got {value}"
            )


def _check_kernel_to_json(argv: list[str], final: Path) -> int:
    """Run the grid with its ``--json`` report pointed at a temporary name beside
    ``final``, renamed into place only when the grid wrote it."""
    from refserve.conformance.kernel_grid import check_kernel_main
    from refserve.files import temp_name

    # The grid writes its report with a plain open(): hand it a temporary name beside the
    # real one and rename only a finished report, so Ctrl-C leaves nothing half-written.
    # Abbreviations of --json cannot occur (each is also one of --jsonl).
    tmp = temp_name(final)
    forward = list(argv)
    for i, arg in enumerate(argv):
        if arg == "--json" and i + 1 < len(forward):
            forward[i + 1] = str(tmp)
        elif arg.startswith("--json="):
            forward[i] = f"--json={tmp}"
    try:
        code = check_kernel_main(forward)
        if tmp.exists():
            os.replace(tmp, final)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    return code


_MODULE_NAME = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def _check_kernel_target(target: str) -> None:
    """``MODULE:FUNCTION`` whose top-level package exists. Nothing is imported here: the
    grid loads the kernel in a worker subprocess, so a kernel that crashes on import
    cannot take this process down."""
    import importlib.util

    module_name, colon, function = target.partition(":")
    if not (module_name and colon and function):
        raise InvalidArgument(f"check-kernel: target {clip(target)!r} is not MODULE:FUNCTION")
    if not _MODULE_NAME.match(module_name) or not function.isidentifier():
        raise InvalidArgument(f"check-kernel: {clip(target)!r} is not MODULE:FUNCTION")
    top = module_name.split(".")[0]
    if importlib.util.find_spec(top) is None:
        raise InvalidArgument(f"check-kernel: no module named {top!r} (in {clip(target)!r})")


def _conformance_main(argv: list[str]) -> int:
    from refserve.conformance.cli import conformance_main  # lazy: the core never imports it

    return conformance_main(argv)


# --------------------------------------------------------------------- rendering
def render_rounds(result: SimResult) -> str:
    head = (
        f"{'round':>5} {'start_ms':>9} {'end_ms':>9}  {'P':>5} {'D':>4} {'kv_blocks':>9}  scheduled"
    )
    lines = [head, "-" * len(head)]
    for s in result.steps:
        who = " ".join(f"{rid}:{n}" for rid, n in s.tokens) or "-"
        extra = ""
        if s.outcome.preempted:
            extra += f"  preempted {','.join(s.outcome.preempted)}"
        if s.outcome.finished:
            extra += f"  finished {','.join(s.outcome.finished)}"
        lines.append(
            f"{s.step_index + 1:>5} {s.start_ms:>9.2f} {s.end_ms:>9.2f}  {s.num_prefill_tokens:>5} "
            f"{s.num_decodes:>4} {s.kv_blocks_used:>9}  {who}{extra}"
        )
    return "\n".join(lines)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _pcts(d: dict[str, float | None]) -> str:
    return " ".join(f"{k} {_fmt(d[k])}" for k in ("p50", "p95", "p99"))


def render_summary(result: SimResult) -> str:
    from refserve.core.request_metrics import RequestMetrics
    from refserve.sim.metrics import RunMetrics

    reqs = [RequestMetrics.of(r) for r in result.requests]
    run = RunMetrics.of(reqs, result.makespan_ms)
    head = (
        f"{'request':>8} {'arrival':>8} {'queue':>7} {'TTFT':>7} {'E2E':>8} {'out':>4} "
        f"{'cached':>6} {'preempt':>7}  reason  ITL"
    )
    lines = [head, "-" * len(head)]
    for m in reqs:
        itl = "[" + ", ".join(f"{x:g}" for x in m.itl_ms) + "]"
        lines.append(
            f"{m.request_id:>8} {m.arrival_ms:>8.2f} {_fmt(m.queue_ms):>7} "
            f"{_fmt(m.ttft_ms):>7} {_fmt(m.e2e_ms):>8} {m.num_output_tokens:>4} "
            f"{m.num_cached_tokens:>6} {m.num_preemptions:>7}  {m.finish_reason or '-':6}  {itl}"
        )
    lines += [
        "",
        f"makespan {run.duration_ms:.2f} ms over {result.num_steps} rounds; "
        f"{run.num_finished}/{run.num_requests} requests finished",
        f"throughput: input {run.input_tokens_per_s:.2f} tok/s, "
        f"output {run.output_tokens_per_s:.2f} tok/s, {run.requests_per_s:.2f} req/s",
        f"TTFT ms: {_pcts(run.ttft_ms)}; ITL ms: {_pcts(run.itl_ms)}",
        f"preemptions {run.num_preemptions}, prefix-cached prompt tokens {run.num_cached_tokens}, "
        f"mean requests in system {run.mean_in_system:.3f}",
    ]
    if result.swap is not None:
        lines.append(str(result.swap))
    return "\n".join(lines)


def result_json(result: SimResult, config: SchedulerConfig, cost: StepCost) -> dict[str, object]:
    from dataclasses import asdict

    from refserve.core.request_metrics import RequestMetrics
    from refserve.sim.metrics import RunMetrics

    reqs = [RequestMetrics.of(r) for r in result.requests]
    run = RunMetrics.of(reqs, result.makespan_ms)
    return {
        "config": {
            k: str(v) if not isinstance(v, int | float | bool) else v
            for k, v in asdict(config).items()
        },
        "cost_model": str(cost),
        "requests": [
            {
                **asdict(m),
                "queue_ms": m.queue_ms,
                "ttft_ms": m.ttft_ms,
                "itl_ms": list(m.itl_ms),
                "tpot_ms": m.tpot_ms,
                "e2e_ms": m.e2e_ms,
            }
            for m in reqs
        ],
        "iterations": [
            {
                "round": s.step_index + 1,
                "start_ms": s.start_ms,
                "end_ms": s.end_ms,
                "scheduled": [{"id": rid, "tokens": n} for rid, n in s.tokens],
                "num_prefill_tokens": s.num_prefill_tokens,
                "num_decodes": s.num_decodes,
                "kv_blocks_used": s.kv_blocks_used,
                "preempted": list(s.outcome.preempted),
                "swapped_out": list(s.plan.swapped_out),
                "swapped_in": list(s.plan.swapped_in),
                "finished": list(s.outcome.finished),
            }
            for s in result.steps
        ],
        "summary": asdict(run),
        "swap": None
        if result.swap is None
        else {
            **asdict(result.swap),
            "bytes_out": result.swap.bytes_out,
            "bytes_in": result.swap.bytes_in,
        },
    }


if __name__ == "__main__":
    raise SystemExit(main())
