"""One full CPU step with N running decode requests (block 16, invariant checks off).

Measures ``schedule()``, building the executor inputs (token ids, positions, slot
mapping, block tables as int arrays) and ``commit()`` together, per running request.
The bulk path runs on the persistent batch (docs/ARCHITECTURE.md, "The persistent
batch"). The interleaved bulk-vs-reference figures with prefix caching off and on, and
the memory per request, come from ``refserve.conformance.bench.peers --engines ref ref-loop`` and
``refserve.conformance.bench.memory`` (the last part of ``make bench``); side by side with vLLM
and nano-vllm-fork: ``make bench-peers``.
Run: ``make bench`` (or ``pytest tests/bench/test_step_bench.py --benchmark-only``).
"""

from __future__ import annotations

import gc
import os

import pytest
import torch
from pytest_benchmark.fixture import BenchmarkFixture

from refserve.core.config import SchedulerConfig
from refserve.core.inputs import build_inputs
from refserve.core.request import Request, StopParams
from refserve.core.scheduler import Scheduler
from tests.harness import reference_loop

PROMPT_LEN = 100  # ~7 blocks of KV per request when the measurement starts


def running_decodes(n: int, *, fast_decode: bool = True) -> Scheduler:
    cfg = SchedulerConfig(
        max_num_batched_tokens=max(2048, 2 * n), max_num_seqs=n, block_size=16, num_blocks=n * 64
    )
    s = Scheduler(cfg) if fast_decode else reference_loop(Scheduler(cfg))
    for i in range(n):
        prompt = [(i * 31 + j) % 30000 + 1 for j in range(PROMPT_LEN)]
        s.add_request(Request(f"r{i}", prompt, StopParams(max_tokens=1 << 20, ignore_eos=True)))
    while s.waiting or any(r.num_output_tokens == 0 for r in s.running):
        plan = s.schedule()
        s.commit(
            plan, {rid: 5 for rid, smp in zip(plan.request_ids, plan.samples, strict=True) if smp}
        )
    return s


def one_step(s: Scheduler) -> None:
    plan = s.schedule()
    inputs = build_inputs(plan, s.requests, s.pool, s.batch)
    s.commit(plan, torch.full((len(inputs.sample_request_ids),), 7))


@pytest.mark.parametrize("fast_decode", [True, False], ids=["bulk", "reference"])
@pytest.mark.parametrize("n", [64, 256, 1024])
def test_decode_step(benchmark: BenchmarkFixture, n: int, fast_decode: bool) -> None:
    s = running_decodes(n, fast_decode=fast_decode)
    gc.collect()
    benchmark.extra_info["running_requests"] = n
    # REFSERVE_BENCH_NOGC=1 measures without the cyclic GC, to see its share.
    no_gc = os.environ.get("REFSERVE_BENCH_NOGC") == "1"
    if no_gc:
        gc.disable()
    try:
        benchmark.pedantic(one_step, args=(s,), rounds=30, iterations=1, warmup_rounds=3)
    finally:
        if no_gc:
            gc.enable()
    per_request_us = benchmark.stats.stats.median / n * 1e6
    benchmark.extra_info["us_per_request"] = round(per_request_us, 3)
    path = "bulk" if fast_decode else "reference"
    print(f"\nN={n} {path}: {per_request_us:.2f} us per running request per step")
