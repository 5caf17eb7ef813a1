"""What journaling K/V costs a step (docs/ARCHITECTURE.md, "Atomic steps"; ref/model/executor.py).

Times 200 engine steps of the tiny model (CPU) with ``ModelExecutor.begin`` saving what
each step may write, and with ``begin`` replaced by a no-op, in interleaved rounds (the
order alternates, so drift in the machine's load hits both alike); prints the medians,
the overhead, and what one ``begin`` and one ``rollback`` of a decode step cost. Not
collected by pytest.

Run: ``.venv/bin/python tests/bench/kv_journal_overhead.py [rounds]``
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

from refserve.core.config import SchedulerConfig
from refserve.core.inputs import ModelInputs
from refserve.core.plan import StepPlan
from refserve.engine.llm_engine import LLMEngine
from refserve.model.sampler import SamplingParams

STEPS = 200


def engine(journal: bool) -> LLMEngine:
    # 16 requests of 48-token prompts and 200 outputs: prefill chunks, then decodes of
    # the whole batch, the steady state most steps are in.
    cfg = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=16, num_blocks=512)
    e = LLMEngine("tiny", scheduler_config=cfg)
    g = torch.Generator().manual_seed(0)
    for i in range(16):
        prompt = torch.randint(3, 250, (48,), generator=g).tolist()
        e.add_request(prompt, SamplingParams(max_tokens=200, ignore_eos=True), request_id=f"r{i}")
    if not journal:
        e.executor.begin = lambda plan, inputs: None  # type: ignore[method-assign]
    return e


def timed(journal: bool, in_begin: list[float] | None = None) -> float:
    """Wall time of STEPS steps; with ``in_begin``, also the share spent inside
    ``begin`` (the direct cost, unaffected by load on the other rounds)."""
    e = engine(journal)
    if journal and in_begin is not None:
        ex = e.executor
        begin = ex.begin
        spent = [0.0]

        def timed_begin(plan: StepPlan, inputs: ModelInputs | None) -> None:
            t = time.perf_counter()
            begin(plan, inputs)
            spent[0] += time.perf_counter() - t

        ex.begin = timed_begin  # type: ignore[method-assign]
    t0 = time.perf_counter()
    for _ in range(STEPS):
        e.step()
    total = time.perf_counter() - t0
    if journal and in_begin is not None:
        in_begin.append(spent[0] / total)
    return total


def begin_and_rollback_ms() -> tuple[float, float]:
    """Medians of one ``begin`` and one ``rollback`` of a decode step of the 16 requests
    (after 60 steps), in ms."""
    e = engine(True)
    for _ in range(60):
        e.step()
    ex, sched = e.executor, e.scheduler
    begins, rollbacks = [], []
    for _ in range(200):
        plan = sched.schedule(e.now_ms())
        inputs = e.core._inputs(plan)
        t0 = time.perf_counter()
        ex.begin(plan, inputs)
        t1 = time.perf_counter()
        ex.rollback()
        t2 = time.perf_counter()
        sched.rollback()
        begins.append(t1 - t0)
        rollbacks.append(t2 - t1)
    return statistics.median(begins) * 1e3, statistics.median(rollbacks) * 1e3


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 7
    load = os.getloadavg()[0]
    timed(True)  # warm up (allocator, first kernels)
    on: list[float] = []
    off: list[float] = []
    share: list[float] = []
    for r in range(rounds):
        for journal in (True, False) if r % 2 == 0 else (False, True):
            (on if journal else off).append(timed(journal, share))
    m_on, m_off = statistics.median(on), statistics.median(off)
    paired = statistics.median(a / b for a, b in zip(on, off, strict=True))
    begin, rollback = begin_and_rollback_ms()
    print(f"load average at start: {load:.2f}; {rounds} rounds of {STEPS} steps")
    print(f"with journal:    median {m_on * 1e3:8.1f} ms  ({m_on / STEPS * 1e3:.3f} ms/step)")
    print(f"without journal: median {m_off * 1e3:8.1f} ms  ({m_off / STEPS * 1e3:.3f} ms/step)")
    a_b = (m_on / m_off - 1) * 100
    print(f"A/B overhead: {a_b:+.1f} % (medians), {(paired - 1) * 100:+.1f} % (paired rounds)")
    print(f"time inside begin: {statistics.median(share) * 100:.2f} % of step time (median)")
    print(f"one decode step of 16 requests: begin {begin:.3f} ms, rollback {rollback:.3f} ms")


if __name__ == "__main__":
    main()
