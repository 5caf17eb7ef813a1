"""The job-completion-time section of ``refserve compare``'s ``report.md``: per trace, JCT
P50 / P95 of FCFS, the decode-first policies, MLFQ and its ablations at every swept rate,
then what the figures say (:mod:`refserve.report.jct`): where MLFQ beats the others, and
how much of its gain the skip-join and the proactive swap account for; on a trace with a
constrained server of its own (``heavy-tight``), also the mlfq policies' displacements
and swaps at every rate and the findings rate by rate. Every sentence is computed from
the sweep."""

from __future__ import annotations

from collections.abc import Sequence

from refserve.report.jct import (
    BASELINES,
    JCT_POLICIES,
    MLFQ,
    RATE_BASELINES,
    TIE,
    Ablation,
    JctFindings,
    JctPair,
    LinkPrice,
    MlfqActivity,
    RateFindings,
)
from refserve.report.policies import MLFQ_LINK_GB_PER_S
from refserve.report.sweep import PlannedTrace, SweepResult


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
            lines += _activity_table(planned, [x for x in findings.per_rate if x.trace == name])
    if findings is not None:
        lines += _findings(sweep, findings)
    return lines


def _server_text(planned: PlannedTrace) -> str:
    server = planned.spec.server
    assert server is not None
    return f"{server.max_num_seqs} seats, {server.num_blocks} KV blocks"


