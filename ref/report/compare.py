"""``refserve compare``: scheduler policies over example 3's traces and a request-rate sweep.

The experiment of docs/ARCHITECTURE.md, example 3: the same traces (short chat, long prompt,
agent multi-turn, plus a chat stream with a few long prompts mixed in, and a trace of
heavy-tailed output lengths), a fixed request-rate sweep, and several scheduling policies
(among them the skip-join MLFQ and two ablations of it); report P50/P95/P99 TTFT, P99 TBT,
job completion time P50/P95, tokens/s, goodput, rejections, preemptions and the MLFQ
policies' displacements and swaps, and find where goodput bends as the rate rises.

Everything runs on the cost-model simulator (same scheduler and engine core as the real
engine). Choices, all overridable from the command line:

- **Cost model**: example 2's ``2 + 0.5P + D`` ms. With the default ``--scale 16`` one
  simulated token stands for 16 real ones, so 0.5 ms per simulated prefill token is about
  31 us per real token: roughly an 8B model on one H100/H200-class GPU. Decode and the
  fixed per-step term are teaching numbers, not a fit; every time in the report is the
  simulator's virtual ms on this model.
- **Scale**: token lengths are divided by ``--scale`` (see :mod:`refserve.sim.workloads`); times
  (arrivals, tool waits) are not.
- **SLOs from the cost model** ``a + b*P + c*D`` (as in :mod:`refserve.report.cluster_experiment`;
  :meth:`~refserve.report.policies.Slo.of`): TBT SLO = 3 x the decode-only step of 32 decodes,
  ``3 * (a + 32c)`` = 102 ms by default (a mixed step may cost up to three decode-only
  steps); TTFT SLO = the TBT SLO + 2 x the prompt's own prefill time ``b*P`` (a long
  prompt is not failed for being long). ``--tbt-slo-ms`` and the TTFT options override.
- **Engine**: the token budget is derived from the TBT SLO: the largest multiple of the
  block size whose step with 32 decodes, ``a + b*B + 32c``, meets it (128 by default;
  ``--max-num-batched-tokens`` overrides); block 16, 4096 KV blocks (65,536 simulated
  tokens, about 1M real tokens at scale 16), at most 256 running requests; a trace may
  bring a server of its own (``heavy-tight``: the heavy trace on 16 seats and 132
  blocks, where the MLFQ policies displace and swap). The budget is
  also a policy parameter: ``chunked-4B`` runs chunked prefill at 4 x the budget (512),
  where a full chunk alone makes a 258 ms step, over the TBT SLO.
- **Chat** comes from 8 applications, each with its own 2K-token system prompt (128
  simulated tokens, before a ~64-token question): every prompt needs two chunks, and the
  prefix cache has a shared prefix per application to reuse.
- **Goodput**: ``goodput = SLO attainment x offered rate`` (requests/s that meet both SLOs;
  never above the offered rate); also output tokens/s of requests that meet them. For
  agent sessions the offered request rate is measured (turns / span of their arrivals):
  a turn arrives only after its predecessor finished plus the tool wait. The
  **knee** of a policy is the first swept rate whose attainment (goodput / offered) falls
  below ``--knee`` (0.9).

Policies are a list of :class:`NamedPolicy`; add one by appending to :data:`POLICIES`. A
policy that needs a :class:`~refserve.core.config.SchedulerConfig` field this checkout lacks is
skipped and named in the report. ``slo-aware`` uses SLO-aware chunk sizing with the
simulator's cost model as the iteration model.

This module runs the comparison and writes its report, and is the package's public face
for it; the parts live beside it: :mod:`refserve.report.policies` (SLOs and policies),
:mod:`refserve.report.workload_specs` (the traces), :mod:`refserve.report.sweep` (the runs),
:mod:`refserve.report.analysis` (limits, fairness, knees), :mod:`refserve.report.jct` and
:mod:`refserve.report.jct_markdown` (job completion time), :mod:`refserve.report.swap_comparison`,
:mod:`refserve.report.outcome` (``report.json``), :mod:`refserve.report.markdown` (``report.md``)
and :mod:`refserve.report.plots` (the PNGs). The command line is :mod:`refserve.cli.compare`.
"""

from __future__ import annotations

import json
import time
from typing import TextIO

from refserve.files import atomic_write_text, check_output_dir
from refserve.report.analysis import (
    BOUND_FLOOR,
    KV_FULL,
    NO_LIMIT,
    LimitFractions,
    PointResult,
    knee_cause,
    knee_point,
    knee_rate,
    limit_fractions,
    tenant_fairness,
)
from refserve.report.markdown import knee_text, render_markdown
from refserve.report.outcome import CompareOutcome, report_json
from refserve.report.plots import write_compare_plots
from refserve.report.policies import POLICIES, NamedPolicy, Slo
from refserve.report.swap_comparison import SwapResult, run_swap_comparison
from refserve.report.sweep import (
    BASE_CONFIG,
    DEFAULT_COST,
    DEFAULT_SCALE,
    STOP_BELOW,
    CompareOptions,
    PlannedTrace,
    SweepResult,
    run_point,
    run_sweep,
)
from refserve.report.workload_specs import TRACES, TraceSpec

__all__ = [
    "BASE_CONFIG",
    "BOUND_FLOOR",
    "DEFAULT_COST",
    "DEFAULT_SCALE",
    "KV_FULL",
    "NO_LIMIT",
    "POLICIES",
    "STOP_BELOW",
    "TRACES",
    "CompareOptions",
    "CompareOutcome",
    "LimitFractions",
    "NamedPolicy",
    "PlannedTrace",
    "PointResult",
    "Slo",
    "SwapResult",
    "SweepResult",
    "TraceSpec",
    "knee_cause",
    "knee_point",
    "knee_rate",
    "knee_text",
    "limit_fractions",
    "run_compare",
    "run_point",
    "tenant_fairness",
]


def run_compare(
    opts: CompareOptions, stream: TextIO, *, progress: bool = True
) -> dict[str, object]:
    """Run the sweep, write ``report.md``, ``report.json`` and the PNG plots; return the JSON."""
    started = time.perf_counter()
    sweep = run_sweep(opts, stream, progress=progress)
    swap = tuple(run_swap_comparison())
    wall = time.perf_counter() - started
    check_output_dir(opts.out, "--out")  # checked before the sweep too; it may have gone
    plots = write_compare_plots(opts.out, sweep, swap)
    outcome = CompareOutcome.of(opts, sweep, swap, plots, wall)
    report = report_json(outcome)
    # Each file goes to a temporary name first: Ctrl-C never leaves half of one. Strict
    # JSON (allow_nan=False): a non-finite number is a bug to report, not a file to write.
    atomic_write_text(
        opts.out / "report.json", json.dumps(report, indent=2, allow_nan=False) + "\n", "--out"
    )
    atomic_write_text(opts.out / "report.md", render_markdown(outcome), "--out")
    return report
