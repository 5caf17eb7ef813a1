"""``refserve kv-layouts``: capacity and goodput against context length for several KV
layouts at one memory, on the simulator, and by default capacity and CPU throughput on
the real engine running a tiny hybrid model (``--no-engine`` leaves that part out;
:mod:`refserve.report.kv_layouts_report`; the committed report is
docs/kv_layouts/report.md, written by ``refserve kv-layouts --out docs/kv_layouts``).

Every option is checked before anything runs: the lists and numbers here, their
meaning (a context that never fits, a load out of range, an unknown layout) by the
settings records, which raise :class:`~refserve.errors.InvalidArgument` naming the field.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from refserve.cli.args import (
    MAX_BLOCK_SIZE,
    MAX_BLOCKS,
    MAX_SEQS,
    MAX_TOKENS,
    add_command,
    clip,
    finite_float,
    int_at_most,
)
from refserve.core.cost import StepCost
from refserve.errors import InvalidArgument
from refserve.files import check_output_dir, shown

if TYPE_CHECKING:
    from refserve.report.kv_layouts_engine import EngineExperiment
    from refserve.report.kv_layouts_report import KVLayoutsOptions
    from refserve.sim.kv_layouts import KVLayout

#: The longest prompt one run takes (a run builds its prompts' tokens in memory).
MAX_CONTEXT = 1 << 20
MAX_SLO_MS = 1e9
MAX_GOODPUT_REQUESTS = 20_000
DEFAULT_WINDOW = 1024
DEFAULT_RATIO = 4
#: ``--quick``: three short contexts on a small pool (seconds).
QUICK: dict[str, Any] = {
    "contexts": (256, 1024, 4096),
    "output_len": 32,
    "window": 256,
    "dense_blocks": 512,
    "goodput_requests": 20,
}


def _contexts(text: str) -> tuple[int, ...]:
    parts = [x.strip() for x in text.split(",")]
    try:
        values = tuple(int(x) for x in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected prompt lengths like 1024,4096; got {clip(text)!r}"
        ) from None
    if any(not 1 <= v <= MAX_CONTEXT for v in values):
        raise argparse.ArgumentTypeError(
            f"prompt lengths must be ints in [1, {MAX_CONTEXT}]; got {clip(text)!r}"
        )
    return values


def _names(text: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(","))
    if not all(names):
        raise argparse.ArgumentTypeError(
            f"expected names like dense,hybrid-1:1; got {clip(text)!r}"
        )
    return names


def _trace(text: str) -> tuple[str, int]:
    layout, sep, context = text.rpartition("@")
    try:
        n = int(context)
    except ValueError:
        n = 0
    if not sep or not layout or n < 1:
        raise argparse.ArgumentTypeError(
            f"expected LAYOUT@CONTEXT like dense@4096; got {clip(text)!r}"
        )
    return layout, n


def add_kv_layouts_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``kv-layouts`` subcommand to an ``add_subparsers()`` object."""
    p = add_command(
        sub,
        "kv-layouts",
        "capacity and goodput against context length for dense, hybrid and compressed KV "
        "layouts at one memory, on the simulator; writes DIR/report.md, DIR/report.json and "
        "PNG plots",
    )
    ms = finite_float(0, MAX_SLO_MS)
    p.add_argument(
        "--out",
        type=Path,
        default=Path("kv-layouts-report"),
        help="output folder (default %(default)s)",
    )
    p.add_argument(
        "--contexts",
        type=_contexts,
        help="prompt lengths, e.g. 1024,4096 (default 1024,2048,4096,8192,16384,32768)",
    )
    p.add_argument("--output-len", type=int_at_most(MAX_TOKENS), help="output tokens (default 128)")
    p.add_argument(
        "--window",
        type=int_at_most(MAX_CONTEXT),
        help="the hybrid layouts' sliding window in tokens (default 1024)",
    )
    p.add_argument(
        "--ratio",
        type=int_at_most(MAX_CONTEXT),
        help="the compressed layout's tokens per K/V entry (default 4)",
    )
    p.add_argument(
        "--layouts",
        type=_names,
        help="a subset of dense,hybrid-1:1,hybrid-5:1,compressed-rRATIO, the first the "
        "baseline (default all)",
    )
    p.add_argument(
        "--dense-blocks",
        type=int_at_most(MAX_BLOCKS),
        metavar="N",
        help="the KV memory in dense blocks (default 4608: 73,728 tokens at block 16)",
    )
    p.add_argument(
        "--block-size", type=int_at_most(MAX_BLOCK_SIZE), help="tokens per block (default 16)"
    )
    p.add_argument("--cost", help="step cost in ms, e.g. '5+0.03P+0.1D' (the default)")
    p.add_argument(
        "--capacity-budget",
        type=int_at_most(MAX_TOKENS),
        metavar="N",
        help="the capacity runs' token budget per step (default 8192)",
    )
    p.add_argument(
        "--goodput-budget",
        type=int_at_most(MAX_TOKENS),
        metavar="N",
        help="the goodput runs' token budget per step (default 2048)",
    )
    p.add_argument(
        "--max-num-seqs", type=int_at_most(MAX_SEQS), help="running requests at most (default 1024)"
    )
    p.add_argument(
        "--load",
        type=finite_float(0, 10, lo_open=True),
        help="goodput arrival rate as a share of the prompts' prefill rate (default 0.6)",
    )
    p.add_argument(
        "--goodput-requests",
        type=int_at_most(MAX_GOODPUT_REQUESTS),
        metavar="N",
        help=f"requests per goodput run (default 100; at most {MAX_GOODPUT_REQUESTS:,})",
    )
    p.add_argument(
        "--seed", type=int_at_most((1 << 63) - 1, lo=-(1 << 63)), default=0, help="seed (default 0)"
    )
    p.add_argument("--ttft-slo-ms", type=ms, metavar="MS", help="TTFT SLO base (default 500)")
    p.add_argument(
        "--ttft-slo-per-token-ms",
        type=ms,
        metavar="MS",
        help="TTFT allowance per prompt token (default 2 x the cost model's prefill time)",
    )
    p.add_argument(
        "--tbt-slo-ms",
        type=finite_float(0, MAX_SLO_MS, lo_open=True),
        metavar="MS",
        help="no gap between two tokens longer than this (default 100)",
    )
    p.add_argument(
        "--trace",
        type=_trace,
        metavar="LAYOUT@CONTEXT",
        help="the capacity run plotted step by step (default: the layout of the most "
        "groups at the middle context)",
    )
    p.add_argument(
        "--engine",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also measure the real engine on a tiny hybrid model, on CPU, in seconds "
        "(default on; --no-engine: the simulator alone)",
    )
    p.add_argument(
        "--engine-contexts",
        type=_contexts,
        help="the engine part's prompt lengths (default 64,128,256,512; at most 8192)",
    )
    p.add_argument(
        "--engine-dense-blocks",
        type=int_at_most(MAX_BLOCKS),
        metavar="N",
        help="the engine part's KV memory in dense blocks (default 512: 4,096 tokens at block 8)",
    )
    p.add_argument(
        "--engine-window",
        type=int_at_most(MAX_CONTEXT),
        help="the engine model's sliding window in tokens (default 32)",
    )
    p.add_argument(
        "--engine-threads",
        type=int_at_most(256),
        help="torch threads for the engine part (default 1)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="three short contexts, a small pool (the simulator; the engine part keeps its sizes)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=run_kv_layouts_cli)
    return p


