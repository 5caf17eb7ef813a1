"""The markdown of a ``bench-peers`` run: the scheduler-step table and the block-pool
table, each with what every engine's timed work includes.

:func:`render_markdown` is the driver's own ``out/bench-peers.md``;
:mod:`refserve.conformance.bench.report` puts :func:`render_steps` and :func:`render_pool` one
heading level down into docs/BENCHMARKS.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from refserve.conformance.bench.machine import machine_line
from refserve.conformance.bench.results import (
    BASELINE,
    POOL_CONFIGS,
    Cell,
    Run,
    figure,
    growth,
    phase_us,
    pool_figure,
    pool_ratio,
    ratio,
)


def _fmt_us(x: float) -> str:
    return f"{x:.1f} us" if x >= 1 else f"{x:.2f} us"


@dataclass(frozen=True)
class _Style:
    """How one table prints a figure and its ratio: the pool's figures per block are a
    fraction of a microsecond, so they keep more digits than the step's per request."""

    figure: Callable[[float], str]
    ratio_digits: int


_STEP_STYLE = _Style(_fmt_us, 1)
_POOL_STYLE = _Style(lambda x: f"{x:.3f} us", 2)


@dataclass(frozen=True)
class _Entry:
    """One table entry before it is printed."""

    engine: str
    us: float | None
    """The figure (None: not measured)."""
    ratio: float | None
    cell: Cell | None
    """Where the figure comes from (None: the run never asked for that configuration)."""

    def text(self, style: _Style) -> str:
        if self.us is None:
            return f"n/a ({self.cell.status})" if self.cell is not None else "n/a"
        text = style.figure(self.us)
        # refserve is the baseline: its ratio is 1 by definition, so it shows the figure alone.
        if self.engine != BASELINE and self.ratio is not None:
            text += f" ({self.ratio:.{style.ratio_digits}f}x)"
        return text


def _row(entries: Sequence[str]) -> str:
    return "| " + " | ".join(entries) + " |"


def _name(run: Run, engine: str) -> str:
    """The engine as its worker named itself, else its key."""
    return str(run.engines.get(engine, {}).get("name") or engine)


def _includes(run: Run, what: Callable[[dict[str, Any]], str]) -> list[str]:
    """One line per engine: ``what`` its timed work covers, or why it was not measured."""
    return [
        f"- {_name(run, e)}: **not measured**: {info['error']}"
        if info.get("error")
        else f"- {_name(run, e)}: {what(info)}"
        for e, info in run.engines.items()
    ]


def render_markdown(run: Run) -> str:
    """The side-by-side table, what each timed step includes, and the phase breakdown."""
    load = " / ".join(f"{x:.2f}" for x in run.load_before)
    load_after = " / ".join(f"{x:.2f}" for x in run.load_after)
    head = [
        "# Scheduler step and block pool, side by side (`make bench-peers`)",
        "",
        f"Command: `{run.command}`. Started {run.started}; {run.cpus} CPUs; load average "
        f"(1 / 5 / 15 min) {load} before, {load_after} after. "
        + (f"{machine_line(run.machine)}. " if run.machine else "")
        + (
            f"Every worker pinned to CPU {run.pinned_cpu} (`--cpu`): the rounds run one at "
            "a time, so they never compete for it."
            if run.pinned_cpu is not None
            else "Workers not pinned: the OS placed them (`--no-pin`, or no CPU affinity here)."
        ),
        "",
    ]
    steps = render_steps(run) if "steps" in run.parts else []
    pool = render_pool(run) if "pool" in run.parts else []
    return "\n".join(head + steps + pool) + "\n"


def render_pool(run: Run, level: int = 2) -> list[str]:
    """The block-pool table: us per block, ratio to refserve, what each round includes."""
    pw = run.pool_workload
    return [
        "#" * level + " Block pool (allocate + free)",
        "",
        f"Each engine's block pool alone, {pw['blocks']} blocks of {pw['block_size']}: a "
        f"round allocates {pw['blocks_per_round']} fresh blocks for a new request and frees "
        "them; with prefix caching every free block is cached beforehand, so every pop "
        "evicts, and each round hashes and indexes its full blocks. Median over all rounds "
        f"(interleaved, {pw['timed_rounds_per_message']} per message, {run.rounds} messages "
        f"per engine after {run.warmup} warm-up), per block; in brackets the ratio to "
        "refserve with the same prefix caching in this run.",
        "",
        "| engine | no prefix caching | prefix caching, same hashing | "
        "prefix caching, engine's own hashing |",
        "|---|---|---|---|",
        *(_pool_row(run, e) for e in run.engines),
        "",
        "Hashing: *same* is `refserve.spec.hashing.block_key` in both engines, sha256 over the "
        "parent key (32 bytes) and the block's 16 token ids as int64 (128 bytes); vLLM's *own* is "
        "`hash_block_tokens(sha256, ...)`, sha256 over the pickle of (parent hash, token "
        "tuple, None).",
        "",
        "What each engine's pool round includes:",
        "",
        *_includes(run, lambda info: str(info.get("pool_includes") or "no block-pool benchmark")),
        "",
    ]


