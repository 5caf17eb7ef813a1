"""What one numpy call over the rows of a step costs with cold CPU caches.

Between two steps the model runs and the caches hold its data, so the persistent batch
(ref/core/batch.py) pays each vector operation's fixed cost cold. This measures a few of
the calls a bulk step makes, over N int64 rows, right after a 64 MiB buffer is written
(cold) and again at once (warm); medians of the rounds, in microseconds.
docs/ARCHITECTURE.md, "The persistent batch", cites it.

    python -m refserve.conformance.bench.cold_ops [--rows 1024] [--rounds 30]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np


def measure(rows: int, rounds: int) -> list[tuple[str, float, float]]:
    junk = np.ones(64 << 20, dtype=np.uint8)
    a = np.arange(rows, dtype=np.int64)
    idx = np.arange(rows)
    calls: dict[str, Callable[[], object]] = {
        "compare (a == 0)": lambda: a == 0,
        "modulo (a % 16)": lambda: a % 16,
        "gather (a[idx])": lambda: a[idx],
        "scatter (a[idx] = a)": lambda: a.__setitem__(idx, a),
        "slice copy": lambda: a[: rows - 1].copy(),
        "flatnonzero": lambda: np.flatnonzero(a == 5),
    }
    out = []
    for name, call in calls.items():
        cold, warm = [], []
        for _ in range(rounds):
            junk += 1  # evict the caches, as a model's forward pass would
            t0 = time.perf_counter_ns()
            call()
            t1 = time.perf_counter_ns()
            call()
            t2 = time.perf_counter_ns()
            cold.append(t1 - t0)
            warm.append(t2 - t1)
        out.append((name, statistics.median(cold) / 1e3, statistics.median(warm) / 1e3))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=30)
    args = p.parse_args(argv)
    print(f"| call over {args.rows} int64 rows | cold us | warm us |")
    print("|---|---:|---:|")
    for name, cold, warm in measure(args.rows, args.rounds):
        print(f"| {name} | {cold:.1f} | {warm:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
