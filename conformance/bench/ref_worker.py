"""refserve's side of ``make bench-peers`` (runs in refserve's own venv).

The timed step is refserve's full CPU step, as ``tests/bench/test_step_bench.py`` times
it: ``Scheduler.schedule()``, ``build_inputs()`` (token ids, positions, slot mapping and
block tables as int tensors: what the executor receives) and ``Scheduler.commit()``
(append the sampled tokens, stop checks, KV bookkeeping, prefix-cache indexing of the
blocks that fill). The scheduler runs with its defaults (bulk decode path, invariant
checks off).
"""

from __future__ import annotations

import time
from importlib import metadata

from conformance.bench import workload as W
from conformance.bench.worker import serve
from ref.core.config import SchedulerConfig
from ref.core.inputs import build_inputs
from ref.core.request import Request, StopParams
from ref.core.scheduler import Scheduler


class RefBench:
    phases = ("schedule", "build_inputs", "commit")
    includes = (
        "Scheduler.schedule() + build_inputs() (token ids, positions, slot mapping, block "
        "tables as int tensors, what the executor receives) + Scheduler.commit()"
    )

    @property
    def name(self) -> str:
        try:
            return f"refserve {metadata.version('refserve')}"
        except metadata.PackageNotFoundError:
            return "refserve"

    def setup(self, shape: W.Shape) -> object:
        cfg = SchedulerConfig(
            max_num_batched_tokens=shape.max_num_batched_tokens,
            max_num_seqs=shape.max_num_seqs,
            block_size=W.BLOCK_SIZE,
            num_blocks=shape.num_blocks,
            enable_prefix_caching=shape.prefix_caching,
        )
        s = Scheduler(cfg)
        for i in range(shape.n):
            stop = StopParams(max_tokens=W.MAX_TOKENS, ignore_eos=True)
            s.add_request(Request(W.request_id(i), W.prompt(i), stop))
        while s.waiting or any(r.num_output_tokens == 0 for r in s.running):
            plan = s.schedule()
            s.commit(
                plan,
                {
                    rid: W.PREFILL_TOKEN
                    for rid, smp in zip(plan.request_ids, plan.samples, strict=True)
                    if smp
                },
            )
        if len(s.running) != shape.n:
            raise RuntimeError(f"{len(s.running)} of {shape.n} requests running after prefill")
        return s

    def step(self, state: object) -> tuple[int, ...]:
        assert isinstance(state, Scheduler)
        s = state
        t0 = time.perf_counter_ns()
        plan = s.schedule()
        t1 = time.perf_counter_ns()
        inputs = build_inputs(plan, s.requests, s.pool)
        t2 = time.perf_counter_ns()
        sampled = dict.fromkeys(inputs.sample_request_ids, W.SAMPLED)  # the model's output
        t3 = time.perf_counter_ns()
        s.commit(plan, sampled)
        t4 = time.perf_counter_ns()
        if len(sampled) != len(s.running):
            raise RuntimeError(f"a step sampled {len(sampled)} of {len(s.running)} requests")
        return (t1 - t0, t2 - t1, t4 - t3)


if __name__ == "__main__":
    raise SystemExit(serve(RefBench))