#: The options that replace a field of the experiment's settings when given.
FIELDS = (
    "contexts",
    "output_len",
    "dense_blocks",
    "block_size",
    "capacity_budget",
    "goodput_budget",
    "max_num_seqs",
    "load",
    "goodput_requests",
)


def options_from_args(args: argparse.Namespace) -> KVLayoutsOptions:
    """The run's :class:`~refserve.report.kv_layouts_report.KVLayoutsOptions`, checked;
    the output folder is created (or refused) too, nothing else is written."""
    from refserve.report.kv_layouts_report import KVLayoutsOptions, default_slo
    from refserve.report.policies import Slo
    from refserve.sim.kv_layouts import LayoutExperiment

    given: dict[str, Any] = dict(QUICK) if args.quick else {}
    given.update({k: getattr(args, k) for k in FIELDS if getattr(args, k) is not None})
    window = given.pop("window", DEFAULT_WINDOW)  # --quick's, else the default
    layouts = _layouts(args, window if args.window is None else args.window)
    if args.cost is not None:
        given["cost"] = StepCost.parse(args.cost)
    exp = LayoutExperiment(layouts, seed=args.seed, **given)
    derived = default_slo(exp)
    slo = Slo(
        derived.ttft_base_ms if args.ttft_slo_ms is None else args.ttft_slo_ms,
        derived.ttft_per_token_ms
        if args.ttft_slo_per_token_ms is None
        else args.ttft_slo_per_token_ms,
        derived.tbt_ms if args.tbt_slo_ms is None else args.tbt_slo_ms,
    )
    opts = KVLayoutsOptions(exp, slo, args.out, args.trace, command_line(args), _engine(args))
    check_output_dir(opts.out, "--out")
    return opts


