"""Recompute vs swap: one memory-pressure trace under each preemption mode at two host-link
speeds, docs/GUIDE.md's memory-pressure experiment as a section of ``refserve compare``'s
report (docs/ARCHITECTURE.md, example 3).

Real token lengths (no scale); times are the simulator's virtual ms.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from refserve.core.config import SchedulerConfig
from refserve.core.cost import StepCost
from refserve.core.request_metrics import RequestMetrics
from refserve.core.scheduler import Scheduler
from refserve.core.swap import PreemptionMode, SwapCost
from refserve.sim.metrics import RunMetrics, percentile
from refserve.sim.simulator import simulate
from refserve.sim.trace import load_trace

# docs/GUIDE.md's memory-pressure experiment ("Recompute vs swap"): a 7B-like model
# (512 KiB of KV per token), a pool small enough that 12 long requests preempt each other.
# At 25 GB/s the round trip (0.042 ms/token) is cheaper than recomputing (0.07 ms/token);
# at 8 GB/s (0.131) dearer.
SWAP_TRACE = "memory_pressure"
SWAP_COST = "7+0.07P+0.05D"
SWAP_KV_BYTES_PER_TOKEN = 512 * 1024
SWAP_HOST_BLOCKS = 4096
SWAP_LINKS_GB_PER_S = (25.0, 8.0)
SWAP_CONFIG = SchedulerConfig(max_num_batched_tokens=2048, block_size=16, num_blocks=700)


@dataclass(frozen=True)
class SwapResult:
    """One preemption mode on the memory-pressure trace (times in virtual ms)."""

    mode: str
    link_gb_per_s: float | None  # None: recompute, no host link used
    makespan_ms: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    e2e_p99_ms: float | None
    preemptions: int
    swapped_out: int  # requests whose KV went to the host

    @property
    def label(self) -> str:
        return (
            self.mode if self.link_gb_per_s is None else f"{self.mode} {self.link_gb_per_s:g} GB/s"
        )


def run_swap_comparison() -> list[SwapResult]:
    """The same trace under recompute, swap and auto preemption at two link speeds."""
    cost = StepCost.parse(SWAP_COST)
    trace = load_trace(SWAP_TRACE)
    runs: list[tuple[PreemptionMode, float | None]] = [(PreemptionMode.RECOMPUTE, None)]
    runs += [
        (m, g) for g in SWAP_LINKS_GB_PER_S for m in (PreemptionMode.SWAP, PreemptionMode.AUTO)
    ]
    out: list[SwapResult] = []
    for mode, link in runs:
        cfg = SWAP_CONFIG
        if link is not None:
            cfg = dataclasses.replace(
                cfg,
                preemption_mode=mode,
                num_host_blocks=SWAP_HOST_BLOCKS,
                swap_cost=SwapCost(SWAP_KV_BYTES_PER_TOKEN, link, iteration=cost),
            )
        result = simulate(Scheduler(cfg), [t.to_request() for t in trace], cost, keep_steps=False)
        reqs = [RequestMetrics.of(r) for r in result.requests]
        run = RunMetrics.of(reqs, result.makespan_ms)
        e2es = [e for m in reqs if (e := m.e2e_ms) is not None]
        out.append(
            SwapResult(
                mode=mode.value,
                link_gb_per_s=link,
                makespan_ms=result.makespan_ms,
                ttft_p50_ms=run.ttft_ms["p50"],
                ttft_p99_ms=run.ttft_ms["p99"],
                itl_p50_ms=run.itl_ms["p50"],
                itl_p99_ms=run.itl_ms["p99"],
                e2e_p99_ms=percentile(e2es, 99),
                preemptions=run.num_preemptions,
                swapped_out=0 if result.swap is None else result.swap.num_swapped_out,
            )
        )
    return out
