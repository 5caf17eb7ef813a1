"""Migration's K/V: sent, against recomputed (``make bench``; docs/MIGRATION.md, "The cost
rule").

The measurement is ``tests/bench/test_migration_bench.py`` (pytest-benchmark, in process,
the tiny model): per context length ``L``, the time to move a request holding ``L``
tokens of K/V from one engine to another with its K/V (``migrate(..., kv="transfer")``:
export, stage, write, ack, release, commit), against the time an engine that holds none
of them takes to prefill the same ``L`` tokens (what a move without its K/V costs the
destination). The rounds are interleaved (every length, both ways, in each round; the
order alternating) and the figures are medians over rounds. This module turns the
rounds into the figures (:func:`summarise`), kept in the benchmark's ``extra_info``
under :data:`FORMAT`, and renders them for docs/BENCHMARKS.md (:func:`table`).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from itertools import pairwise
from typing import Any

from refserve.spec.arith import blocks_needed

FORMAT = "refserve-bench-migration"


def summarise(
    transfer_s: Mapping[int, Sequence[float]],
    recompute_s: Mapping[int, Sequence[float]],
    block_size: int,
    kv_bytes_per_token: int,
) -> dict[str, Any]:
    """The figures of one run: per length the medians, their ratio and the time per
    block sent; then the break-even length (:func:`breakeven`)."""
    rows = []
    for n in sorted(transfer_s):
        t = statistics.median(transfer_s[n])
        r = statistics.median(recompute_s[n])
        blocks = blocks_needed(n, block_size)
        rows.append(
            {
                "tokens": n,
                "blocks": blocks,
                "transfer_s": t,
                "recompute_s": r,
                "ratio": t / r,
                "transfer_s_per_block": t / blocks,
                "rounds": len(transfer_s[n]),
            }
        )
    return {
        "format": FORMAT,
        "block_size": block_size,
        "kv_bytes_per_token": kv_bytes_per_token,
        "figures": rows,
        "breakeven": breakeven(rows),
    }


def breakeven(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Where sending starts to beat recomputing, over rows sorted by length: the shortest
    measured length whose ratio is below 1 (None if none is); the length where the
    difference of the two medians crosses zero, interpolated linearly between the two
    measured lengths around the first crossing (None when it does not cross inside the
    measured range: ``below`` says on which side it lies); and the marginal cost of one
    more block sent, from the two longest contexts."""
    measured = next((r["tokens"] for r in rows if r["ratio"] < 1), None)
    crossing = _crossing(rows, 0.0)
    # The step's fixed cost, which a recompute riding in a step the destination runs
    # anyway does not add: the recompute less its time at the shortest length.
    added = _crossing(rows, rows[0]["recompute_s"]) if rows else None
    marginal = None
    if len(rows) >= 2 and rows[-1]["blocks"] > rows[-2]["blocks"]:
        a, b = rows[-2], rows[-1]
        marginal = (b["transfer_s"] - a["transfer_s"]) / (b["blocks"] - a["blocks"])
    return {
        "measured_tokens": measured,
        "interpolated_tokens": None if crossing is None else round(crossing, 1),
        "added_tokens": None if added is None else round(added, 1),
        # Sending wins already at the shortest length (True), or never (False).
        "below": bool(rows) and rows[0]["ratio"] < 1,
        "marginal_s_per_block": marginal,
    }


def _crossing(rows: Sequence[Mapping[str, Any]], fixed_s: float) -> float | None:
    """The first length where ``transfer - (recompute - fixed_s)`` turns negative,
    interpolated linearly between the measured lengths around it; None if it does not."""
    for lo, hi in pairwise(rows):
        d_lo = lo["transfer_s"] - lo["recompute_s"] + fixed_s
        d_hi = hi["transfer_s"] - hi["recompute_s"] + fixed_s
        if d_lo >= 0 > d_hi:
            return float(lo["tokens"] + (hi["tokens"] - lo["tokens"]) * d_lo / (d_lo - d_hi))
    return None


def _ms(seconds: float) -> str:
    """A duration in the unit that keeps it short: s, ms or us."""
    if seconds >= 1:
        return f"{seconds:.3g} s"
    ms = seconds * 1e3
    return f"{ms:.3g} ms" if ms >= 0.1 else f"{ms * 1e3:.3g} us"


def _tokens(n: int) -> str:
    return f"{n} token{'s' * (n != 1)}"


def table(info: Mapping[str, Any]) -> list[str]:
    """The markdown lines of one run's figures (its ``extra_info``)."""
    lines = [
        f"Blocks of {info['block_size']} tokens, {info['kv_bytes_per_token']:,} bytes of K/V "
        'per token. Transfer: `migrate(src, dst, rid, kv="transfer")` of a request '
        "holding the context's K/V (export, stage, write, ack, release, commit; prefix "
        "caching off, so every block travels). Recompute: one prefill step of the same "
        "tokens on an engine that holds none of them (built and warmed before the timing, "
        "prefix caching off). One torch thread for both. Medians over the interleaved "
        "rounds; the ratio is transfer over recompute, measured in the same run (below 1: "
        "sending wins).",
        "",
        "| context tokens | blocks | transfer | per block | recompute | transfer / recompute "
        "| rounds |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in info["figures"]:
        lines.append(
            f"| {r['tokens']} | {r['blocks']} | {_ms(r['transfer_s'])} | "
            f"{_ms(r['transfer_s_per_block'])} | {_ms(r['recompute_s'])} | "
            f"{r['ratio']:.2f} | {r['rounds']} |"
        )
    be = info["breakeven"]
    measured, crossing = be["measured_tokens"], be["interpolated_tokens"]
    shortest, longest = info["figures"][0]["tokens"], info["figures"][-1]["tokens"]
    if crossing is not None:
        where = (
            f"sending is faster from {_tokens(measured)} of context on (the shortest measured "
            f"length where it is); the two medians cross at about {crossing:g} tokens "
            "(interpolated between the lengths around it)"
        )
    elif be["below"]:
        where = (
            f"sending is faster at every measured length, down to {_tokens(shortest)}: the "
            "break-even lies below the range measured"
        )
    else:
        where = f"sending is slower at every measured length, up to {_tokens(longest)}"
    marginal = be["marginal_s_per_block"]
    lines += ["", f"Break-even: {where}."]
    added = be["added_tokens"]
    lines += [
        "",
        "Counting only what the prefill adds to a step (the recompute less its time at "
        f"{_tokens(shortest)}: a step's fixed cost, which a recompute riding in a step the "
        "destination runs anyway does not add), "
        + (
            f"sending is faster from about {added:g} tokens on."
            if added is not None
            else "the two do not cross inside the measured range."
        ),
    ]
    if marginal is not None:
        lines += [
            "",
            f"One block more sent costs {_ms(marginal)} (the difference of the two longest "
            "contexts, per block).",
        ]
    lines.append("")
    return lines
