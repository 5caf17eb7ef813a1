"""A timeline picture of a run: who got how many tokens in each step, and KV in use.

Two forms: :func:`write_timeline_html` (inline SVG, no dependency) and
:func:`write_timeline_png` (matplotlib, imported only when called).

The HTML page opens in any browser: one column per step, stacked by request (prefill
tokens solid, decode tokens a lighter shade), and a line for KV blocks in use on a second
axis.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from refserve.core.engine_core import StepRecord
from refserve.files import atomic_write_text

if TYPE_CHECKING:
    from matplotlib.axes import Axes

_PALETTE = (
    "#4e79a7",
    "#f28e2b",
    "#e15759",
    "#76b7b2",
    "#59a14f",
    "#edc948",
    "#b07aa1",
    "#ff9da7",
    "#9c755f",
    "#bab0ac",
)


@dataclass(frozen=True)
class _SvgFrame:
    """Where the plot area of the SVG sits and how a step and a token scale to pixels."""

    width: int
    height: int
    left: int
    top: int
    plot_w: int
    plot_h: int
    col: float  # pixels per step
    max_tokens: int  # tokens of the fullest step: the full plot height

    @property
    def base(self) -> float:
        return float(self.top + self.plot_h)


def _request_ids(steps: Sequence[StepRecord]) -> list[str]:
    """Every request that got tokens, in order of first appearance."""
    ids: list[str] = []
    for s in steps:
        ids += [rid for rid, _ in s.tokens if rid not in ids]
    return ids


def _colors(ids: Sequence[str]) -> dict[str, str]:
    return {rid: _PALETTE[i % len(_PALETTE)] for i, rid in enumerate(ids)}


def render_timeline_svg(steps: Sequence[StepRecord], num_blocks: int, title: str = "") -> str:
    width, height, left, bottom, top = 900, 360, 56, 40, 36
    plot_w, plot_h = width - left - 56, height - bottom - top
    max_tokens = max((sum(t for _, t in s.tokens) for s in steps), default=1) or 1
    frame = _SvgFrame(
        width, height, left, top, plot_w, plot_h, plot_w / max(len(steps), 1), max_tokens
    )
    ids = _request_ids(steps)
    color = _colors(ids)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        'font-family="sans-serif" font-size="11">',
        f'<text x="{left}" y="20" font-size="14">{html.escape(title)}</text>',
        _line(left, top + plot_h, left + plot_w, top + plot_h),
        _line(left, top, left, top + plot_h),
        f'<text x="8" y="{top + 10}">{max_tokens} tok</text>',
        f'<text x="{left + plot_w + 4}" y="{top + 10}" fill="#c00">{num_blocks} blk</text>',
    ]
    for i, s in enumerate(steps):
        parts += _svg_step_bars(frame, i, s, color)
    if steps:
        parts.append(_svg_kv_line(frame, steps, num_blocks))
    parts.append(f'<text x="{left + plot_w / 2 - 20}" y="{height - 8}">step</text>')
    parts += _svg_legend(frame, ids, color)
    parts.append("</svg>")
    return "\n".join(parts)


def _svg_step_bars(frame: _SvgFrame, i: int, s: StepRecord, color: dict[str, str]) -> list[str]:
    """Step ``i``'s column: one rect per request, stacked, decode a lighter shade."""
    x = frame.left + i * frame.col
    y = frame.base
    decode_ids = {
        rid for rid, is_p in zip(s.plan.request_ids, s.plan.is_prefill, strict=True) if not is_p
    }
    bar_w = max(frame.col - 2, 1)
    rects = []
    for rid, tokens in s.tokens:
        h = frame.plot_h * tokens / frame.max_tokens
        y -= h
        kind = "decode" if rid in decode_ids else "prefill"
        opacity = "0.55" if kind == "decode" else "1"
        tip = f"step {s.step_index + 1}: {html.escape(rid)} {tokens} tok ({kind})"
        rects.append(
            f'<rect x="{x + 1:.1f}" y="{y:.1f}" width="{bar_w:.1f}" height="{h:.1f}" '
            f'fill="{color[rid]}" fill-opacity="{opacity}"><title>{tip}</title></rect>'
        )
    return rects


def _svg_kv_line(frame: _SvgFrame, steps: Sequence[StepRecord], num_blocks: int) -> str:
    """KV blocks in use, against the right axis (the whole pool is the full height)."""
    kv_y = [frame.base - frame.plot_h * s.kv_blocks_used / max(num_blocks, 1) for s in steps]
    pts = " ".join(f"{frame.left + (i + 0.5) * frame.col:.1f},{y:.1f}" for i, y in enumerate(kv_y))
    return f'<polyline points="{pts}" fill="none" stroke="#c00" stroke-width="1.5"/>'


