"""How the simulator's cost grows with the trace: seconds per request and peak memory.

Two trace shapes over the same request mix (prompts of 12-20 tokens, 2-6 output tokens,
distinct prompts, so no prefix hits):

* ``steady``: one arrival every :data:`STEADY_GAP_MS`, about 60 % of what the engine
  serves, so the queue stays short and the run is in a steady state;
* ``burst``: every request arrives at time 0, so the waiting queue starts with all of
  them (the case a per-step scan or sort of the queue makes quadratic).

Each point runs in a fresh process, so its peak RSS is its own (the baseline, measured
before the trace is built, is mostly the interpreter and torch, which ``refserve.core.inputs``
imports). Rounds are interleaved (every size once, then again) so a load spike on a
shared machine hits all sizes alike; the table shows medians.

Run: ``python -m refserve.sim.simbench`` (sizes 1k-100k) or
``python -m refserve.sim.simbench --sizes 1000,10000,100000,1000000 --rounds 3``.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from refserve.core.config import SchedulerConfig
from refserve.core.cost import StepCost
from refserve.core.request import Request, StopParams
from refserve.core.scheduler import Scheduler
from refserve.sim.simulator import simulate

SHAPES = ("steady", "burst")
CONFIG = SchedulerConfig(
    max_num_batched_tokens=2048, max_num_seqs=256, block_size=16, num_blocks=1024
)
COST = StepCost.parse("2+0.5P+D")
# A request costs about 0.5 * 16 (prefill) + 3 (decodes) = 11 ms of step time when
# batched; one arrival per 20 ms keeps the engine about 60 % busy (fixed step costs
# included), so the system stays in a steady state at any trace length.
STEADY_GAP_MS = 20.0


def synthetic_requests(n: int, shape: str, seed: int = 0) -> list[Request]:
    """``n`` fresh requests of the given shape (deterministic for a seed)."""
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {SHAPES}, got {shape!r}")
    rng = random.Random(f"simbench:{seed}")
    gap = STEADY_GAP_MS if shape == "steady" else 0.0
    return [
        Request(
            f"r{i}",
            [rng.randrange(32000) for _ in range(rng.randint(12, 20))],
            StopParams(max_tokens=rng.randint(2, 6), ignore_eos=True),
            arrival_ms=i * gap,
        )
        for i in range(n)
    ]


@dataclass(frozen=True)
class Point:
    """One run: ``n`` requests of ``shape`` replayed by :func:`refserve.sim.simulator.simulate`."""

    shape: str
    n: int
    seconds: float  # wall time of the replay only, not building the trace
    cpu_seconds: float  # this process's CPU time over the same span
    num_steps: int
    peak_rss_mib: float  # of the whole process
    baseline_rss_mib: float  # before the trace was built

    @property
    def us_per_request(self) -> float:
        return self.seconds / self.n * 1e6

    @property
    def cpu_us_per_request(self) -> float:
        return self.cpu_seconds / self.n * 1e6


def measure(n: int, shape: str) -> Point:
    """Replay in this process (its peak RSS is only meaningful in a fresh process)."""
    baseline = _rss_mib()
    requests = synthetic_requests(n, shape)
    gc.collect()  # start each point without the trace's garbage
    started, cpu_started = time.perf_counter(), time.process_time()
    result = simulate(Scheduler(CONFIG), requests, COST, keep_steps=False)
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    assert all(r.is_done for r in result.requests), "every request finishes"
    return Point(shape, n, seconds, cpu, result.num_steps, _rss_mib(), baseline)


def _rss_mib() -> float:
    # ru_maxrss is in KiB on Linux (the machines this runs on).
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure_in_subprocess(n: int, shape: str) -> Point:
    """:func:`measure` in a fresh interpreter, so the peak RSS is this point's alone."""
    out = subprocess.run(
        [sys.executable, "-m", "refserve.sim.simbench", "--worker", str(n), shape],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return Point(**json.loads(out.splitlines()[-1]))


@dataclass(frozen=True)
class Row:
    """The median of a point's rounds."""

    shape: str
    n: int
    us_per_request: float  # wall
    cpu_us_per_request: float  # CPU: what the scaling checks compare (less load noise)
    peak_rss_mib: float
    baseline_rss_mib: float
    num_steps: int
    rounds: int


def run(sizes: Sequence[int], shapes: Sequence[str], rounds: int) -> list[Row]:
    """Every (shape, size) point ``rounds`` times, interleaved; medians per point.

    Sizes of a million or more run once: one such round already lasts minutes, long
    enough to average out the machine's load.
    """
    points: dict[tuple[str, int], list[Point]] = {(s, n): [] for s in shapes for n in sizes}
    for k in range(rounds):
        for shape in shapes:
            for n in sizes:
                if k and n >= 1_000_000:
                    continue
                points[shape, n].append(measure_in_subprocess(n, shape))
    return [
        Row(
            shape,
            n,
            statistics.median(p.us_per_request for p in ps),
            statistics.median(p.cpu_us_per_request for p in ps),
            statistics.median(p.peak_rss_mib for p in ps),
            statistics.median(p.baseline_rss_mib for p in ps),
            ps[0].num_steps,
            len(ps),
        )
        for (shape, n), ps in points.items()
    ]


def render(rows: Sequence[Row]) -> str:
    head = (
        f"{'shape':>6} {'requests':>9} {'us/req wall':>11} {'us/req CPU':>10} {'steps':>9} "
        f"{'peak RSS MiB':>12} {'over baseline':>13} {'rounds':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.shape:>6} {r.n:>9,} {r.us_per_request:>11.1f} {r.cpu_us_per_request:>10.1f} "
            f"{r.num_steps:>9,} "
            f"{r.peak_rss_mib:>12.0f} {r.peak_rss_mib - r.baseline_rss_mib:>13.0f} "
            f"{r.rounds:>6}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m refserve.sim.simbench", description=__doc__)
    p.add_argument("--sizes", default="1000,10000,100000", help="comma-separated")
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--worker", nargs=2, metavar=("N", "SHAPE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        point = measure(int(args.worker[0]), args.worker[1])
        print(json.dumps(asdict(point)))
        return 0
    sizes = [int(x) for x in args.sizes.split(",")]
    shapes = args.shapes.split(",")
    print(render(run(sizes, shapes, args.rounds)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
