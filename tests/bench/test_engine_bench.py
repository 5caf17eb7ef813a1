"""Output tokens/s of the real engine (tiny model, CPU) on one mixed workload.

Three batching modes over the same requests: continuous batching (decode-first with
chunked prefill), static batching (a batch runs until its last member finishes) and one
request at a time (``max_num_seqs=1``). The figure that matters is the ratio between
modes measured in the same run; absolute tokens/s on a shared 2-core machine are noisy.
Run: ``make bench`` (or ``pytest tests/bench/test_engine_bench.py --benchmark-only -s``).
"""

from __future__ import annotations

import random
import time

import pytest
from pytest_benchmark.fixture import BenchmarkFixture

from refserve.core.config import PolicyName, SchedulerConfig
from refserve.engine.llm_engine import LLMEngine
from refserve.model.sampler import SamplingParams

MODES = {
    "continuous": {"max_num_seqs": 16, "policy": PolicyName.DECODE_FIRST},
    "static": {"max_num_seqs": 16, "policy": PolicyName.STATIC},
    "one-at-a-time": {"max_num_seqs": 1, "policy": PolicyName.DECODE_FIRST},
}


def workload() -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(0)
    out = []
    for _ in range(16):
        prompt = [rng.randrange(0, 256) for _ in range(rng.choice((4, 8, 24, 64)))]
        # Mixed output lengths: static batching waits for the longest member.
        out.append((prompt, SamplingParams(max_tokens=rng.choice((4, 8, 32)), ignore_eos=True)))
    return out


def run_mode(mode: str) -> int:
    cfg = SchedulerConfig(max_num_batched_tokens=256, block_size=16, num_blocks=256, **MODES[mode])  # type: ignore[arg-type]
    engine = LLMEngine("tiny", scheduler_config=cfg)
    work = workload()
    results = engine.generate([p for p, _ in work], [sp for _, sp in work])
    return sum(len(o.token_ids) for r in results for o in r.outputs)


@pytest.mark.parametrize("mode", list(MODES))
def test_engine_output_tokens_per_second(benchmark: BenchmarkFixture, mode: str) -> None:
    tokens = run_mode(mode)  # warm-up, and the token count the timing divides
    benchmark.pedantic(run_mode, args=(mode,), rounds=3, iterations=1)
    tok_s = tokens / benchmark.stats.stats.median
    benchmark.extra_info["output_tokens_per_s"] = round(tok_s, 1)
    print(f"\n{mode}: {tok_s:.1f} output tok/s ({tokens} tokens)")


def test_engine_mode_ratios(benchmark: BenchmarkFixture) -> None:
    """All three modes timed back to back in one run; prints the ratios (docs/GUIDE.md,
    "Benchmarks")."""

    def all_modes() -> dict[str, float]:
        rates = {}
        for mode in MODES:
            t0 = time.perf_counter()
            tokens = run_mode(mode)
            rates[mode] = tokens / (time.perf_counter() - t0)
        return rates

    rates = benchmark.pedantic(all_modes, rounds=1, iterations=1)
    base = rates["one-at-a-time"]
    for mode, r in rates.items():
        benchmark.extra_info[mode] = round(r / base, 2)
    print(
        "\n" + ", ".join(f"{m} {r / base:.2f}x" for m, r in rates.items()) + " (vs one-at-a-time)"
    )
    assert rates["continuous"] > rates["one-at-a-time"]
