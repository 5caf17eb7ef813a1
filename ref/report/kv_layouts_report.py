"""``refserve kv-layouts``: capacity and goodput against context length for several KV
layouts at one memory, and the admission's block count against the pool's, on the
cost-model simulator (the runs: :mod:`refserve.sim.kv_layouts`, whose doc states the
memory model) and, unless told not to, capacity, CPU wall-clock throughput and the same
block count on the real engine running a tiny hybrid model
(:mod:`refserve.report.kv_layouts_engine`). Writes ``report.json``, ``report.md``
(rendered from the JSON by :mod:`refserve.report.kv_layouts_markdown`) and the PNG
charts (three for the simulator, two for the engine).

The JSON keeps each measuring source's tables apart (``sources``: the simulator, then
the real engine with its own settings and layouts, ``kind`` telling them apart), so one
source's tables never change another's.

Goodput: a request counts when it finished normally, its first token came within
``Slo.ttft_limit_ms`` of its arrival and no gap between two of its tokens passed the
TBT SLO (:class:`refserve.report.policies.Slo`); goodput = SLO attainment x the offered
rate, as in ``refserve compare``. Ratios are against the experiment's first layout
(dense), measured in the same run on the same arrivals.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from refserve.core.request_metrics import RequestMetrics
from refserve.errors import InvalidArgument
from refserve.files import atomic_write_text, check_output_dir
from refserve.report.kv_layouts_engine import EngineExperiment, EngineMeasured, measure_engine
from refserve.report.kv_layouts_markdown import render_markdown
from refserve.report.plots import new_figure, write_png
from refserve.report.policies import Slo
from refserve.sim.kv_layouts import (
    CapacityAdmission,
    KVLayout,
    LayoutExperiment,
    LoopFigures,
    LoopRun,
    StepSample,
    run_capacity,
    run_goodput,
)
from refserve.sim.metrics import percentile

#: The command that regenerates the committed report (docs/kv_layouts/).
COMMAND = "refserve kv-layouts --out docs/kv_layouts"
#: The goodput SLOs' defaults: TTFT base and TBT in ms (the TTFT allowance per prompt
#: token is ``TTFT_PREFILL_MULTIPLE`` x the cost model's prefill time per token).
TTFT_BASE_MS = 500.0
TBT_MS = 100.0
TTFT_PREFILL_MULTIPLE = 2.0
SIMULATOR = "simulator"
ENGINE = "real engine"
PLOTS = {
    "capacity": "capacity_vs_context.png",
    "goodput": "goodput_vs_context.png",
    "estimate": "estimate_vs_held.png",
}
ENGINE_PLOTS = {
    "engine_capacity": "engine_capacity_vs_context.png",
    "engine_throughput": "engine_throughput_vs_context.png",
}


def default_slo(exp: LayoutExperiment) -> Slo:
    return Slo(TTFT_BASE_MS, TTFT_PREFILL_MULTIPLE * exp.cost.b, TBT_MS)


@dataclass(frozen=True)
class KVLayoutsOptions:
    """What to run and where the report goes; ``trace`` is the capacity run whose every
    step is plotted (layout name, context), by default the layout of the most groups (the
    first of them) at the middle context length; ``command`` the command line the report
    says measured it; ``engine`` the real engine's part (None: the simulator alone)."""

    exp: LayoutExperiment
    slo: Slo
    out: Path
    trace: tuple[str, int] | None = None
    command: str = COMMAND  # the command line that measures this report
    engine: EngineExperiment | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.exp, LayoutExperiment) or not isinstance(self.slo, Slo):
            raise InvalidArgument("KVLayoutsOptions needs a LayoutExperiment and an Slo")
        if self.engine is not None and not isinstance(self.engine, EngineExperiment):
            raise InvalidArgument(
                f"KVLayoutsOptions.engine must be an EngineExperiment or None, got {self.engine!r}"
            )
        for name in ("ttft_base_ms", "ttft_per_token_ms", "tbt_ms"):
            value = getattr(self.slo, name)
            if not (math.isfinite(value) and value >= 0):
                raise InvalidArgument(f"slo.{name} must be a finite number >= 0, got {value!r}")
        if not self.slo.tbt_ms > 0:
            raise InvalidArgument(f"slo.tbt_ms must be > 0, got {self.slo.tbt_ms!r}")
        layout, context = self.trace_point
        if layout not in {x.name for x in self.exp.layouts} or context not in self.exp.contexts:
            raise InvalidArgument(
                f"trace {layout}@{context}: not a layout and context of the experiment"
            )

    @property
    def trace_point(self) -> tuple[str, int]:
        if self.trace is not None:
            return self.trace
        contexts = self.exp.contexts
        most = max(self.exp.layouts, key=lambda x: len(x.groups))
        return most.name, contexts[len(contexts) // 2]


@dataclass(frozen=True)
class CapacityPoint:
    """One layout at one context length: the analytic bound beside both closed loops."""

    layout: str
    context: int
    num_blocks: int
    peak_blocks: int
    bound: int
    chunk_peak_blocks: int
    chunk_bound: int
    concurrency: int
    num_requests: int
    reserve_peak: LoopFigures
    sequence: LoopFigures


@dataclass(frozen=True)
class GoodputPoint:
    """One layout at one context length on the open-loop trace."""

    layout: str
    context: int
    rate_rps: float
    num_requests: int
    num_finished: int
    slo_attainment: float
    goodput_rps: float
    goodput_tokens_per_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tbt_p99_ms: float | None
    ttft_miss_rate: float
    tbt_miss_rate: float
    preemptions: int
    makespan_ms: float
    goodput_ratio: float | None = None  # to the baseline layout's (None: it had none)


def goodput_point(exp: LayoutExperiment, slo: Slo, layout: KVLayout, context: int) -> GoodputPoint:
    """Run and judge one open loop (module doc)."""
    result = run_goodput(exp, layout, context)
    reqs = [RequestMetrics.of(r) for r in result.requests]
    n = len(reqs)
    met = [m for m in reqs if slo.met(m)]
    secs = result.makespan_ms / 1e3
    rate = exp.rate_rps(context)
    attainment = len(met) / n
    ttfts = [t for m in reqs if (t := m.ttft_ms) is not None]
    return GoodputPoint(
        layout=layout.name,
        context=context,
        rate_rps=rate,
        num_requests=n,
        num_finished=sum(m.finish_reason in ("stop", "length") for m in reqs),
        slo_attainment=attainment,
        goodput_rps=attainment * rate,
        goodput_tokens_per_s=sum(m.num_output_tokens for m in met) / secs if secs > 0 else 0.0,
        ttft_p50_ms=percentile(ttfts, 50),
        ttft_p99_ms=percentile(ttfts, 99),
        tbt_p99_ms=percentile([x for m in reqs for x in m.itl_ms], 99),
        ttft_miss_rate=sum(not slo.ttft_met(m) for m in reqs) / n,
        tbt_miss_rate=sum(not slo.tbt_met(m) for m in reqs) / n,
        preemptions=sum(m.num_preemptions for m in reqs),
        makespan_ms=result.makespan_ms,
    )


def with_ratios(points: Sequence[GoodputPoint], baseline: str) -> list[GoodputPoint]:
    """Each point with its goodput over the baseline layout's at the same context."""
    base = {p.context: p.goodput_rps for p in points if p.layout == baseline}
    return [
        dataclasses.replace(
            p, goodput_ratio=p.goodput_rps / base[p.context] if base.get(p.context) else None
        )
        for p in points
    ]


@dataclass(frozen=True)
class Measured:
    """Every run of one source."""

    capacity: tuple[CapacityPoint, ...]
    goodput: tuple[GoodputPoint, ...]
    trace: tuple[StepSample, ...]  # the plotted capacity run's steps
    engine: EngineMeasured | None = None  # the real engine's runs, when asked for


def measure(opts: KVLayoutsOptions, stream: TextIO | None = None) -> Measured:
    """Every capacity and goodput run, context by context, then the engine's."""
    exp = opts.exp
    capacity: list[CapacityPoint] = []
    goodput: list[GoodputPoint] = []
    trace: tuple[StepSample, ...] = ()
    for context in exp.contexts:
        for layout in exp.layouts:
            started = time.perf_counter()
            runs = {a: run_capacity(exp, layout, context, a) for a in CapacityAdmission}
            capacity.append(_capacity_point(exp, layout, context, runs))
            if (layout.name, context) == opts.trace_point:
                trace = runs[CapacityAdmission.RESERVE_PEAK].samples
            goodput.append(goodput_point(exp, opts.slo, layout, context))
            if stream is not None:
                c, g = capacity[-1], goodput[-1]
                print(
                    f"  {context:>6} tokens {layout.name:<12} bound {c.bound:>4} "
                    f"ran {c.reserve_peak.max_running:>4}  goodput {g.goodput_rps:8.3f}/s "
                    f"({time.perf_counter() - started:.1f} s)",
                    file=stream,
                    flush=True,
                )
    engine = None if opts.engine is None else measure_engine(opts.engine, stream)
    return Measured(tuple(capacity), tuple(with_ratios(goodput, exp.baseline.name)), trace, engine)


def _capacity_point(
    exp: LayoutExperiment,
    layout: KVLayout,
    context: int,
    runs: dict[CapacityAdmission, LoopRun],
) -> CapacityPoint:
    return CapacityPoint(
        layout=layout.name,
        context=context,
        num_blocks=layout.num_blocks(exp.dense_blocks),
        peak_blocks=layout.peak(context + exp.output_len, exp.block_size),
        bound=exp.bound(layout, context),
        chunk_peak_blocks=exp.chunk_peak(layout, context),
        chunk_bound=exp.chunk_bound(layout, context),
        concurrency=exp.concurrency(layout, context),
        num_requests=exp.capacity_requests(layout, context),
        reserve_peak=runs[CapacityAdmission.RESERVE_PEAK].figures,
        sequence=runs[CapacityAdmission.SEQUENCE].figures,
    )


# ------------------------------------------------------------------------------- JSON
def estimate_rows(
    capacity: Sequence[CapacityPoint], layouts: Sequence[KVLayout]
) -> list[dict[str, object]]:
    """Per layout, over every capacity run of it (both admissions): the largest,
    smallest and mean (per step) gap of the pool's used blocks to each estimate."""
    return [
        gap_row(
            layout.name,
            [f for p in capacity if p.layout == layout.name for f in (p.reserve_peak, p.sequence)],
        )
        for layout in layouts
    ]


def gap_row(layout: str, runs: Sequence[LoopFigures]) -> dict[str, object]:
    """One layout's row of the estimate table over ``runs``."""
    steps = sum(f.num_steps for f in runs)
    row: dict[str, object] = {"layout": layout, "runs": len(runs), "steps": steps}
    for key in ("gap", "gap_now"):
        gaps = [getattr(f, key) for f in runs]
        row[key] = {
            "max_gap": max((g.max_gap for g in gaps), default=0),
            "min_gap": min((g.min_gap for g in gaps), default=0),
            "mean_gap": sum(g.mean_gap * f.num_steps for g, f in zip(gaps, runs, strict=True))
            / steps
            if steps
            else 0.0,
        }
    return row


def report_json(opts: KVLayoutsOptions, measured: Measured, wall_s: float) -> dict[str, object]:
    """``report.json``: the settings, the layouts and each source's tables."""
    exp = opts.exp
    layout, context = opts.trace_point
    return {
        "title": "Memory per token is not a constant: KV layouts at one memory",
        "command": opts.command,
        "settings": _settings(opts, wall_s),
        "layouts": [_layout_json(x, exp) for x in exp.layouts],
        "sources": [
            {
                "name": SIMULATOR,
                "description": "the real scheduler with the cost-model executor "
                "(ref/sim/simulator.py), prefix caching off",
                "capacity": [dataclasses.asdict(p) for p in measured.capacity],
                "goodput": [dataclasses.asdict(p) for p in measured.goodput],
                "estimate": estimate_rows(measured.capacity, exp.layouts),
                "estimate_trace": {
                    "layout": layout,
                    "context": context,
                    "admission": str(CapacityAdmission.RESERVE_PEAK),
                    "step": [s.step_index for s in measured.trace],
                    "used_blocks": [s.used_blocks for s in measured.trace],
                    "estimate_blocks": [s.estimate_blocks for s in measured.trace],
                    "estimate_now_blocks": [s.estimate_now_blocks for s in measured.trace],
                    "running": [s.running for s in measured.trace],
                },
            },
            *([] if measured.engine is None else [engine_json(opts, measured.engine)]),
        ],
        "plots": dict(PLOTS) | ({} if measured.engine is None else ENGINE_PLOTS),
    }


def engine_json(opts: KVLayoutsOptions, measured: EngineMeasured) -> dict[str, object]:
    """The real engine's entry of ``sources``: its settings (the model, the memory, the
    CPU), its layouts, a capacity point per layout and prompt length, the estimate rows
    over its runs and the greedy outputs compared."""
    exp = opts.engine
    assert exp is not None
    cfg = exp.model_config()
    points = measured.points
    return {
        "name": ENGINE,
        "kind": "engine",
        "description": "refserve's engine (LLMEngine, ref/engine/llm_engine.py) running a "
        "tiny random-weight hybrid Qwen2 on CPU, greedy, prefix caching off",
        "settings": {
            "contexts": list(exp.contexts),
            "output_len": exp.output_len,
            "block_size": exp.block_size,
            "dense_blocks": exp.dense_blocks,
            "dense_tokens": exp.dense_blocks * exp.block_size,
            "capacity_budget": exp.capacity_budget,
            "admission": str(CapacityAdmission.RESERVE_PEAK),
            "model": {
                "model_type": cfg.model_type,
                "num_layers": cfg.num_layers,
                "sliding_layers": sum(
                    cfg.layer_window(i) is not None for i in range(cfg.num_layers)
                ),
                "window": exp.window,
                "hidden_size": cfg.hidden_size,
                "num_heads": cfg.num_heads,
                "num_kv_heads": cfg.num_kv_heads,
                "head_dim": cfg.head_dim,
                "vocab_size": cfg.vocab_size,
                "weights_seed": exp.seed,
            },
            "device": "cpu",
            "torch_threads": measured.torch_threads,
            "check_invariants": exp.check_invariants,
            "wall_s": round(sum(p.wall_s for p in points), 1),
        },
        "layouts": [_layout_json(x, exp.sizes) for x in exp.layouts],
        "capacity": [dataclasses.asdict(p) for p in points],
        "estimate": [
            gap_row(x.name, [p.reserve_peak for p in points if p.layout == x.name])
            for x in exp.layouts
        ],
        "outputs": {"requests_compared": measured.requests_compared, "identical": True},
    }


def _settings(opts: KVLayoutsOptions, wall_s: float) -> dict[str, object]:
    exp = opts.exp
    return {
        "contexts": list(exp.contexts),
        "output_len": exp.output_len,
        "block_size": exp.block_size,
        "dense_blocks": exp.dense_blocks,
        "dense_tokens": exp.dense_blocks * exp.block_size,
        "cost_model": str(exp.cost),
        "capacity_budget": exp.capacity_budget,
        "goodput_budget": exp.goodput_budget,
        "max_num_seqs": exp.max_num_seqs,
        "load": exp.load,
        "goodput_requests": exp.goodput_requests,
        "seed": exp.seed,
        "baseline": exp.baseline.name,
        "slo": dataclasses.asdict(opts.slo),
        "wall_s": round(wall_s, 1),
    }


def _layout_json(layout: KVLayout, exp: LayoutExperiment) -> dict[str, object]:
    return {
        "name": layout.name,
        "description": layout.description,
        "groups": layout.groups_text(),
        "kv_groups": [
            {k: str(v) if k == "kind" else v for k, v in dataclasses.asdict(g).items()}
            for g in layout.kv_groups
        ],
        "blocks_multiplier": layout.blocks_multiplier,
        "num_blocks": layout.num_blocks(exp.dense_blocks),
    }


# ------------------------------------------------------------------------------ plots
def write_plots(out: Path, opts: KVLayoutsOptions, measured: Measured) -> None:
    exp = opts.exp
    names = [x.name for x in exp.layouts]
    cap = sorted(measured.capacity, key=lambda p: p.context)
    tokens = exp.dense_blocks * exp.block_size
    _context_chart(
        out / PLOTS["capacity"],
        f"requests running at once, {tokens:,} dense tokens of KV memory",
        "most requests running",
        {n: [(p.context, p.reserve_peak.max_running) for p in cap if p.layout == n] for n in names},
        dashed={n: [(p.context, p.bound) for p in cap if p.layout == n] for n in names},
        labels=("measured", "bound"),
    )
    good = sorted(measured.goodput, key=lambda p: p.context)
    _context_chart(
        out / PLOTS["goodput"],
        f"goodput vs context length (load {exp.load:g} of the prefill rate)",
        "goodput (req/s, both SLOs met)",
        {n: [(p.context, p.goodput_rps) for p in good if p.layout == n] for n in names},
        reference=sorted({(p.context, p.rate_rps) for p in good}),
        labels=("", "offered (req/s)"),
    )
    _estimate_chart(out / PLOTS["estimate"], opts, measured.trace)
    if opts.engine is not None and measured.engine is not None:
        _engine_charts(out, opts.engine, measured.engine)


def _engine_charts(out: Path, exp: EngineExperiment, measured: EngineMeasured) -> None:
    names = [x.name for x in exp.layouts]
    points = sorted(measured.points, key=lambda p: p.context)
    tokens = exp.dense_blocks * exp.block_size
    _context_chart(
        out / ENGINE_PLOTS["engine_capacity"],
        f"real engine: requests running at once, {tokens:,} dense tokens of KV memory",
        "most requests running",
        {
            n: [(p.context, p.reserve_peak.max_running) for p in points if p.layout == n]
            for n in names
        },
        dashed={n: [(p.context, p.bound) for p in points if p.layout == n] for n in names},
        labels=("measured", "bound"),
    )
    _context_chart(
        out / ENGINE_PLOTS["engine_throughput"],
        f"real engine: output tokens/s, CPU wall time ({measured.torch_threads} thread"
        f"{'s' if measured.torch_threads > 1 else ''}; not a GPU figure)",
        "output tokens/s (CPU wall clock)",
        {n: [(p.context, p.output_tokens_per_s) for p in points if p.layout == n] for n in names},
    )


def _context_chart(
    path: Path,
    title: str,
    y_label: str,
    lines: dict[str, list[tuple[int, float]]],
    *,
    dashed: dict[str, list[tuple[int, float]]] | None = None,
    reference: list[tuple[int, float]] | None = None,
    labels: tuple[str, str] = ("", ""),
) -> None:
    """A line per layout against the context length (log-log, the contexts as ticks):
    with ``dashed`` a dashed companion in the same colour, with ``reference`` one grey
    dashed line; ``labels`` name the solid and dashed kinds."""
    fig = new_figure()
    ax = fig.add_subplot()
    solid, other = labels
    if reference:
        ax.plot(*zip(*reference, strict=True), "--", color="0.6", label=other)
    markers = "osD^v<>"
    for i, (name, pts) in enumerate(lines.items()):
        (line,) = ax.plot(
            *zip(*pts, strict=True),
            marker=markers[i % len(markers)],
            markersize=4,
            label=f"{name} ({solid})" if solid else name,
        )
        if dashed:
            ax.plot(
                *zip(*dashed[name], strict=True),
                "--",
                color=line.get_color(),
                alpha=0.6,
                label=f"{name} ({other})",
            )
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter

    plain = FuncFormatter(lambda v, _pos: f"{v:g}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    contexts = sorted({x for pts in lines.values() for x, _ in pts})
    ax.xaxis.set_major_locator(FixedLocator(contexts))
    ax.xaxis.set_major_formatter(plain)
    ax.xaxis.set_minor_formatter(NullFormatter())
    # 1, 2, 5 in every decade: readable labels over one decade or several.
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.grid(True, alpha=0.3)
    ax.set_title(title)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel(y_label)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8, frameon=False)
    write_png(path, fig)


def _estimate_chart(path: Path, opts: KVLayoutsOptions, trace: Sequence[StepSample]) -> None:
    """The plotted run's pool, step by step, against the two estimates."""
    fig = new_figure()
    ax = fig.add_subplot()
    steps = [s.step_index for s in trace]
    ax.plot(steps, [s.used_blocks for s in trace], color="C0", lw=2.5, label="pool: used blocks")
    ax.plot(
        steps,
        [s.estimate_blocks for s in trace],
        "--",
        color="C1",
        lw=1.2,
        label="sum of layout_blocks at the last allocation",
    )
    ax.plot(
        steps,
        [s.estimate_now_blocks for s in trace],
        ":",
        color="C2",
        lw=1.2,
        label="sum of layout_blocks at the KV length now",
    )
    layout, context = opts.trace_point
    blocks = next(x for x in opts.exp.layouts if x.name == layout).num_blocks(opts.exp.dense_blocks)
    ax.axhline(blocks, color="0.6", ls="--", lw=1, label=f"the pool ({blocks:,} blocks)")
    ax.set_title(f"{layout}, {context} prompt tokens: the pool against the estimate")
    ax.set_xlabel("step")
    ax.set_ylabel("blocks")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower center", fontsize=8, frameon=False)
    write_png(path, fig)


# ------------------------------------------------------------------------------- run
def run_kv_layouts(opts: KVLayoutsOptions, stream: TextIO | None = None) -> dict[str, object]:
    """Measure, then write ``report.json``, ``report.md`` and the charts into
    ``opts.out``; return the JSON document."""
    check_output_dir(opts.out, "--out")
    started = time.perf_counter()
    measured = measure(opts, stream)
    report = report_json(opts, measured, time.perf_counter() - started)
    check_output_dir(opts.out, "--out")  # checked before the runs too; it may have gone
    write_plots(opts.out, opts, measured)
    # Strict JSON (allow_nan=False): a non-finite number is a bug to report, not a file.
    atomic_write_text(
        opts.out / "report.json", json.dumps(report, indent=2, allow_nan=False) + "\n", "--out"
    )
    atomic_write_text(opts.out / "report.md", render_markdown(report), "--out")
    return report
