"""Migration: sending a request's K/V against recomputing it (docs/MIGRATION.md, "The cost
rule"; the figures: conformance/bench/migration.py).

Per context length, in process, with the tiny model on the CPU: the time to move a
request holding that many tokens of K/V to another engine with its K/V (``migrate`` with
``kv="transfer"``: export, stage, write, ack, release, commit; prefix caching off, so
every block travels), against one prefill step of the same tokens on an engine that holds
none of them (the recompute a move without its K/V leaves to the destination; the engine
is built and warmed before the timing, prefix caching off). One torch thread for both.
Every round measures every length both ways, the order alternating; the figures are
medians over rounds, the ratio is against the recompute measured in the same run, and
the break-even length is where sending starts to win. ``make bench`` writes them to
out/bench-migration.json (the ``extra_info`` of the one benchmark), and
docs/BENCHMARKS.md renders them. Run: ``make bench`` (or
``pytest tests/bench/test_migration_bench.py --benchmark-only -s``).
"""

from __future__ import annotations

import gc
import time

import torch
from pytest_benchmark.fixture import BenchmarkFixture

from refserve.conformance.bench.migration import summarise, table
from refserve.core.config import SchedulerConfig
from refserve.engine.llm_engine import LLMEngine
from refserve.engine.migration import migrate
from refserve.model.sampler import SamplingParams

LENGTHS = (1, 4, 16, 64, 256, 1024, 4000)  # tokens of context (the tiny model holds 4,096)
ROUNDS = 15
WARMUP = 2
BLOCK_SIZE = 16
CONFIG = SchedulerConfig(
    block_size=BLOCK_SIZE,
    num_blocks=300,  # 4,800 token slots: the longest context and its next token
    max_num_batched_tokens=4096,  # every prefill in one step
    enable_prefix_caching=False,
)


def _prompt(n: int) -> list[int]:
    return [(7 * i) % 250 + 3 for i in range(n)]


def _holding(n: int) -> tuple[LLMEngine, LLMEngine]:
    """A source engine whose request ``r`` holds ``n`` tokens of K/V (prefilled, its first
    token sampled), and an empty destination like it."""
    src, dst = (
        LLMEngine("tiny", scheduler_config=CONFIG),
        LLMEngine("tiny", scheduler_config=CONFIG),
    )
    src.add_request(_prompt(n), SamplingParams(max_tokens=64, ignore_eos=True), request_id="r")
    src.step()
    kv = src.scheduler.requests["r"].num_computed_tokens
    assert kv == n, f"{kv} tokens of K/V after the prefill, expected {n}"
    return src, dst


def _transfer(pair: list[LLMEngine]) -> float:
    """One move of ``r`` to the other engine of ``pair`` (which then swaps), in seconds."""
    t0 = time.perf_counter()
    migrate(pair[0], pair[1], "r", kv="transfer")
    elapsed = time.perf_counter() - t0
    pair.reverse()
    return elapsed


def _recomputing(n: int) -> LLMEngine:
    """The engine that prefills ``n`` tokens each round: built and warmed outside the
    timing (its pages touched, its first step's one-time costs paid); prefix caching is
    off, so it never holds any of them when a round starts."""
    engine = LLMEngine("tiny", scheduler_config=CONFIG)
    engine.generate([_prompt(n)], SamplingParams(max_tokens=1))
    return engine


def _recompute(engine: LLMEngine, n: int) -> float:
    """One prefill step of ``n`` tokens, in seconds."""
    engine.add_request(_prompt(n), SamplingParams(max_tokens=1))
    t0 = time.perf_counter()
    engine.step()
    elapsed = time.perf_counter() - t0
    assert not engine.scheduler.requests, "the prefill took more than one step"
    return elapsed


def measure() -> dict[str, object]:
    pairs = {n: list(_holding(n)) for n in LENGTHS}
    engines = {n: _recomputing(n) for n in LENGTHS}
    transfer: dict[int, list[float]] = {n: [] for n in LENGTHS}
    recompute: dict[int, list[float]] = {n: [] for n in LENGTHS}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # both sides on one thread: the shared cores vary less
    try:
        for i in range(WARMUP + ROUNDS):
            for n in LENGTHS:
                gc.collect()
                if i % 2:  # alternate which goes first: neither always runs on a warm cache
                    r, t = _recompute(engines[n], n), _transfer(pairs[n])
                else:
                    t, r = _transfer(pairs[n]), _recompute(engines[n], n)
                if i >= WARMUP:
                    transfer[n].append(t)
                    recompute[n].append(r)
    finally:
        torch.set_num_threads(threads)
    per_token = pairs[LENGTHS[0]][0].cache.bytes_per_token
    return summarise(transfer, recompute, BLOCK_SIZE, per_token)


def test_transfer_against_recompute(benchmark: BenchmarkFixture) -> None:
    figures = benchmark.pedantic(measure, rounds=1, iterations=1)
    benchmark.extra_info.update(figures)
    print("\n" + "\n".join(table(figures)))
    rows = figures["figures"]
    assert isinstance(rows, list) and [r["tokens"] for r in rows] == list(LENGTHS)
    # Sending scales with the bytes; recomputing with the forward: the longest context
    # costs more than the shortest either way.
    assert rows[-1]["transfer_s"] > rows[0]["transfer_s"]
    assert rows[-1]["recompute_s"] > rows[0]["recompute_s"]
