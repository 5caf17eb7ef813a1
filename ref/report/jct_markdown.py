"""The job-completion-time section of ``refserve compare``'s ``report.md``: per trace, JCT
P50 / P95 of FCFS, the decode-first policies, MLFQ and its ablations at every swept rate,
then what the figures say (:mod:`refserve.report.jct`): where MLFQ beats the others, and
how much of its gain the skip-join and the proactive swap account for. Every sentence is
computed from the sweep."""

from __future__ import annotations

from collections.abc import Sequence

from refserve.report.jct import (
    BASELINES,
    JCT_POLICIES,
    MLFQ,
    TIE,
    Ablation,
    JctFindings,
    JctPair,
)
from refserve.report.sweep import SweepResult


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def _ratio(mine: float, theirs: float) -> str:
    """``theirs / mine``: how many times faster mlfq is (below 1: slower)."""
    return f"{theirs / mine:.2f}x" if mine > 0 else "-"


def _list(items: Sequence[str]) -> str:
    return ", ".join(items) if items else "none"


def jct_markdown(sweep: SweepResult, findings: JctFindings | None) -> list[str]:
    """The section; empty when the sweep ran none of the JCT policies."""
    ran = [n for n in JCT_POLICIES if any(p.name == n for p in sweep.policies)]
    if not ran:
        return []
    lines = [
        "",
        "## Job completion time",
        "",
        "JCT = finish - arrival of each request that finished normally, P50 / P95 in "
        "virtual ms, for FCFS, the decode-first policies (chunked, prefix-aware) and the "
        "skip-join MLFQ with its two ablations ('-': not run at that rate, past the "
        "policy's knee).",
    ]
    for planned in sweep.plan:
        name = planned.spec.name
        lines += [
            "",
            f"**{name}** ({planned.spec.rate_unit})",
            "",
            "| rate | " + " | ".join(ran) + " |",
            "|---:|" + "---:|" * len(ran),
        ]
        for rate in planned.rates:
            cells = []
            for pol in ran:
                run = next((p for p in sweep.runs_of(name, pol) if p.rate == rate), None)
                cells.append(
                    "-" if run is None else f"{_ms(run.jct_p50_ms)} / {_ms(run.jct_p95_ms)}"
                )
            lines.append(f"| {rate:g} | " + " | ".join(cells) + " |")
    if findings is not None:
        lines += _findings(sweep, findings)
    return lines


def _findings(sweep: SweepResult, f: JctFindings) -> list[str]:
    lines = [
        "",
        "### What the JCT figures say",
        "",
        "Each comparison is at the highest rate where both policies were run (same "
        f"workload); a difference within {TIE:.0%} is a tie.",
        "",
    ]
    for other in BASELINES:
        pairs = [p for p in f.versus if p.other == other]
        if not pairs:
            continue
        lines.append(
            f"- **mlfq vs {other}**: lower JCT P50 on {_list(f.beats(other, 'p50'))}; "
            f"lower P95 on {_list(f.beats(other, 'p95'))}. "
            + "; ".join(_pair_text(p) for p in pairs)
            + "."
        )
    for label, found in (("skip-join", f.skip_join), ("proactive swap", f.proactive_swap)):
        if found:
            lines.append(f"- **the {label}**: " + "; ".join(_ablation_text(a) for a in found) + ".")
    lines += _activity(sweep)
    return lines


def _pair_text(p: JctPair) -> str:
    return (
        f"{p.trace} @ {p.rate:g}: P50 {_ms(p.p50_ms)} vs {_ms(p.other_p50_ms)} ms "
        f"({_ratio(p.p50_ms, p.other_p50_ms)}), P95 {_ms(p.p95_ms)} vs "
        f"{_ms(p.other_p95_ms)} ms ({_ratio(p.p95_ms, p.other_p95_ms)})"
    )


def _share_text(share: float | None) -> str:
    return "no gain over prefix-aware to share" if share is None else f"{share:.0%} of the gain"


def _ablation_text(a: Ablation) -> str:
    p = a.pair
    return (
        f"{p.trace} @ {p.rate:g}: without it P50 {_ms(p.other_p50_ms)} vs {_ms(p.p50_ms)} ms "
        f"({_share_text(a.share_p50)}), P95 {_ms(p.other_p95_ms)} vs {_ms(p.p95_ms)} ms "
        f"({_share_text(a.share_p95)})"
    )


def _activity(sweep: SweepResult) -> list[str]:
    """How often mlfq preempted and moved K/V over the host link, over its whole sweep:
    the mechanisms its ablations take away can only matter where they fired."""
    runs = [p for p in sweep.points if p.policy == MLFQ]
    if not runs:
        return []
    per_trace = []
    for planned in sweep.plan:
        mine = [p for p in runs if p.trace == planned.spec.name]
        if not mine:
            continue
        swap_steps = sum(p.limits.swap * p.num_steps for p in mine)
        steps = sum(p.num_steps for p in mine)
        per_trace.append(
            f"{planned.spec.name} {sum(p.preemptions for p in mine)} preemptions, "
            f"{swap_steps / steps if steps else 0.0:.1%} of steps with a swap"
        )
    return [
        f"- **mlfq's preemptions and swaps** over its sweep: {'; '.join(per_trace)}.",
    ]
