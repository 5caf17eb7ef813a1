"""The markdown of a ``bench-peers`` run: the scheduler-step table and the block-pool
table, each with what every engine's timed work includes.

:func:`render_markdown` is the driver's own ``out/bench-peers.md``;
:mod:`conformance.bench.report` puts :func:`render_steps` and :func:`render_pool` one
heading level down into docs/BENCHMARKS.md.
"""

from __future__ import annotations

from conformance.bench.machine import machine_line
from conformance.bench.results import (
    BASELINE,
    POOL_CONFIGS,
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
    lines = [
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
    ]
    for e, info in run.engines.items():
        row = [str(info.get("name") or e)]
        for caching, hashing in POOL_CONFIGS:
            if e == BASELINE and hashing == "native":
                row.append("(same as its own)")
                continue
            cell = next(
                (
                    c
                    for c in run.pool_cells
                    if (c.engine, c.prefix_caching, c.hashing) == (e, caching, hashing)
                ),
                None,
            )
            f = pool_figure(run.pool_cells, e, caching, hashing)
            if f is None:
                row.append(f"n/a ({cell.status})" if cell is not None else "n/a")
                continue
            r = pool_ratio(run.pool_cells, e, caching, hashing)
            text = f"{f:.3f} us"
            if e != BASELINE and r is not None:
                text += f" ({r:.2f}x)"
            row.append(text)
        lines.append("| " + " | ".join(row) + " |")
    lines += [
        "",
        "Hashing: *same* is `spec.hashing.block_key` in both engines, sha256 over the parent "
        "key (32 bytes) and the block's 16 token ids as int64 (128 bytes); vLLM's *own* is "
        "`hash_block_tokens(sha256, ...)`, sha256 over the pickle of (parent hash, token "
        "tuple, None).",
        "",
        "What each engine's pool round includes:",
        "",
    ]
    for e, info in run.engines.items():
        name = str(info.get("name") or e)
        if info.get("error"):
            lines.append(f"- {name}: **not measured**: {info['error']}")
        else:
            lines.append(f"- {name}: {info.get('pool_includes') or 'no block-pool benchmark'}")
    lines.append("")
    return lines


def render_steps(run: Run, level: int = 2) -> list[str]:
    """The scheduler-step table, what each step includes, and the phase breakdown."""
    sizes = run.sizes
    lo, hi = (min(sizes), max(sizes)) if sizes else (0, 0)
    lo_prompt, hi_prompt = run.workload["prompt_tokens"]
    lines = [
        "#" * level + " Scheduler step",
        "",
        f"Decode-heavy workload: N running requests, block {run.workload['block_size']}, "
        f"prompts of {lo_prompt}-{hi_prompt} tokens, every request decoding; one step decodes "
        f"one token for each. Median of {run.rounds} interleaved rounds ({run.warmup} warm-up "
        "rounds discarded), per running request; in brackets the ratio to refserve on the "
        "same configuration in this run.",
        "",
        "| engine | prefix caching | "
        + " | ".join(f"N = {n}" for n in sizes)
        + f" | growth N = {lo} to {hi} |",
        "|---|---|" + "---|" * len(sizes) + "---|",
    ]
    for e, info in run.engines.items():
        name = str(info.get("name") or e)
        for caching in (False, True):
            row = [name, "on" if caching else "off"]
            for n in sizes:
                cell = next(
                    (c for c in run.cells if (c.engine, c.n, c.prefix_caching) == (e, n, caching)),
                    None,
                )
                f = figure(run.cells, e, n, caching)
                if f is None:
                    row.append(f"n/a ({cell.status})" if cell is not None else "n/a")
                    continue
                r = ratio(run.cells, e, n, caching)
                text = _fmt_us(f)
                if e != BASELINE and r is not None:
                    text += f" ({r:.1f}x)"
                row.append(text)
            g = growth(run.cells, e, caching, sizes)
            row.append("n/a" if g is None else f"{g:.2f}x")
            lines.append("| " + " | ".join(row) + " |")
    lines += ["", "What each engine's timed step includes:", ""]
    for e, info in run.engines.items():
        name = str(info.get("name") or e)
        if info.get("error"):
            lines.append(f"- {name}: **not measured**: {info['error']}")
        else:
            lines.append(f"- {name}: {info.get('includes', '')}")
    missing = {
        (str(run.engines.get(c.engine, {}).get("name") or c.engine), c.status, c.reason)
        for c in run.cells
        if c.status != "ok" and not run.engines.get(c.engine, {}).get("error")
    }
    if missing:
        lines += ["", "Not measured:", ""]
        lines += [f"- {name} ({status}): {reason}" for name, status, reason in sorted(missing)]
    lines += [
        "",
        "Phases (median of each phase over the rounds, per running request; the medians "
        "need not add up to the step's):",
        "",
        "| engine | prefix caching | N | phases |",
        "|---|---|---|---|",
    ]
    rank = {e: i for i, e in enumerate(run.engines)}
    for c in sorted(run.cells, key=lambda c: (rank.get(c.engine, 0), c.prefix_caching, c.n)):
        if c.status != "ok" or not c.times_ns:
            continue
        info = run.engines.get(c.engine, {})
        phases = info.get("phases", [])
        parts = ", ".join(
            f"{p} {_fmt_us(x)}" for p, x in zip(phases, phase_us(c.times_ns, c.n), strict=False)
        )
        lines.append(
            f"| {info.get('name') or c.engine} | {'on' if c.prefix_caching else 'off'} | "
            f"{c.n} | {parts} |"
        )
    lines.append("")
    return lines
