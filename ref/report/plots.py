"""PNG charts for reports, drawn with matplotlib.

matplotlib is imported inside the drawing functions only: the engine core, the simulator
and every command that draws nothing never pay for (or depend on) it. Figures are built
with the object-oriented ``Figure`` API and the Agg canvas, never pyplot, so no GUI
backend is chosen and nothing global changes. Each file is rendered into memory and then
renamed into place, so an interrupted run never leaves half a PNG.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from refserve.errors import OutputPathError
from refserve.files import shown, temp_name
from refserve.report.swap_comparison import SWAP_COST, SWAP_TRACE

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from refserve.report.analysis import PointResult
    from refserve.report.policies import NamedPolicy
    from refserve.report.swap_comparison import SwapResult
    from refserve.report.sweep import SweepResult
    from refserve.report.workload_specs import TraceSpec

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# Small enough to commit (a few tens of KB each) and still readable at page width.
FIGSIZE = (7.0, 4.0)
DPI = 100

Point = tuple[float, float | None]
# Trace (or "swap") -> chart kind -> the PNG's file name in the output folder.
ChartFiles = dict[str, dict[str, str]]


@dataclass(frozen=True)
class BarGroup:
    """One cluster of a grouped bar chart: a label and a value per series."""

    label: str
    values: Mapping[str, float | None]


def new_figure(width: float = FIGSIZE[0], height: float = FIGSIZE[1]) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=DPI)
    FigureCanvasAgg(fig)
    return fig


def write_png(path: Path, fig: Figure, what: str = "plot") -> Path:
    """Render ``fig`` and write it to ``path`` through a temporary name."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight")
    tmp = temp_name(path)
    try:
        with tmp.open("xb") as fh:
            fh.write(buf.getvalue())
        os.replace(tmp, path)
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the name
        reason = e.strerror if isinstance(e, OSError) and e.strerror else e
        raise OutputPathError(f"{what} {shown(path)}: cannot write: {reason}") from None
    finally:
        # Ctrl-C between open and rename must not leave the temporary file behind.
        with contextlib.suppress(OSError):
            tmp.unlink()
    return path


def line_chart_png(
    path: Path,
    title: str,
    x_label: str,
    y_label: str,
    series: Mapping[str, Sequence[Point]],
    *,
    log_y: bool = False,
    log_x: bool = False,
    reference: Sequence[Point] | None = None,
    reference_label: str = "",
) -> Path:
    """A line chart, one line with markers per series; ``None`` breaks a line.

    ``reference`` is drawn dashed grey (e.g. the offered load, y = x).
    """
    fig = new_figure()
    ax = fig.add_subplot()
    if reference:
        xs, ys = _xy(reference)
        ax.plot(xs, ys, "--", color="0.6", label=reference_label or "reference")
    # Distinct markers as well as colours: policies that coincide stay visible.
    markers = "osD^v<>ph*"
    for i, (name, pts) in enumerate(series.items()):
        xs, ys = _xy(pts)
        ax.plot(xs, ys, marker=markers[i % len(markers)], markersize=4, label=name)
    from matplotlib.ticker import FuncFormatter

    # Plain numbers (0.1, 16), not 10^-1 mathtext: a rate is read off the axis.
    plain = FuncFormatter(lambda v, _pos: f"{v:g}")
    if log_x:
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(plain)
    if log_y:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(plain)
        # Within about a decade there are no major ticks to read, so label the minor
        # ones; across several decades they would crowd the axis.
        lo, hi = ax.get_ylim()
        if hi <= 20 * lo:
            ax.yaxis.set_minor_formatter(plain)
    else:
        ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.set_xlabel(x_label)
    ax.set_ylabel(y_label)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8, frameon=False)
    return write_png(path, fig)


def grouped_bar_chart_png(
    path: Path,
    title: str,
    x_label: str,
    y_label: str,
    groups: Sequence[BarGroup],
    *,
    log_y: bool = False,
    label_format: str = "%.0f",
) -> Path:
    """Bars side by side within each group; a missing value (``None``) draws no bar;
    each bar labelled with its value in ``label_format``."""
    fig = new_figure()
    ax = fig.add_subplot()
    names: list[str] = []
    for g in groups:
        names += [n for n in g.values if n not in names]
    width = 0.8 / max(len(names), 1)
    for j, name in enumerate(names):
        xs = [i + (j - (len(names) - 1) / 2) * width for i in range(len(groups))]
        ys = [_nan(g.values.get(name)) for g in groups]
        bars = ax.bar(xs, ys, width, label=name)
        ax.bar_label(bars, fmt=label_format, fontsize=7, padding=1)
    ax.set_xticks(range(len(groups)), [g.label for g in groups])
    if log_y:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.set_xlabel(x_label)
    ax.set_ylabel(y_label)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8, frameon=False)
    return write_png(path, fig)