def _pool_row(run: Run, engine: str) -> str:
    return _row([_name(run, engine), *(_pool_entry(run, engine, *cfg) for cfg in POOL_CONFIGS)])


def _pool_entry(run: Run, engine: str, caching: bool, hashing: str) -> str:
    # refserve has one hashing: its native-hashing column would repeat its same-hashing one.
    if engine == BASELINE and hashing == "native":
        return "(same as its own)"
    cells = run.pool_cells
    config = (engine, caching, hashing)
    entry = _Entry(
        engine,
        pool_figure(cells, engine, caching, hashing),
        pool_ratio(cells, engine, caching, hashing),
        next((c for c in cells if (c.engine, c.prefix_caching, c.hashing) == config), None),
    )
    return entry.text(_POOL_STYLE)


def render_steps(run: Run, level: int = 2) -> list[str]:
    """The scheduler-step table, what each step includes, and the phase breakdown."""
    lo_prompt, hi_prompt = run.workload["prompt_tokens"]
    return [
        "#" * level + " Scheduler step",
        "",
        f"Decode-heavy workload: N running requests, block {run.workload['block_size']}, "
        f"prompts of {lo_prompt}-{hi_prompt} tokens, every request decoding; one step decodes "
        f"one token for each. Median of {run.rounds} interleaved rounds ({run.warmup} warm-up "
        "rounds discarded), per running request; in brackets the ratio to refserve on the "
        "same configuration in this run.",
        "",
        *_steps_table(run),
        "",
        "What each engine's timed step includes:",
        "",
        *_includes(run, lambda info: str(info.get("includes", ""))),
        *_not_measured(run),
        *_phases(run),
    ]


def _steps_table(run: Run) -> list[str]:
    sizes = run.sizes
    lo, hi = (min(sizes), max(sizes)) if sizes else (0, 0)
    return [
        "| engine | prefix caching | "
        + " | ".join(f"N = {n}" for n in sizes)
        + f" | growth N = {lo} to {hi} |",
        "|---|---|" + "---|" * len(sizes) + "---|",
        *(_steps_row(run, e, caching) for e in run.engines for caching in (False, True)),
    ]


def _steps_row(run: Run, engine: str, caching: bool) -> str:
    g = growth(run.cells, engine, caching, run.sizes)
    return _row(
        [
            _name(run, engine),
            "on" if caching else "off",
            *(_step_entry(run, engine, n, caching) for n in run.sizes),
            "n/a" if g is None else f"{g:.2f}x",
        ]
    )


def _step_entry(run: Run, engine: str, n: int, caching: bool) -> str:
    config = (engine, n, caching)
    entry = _Entry(
        engine,
        figure(run.cells, engine, n, caching),
        ratio(run.cells, engine, n, caching),
        next((c for c in run.cells if (c.engine, c.n, c.prefix_caching) == config), None),
    )
    return entry.text(_STEP_STYLE)


def _not_measured(run: Run) -> list[str]:
    """Why each configuration an engine could not run is missing; an engine that never
    started is said once, in the list above, not once per configuration."""
    missing = {
        (_name(run, c.engine), c.status, c.reason)
        for c in run.cells
        if c.status != "ok" and not run.engines.get(c.engine, {}).get("error")
    }
    if not missing:
        return []
    return [
        "",
        "Not measured:",
        "",
        *(f"- {name} ({status}): {reason}" for name, status, reason in sorted(missing)),
    ]


def _phases(run: Run) -> list[str]:
    rank = {e: i for i, e in enumerate(run.engines)}
    cells = sorted(run.cells, key=lambda c: (rank.get(c.engine, 0), c.prefix_caching, c.n))
    return [
        "",
        "Phases (median of each phase over the rounds, per running request; the medians "
        "need not add up to the step's):",
        "",
        "| engine | prefix caching | N | phases |",
        "|---|---|---|---|",
        *(_phase_row(run, c) for c in cells if c.status == "ok" and c.times_ns),
        "",
    ]


def _phase_row(run: Run, c: Cell) -> str:
    phases = run.engines.get(c.engine, {}).get("phases", [])
    parts = ", ".join(
        f"{p} {_fmt_us(x)}" for p, x in zip(phases, phase_us(c.times_ns, c.n), strict=False)
    )
    return _row([_name(run, c.engine), "on" if c.prefix_caching else "off", str(c.n), parts])
