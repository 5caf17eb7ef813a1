"""The ``refserve`` command line: ``simulate``, ``demo``, ``check-kernel``.

Subcommands that need ``conformance`` import it lazily so the core never depends on it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from ref.config import Admission, PolicyName, SchedulerConfig
from ref.cost_model import CostModel
from ref.errors import RefserveError
from ref.metrics import RequestMetrics, RunMetrics
from ref.scheduler import Scheduler
from ref.sim import SimResult, simulate
from ref.swap import PreemptionMode, SwapCostModel
from ref.trace import BUILTIN, load_trace


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # These own their whole argument list: argparse cannot hand options that come first
    # to a REMAINDER positional.
    if argv[:1] == ["conformance"]:
        return _conformance_main(argv[1:])
    if argv[:1] == ["check-kernel"]:
        return _check_kernel_main(argv[1:])
    if argv[:1] == ["compare"]:
        from ref.compare import compare_main

        return compare_main(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.func(args)
    except RefserveError as e:
        print(f"refserve: error: {e}", file=sys.stderr)
        return 2
    return code


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="refserve", description=__doc__)
    sub = p.add_subparsers(required=True, metavar="COMMAND")

    sim = sub.add_parser("simulate", help="replay a JSONL trace on the cost-model simulator")
    sim.add_argument(
        "trace", help=f"path to a JSONL trace, or a built-in one: {', '.join(BUILTIN)}"
    )
    _add_config_args(sim)
    sim.add_argument("--json", type=Path, help="write timelines, iterations and summary here")
    sim.add_argument("--quiet", action="store_true", help="summary only, no per-round table")
    sim.add_argument("--timeline", type=Path, help="write a timeline picture (self-contained HTML)")
    sim.set_defaults(func=_simulate)

    demo = sub.add_parser(
        "demo", help="the main job: the tiny model on a mixed workload, every step checked"
    )
    demo.add_argument("--timeline", type=Path, default=Path("out/demo-timeline.html"))
    demo.add_argument(
        "--simulator", action="store_true", help="the seed scenarios on the simulator instead"
    )
    demo.set_defaults(func=_demo)

    from ref.generate_cli import add_generate_parser

    add_generate_parser(sub)

    ck = sub.add_parser("check-kernel", help="run the kernel grid against the dense oracle")
    ck.add_argument(
        "rest", nargs=argparse.REMAINDER, help="MODULE:FUNCTION [--layout vllm] [--json OUT]"
    )
    ck.set_defaults(func=_check_kernel)
    cmp = sub.add_parser(
        "compare", help="compare scheduling policies over built-in traces and a rate sweep"
    )
    cmp.add_argument("rest", nargs=argparse.REMAINDER, help="[--out DIR] [--rates ...] [--quick]")
    conf = sub.add_parser(
        "conformance", help="check an engine's scheduler and KV manager against the spec"
    )
    conf.add_argument(
        "rest",
        nargs=argparse.REMAINDER,
        help="--adapter MODULE:FACTORY [--scenarios ...] [--report R.json] [--markdown R.md] "
        "[--examples N] [--replay W.json] [--list]",
    )
    conf.set_defaults(func=_conformance)
    return p


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=4096)
    p.add_argument("--max-model-len", type=int, default=1 << 20)
    p.add_argument(
        "--cost", default="2+0.5P+D", help="step cost in ms, e.g. '2+0.5P+D' (K: KV read)"
    )
    p.add_argument(
        "--policy", choices=[x.value for x in PolicyName], default=PolicyName.DECODE_FIRST.value
    )
    p.add_argument(
        "--admission", choices=[x.value for x in Admission], default=Admission.FIRST_CHUNK.value
    )
    p.add_argument("--watermark-blocks", type=int, default=0)
    p.add_argument(
        "--align-chunks", action="store_true", help="end partial chunks on block boundaries"
    )
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--no-chunked-prefill", action="store_true")
    p.add_argument(
        "--preemption-mode",
        choices=[x.value for x in PreemptionMode],
        default=PreemptionMode.RECOMPUTE.value,
        help="swap/auto need --num-host-blocks; auto also --kv-bytes-per-token",
    )
    p.add_argument("--num-host-blocks", type=int, default=0, help="host swap pool size")
    p.add_argument(
        "--kv-bytes-per-token",
        type=int,
        help="K+V bytes of one token over all layers (prices swap; e.g. 524288 for a 7B fp16)",
    )
    p.add_argument("--swap-link-gbps", type=float, default=25.0, help="host link GB/s")
    p.add_argument(
        "--check", action="store_true", help="check every spec invariant after every step"
    )


def _config(args: argparse.Namespace) -> SchedulerConfig:
    return SchedulerConfig(
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        enable_chunked_prefill=not args.no_chunked_prefill,
        align_chunks_to_blocks=args.align_chunks,
        admission=Admission(args.admission),
        watermark_blocks=args.watermark_blocks,
        policy=PolicyName(args.policy),
        preemption_mode=PreemptionMode(args.preemption_mode),
        num_host_blocks=args.num_host_blocks,
        swap_cost=(
            SwapCostModel(
                args.kv_bytes_per_token,
                args.swap_link_gbps,
                iteration=CostModel.parse(args.cost),
            )
            if args.kv_bytes_per_token is not None
            else None
        ),
    )


def _simulate(args: argparse.Namespace) -> int:
    config = _config(args)
    cost = CostModel.parse(args.cost)
    trace = load_trace(args.trace)
    result = simulate(
        Scheduler(config), [t.to_request() for t in trace], cost, check_invariants=args.check
    )
    if not args.quiet:
        print(render_rounds(result))
        print()
    print(render_summary(result))
    if args.timeline:
        from ref.timeline import write_timeline_html

        write_timeline_html(
            args.timeline, result.steps, config.num_blocks, f"refserve simulate {args.trace}"
        )
        print(f"\ntimeline picture: {args.timeline}")
    if args.json:
        args.json.write_text(
            json.dumps(result_json(result, config, cost), indent=2) + "\n", encoding="utf-8"
        )
        print(f"\nwrote {args.json}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    if not args.simulator:
        from ref.engine import demo_main

        args.timeline.parent.mkdir(parents=True, exist_ok=True)
        return demo_main(args.timeline)
    return _simulator_demo()


def _simulator_demo() -> int:
    print("refserve demo: seed 002's worked example on the cost-model simulator")
    print("(cost 2 + 0.5P + D ms, token budget 4, decode first, then FCFS prefill)\n")
    config = SchedulerConfig(max_num_batched_tokens=4, max_num_seqs=8, block_size=4, num_blocks=64)
    result = simulate(
        Scheduler(config),
        [t.to_request() for t in load_trace("seed002")],
        CostModel.parse("2+0.5P+D"),
        check_invariants=True,
    )
    print(render_rounds(result))
    print()
    print(render_summary(result))
    print("\nseed 000: decode-only batch of A(2 steps), B(5), C(2, ready after round 2), 2 slots")
    for policy in (PolicyName.STATIC, PolicyName.DECODE_FIRST):
        cfg = SchedulerConfig(
            max_num_batched_tokens=64, max_num_seqs=2, block_size=16, num_blocks=16, policy=policy
        )
        r = simulate(
            Scheduler(cfg),
            [t.to_request() for t in load_trace("seed000_decode")],
            CostModel(1, 0, 0),
            check_invariants=True,
        )
        print(f"  {policy.value:>12}: {len(r.steps)} rounds")
    print("\nevery step above was checked against all spec invariants")
    return 0


def _check_kernel(args: argparse.Namespace) -> int:
    return _check_kernel_main(list(args.rest))


def _check_kernel_main(argv: list[str]) -> int:
    from conformance.kernel_grid import check_kernel_main  # lazy: the core never imports it

    return check_kernel_main(argv)


def _conformance(args: argparse.Namespace) -> int:
    return _conformance_main(list(args.rest))


def _conformance_main(argv: list[str]) -> int:
    from conformance.cli import conformance_main  # lazy: the core never imports it

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
        if s.events.preempted:
            extra += f"  preempted {','.join(s.events.preempted)}"
        if s.events.finished:
            extra += f"  finished {','.join(s.events.finished)}"
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
        f"makespan {run.duration_ms:.2f} ms over {len(result.steps)} rounds; "
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


def result_json(result: SimResult, config: SchedulerConfig, cost: CostModel) -> dict[str, object]:
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
                "preempted": list(s.events.preempted),
                "swapped_out": list(s.plan.swapped_out),
                "swapped_in": list(s.plan.swapped_in),
                "finished": list(s.events.finished),
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