def _activity_table(planned: PlannedTrace, per_rate: Sequence[RateFindings]) -> list[str]:
    """The mlfq policies' moves at each rate of a trace with its own server."""
    if not per_rate:
        return []
    lines = [
        "",
        f"The mlfq policies' moves on **{planned.spec.name}** ({_server_text(planned)}): "
        "requests displaced by the policy (of them, moved out for the running requests' "
        "headroom), all preemptions (the displaced and the engine's own for want of a "
        "block), requests whose K/V went to the host, blocks copied out / in, and the "
        f"bytes moved both ways with their time on the {MLFQ_LINK_GB_PER_S:g} GB/s link "
        "(priced into the steps they ran in).",
        "",
        "| rate | policy | displaced (headroom) | preemptions | swapped out | "
        "blocks out / in | GB moved | link s |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for found in per_rate:
        lines += [
            f"| {found.rate:g} | {a.policy} | {a.displaced} ({a.headroom_swaps}) | "
            f"{a.preemptions} | {a.swapped_out} | {a.swap_blocks_out} / {a.swap_blocks_in} | "
            f"{a.swap_bytes / 1e9:,.1f} | {_link_s(a):,.2f} |"
            for a in found.activity
        ]
    return lines


def _link_s(a: MlfqActivity) -> float:
    return a.swap_bytes / (MLFQ_LINK_GB_PER_S * 1e9)


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
    for planned in sweep.plan:
        mine = [x for x in f.per_rate if x.trace == planned.spec.name]
        if mine:
            lines += _per_rate_findings(planned, mine, f.link)
    return lines


def _verdict_rates(per_rate: Sequence[RateFindings], other: str, which: str) -> str:
    """The rates at which mlfq's JCT ``which`` beat ``other``'s."""
    rates = [
        f"{x.rate:g}"
        for x in per_rate
        if (p := x.against(other)) is not None and getattr(p, which) == "better"
    ]
    return _list(rates)


def _per_rate_findings(
    planned: PlannedTrace, per_rate: Sequence[RateFindings], link: LinkPrice | None
) -> list[str]:
    name = planned.spec.name
    price = (
        ""
        if link is None
        else f" Moving one simulated token's K/V out and back costs {link.round_trip_ms:.2f} "
        f"ms of link time, recomputing it {link.recompute_ms:.2f} ms; the copies are "
        "priced into the step they run in, stalling every request of that step."
    )
    lines = [
        "",
        f"**On {name}'s constrained server** ({_server_text(planned)}), rate by rate "
        f"({planned.spec.rate_unit}; the same workload for every policy at a rate). "
        "An ablation's share is the part of mlfq's JCT gain over prefix-aware that "
        "turning the ingredient off loses (none to share where mlfq has no gain). The "
        "proactive swap's ablation, mlfq-recompute, has no host pool: every displaced "
        "request drops its K/V and recomputes it when it is back, and no running request "
        "is moved out for headroom." + price,
        "",
    ]
    for other in RATE_BASELINES:
        if any(x.against(other) is not None for x in per_rate):
            lines.append(
                f"- **mlfq vs {other}**: lower JCT P50 at "
                f"{_verdict_rates(per_rate, other, 'p50')}; lower P95 at "
                f"{_verdict_rates(per_rate, other, 'p95')}."
            )
    lines += [f"- **@ {x.rate:g}**: {_rate_text(x)}" for x in per_rate]
    return lines


def _effect(verdict: str, which: str) -> str:
    """What an ingredient does to ``which``, from mlfq's verdict against the policy
    without it."""
    return {"better": f"lowers {which}", "worse": f"raises {which}"}.get(
        verdict, f"leaves {which} within {TIE:.0%}"
    )


def _share_short(share: float | None) -> str:
    if share is None:
        return "none to share"
    if share > 1:
        return f"{share:.0%}, more than mlfq's whole gain"
    if share < 0:
        return f"{share:.0%}: mlfq gains more without it"
    return f"{share:.0%}"


def _rate_ablation_text(label: str, a: Ablation | None) -> str:
    if a is None:
        return f"the {label}: not compared (a policy did not run at this rate)"
    p = a.pair
    return (
        f"the {label} {_effect(p.p50, 'P50')} and {_effect(p.p95, 'P95')} (without it "
        f"{_ms(p.other_p50_ms)} / {_ms(p.other_p95_ms)} ms; share of the gain P50 "
        f"{_share_short(a.share_p50)}, P95 {_share_short(a.share_p95)})"
    )


def _moves_text(a: MlfqActivity) -> str:
    moved = (
        f", {a.swapped_out} swapped out ({a.swap_blocks_out} blocks out, "
        f"{a.swap_blocks_in} in, {a.swap_bytes / 1e9:,.1f} GB, {_link_s(a):,.2f} s on the link)"
        if a.swapped_out or a.swap_blocks_in
        else ", nothing swapped"
    )
    return (
        f"{a.policy} displaced {a.displaced} ({a.headroom_swaps} for headroom), "
        f"{a.preemptions} preemptions{moved}"
    )


def _rate_text(x: RateFindings) -> str:
    mine = next((a for a in x.activity if a.policy == MLFQ), None)
    jcts = []
    if x.versus:
        first = x.versus[0]
        jcts.append(f"JCT P50 / P95 mlfq {_ms(first.p50_ms)} / {_ms(first.p95_ms)} ms")
    jcts += [
        f"{p.other} {_ms(p.other_p50_ms)} / {_ms(p.other_p95_ms)} (mlfq {p.p50} / {p.p95})"
        for p in x.versus
    ]
    parts = [
        ", ".join(jcts) if jcts else "no baseline ran at this rate",
        _rate_ablation_text("skip-join", x.skip_join),
        _rate_ablation_text("proactive swap", x.proactive_swap),
    ]
    if mine is not None and mine.displaced == 0 and mine.preemptions == 0:
        parts.append("mlfq displaced nobody here, so its ablations can only tie")
    parts.append("; ".join(_moves_text(a) for a in x.activity))
    return "; ".join(parts) + "."


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
            f"{planned.spec.name} {sum(p.displaced or 0 for p in mine)} displaced, "
            f"{sum(p.preemptions for p in mine)} preemptions, "
            f"{sum(p.swapped_out for p in mine)} swapped out, "
            f"{swap_steps / steps if steps else 0.0:.1%} of steps with a swap"
        )
    return [
        f"- **mlfq's preemptions and swaps** over its sweep: {'; '.join(per_trace)}.",
    ]
