"""What a finished ``refserve compare`` found, as one record, and its ``report.json``
document (docs/ARCHITECTURE.md, example 3); :mod:`refserve.report.markdown` renders the same
record as ``report.md``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from refserve.report.jct import JctFindings, jct_findings
from refserve.report.plots import ChartFiles
from refserve.report.policies import mlfq_swap_cost
from refserve.report.swap_comparison import (
    SWAP_CONFIG,
    SWAP_COST,
    SWAP_KV_BYTES_PER_TOKEN,
    SWAP_TRACE,
    SwapResult,
)
from refserve.report.sweep import CompareOptions, SweepResult


@dataclass(frozen=True)
class CompareOutcome:
    """The sweep, the recompute-vs-swap runs, the charts drawn from them, and the knees."""

    opts: CompareOptions
    sweep: SweepResult
    swap: tuple[SwapResult, ...]
    plots: ChartFiles
    wall_s: float  # the sweep and the swap runs, wall clock
    knees: dict[str, dict[str, float | None]]  # trace -> policy -> knee rate
    causes: dict[str, dict[str, str | None]]  # trace -> policy -> what bound at the knee
    jct: JctFindings | None = None  # MLFQ's job completion time findings (None: not run)

    @classmethod
    def of(
        cls,
        opts: CompareOptions,
        sweep: SweepResult,
        swap: tuple[SwapResult, ...],
        plots: ChartFiles,
        wall_s: float,
    ) -> CompareOutcome:
        return cls(
            opts,
            sweep,
            swap,
            plots,
            wall_s,
            knees=sweep.knees(opts.knee),
            causes=sweep.knee_causes(opts.knee),
            jct=jct_findings(sweep, mlfq_swap_cost(opts.scale, opts.cost)),
        )


def report_json(outcome: CompareOutcome) -> dict[str, object]:
    """``report.json``: the settings, every run's numbers, the knees and the swap runs."""
    sweep = outcome.sweep
    return {
        "settings": _settings_json(outcome),
        "traces": [
            {
                "name": t.spec.name,
                "description": t.spec.description,
                "rate_unit": t.spec.rate_unit,
                "rates": list(t.rates),
                # None: the comparison's server (settings.base_config).
                "server": None if t.spec.server is None else dataclasses.asdict(t.spec.server),
            }
            for t in sweep.plan
        ],
        "policies": [{"name": p.name, "description": p.description} for p in sweep.policies],
        "skipped_policies": [
            {"name": p.name, "needs": list(p.requires), "description": p.description}
            for p in sweep.skipped
        ],
        "knees": outcome.knees,
        "knee_causes": outcome.causes,
        "stopped_early": sweep.stopped,
        "plots": outcome.plots,
        "points": [dataclasses.asdict(p) for p in sweep.points],
        "jct": None if outcome.jct is None else dataclasses.asdict(outcome.jct),
        "swap_vs_recompute": {
            "trace": SWAP_TRACE,
            "cost_model": SWAP_COST,
            "kv_bytes_per_token": SWAP_KV_BYTES_PER_TOKEN,
            "num_blocks": SWAP_CONFIG.num_blocks,
            "runs": [dataclasses.asdict(r) for r in outcome.swap],
        },
    }


def _settings_json(outcome: CompareOutcome) -> dict[str, object]:
    opts = outcome.opts
    return {
        "cost_model": str(opts.cost),
        "scale": opts.scale,
        "seed": opts.seed,
        "quick": opts.quick,
        "knee_threshold": opts.knee,
        "slo": dataclasses.asdict(opts.slo),
        "base_config": {
            k: v if isinstance(v, int | float | bool) else str(v)
            for k, v in dataclasses.asdict(opts.base).items()
        },
        "wall_s": round(outcome.wall_s, 3),
    }
