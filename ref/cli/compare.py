"""``refserve compare``'s command line: parse and check the options, run the comparison
(:func:`refserve.report.compare.run_compare`), print where the report went and each knee.

Limits of the options, checked before anything is built: ``--scale`` in
[``MIN_SCALE``, ``MAX_SCALE``] (scale 1 is example 3's real lengths; below it a session
would outgrow what the simulator replays in reasonable time), rates at most ``MAX_RATE``,
at most ``MAX_REQUESTS`` requests (sessions) in one run (a run's requests are built in
memory up front), SLOs at most ``MAX_SLO_MS``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from refserve.cli.args import (
    MAX_BLOCKS,
    MAX_TOKENS,
    ArgumentParser,
    finite_float,
    int_at_most,
    run_cli,
)
from refserve.core.cost import StepCost
from refserve.errors import InvalidArgument
from refserve.files import check_output_dir, shown
from refserve.report.compare import (
    BASE_CONFIG,
    DEFAULT_COST,
    DEFAULT_SCALE,
    POLICIES,
    TRACES,
    CompareOptions,
    Slo,
    knee_text,
    run_compare,
)

MIN_SCALE, MAX_SCALE = 1.0, 65536.0
MAX_RATE = 10_000.0
MAX_REQUESTS = 100_000
MAX_SLO_MS = 1e9


def _float_list(text: str) -> tuple[float, ...]:
    try:
        rates = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected numbers like 1,2,4; got {text[:60]!r}"
        ) from None
    if not rates or any(not (0 < r <= MAX_RATE) for r in rates):
        raise argparse.ArgumentTypeError(
            f"rates must be finite numbers > 0 and <= {MAX_RATE:g}; got {text[:60]!r}"
        )
    return rates


def _names(text: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(","))
    if not all(names):
        raise argparse.ArgumentTypeError(f"expected names like a,b; got {text[:60]!r}")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"a name is given twice in {text[:60]!r}")
    return names


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="refserve compare",
        description="Compare scheduling policies over example 3's traces and a rate sweep "
        "on the simulator; writes DIR/report.md, DIR/report.json and PNG plots.",
    )
    ms = finite_float(0, MAX_SLO_MS)
    p.add_argument(
        "--out",
        type=Path,
        default=Path("compare-report"),
        help="output folder (default %(default)s)",
    )
    p.add_argument(
        "--rates",
        type=_float_list,
        help=f"rates to sweep for every trace (default: per trace; each <= {MAX_RATE:g})",
    )
    p.add_argument("--quick", action="store_true", help="few requests and rates (seconds)")
    p.add_argument("--traces", type=_names, help=f"subset of {','.join(t.name for t in TRACES)}")
    p.add_argument(
        "--policies", type=_names, help=f"subset of {','.join(x.name for x in POLICIES)}"
    )
    p.add_argument(
        "--requests",
        type=int_at_most(MAX_REQUESTS),
        help=f"requests (sessions for agent) per run (at most {MAX_REQUESTS:,})",
    )
    p.add_argument(
        "--scale",
        type=finite_float(MIN_SCALE, MAX_SCALE),
        default=DEFAULT_SCALE,
        help=f"divide token lengths ({MIN_SCALE:g} to {MAX_SCALE:g}; 1 = example 3's lengths)",
    )
    p.add_argument(
        "--seed",
        type=int_at_most((1 << 63) - 1, lo=-(1 << 63)),
        default=0,
        help="seed of the generated workloads (default %(default)s)",
    )
    p.add_argument("--cost", default=DEFAULT_COST, help="step cost in ms, e.g. '2+0.5P+D'")
    p.add_argument(
        "--ttft-slo-ms",
        type=ms,
        default=None,
        metavar="MS",
        help="goodput: first token within this plus --ttft-slo-per-token-ms per prompt token "
        "(default: the TBT SLO)",
    )
    p.add_argument(
        "--ttft-slo-per-token-ms",
        type=ms,
        default=None,
        metavar="MS",
        help="the time-to-first-token allowance per prompt token (default: 2 x the cost "
        "model's prefill time per token)",
    )
    p.add_argument(
        "--tbt-slo-ms",
        type=finite_float(0, MAX_SLO_MS, lo_open=True),
        default=None,
        metavar="MS",
        help="goodput: no gap between two tokens longer than this (default: 3 x the cost "
        "model's decode-only step of 32 decodes)",
    )
    p.add_argument(
        "--knee",
        type=finite_float(0, 1, lo_open=True),
        default=0.9,
        help="a policy's knee is the first rate whose goodput/offered falls below this, in "
        "(0, 1] (default %(default)s)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int_at_most(MAX_TOKENS),
        default=None,
        metavar="N",
        help="every policy's token budget per step (default: the largest whole number of "
        "blocks whose step with 32 decodes meets the TBT SLO; at most "
        f"{MAX_TOKENS:,})",
    )
    p.add_argument(
        "--num-blocks",
        type=int_at_most(MAX_BLOCKS),
        default=BASE_CONFIG.num_blocks,
        metavar="N",
        help=f"every policy's KV blocks (default %(default)s; at most {MAX_BLOCKS:,}); a "
        "trace with a server of its own (heavy-tight) keeps its own",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument(
        "--full-sweep", action="store_true", help="run every rate even far past a policy's knee"
    )
    return p


_T = TypeVar("_T")


def _pick(
    what: str, names: tuple[str, ...] | None, items: tuple[_T, ...], name_of: Callable[[_T], str]
) -> tuple[_T, ...]:
    if names is None:
        return items
    by_name = {name_of(i): i for i in items}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise InvalidArgument(
            f"unknown {what} {', '.join(unknown)}; choose from {', '.join(by_name)}"
        )
    return tuple(by_name[n] for n in names)


def compare_options(argv: list[str]) -> tuple[CompareOptions, bool]:
    """Parse and check the command line: the options and whether to show progress.
    Nothing is built or written yet (the output folder is created if missing, and
    refused if it cannot hold the report)."""
    args = _parser().parse_args(argv)
    if args.requests is not None and args.requests < 1:
        raise InvalidArgument(f"--requests must be >= 1, got {args.requests}")
    # The SLOs and the budget follow the cost model unless given (refserve.report.compare, "SLOs").
    cost = StepCost.parse(args.cost)
    derived = Slo.of(cost)
    slo = Slo(
        derived.ttft_base_ms if args.ttft_slo_ms is None else args.ttft_slo_ms,
        derived.ttft_per_token_ms
        if args.ttft_slo_per_token_ms is None
        else args.ttft_slo_per_token_ms,
        derived.tbt_ms if args.tbt_slo_ms is None else args.tbt_slo_ms,
    )
    opts = CompareOptions(
        out=args.out,
        traces=_pick("trace", args.traces, TRACES, lambda t: t.name),
        policies=_pick("policy", args.policies, POLICIES, lambda p: p.name),
        rates=args.rates,
        quick=args.quick,
        scale=args.scale,
        seed=args.seed,
        cost=cost,
        slo=slo,
        base=dataclasses.replace(
            BASE_CONFIG,
            max_num_batched_tokens=(
                slo.budget(cost, BASE_CONFIG.block_size)
                if args.max_num_batched_tokens is None
                else args.max_num_batched_tokens
            ),
            num_blocks=args.num_blocks,
        ),
        knee=args.knee,
        num=args.requests,
        stop_after=None if args.full_sweep else 2,
    )
    _check_run_sizes(opts)
    check_output_dir(opts.out, "--out")
    return opts, not args.no_progress


def _check_run_sizes(opts: CompareOptions) -> None:
    """A rate's request count grows with the rate (agent: rate x 20 s); bound it before
    any workload is built."""
    for spec in opts.traces:
        for rate in spec.rates_to_sweep(opts.rates, opts.quick):
            n = spec.num_units(rate, opts.num, opts.quick)
            if n > MAX_REQUESTS:
                raise InvalidArgument(
                    f"--rates {rate:g} asks for {n:,} {spec.name} requests in one run; at "
                    f"most {MAX_REQUESTS:,}"
                )


def _cluster_parser() -> argparse.ArgumentParser:
    from refserve.report.cluster_experiment import POLICIES as CLUSTER_POLICIES
    from refserve.report.cluster_experiment import REPLICA_COUNTS
    from refserve.report.cluster_experiment import TRACES as CLUSTER_TRACES

    p = ArgumentParser(
        prog="refserve compare --cluster",
        description="Compare routing and migration policies on 1 to 8 simulated replicas "
        "(docs/CLUSTER.md, 'The experiment'); writes DIR/cluster.md, DIR/cluster.json and "
        "PNG plots.",
    )
    p.add_argument("--out", type=Path, default=Path("compare-report"), help="output folder")
    p.add_argument(
        "--traces", type=_names, help=f"subset of {','.join(t.name for t in CLUSTER_TRACES)}"
    )
    p.add_argument(
        "--policies", type=_names, help=f"subset of {','.join(x.name for x in CLUSTER_POLICIES)}"
    )
    p.add_argument(
        "--replicas",
        type=_replica_counts,
        default=REPLICA_COUNTS,
        help="replica counts, e.g. 1,2,4,8 (default); each at most 64",
    )
    p.add_argument("--seed", type=int_at_most((1 << 63) - 1, lo=-(1 << 63)), default=0, help="seed")
    p.add_argument("--cost", default=DEFAULT_COST, help="step cost in ms, e.g. '2+0.5P+D'")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--quick", action="store_true", help="two loads and two budgets (seconds)")
    return p


MAX_CLUSTER_REPLICAS = 64


def _replica_counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected counts like 1,2,4; got {text[:60]!r}") from None
    if not counts or any(not 1 <= n <= MAX_CLUSTER_REPLICAS for n in counts):
        raise argparse.ArgumentTypeError(
            f"replica counts must be in [1, {MAX_CLUSTER_REPLICAS}]; got {text[:60]!r}"
        )
    return counts


def cluster_compare_cli(argv: list[str]) -> int:
    """``refserve compare --cluster ...`` (ref/report/cluster_report.py)."""
    from refserve.report import cluster_experiment as ce
    from refserve.report.cluster_experiment import POLICIES as CLUSTER_POLICIES
    from refserve.report.cluster_experiment import TRACES as CLUSTER_TRACES
    from refserve.report.cluster_experiment import ClusterOptions
    from refserve.report.cluster_report import run_cluster_compare

    args = _cluster_parser().parse_args(argv)
    opts = ClusterOptions(
        loads=ce.QUICK_LOADS if args.quick else ce.LOAD_MULTIPLIERS,
        budgets=ce.QUICK_BUDGETS if args.quick else ce.BUDGETS,
        pd_loads=ce.QUICK_PD_LOADS if args.quick else ce.PD_LOADS,
        traces=_pick("trace", args.traces, CLUSTER_TRACES, lambda t: t.name),
        policies=_pick("policy", args.policies, CLUSTER_POLICIES, lambda p: p.name),
        replicas=args.replicas,
        cost=StepCost.parse(args.cost),
        seed=args.seed,
    )
    check_output_dir(args.out, "--out")
    report = run_cluster_compare(opts, args.out, None if args.quiet else sys.stderr)
    plots = report["plots"]
    assert isinstance(plots, list)
    print(f"wrote {shown(args.out / 'cluster.md')} and {shown(args.out / 'cluster.json')}")
    print(f"  {len(plots)} PNG charts in {shown(args.out)}")
    knees = report["knees"]
    assert isinstance(knees, dict)
    for trace, per in knees.items():
        text = ", ".join(f"{n} {'none' if k is None else f'{k:g}x'}" for n, k in per.items())
        print(f"  knee ({trace}, load at 4 replicas): {text}")
    return 0


def compare_cli(argv: list[str]) -> int:
    """``refserve compare ...``: typed errors propagate to :func:`refserve.cli.args.run_cli`.
    With ``--cluster``: :func:`cluster_compare_cli`."""
    if "--cluster" in argv:
        return cluster_compare_cli([a for a in argv if a != "--cluster"])
    opts, progress = compare_options(argv)
    report = run_compare(opts, sys.stderr, progress=progress)
    print(f"wrote {shown(opts.out / 'report.md')} and {shown(opts.out / 'report.json')}")
    plots = report["plots"]
    assert isinstance(plots, dict)
    charts = [name for per in plots.values() for name in per.values()]
    print(f"  {len(charts)} PNG charts in {shown(opts.out)}: {', '.join(charts)}")
    knees, traces = report["knees"], report["traces"]
    assert isinstance(knees, dict) and isinstance(traces, list)
    for t in traces:
        per_policy = knees[t["name"]]
        text = ", ".join(f"{n} {knee_text(k, t['rates'])}" for n, k in per_policy.items())
        print(f"  knee ({t['name']}, {t['rate_unit']}): {text}")
    return 0


def compare_main(argv: list[str]) -> int:
    """``refserve compare [--out DIR] [--rates R1,R2,...] [--quick] ...``; returns an exit code."""
    debug = "--debug" in argv
    return run_cli(lambda: compare_cli([a for a in argv if a != "--debug"]), debug=debug)


if __name__ == "__main__":
    raise SystemExit(compare_main(sys.argv[1:]))
