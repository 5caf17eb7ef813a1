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
from pathlib import Path

from ref.core.engine_core import StepRecord
from ref.files import atomic_write_text

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


def render_timeline_svg(steps: Sequence[StepRecord], num_blocks: int, title: str = "") -> str:
    width, height, left, bottom, top = 900, 360, 56, 40, 36
    plot_w, plot_h = width - left - 56, height - bottom - top
    n = max(len(steps), 1)
    col = plot_w / n
    max_tokens = max((sum(t for _, t in s.tokens) for s in steps), default=1) or 1
    ids: list[str] = []
    for s in steps:
        for rid, _ in s.tokens:
            if rid not in ids:
                ids.append(rid)
    color = {rid: _PALETTE[i % len(_PALETTE)] for i, rid in enumerate(ids)}
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
        x = left + i * col
        y = float(top + plot_h)
        decode_ids = {
            rid for rid, is_p in zip(s.plan.request_ids, s.plan.is_prefill, strict=True) if not is_p
        }
        for rid, tokens in s.tokens:
            h = plot_h * tokens / max_tokens
            y -= h
            kind = "decode" if rid in decode_ids else "prefill"
            opacity = "0.55" if kind == "decode" else "1"
            tip = f"step {s.step_index + 1}: {html.escape(rid)} {tokens} tok ({kind})"
            parts.append(
                f'<rect x="{x + 1:.1f}" y="{y:.1f}" width="{max(col - 2, 1):.1f}" height="{h:.1f}" '
                f'fill="{color[rid]}" fill-opacity="{opacity}"><title>{tip}</title></rect>'
            )
    if steps:
        kv_y = [top + plot_h - plot_h * s.kv_blocks_used / max(num_blocks, 1) for s in steps]
        pts = " ".join(f"{left + (i + 0.5) * col:.1f},{y:.1f}" for i, y in enumerate(kv_y))
        parts.append(f'<polyline points="{pts}" fill="none" stroke="#c00" stroke-width="1.5"/>')
    parts.append(f'<text x="{left + plot_w / 2 - 20}" y="{height - 8}">step</text>')
    for j, rid in enumerate(ids[:8]):  # legend: the first eight requests
        lx, ly = left + j * 105, height - 24
        parts.append(f'<rect x="{lx}" y="{ly - 9}" width="10" height="10" fill="{color[rid]}"/>')
        parts.append(f'<text x="{lx + 14}" y="{ly}">{html.escape(rid)}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


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
    from ref.report.plots import new_figure, write_png

    fig = new_figure(8.0, 4.0)
    ax = fig.add_subplot()
    ids: list[str] = []
    for s in steps:
        ids += [rid for rid, _ in s.tokens if rid not in ids]
    color = {rid: _PALETTE[i % len(_PALETTE)] for i, rid in enumerate(ids)}
    x = [s.step_index for s in steps]
    bottom = [0.0] * len(steps)
    for rid in ids:
        # One bar series per request and kind, so the legend names each request once.
        for prefill in (True, False):
            heights = []
            for s in steps:
                got = dict(s.tokens).get(rid, 0)
                kinds = dict(zip(s.plan.request_ids, s.plan.is_prefill, strict=True))
                heights.append(float(got) if got and kinds.get(rid) is prefill else 0.0)
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
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.set_ylim(0, max(bottom, default=1.0) * 1.05 or 1.0)
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


def _has_prefill(steps: Sequence[StepRecord], rid: str) -> bool:
    return any(
        r == rid and p
        for s in steps
        for r, p in zip(s.plan.request_ids, s.plan.is_prefill, strict=True)
    )
