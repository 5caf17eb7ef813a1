"""refserve's side of ``make bench-peers`` (runs in refserve's own venv).

The timed step is refserve's full CPU step, as ``tests/bench/test_step_bench.py`` times
it: ``Scheduler.schedule()``, ``build_inputs()`` (token ids, positions, slot mapping and
block tables as int arrays: what the executor receives) and ``Scheduler.commit()``
with the sampled tokens as an int tensor (append them, stop checks, KV bookkeeping,
prefix-cache indexing of the blocks that fill). The scheduler runs with its defaults
(the bulk decode path on the persistent batch, invariant checks off);
``python -m refserve.conformance.bench.ref_worker --reference-loop`` (the ``ref-loop`` engine of
``refserve.conformance.bench.peers``) forces the per-request reference loop instead, in a
process of its own, so neither path's garbage is collected in the other's time.

The block-pool round is ``BlockPool.allocate`` of a new request's ``POOL_K`` full blocks
(its token ids stored in its table; with prefix caching each full block hashed with
``refserve.spec.hashing.block_key``, sha256 over the parent key and the block's 16 token ids as
int64, 160 bytes, and indexed, every pop evicting a cached block) then ``BlockPool.free``,
outside any step transaction.
"""

from __future__ import annotations

import sys
import time
from importlib import metadata

import torch

from refserve.conformance.bench import workload as W
from refserve.conformance.bench.worker import Unsupported, serve
from refserve.core.config import SchedulerConfig
from refserve.core.inputs import build_inputs
from refserve.core.request import Request, StopParams
from refserve.core.scheduler import Scheduler
from refserve.kv import BlockPool


class _PoolState:
    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.round = 0


class RefBench:
    fast_decode = True
    phases = ("schedule", "build_inputs", "commit")
    includes = (
        "Scheduler.schedule() + build_inputs() (token ids, positions, slot mapping, block "
        "tables as int arrays, what the executor receives) + Scheduler.commit()"
    )

    @property
    def name(self) -> str:
        try:
            name = f"refserve {metadata.version('refserve')}"
        except metadata.PackageNotFoundError:
            name = "refserve"
        return name if self.fast_decode else f"{name}, reference loop"

    def setup(self, shape: W.Shape) -> object:
        cfg = SchedulerConfig(
            max_num_batched_tokens=shape.max_num_batched_tokens,
            max_num_seqs=shape.max_num_seqs,
            block_size=W.BLOCK_SIZE,
            num_blocks=shape.num_blocks,
            enable_prefix_caching=shape.prefix_caching,
        )
        s = Scheduler(cfg)
        # The benchmark's baseline: the same scheduler on its per-request path.
        s.fast_decode = self.fast_decode
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

    pool_includes = (
        "BlockPool.allocate(new request, POOL_K full blocks: validation, a block table "
        "holding the token ids, with caching sha256 per full block via "
        "refserve.spec.hashing.block_key over 160 bytes, indexing, eviction on pop) + "
        "BlockPool.free"
    )

    def pool_setup(self, prefix_caching: bool, hashing: str) -> object:
        if hashing != "same":
            raise Unsupported(f"refserve has one block hashing (block_key), not {hashing!r}")
        pool = BlockPool(W.POOL_BLOCKS, W.BLOCK_SIZE, enable_prefix_caching=prefix_caching)
        if prefix_caching:
            warm = W.pool_warm_tokens(pool.num_free_blocks)
            pool.allocate("warm", warm, len(warm))
            pool.free("warm")
        return _PoolState(pool)

    def pool_round(self, state: object) -> int:
        assert isinstance(state, _PoolState)
        pool = state.pool
        tokens = W.pool_tokens(state.round)
        state.round += 1
        n = len(tokens)
        t0 = time.perf_counter_ns()
        pool.allocate("r", tokens, n)
        pool.free("r")
        return time.perf_counter_ns() - t0

    def step(self, state: object) -> tuple[int, ...]:
        assert isinstance(state, Scheduler)
        s = state
        t0 = time.perf_counter_ns()
        plan = s.schedule()
        t1 = time.perf_counter_ns()
        inputs = build_inputs(plan, s.requests, s.pool, s.batch)
        t2 = time.perf_counter_ns()
        sampled = torch.full((len(inputs.sample_request_ids),), W.SAMPLED)  # the model's output
        t3 = time.perf_counter_ns()
        s.commit(plan, sampled)
        t4 = time.perf_counter_ns()
        if len(sampled) != len(s.running):
            raise RuntimeError(f"a step sampled {len(sampled)} of {len(s.running)} requests")
        return (t1 - t0, t2 - t1, t4 - t3)


class RefLoopBench(RefBench):
    """refserve forced onto the per-request reference loop (``fast_decode=False``)."""

    fast_decode = False


if __name__ == "__main__":
    raise SystemExit(serve(RefLoopBench if "--reference-loop" in sys.argv else RefBench))