@dataclass(frozen=True)
class BarPanel:
    """One panel of :func:`stacked_panels_png`: its title and its stacked bars."""

    title: str
    bars: Sequence[BarGroup]


def stacked_panels_png(path: Path, title: str, y_label: str, panels: Sequence[BarPanel]) -> Path:
    """One panel a row of stacked bars: each bar a group, its values stacked in the
    order they are given (a missing part is 0), the total labelled on top; each panel
    its own y scale, so a panel of seconds does not flatten one of milliseconds."""
    fig = new_figure(max(FIGSIZE[0], 3.2 * len(panels)), FIGSIZE[1] + 0.6)
    parts: list[str] = []
    for panel in panels:
        for g in panel.bars:
            parts += [n for n in g.values if n not in parts]
    colors = [f"C{i}" for i in range(len(parts))]
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, panel in zip(axes, panels, strict=True):
        xs = range(len(panel.bars))
        bottom = [0.0] * len(panel.bars)
        for part, color in zip(parts, colors, strict=True):
            ys = [g.values.get(part) or 0.0 for g in panel.bars]
            ax.bar(xs, ys, 0.7, bottom=bottom, color=color, label=part)
            bottom = [b + y for b, y in zip(bottom, ys, strict=True)]
        for x, total in zip(xs, bottom, strict=True):
            ax.annotate(f"{total:.0f}", (x, total), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(list(xs), [g.label for g in panel.bars], rotation=35, ha="right")
        ax.tick_params(axis="x", labelsize=7)
        ax.set_title(panel.title, fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].set_ylabel(y_label)
    fig.suptitle(title)
    axes[0].legend(loc="upper left", fontsize=7, framealpha=0.8)
    fig.tight_layout()
    return write_png(path, fig)


def _nan(y: float | None) -> float:
    return float("nan") if y is None else y


def _xy(pts: Sequence[Point]) -> tuple[list[float], list[float]]:
    ordered = sorted(pts, key=lambda p: p[0])
    return [x for x, _ in ordered], [_nan(y) for _, y in ordered]


# ------------------------------------------------------------------------ refserve compare
def write_compare_plots(out: Path, sweep: SweepResult, swap: Sequence[SwapResult]) -> ChartFiles:
    """``refserve compare``'s charts in ``out``: goodput and P99 TTFT against the rate for
    each trace, and the recompute-vs-swap latencies; returns their file names."""
    plots: ChartFiles = {}
    for planned in sweep.plan:
        spec = planned.spec
        mine = [p for p in sweep.points if p.trace == spec.name]
        plots[spec.name] = _trace_charts(out, spec, mine, sweep.policies)
    if swap:
        plots["swap"] = {"latency": _swap_chart(out, swap)}
    return plots


def _trace_charts(
    out: Path, spec: TraceSpec, mine: Sequence[PointResult], policies: Sequence[NamedPolicy]
) -> dict[str, str]:
    """One trace's goodput and P99 TTFT charts, a line per policy."""

    def series(get: Callable[[PointResult], float | None]) -> dict[str, list[Point]]:
        return {
            pol.name: [(p.rate, get(p)) for p in mine if p.policy == pol.name] for pol in policies
        }

    offered: list[Point] = sorted({(p.rate, p.offered_rps) for p in mine})
    swept = [p.rate for p in mine]
    log_x = bool(swept) and max(swept) / min(swept) >= 50
    names = {"goodput": f"goodput_{spec.name}.png", "ttft_p99": f"ttft_p99_{spec.name}.png"}
    line_chart_png(
        out / names["goodput"],
        f"{spec.name}: goodput (both SLOs met) vs offered rate",
        f"rate ({spec.rate_unit})",
        "goodput (req/s)",
        series(lambda p: p.goodput_rps),
        log_x=log_x,
        reference=offered,
        reference_label="offered (req/s)",
    )
    line_chart_png(
        out / names["ttft_p99"],
        f"{spec.name}: P99 TTFT vs offered rate",
        f"rate ({spec.rate_unit})",
        "P99 TTFT (ms)",
        series(lambda p: p.ttft_p99_ms),
        log_y=True,
        log_x=log_x,
    )
    return names


def _swap_chart(out: Path, swap: Sequence[SwapResult]) -> str:
    """The recompute-vs-swap latencies, a bar group per preemption mode and link."""
    name = "swap_vs_recompute.png"
    grouped_bar_chart_png(
        out / name,
        f"recompute vs swap on {SWAP_TRACE} (cost {SWAP_COST} ms)",
        "preemption mode (host link)",
        "latency (virtual ms, log scale)",
        [
            BarGroup(
                r.label,
                {
                    "TTFT p99": r.ttft_p99_ms,
                    "ITL p50": r.itl_p50_ms,
                    "ITL p99": r.itl_p99_ms,
                    "E2E p99": r.e2e_p99_ms,
                },
            )
            for r in swap
        ],
        log_y=True,
    )
    return name
