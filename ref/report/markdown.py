"""``report.md`` of ``refserve compare`` (docs/ARCHITECTURE.md, example 3): the settings,
the policies, the knee of each policy on each trace and what limits it, every run's row,
and the recompute-vs-swap table; one function per section."""

from __future__ import annotations

from collections.abc import Sequence

from refserve.report.analysis import BOUND_FLOOR, KV_FULL, NO_LIMIT, PointResult
from refserve.report.jct_markdown import jct_markdown
from refserve.report.outcome import CompareOutcome
from refserve.report.policies import NamedPolicy
from refserve.report.swap_comparison import (
    SWAP_CONFIG,
    SWAP_COST,
    SWAP_HOST_BLOCKS,
    SWAP_KV_BYTES_PER_TOKEN,
    SWAP_TRACE,
    SwapResult,
)
from refserve.report.sweep import STOP_BELOW, PlannedTrace


def knee_text(knee: float | None, rates: Sequence[float]) -> str:
    """``> max`` when no swept rate fell below, ``<= min`` when already the first did."""
    if knee is None:
        return f"> {max(rates):g}"
    return f"<= {knee:g}" if knee == min(rates) else f"{knee:g}"


def _f(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def _pct(x: float) -> str:
    return f"{100 * x:.0f} %"


def render_markdown(outcome: CompareOutcome) -> str:
    lines = _header(outcome)
    lines += _policies(outcome)
    lines += _knee_table(outcome)
    lines += _summary(outcome)
    for planned in outcome.sweep.plan:
        lines += _trace_section(outcome, planned)
    lines += jct_markdown(outcome.sweep, outcome.jct)
    lines += _notes(outcome)
    lines += _swap_markdown(outcome.swap, outcome.plots)
    return "\n".join(lines)


def _header(outcome: CompareOutcome) -> list[str]:
    opts = outcome.opts
    slo, base = opts.slo, opts.base
    return [
        "# refserve compare: scheduling policies over example 3's traces",
        "",
        f"Simulator, cost model `{opts.cost}` ms per step (P prefill tokens, D decodes), "
        f"token lengths divided by {opts.scale:g} (scale), seed {opts.seed}"
        f"{', quick run' if opts.quick else ''}; {len(outcome.sweep.points)} runs in "
        f"{outcome.wall_s:.1f} s.",
        f"Engine: token budget {base.max_num_batched_tokens}, block {base.block_size}, "
        f"{base.num_blocks} KV blocks, max {base.max_num_seqs} running requests"
        f"{_own_servers(outcome)}. Times are the simulator's virtual ms.",
        "",
        f"SLOs per request: TTFT <= {slo.ttft_base_ms:g} ms + {slo.ttft_per_token_ms:g} ms "
        f"x prompt tokens; every gap between tokens (TBT) <= {slo.tbt_ms:g} ms. "
        "**Goodput** = requests/s meeting both (= SLO attainment x offered rate; for agent "
        "sessions the offered request rate is measured: turns over the span of their "
        "arrivals, since a turn waits for its predecessor and the tool). "
        f"**Knee**: the first swept rate where goodput / offered < {opts.knee:g}.",
        "",
    ]


def _own_servers(outcome: CompareOutcome) -> str:
    """The traces that run on a server of their own, and its limits."""
    own = [
        f"{t.spec.name} {t.spec.server.max_num_seqs} running requests and "
        f"{t.spec.server.num_blocks} KV blocks"
        for t in outcome.sweep.plan
        if t.spec.server is not None
    ]
    return f" (except {'; '.join(own)})" if own else ""


def _policies(outcome: CompareOutcome) -> list[str]:
    lines = ["## Policies", ""]
    lines += [f"- **{p.name}**: {p.description}" for p in outcome.sweep.policies]
    lines += [
        f"- ~~{p.name}~~ skipped: this checkout's SchedulerConfig has no "
        f"{', '.join(p.requires)} ({p.description})"
        for p in outcome.sweep.skipped
    ]
    return lines


def _knee_table(outcome: CompareOutcome) -> list[str]:
    policies = outcome.sweep.policies
    lines = ["", f"## Knee rates (first rate where goodput / offered < {outcome.opts.knee:g})", ""]
    head = "| trace | unit | " + " | ".join(p.name for p in policies) + " |"
    lines += [head, "|" + "---|" * (len(policies) + 2)]
    for planned in outcome.sweep.plan:
        spec = planned.spec
        knees = outcome.knees[spec.name]
        cells = [knee_text(knees[p.name], planned.rates) for p in policies]
        lines.append(f"| {spec.name} | {spec.rate_unit} | " + " | ".join(cells) + " |")
    return lines


def _summary(outcome: CompareOutcome) -> list[str]:
    lines = [
        "",
        "## Summary",
        "",
        "Per trace and policy: the knee and **what limits it** (the engine limit that "
        "bound in the most steps of the run at the knee rate: token budget, max sequences, "
        f"KV blocks (a preemption or >= {KV_FULL:.0%} of the pool in use) or swap "
        f"bandwidth; `{NO_LIMIT}` when none bound in {BOUND_FLOOR:.0%} of steps, i.e. the "
        "SLO failed on how long steps take, not on a full resource, with the SLO missed "
        "by more requests in brackets: TBT, a prefill chunk made the step too long for "
        "the decodes in it; TTFT, prompts queued behind others' prefill), the highest swept "
        "rate still at or above the threshold, the peak goodput over the sweep, P99 TTFT / "
        "P99 TBT at the last good rate, tenant fairness at the knee (or the highest rate "
        "run when there is none), and the share of requests "
        "over the whole sweep that did not finish normally (rejected or capacity / OOM).",
        "",
        "| trace | policy | knee | knee cause | last good rate | peak goodput req/s (at rate) | "
        "P99 TTFT ms | P99 TBT ms | fairness at knee | rejected / OOM | preemptions |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for planned in outcome.sweep.plan:
        lines += [_summary_row(outcome, planned, pol) for pol in outcome.sweep.policies]
    return lines


def _summary_row(outcome: CompareOutcome, planned: PlannedTrace, pol: NamedPolicy) -> str:
    """One policy on one trace: its knee and cause, the last good rate, the peak goodput."""
    name = planned.spec.name
    row = sorted(outcome.sweep.runs_of(name, pol.name), key=lambda x: x.rate)
    k = outcome.knees[name][pol.name]
    last = _last_good(row, k)
    peak = max(row, key=lambda x: x.goodput_rps)
    cause = outcome.causes.get(name, {}).get(pol.name)
    asked = max(sum(x.num_requests for x in row), 1)
    failed = sum(x.rejected for x in row)
    oom = sum(round(x.capacity_rate * x.num_requests) for x in row)
    # Fairness where it is tested: at the knee (or the top of the sweep).
    strained = next((x for x in row if x.rate == k), row[-1])
    return (
        f"| {name} | {pol.name} | "
        f"{knee_text(k, planned.rates)} | {cause or '-'} | "
        f"{'-' if last is None else f'{last.rate:g}'} | "
        f"{peak.goodput_rps:.2f} ({peak.rate:g}) | "
        f"{_f(None if last is None else last.ttft_p99_ms)} | "
        f"{_f(None if last is None else last.tbt_p99_ms)} | "
        f"{_f(strained.fairness, 2)} | "
        f"{_pct(failed / asked)} / {_pct(oom / asked)} | "
        f"{sum(x.preemptions for x in row)} |"
    )


def _last_good(row: Sequence[PointResult], knee: float | None) -> PointResult | None:
    """The run at the highest swept rate below the knee (all of them without a knee)."""
    good = [x for x in row if knee is None or x.rate < knee]
    return good[-1] if good else None


def _trace_section(outcome: CompareOutcome, planned: PlannedTrace) -> list[str]:
    spec = planned.spec
    charts = outcome.plots[spec.name]
    lines = [
        "",
        f"## {spec.name}",
        "",
        spec.description + ".",
        "",
        f"![goodput vs rate, {spec.name}]({charts['goodput']}) "
        f"![P99 TTFT vs rate, {spec.name}]({charts['ttft_p99']})",
        "",
        f"| policy | rate ({spec.rate_unit}) | offered req/s | TTFT p50 | p95 | p99 ms | "
        "TBT p99 ms | JCT p50 | p95 ms | out tok/s | SLO met | goodput req/s | fairness | "
        "rejected | OOM | "
        "preempted | prefix hit | steps at budget / max seqs / KV full |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for pol in outcome.sweep.policies:
        runs = sorted(outcome.sweep.runs_of(spec.name, pol.name), key=lambda x: x.rate)
        lines += [_run_row(r) for r in runs]
    return lines


def _run_row(r: PointResult) -> str:
    return (
        f"| {r.policy} | {r.rate:g} | {r.offered_rps:.2f} | {_f(r.ttft_p50_ms)} | "
        f"{_f(r.ttft_p95_ms)} | {_f(r.ttft_p99_ms)} | {_f(r.tbt_p99_ms)} | "
        f"{_f(r.jct_p50_ms)} | {_f(r.jct_p95_ms)} | "
        f"{r.output_tokens_per_s:,.0f} | {100 * r.slo_attainment:.0f} % | "
        f"{r.goodput_rps:.2f} | {_f(r.fairness, 2)} | {r.rejected} | "
        f"{_pct(r.capacity_rate)} | {r.preemptions} | "
        f"{100 * r.prefix_hit_rate:.0f} % | {_pct(r.limits.token_budget)} / "
        f"{_pct(r.limits.max_seqs)} / {_pct(r.limits.kv_blocks)} |"
    )


def _notes(outcome: CompareOutcome) -> list[str]:
    stopped = outcome.sweep.stopped
    where = "; ".join(f"{t} {p} from {r:g}" for t, per in stopped.items() for p, r in per.items())
    return [
        "",
        "Rows stop where a policy had SLO attainment below "
        f"{STOP_BELOW:.0%} at {outcome.opts.stop_after} rates in a row (far past its knee; "
        "`--full-sweep` runs them all)" + (f": {where}" if stopped else "") + ".",
        "",
        "Rejected: requests that did not finish normally (capacity or timeout finishes; "
        "none of these policies sets a queue bound or timeout); OOM: the share that "
        "finished `capacity` (could never fit in the pool). Prefix hit: prompt tokens "
        "found in the prefix cache / all prompt tokens. Fairness: Jain's index over the "
        "tenants' SLO attainment (1 = every tenant equally served, 1/n = one tenant gets "
        "all); chat has one tenant per application, mixed two (chat, long), agent one per "
        "session, long a single one (-).",
        "",
    ]


def _swap_markdown(swap: Sequence[SwapResult], plots: dict[str, dict[str, str]]) -> list[str]:
    if not swap:
        return []
    base = swap[0]
    lines = [
        "## Recompute vs swap",
        "",
        f"Trace `{SWAP_TRACE}` (12 requests of 600-1600 prompt and 200-500 output tokens), "
        f"a {SWAP_CONFIG.num_blocks}-block pool, cost `{SWAP_COST}` ms per step, "
        f"{SWAP_KV_BYTES_PER_TOKEN // 1024} KiB of KV per token (a 7B-like model), "
        f"{SWAP_HOST_BLOCKS} host blocks; `auto` swaps only when the round trip is "
        "cheaper than recomputing. Real token lengths (no scale).",
        "",
        f"![recompute vs swap]({plots['swap']['latency']})",
        "",
        "| mode | makespan ms (vs recompute) | TTFT p50 | p99 ms | ITL p50 | p99 ms | "
        "E2E p99 ms | preemptions | swapped out |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in swap:
        lines.append(
            f"| {r.label} | {r.makespan_ms:,.0f} ({r.makespan_ms / base.makespan_ms:.3f}x) | "
            f"{_f(r.ttft_p50_ms)} | {_f(r.ttft_p99_ms)} | {_f(r.itl_p50_ms)} | "
            f"{_f(r.itl_p99_ms)} | {_f(r.e2e_p99_ms)} | {r.preemptions} | {r.swapped_out} |"
        )
    lines.append("")
    return lines