def _svg_legend(frame: _SvgFrame, ids: Sequence[str], color: dict[str, str]) -> list[str]:
    parts = []
    for j, rid in enumerate(ids[:8]):  # legend: the first eight requests
        lx, ly = frame.left + j * 105, frame.height - 24
        parts.append(f'<rect x="{lx}" y="{ly - 9}" width="10" height="10" fill="{color[rid]}"/>')
        parts.append(f'<text x="{lx + 14}" y="{ly}">{html.escape(rid)}</text>')
    return parts


def _line(x1: float, y1: float, x2: float, y2: float) -> str:
    return f'<line x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}" stroke="#333"/>'


def write_timeline_html(
    path: Path, steps: Sequence[StepRecord], num_blocks: int, title: str
) -> Path:
    """Write the timeline as a self-contained HTML page; returns the path.

    Written to a temporary name and renamed: an interrupted run leaves no half page.
    """
    svg = render_timeline_svg(steps, num_blocks, title)
    page = (
        "<!doctype html><meta charset='utf-8'><title>"
        + html.escape(title)
        + "</title><body style='font-family:sans-serif'>"
        + svg
        + "<p>Bars: tokens each request got per step (solid: prefill, light: decode). "
        "Red line: KV blocks in use (right axis). Hover a bar for details.</p></body>"
    )
    return atomic_write_text(path, page, "timeline")


def write_timeline_png(
    path: Path, steps: Sequence[StepRecord], num_blocks: int, title: str
) -> Path:
    """The same picture as a PNG: stacked bars of tokens per request per step (prefill
    solid, decode light), KV blocks in use as a line on the right axis."""
    from matplotlib.ticker import MaxNLocator

    from refserve.report.plots import new_figure, write_png

    fig = new_figure(8.0, 4.0)
    ax = fig.add_subplot()
    x = [s.step_index for s in steps]
    top = _draw_token_bars(ax, x, steps)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.set_ylim(0, max(top, default=1.0) * 1.05 or 1.0)
    ax.set_xlabel("step")
    ax.set_ylabel("tokens scheduled (solid: prefill, light: decode)")
    ax.set_title(title)
    kv = ax.twinx()
    kv.plot(x, [s.kv_blocks_used for s in steps], color="#c00", linewidth=1.5, label="KV blocks")
    kv.axhline(num_blocks, color="#c00", linestyle=":", linewidth=1)
    kv.set_ylim(0, num_blocks * 1.05)
    kv.set_ylabel(f"KV blocks in use (of {num_blocks})", color="#c00")
    handles, labels = ax.get_legend_handles_labels()
    kv_h, kv_l = kv.get_legend_handles_labels()
    ax.legend(
        handles + kv_h,
        labels + kv_l,
        loc="upper left",
        bbox_to_anchor=(1.1, 1.0),
        fontsize=7,
        frameon=False,
    )
    return write_png(path, fig, "timeline")


def _draw_token_bars(ax: Axes, x: list[int], steps: Sequence[StepRecord]) -> list[float]:
    """The stacked bars; returns each step's stacked height."""
    ids = _request_ids(steps)
    color = _colors(ids)
    bottom = [0.0] * len(steps)
    for rid in ids:
        # One bar series per request and kind, so the legend names each request once.
        for prefill in (True, False):
            heights = _kind_heights(steps, rid, prefill=prefill)
            if not any(heights):
                continue
            ax.bar(
                x,
                heights,
                0.85,
                bottom=bottom,
                color=color[rid],
                alpha=1.0 if prefill else 0.45,
                label=rid if prefill or not _has_prefill(steps, rid) else None,
            )
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    return bottom


def _kind_heights(steps: Sequence[StepRecord], rid: str, *, prefill: bool) -> list[float]:
    """Tokens ``rid`` got in each step as a prefill (or a decode), 0 in the others."""
    heights = []
    for s in steps:
        got = dict(s.tokens).get(rid, 0)
        kinds = dict(zip(s.plan.request_ids, s.plan.is_prefill, strict=True))
        heights.append(float(got) if got and kinds.get(rid) is prefill else 0.0)
    return heights


def _has_prefill(steps: Sequence[StepRecord], rid: str) -> bool:
    return any(
        r == rid and p
        for s in steps
        for r, p in zip(s.plan.request_ids, s.plan.is_prefill, strict=True)
    )
