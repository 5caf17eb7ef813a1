"""Simulator cost per request from 1k to 1M requests (``make bench``; skipped by ``make test``).

Two trace shapes (ref/sim/simbench.py): ``steady`` (arrivals spread so the engine is about
60 % busy) and ``burst`` (every request at time 0). Each point runs in a fresh process
for its own peak RSS; rounds are interleaved and the medians compared, all in this one
run, so the checks below cannot pass on figures from another machine or day:

* steady: CPU time per request flat within 1.5x from 1k to 1M requests;
* burst: every size up to 1M finishes (the 100k case used not to within 290 s).

About 15 minutes on a shared 2-core machine, most of it the two 1M runs. The table it
prints is described in docs/GUIDE.md ("The simulator"); its figures reach
docs/BENCHMARKS.md through ``extra_info``. ``make test`` runs the cheap guard
instead (tests/sim/test_sim_scaling.py).
"""

from __future__ import annotations

from pytest_benchmark.fixture import BenchmarkFixture

from refserve.sim.simbench import Row, render, run

SIZES = (1000, 10_000, 100_000, 1_000_000)


def test_simulator_cost_per_request_is_flat(benchmark: BenchmarkFixture) -> None:
    rows: list[Row] = benchmark.pedantic(
        run, args=(SIZES, ("steady", "burst"), 3), rounds=1, iterations=1
    )
    print("\n" + render(rows))
    for r in rows:
        benchmark.extra_info[f"{r.shape} {r.n} us/request CPU"] = round(r.cpu_us_per_request, 1)
        benchmark.extra_info[f"{r.shape} {r.n} peak RSS MiB"] = round(r.peak_rss_mib)
    steady = [r.cpu_us_per_request for r in rows if r.shape == "steady"]
    spread = max(steady) / min(steady)
    benchmark.extra_info["steady spread"] = round(spread, 2)
    assert len(steady) == len(SIZES) and spread <= 1.5, f"steady: {spread:.2f}x from 1k to 1M"
    # measure() asserts that every request finished; here: every burst size was run.
    assert sorted(r.n for r in rows if r.shape == "burst") == list(SIZES)
