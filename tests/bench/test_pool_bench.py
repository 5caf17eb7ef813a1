"""BlockPool micro-benchmarks at 1k and 100k blocks (``make bench``; skipped by ``make test``).

Each benchmark moves ``K`` blocks per round, so cost per block is ``mean / K``; the
groups put the two pool sizes side by side so "cost per operation does not grow with pool
size" can be read off the table (``extra_info`` carries K and the pool size). Pools are
built once per test (O(num_blocks) setup, outside the timed rounds), half of them held by
background requests, and with prefix caching every free block starts out cached so each
pop also evicts, in both sizes alike.

``python tests/bench/test_pool_bench.py [rounds]`` (not collected by pytest) times
allocate + free of K blocks on the two sizes in interleaved rounds, the order alternating,
and prints the medians per block and the 100k / 1k ratio; the side-by-side figures against
vLLM's BlockPool are ``make bench-peers`` (conformance/bench/peers.py, "Block pool").
"""

from __future__ import annotations

import statistics
import sys
import time
from itertools import count
from typing import Any

import pytest

from refserve.kv import BlockPool, fork

BS = 16
K = 32  # blocks moved per timed round
SIZES = [1_000, 100_000]

Benchmark = Any  # pytest-benchmark's fixture type is not exported


def make_pool(num_blocks: int, caching: bool) -> BlockPool:
    """Half the blocks held by background requests; with caching, every free block cached."""
    pool = BlockPool(num_blocks, BS, enable_prefix_caching=caching)
    tokens = count()
    per_req = 64
    for i in range(num_blocks // 2 // per_req):
        pool.allocate(f"bg{i}", [next(tokens) for _ in range(per_req * BS)], per_req * BS)
    if caching:
        warm = pool.num_free_blocks
        pool.allocate("warm", [next(tokens) for _ in range(warm * BS)], warm * BS)
        pool.free("warm")
    return pool


def _per_block(benchmark: Benchmark, num_blocks: int, group: str) -> None:
    benchmark.group = group
    benchmark.extra_info["pool_blocks"] = num_blocks
    benchmark.extra_info["blocks_per_round"] = K


@pytest.mark.parametrize("num_blocks", SIZES)
@pytest.mark.parametrize("caching", [False, True], ids=["nocache", "cache"])
def test_allocate_free(benchmark: Benchmark, num_blocks: int, caching: bool) -> None:
    """Allocate K fresh blocks for a new request, then free it (unique tokens per round)."""
    pool = make_pool(num_blocks, caching)
    _per_block(
        benchmark, num_blocks, f"allocate+free K={K} blocks ({'cache' if caching else 'no cache'})"
    )
    n = K * BS
    fresh = count(10**9)

    def setup() -> tuple[tuple[list[int]], dict[str, Any]]:
        return ([next(fresh) for _ in range(n)],), {}

    def round_(toks: list[int]) -> None:
        pool.allocate("r", toks, n)
        pool.free("r")

    benchmark.pedantic(round_, setup=setup, rounds=2000, iterations=1, warmup_rounds=50)
    assert not pool.has_request("r")


@pytest.mark.parametrize("num_blocks", SIZES)
def test_prefix_lookup(benchmark: Benchmark, num_blocks: int) -> None:
    """Look up a prompt whose first K blocks are cached (K hashes + K identity checks)."""
    pool = make_pool(num_blocks, True)
    prompt = list(range(-1, -(K * BS + 2), -1))
    pool.allocate("holder", prompt, len(prompt))
    _per_block(benchmark, num_blocks, f"prefix lookup K={K} blocks")
    hit = benchmark(pool.lookup, prompt)
    assert len(hit.block_ids) == K


@pytest.mark.parametrize("num_blocks", SIZES)
def test_fork(benchmark: Benchmark, num_blocks: int) -> None:
    """Fork a K-block request and free the child."""
    pool = make_pool(num_blocks, True)
    parent = list(range(-1, -(K * BS), -1))  # K blocks, the last one partial
    pool.allocate("parent", parent, len(parent))
    _per_block(benchmark, num_blocks, f"fork+free K={K} blocks")

    def round_() -> None:
        fork(pool, "parent", "child")
        pool.free("child")

    benchmark(round_)
    assert len(pool.block_table("parent")) == K


@pytest.mark.parametrize("num_blocks", SIZES)
def test_decode_append(benchmark: Benchmark, num_blocks: int) -> None:
    """One decode token for each of D requests (a new block every BS steps)."""
    d = 8
    pool = make_pool(num_blocks, True)
    seqs = {f"d{i}": list(range(i * 10**6, i * 10**6 + 5)) for i in range(d)}
    for rid, toks in seqs.items():
        pool.allocate(rid, toks, len(toks))
    benchmark.group = f"decode append x{d} requests"
    benchmark.extra_info["pool_blocks"] = num_blocks
    benchmark.extra_info["tokens_per_round"] = d

    def step() -> None:
        for rid, toks in seqs.items():
            toks.append(len(toks))
            pool.allocate(rid, toks, 1)

    # 40 new blocks per request: fits the 1k pool's ~500 free blocks.
    benchmark.pedantic(step, rounds=BS * 40, iterations=1)


def interleaved_sizes(rounds: int) -> dict[bool, dict[int, float]]:
    """Median us per block of allocate + free of K fresh blocks, per caching and pool
    size, the sizes' rounds interleaved (order alternating) so load drift hits both."""
    out: dict[bool, dict[int, float]] = {}
    for caching in (False, True):
        pools = [(n, make_pool(n, caching)) for n in SIZES]
        fresh = count(10**9)
        times: dict[int, list[int]] = {n: [] for n in SIZES}
        for r in range(rounds):
            for n, pool in pools if r % 2 == 0 else pools[::-1]:
                tokens = [next(fresh) for _ in range(K * BS)]
                t0 = time.perf_counter_ns()
                pool.allocate("r", tokens, K * BS)
                pool.free("r")
                times[n].append(time.perf_counter_ns() - t0)
        warm = rounds // 10
        out[caching] = {n: statistics.median(t[warm:]) / K / 1e3 for n, t in times.items()}
    return out


if __name__ == "__main__":
    figures = interleaved_sizes(int(sys.argv[1]) if len(sys.argv) > 1 else 3000)
    for caching, per_size in figures.items():
        lo, hi = per_size[SIZES[0]], per_size[SIZES[-1]]
        print(
            f"allocate+free, {'prefix caching' if caching else 'no prefix caching'}: "
            f"{lo:.3f} us/block at {SIZES[0]} blocks, {hi:.3f} at {SIZES[-1]}, "
            f"ratio {hi / lo:.2f}"
        )