def _layouts(args: argparse.Namespace, window: int) -> tuple[KVLayout, ...]:
    """The standard layouts at ``window``, or those ``--layouts`` names, in its order."""
    from refserve.sim.kv_layouts import standard_layouts

    if window < 1:
        raise InvalidArgument(f"--window must be an int >= 1 token, got {window}")
    ratio = DEFAULT_RATIO if args.ratio is None else args.ratio
    if ratio < 2:
        raise InvalidArgument(f"--ratio must be an int >= 2 tokens per entry, got {ratio}")
    layouts = standard_layouts(window, ratio)
    if args.layouts is None:
        return layouts
    by_name = {x.name: x for x in layouts}
    unknown = [n for n in args.layouts if n not in by_name]
    if unknown:
        raise InvalidArgument(
            f"--layouts: unknown layout {', '.join(unknown)}; choose from {', '.join(by_name)}"
        )
    return tuple(by_name[n] for n in args.layouts)


#: The engine part's options and the field of EngineExperiment each sets.
ENGINE_FIELDS = {
    "engine_contexts": "contexts",
    "engine_dense_blocks": "dense_blocks",
    "engine_window": "window",
    "engine_threads": "threads",
}


def _engine(args: argparse.Namespace) -> EngineExperiment | None:
    """The engine part's settings, or None under ``--no-engine`` (which refuses the
    engine part's options: they would do nothing)."""
    from refserve.report.kv_layouts_engine import EngineExperiment

    given = {f: getattr(args, dest) for dest, f in ENGINE_FIELDS.items()}
    given = {f: v for f, v in given.items() if v is not None}
    if not args.engine:
        if given:
            named = ", ".join(
                f"--{d.replace('_', '-')}" for d in ENGINE_FIELDS if getattr(args, d) is not None
            )
            raise InvalidArgument(f"{named}: set for the engine part, but --no-engine drops it")
        return None
    try:
        return EngineExperiment(seed=args.seed, **given)
    except InvalidArgument as e:
        raise InvalidArgument(f"the engine part (--engine-*): {e}") from None


def command_line(args: argparse.Namespace) -> str:
    """The command line that measures what ``args`` asks for, options in one order:
    the report names it (``refserve kv-layouts --out docs/kv_layouts`` for the
    committed one)."""
    parts = ["refserve", "kv-layouts"]
    if args.quick:
        parts.append("--quick")
    for dest in ("contexts", "output_len", "window", "ratio", "layouts", *FIELDS[2:], "cost"):
        value = getattr(args, dest)
        if value is not None:
            text = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
            parts += [f"--{dest.replace('_', '-')}", shlex.quote(text)]
    if args.seed:
        parts += ["--seed", str(args.seed)]
    for dest in ("ttft_slo_ms", "ttft_slo_per_token_ms", "tbt_slo_ms"):
        if getattr(args, dest) is not None:
            parts += [f"--{dest.replace('_', '-')}", f"{getattr(args, dest):g}"]
    if args.trace is not None:
        parts += ["--trace", shlex.quote(f"{args.trace[0]}@{args.trace[1]}")]
    if not args.engine:
        parts.append("--no-engine")
    for dest in ENGINE_FIELDS:
        value = getattr(args, dest)
        if value is not None:
            text = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
            parts += [f"--{dest.replace('_', '-')}", shlex.quote(text)]
    return " ".join([*parts, "--out", shlex.quote(args.out.as_posix())])


def run_kv_layouts_cli(args: argparse.Namespace) -> int:
    """``refserve kv-layouts ...``: typed errors propagate to the CLI's error surface."""
    from refserve.report.kv_layouts_report import run_kv_layouts

    opts = options_from_args(args)
    report = run_kv_layouts(opts, None if args.quiet else sys.stderr)
    print(f"wrote {shown(opts.out / 'report.md')} and {shown(opts.out / 'report.json')}")
    plots = report["plots"]
    assert isinstance(plots, dict)
    print(f"  {len(plots)} PNG charts in {shown(opts.out)}: {', '.join(plots.values())}")
    return 0
