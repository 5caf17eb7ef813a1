"""Line charts as standalone SVG, drawn by hand (no plotting dependency), for reports.

One chart: a title, an x axis (linear), a y axis (linear from 0, or log10), one polyline
with markers per series and a legend. A missing point (``None``) breaks the line.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Mapping, Sequence

_PALETTE = (
    "#4e79a7",
    "#f28e2b",
    "#e15759",
    "#76b7b2",
    "#59a14f",
    "#b07aa1",
    "#edc948",
    "#ff9da7",
    "#9c755f",
    "#bab0ac",
)

Point = tuple[float, float | None]


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About ``count`` round tick values covering ``[lo, hi]``."""
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / max(count, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.floor(lo / step) * step
    ticks: list[float] = []
    t = first
    while t <= hi + step * 1e-9:
        ticks.append(round(t, 10))
        t += step
    if ticks[-1] < hi:
        ticks.append(round(t, 10))
    return ticks


def _decades(lo: float, hi: float) -> list[float]:
    """Powers of ten covering ``[lo, hi]`` (at least two)."""
    lo_exp = math.floor(math.log10(lo))
    hi_exp = max(math.ceil(math.log10(hi)), lo_exp + 1)
    return [10.0**e for e in range(lo_exp, hi_exp + 1)]


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1e4 or abs(v) < 1e-2:
        return f"{v:.0e}"
    return f"{v:g}"


def line_chart_svg(
    title: str,
    x_label: str,
    y_label: str,
    series: Mapping[str, Sequence[Point]],
    *,
    log_y: bool = False,
    log_x: bool = False,
    reference: Sequence[Point] | None = None,
    reference_label: str = "",
    width: int = 640,
    height: int = 380,
) -> str:
    """An SVG line chart. ``reference`` is drawn dashed grey (e.g. offered load y = x)."""
    left, right, top, bottom = 70, 170, 36, 48
    pw, ph = width - left - right, height - top - bottom
    pts = [p for s in series.values() for p in s]
    if reference:
        pts += list(reference)
    xs = [x for x, _ in pts if x > 0 or not log_x]
    ys = [y for _, y in pts if y is not None and (y > 0 or not log_y)]
    if log_x:
        x_ticks = _decades(min(xs, default=1.0), max(xs, default=10.0))
        x_lo, x_hi = math.log10(x_ticks[0]), math.log10(x_ticks[-1])
    else:
        x_ticks = nice_ticks(min(xs, default=0.0), max(xs, default=1.0))
        x_lo, x_hi = x_ticks[0], x_ticks[-1]
    if log_y:
        y_ticks = _decades(min(ys, default=1.0), max(ys, default=10.0))
        y_lo, y_hi = math.log10(y_ticks[0]), math.log10(y_ticks[-1])
    else:
        y_ticks = nice_ticks(0.0, max(ys, default=1.0) or 1.0)
        y_lo, y_hi = y_ticks[0], y_ticks[-1]

    def sx(x: float) -> float:
        v = math.log10(x) if log_x else x
        return left + pw * (v - x_lo) / ((x_hi - x_lo) or 1.0)

    def sy(y: float) -> float:
        v = math.log10(y) if log_y else y
        return top + ph - ph * (v - y_lo) / ((y_hi - y_lo) or 1.0)

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{left}" y="20" font-size="14">{html.escape(title)}</text>',
    ]
    for t in x_ticks:
        x = sx(t)
        out.append(_line(x, top, x, top + ph, "#eee"))
        out.append(f'<text x="{x:.1f}" y="{top + ph + 15}" text-anchor="middle">{_fmt(t)}</text>')
    for t in y_ticks:
        y = sy(t)
        out.append(_line(left, y, left + pw, y, "#eee"))
        out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{_fmt(t)}</text>')
    out.append(_line(left, top + ph, left + pw, top + ph, "#333"))
    out.append(_line(left, top, left, top + ph, "#333"))
    out.append(
        f'<text x="{left + pw / 2:.1f}" y="{height - 10}" text-anchor="middle">'
        f"{html.escape(x_label)}{' (log)' if log_x else ''}</text>"
    )
    out.append(
        f'<text transform="translate(16,{top + ph / 2:.1f}) rotate(-90)" text-anchor="middle">'
        f"{html.escape(y_label)}{' (log)' if log_y else ''}</text>"
    )
    legend: list[tuple[str, str, bool]] = []
    if reference:
        out.extend(_polyline(reference, sx, sy, log_x, log_y, "#999", dashed=True))
        legend.append((reference_label or "reference", "#999", True))
    for i, (name, pts_i) in enumerate(series.items()):
        color = _PALETTE[i % len(_PALETTE)]
        out.extend(_polyline(pts_i, sx, sy, log_x, log_y, color, dashed=False, name=name))
        legend.append((name, color, False))
    for j, (name, color, dashed) in enumerate(legend):
        lx, ly = left + pw + 14, top + 10 + 18 * j
        dash = ' stroke-dasharray="5,3"' if dashed else ""
        out.append(
            f'<line x1="{lx}" y1="{ly - 4}" x2="{lx + 18}" y2="{ly - 4}" stroke="{color}" '
            f'stroke-width="2"{dash}/>'
        )
        out.append(f'<text x="{lx + 24}" y="{ly}">{html.escape(name)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _line(x1: float, y1: float, x2: float, y2: float, color: str) -> str:
    return f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" stroke="{color}"/>'


def _polyline(
    pts: Sequence[Point],
    sx: Callable[[float], float],
    sy: Callable[[float], float],
    log_x: bool,
    log_y: bool,
    color: str,
    *,
    dashed: bool,
    name: str = "",
) -> list[str]:
    out: list[str] = []
    run: list[str] = []
    dash = ' stroke-dasharray="5,3"' if dashed else ""

    def flush() -> None:
        if len(run) > 1:
            out.append(
                f'<polyline points="{" ".join(run)}" fill="none" stroke="{color}" '
                f'stroke-width="2"{dash}/>'
            )
        run.clear()

    for x, y in sorted(pts, key=lambda p: p[0]):
        if y is None or (log_y and y <= 0) or (log_x and x <= 0):
            flush()
            continue
        px, py = sx(x), sy(y)
        run.append(f"{px:.1f},{py:.1f}")
        if not dashed:
            tip = f"{name}: x={x:g}, y={y:.4g}"
            out.append(
                f'<circle cx="{px:.1f}" cy="{py:.1f}" r="3" fill="{color}">'
                f"<title>{html.escape(tip)}</title></circle>"
            )
    flush()
    return out
