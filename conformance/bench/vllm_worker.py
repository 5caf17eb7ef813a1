"""vLLM's side of ``make bench-peers`` (runs in ``.venv-vllm``).

The engine is built exactly as the conformance adapter builds it
(``refserve.conformance.adapters.vllm.VllmAdapter.configure``: vLLM 0.33.0's synchronous V1
``Scheduler`` and ``KVCacheManager`` from a ``VllmConfig``, fcfs, chunked prefill on,
prefix caching as configured, with vLLM's block hasher when it is on); requests are
submitted through the adapter (vLLM's ``Request`` with its ``SamplingParams``).

The timed step is ``Scheduler.schedule()`` + ``Scheduler.update_from_output()``. The
``ModelRunnerOutput`` handed to ``update_from_output`` (one sampled token per request) is
built between the two, untimed: it is the model runner's output. vLLM's input preparation
(token ids, positions, slot mapping, block tables) lives in its GPU model runner
(``GPUModelRunner._prepare_inputs``, with Triton kernels for the slot mapping) and cannot
run here, so it is **not** in vLLM's timed step, unlike refserve's ``build_inputs`` and
nano-vllm's ``prepare_decode``.

The block-pool round is vLLM's ``BlockPool`` alone (``vllm/v1/core/block_pool.py``,
``POOL_BLOCKS`` blocks, events and metrics off): ``get_new_blocks(POOL_K)`` then
``free_blocks(reversed(blocks))``, as ``KVCacheManager.free`` orders them. With prefix
caching the round first hashes each full block, then ``cache_full_blocks`` indexes
them, every pop evicting a cached block. Hashing ``same``: ``refserve.spec.hashing.block_key``,
refserve's function (sha256 over the parent key and the block's 16 token ids as int64,
160 bytes), so both engines hash the same bytes; ``native``: vLLM's own
``hash_block_tokens(sha256, ...)`` (sha256 over the pickle of (parent hash, token tuple,
None)), what ``get_request_block_hasher`` computes when a request gains a full block.
"""

from __future__ import annotations

import importlib
import time
from types import SimpleNamespace
from typing import Any

from refserve.conformance.adapter import EngineConfig, RequestSpec
from refserve.conformance.bench import workload as W
from refserve.conformance.bench.worker import Unsupported, serve


class _PoolState:
    def __init__(self, pool: Any, hashing: str | None, hash_fn: Any, root: bytes | None) -> None:
        self.pool = pool
        self.hashing = hashing  # None: no prefix caching
        self.hash_fn = hash_fn
        self.root = root
        self.sha256: Any = None  # vLLM's hash function, for its native hashing
        self.request = SimpleNamespace(block_hashes=[])
        self.round = 0


class VllmBench:
    phases = ("schedule", "update_from_output")
    includes = (
        "Scheduler.schedule() + Scheduler.update_from_output(); input preparation lives in "
        "vLLM's GPU model runner (GPUModelRunner._prepare_inputs) and is not included"
    )

    def __init__(self) -> None:
        from refserve.conformance.adapters import vllm as adapter_module

        self._mod: Any = adapter_module
        self._v: Any = adapter_module.V

    @property
    def name(self) -> str:
        return f"vLLM {self._v.version}"

    pool_includes = (
        "BlockPool.get_new_blocks(POOL_K) + BlockPool.free_blocks(reversed); with caching "
        "also the block hashes (sha256 per full block: same = refserve.spec.hashing.block_key over "
        "the same 160 bytes as refserve, native = vLLM's hash_block_tokens(sha256), a "
        "pickle) + BlockPool.cache_full_blocks, eviction on pop"
    )

    def pool_setup(self, prefix_caching: bool, hashing: str) -> object:
        from refserve.spec.hashing import DEFAULT_NAMESPACE, block_key

        sha256 = importlib.import_module("vllm.utils.hashing").sha256
        kv_cache_utils: Any = importlib.import_module("vllm.v1.core.kv_cache_utils")
        pool = importlib.import_module("vllm.v1.core.block_pool").BlockPool(
            W.POOL_BLOCKS, prefix_caching, W.BLOCK_SIZE
        )
        if not prefix_caching:
            return _PoolState(pool, None, None, None)
        if hashing == "same":
            state = _PoolState(pool, hashing, block_key, DEFAULT_NAMESPACE.root_key())
        elif hashing == "native":
            kv_cache_utils.init_none_hash(sha256)
            state = _PoolState(pool, hashing, kv_cache_utils.hash_block_tokens, None)
            state.sha256 = sha256
        else:
            raise Unsupported(f"no block hashing {hashing!r}")
        n = pool.get_num_free_blocks()
        blocks = pool.get_new_blocks(n)
        state.request.block_hashes = _chain(state, W.pool_warm_tokens(n), n)
        pool.cache_full_blocks(state.request, blocks, 0, n, W.BLOCK_SIZE, 0)
        pool.free_blocks(reversed(blocks))
        return state

    def pool_round(self, state: object) -> int:
        assert isinstance(state, _PoolState)
        pool, k, bs = state.pool, W.POOL_K, W.BLOCK_SIZE
        tokens = W.pool_tokens(state.round)
        state.round += 1
        if state.hashing is None:
            t0 = time.perf_counter_ns()
            pool.free_blocks(reversed(pool.get_new_blocks(k)))
            return time.perf_counter_ns() - t0
        t0 = time.perf_counter_ns()
        state.request.block_hashes = _chain(state, tokens, k)
        blocks = pool.get_new_blocks(k)
        pool.cache_full_blocks(state.request, blocks, 0, k, bs, 0)
        pool.free_blocks(reversed(blocks))
        return time.perf_counter_ns() - t0

    def _runner_output(self, sched: Any, out: Any, token: int) -> Any:
        """One token for each request whose scheduled tokens reach its known tokens
        (``schedule()`` already advanced ``num_computed_tokens``), none for a partial
        prefill: what vLLM's model runner returns."""
        ids = list(out.num_scheduled_tokens)
        reqs = sched.requests
        return self._v.ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={rid: i for i, rid in enumerate(ids)},
            sampled_token_ids=[
                [token] if reqs[rid].num_computed_tokens >= reqs[rid].num_tokens else []
                for rid in ids
            ],
        )

    def setup(self, shape: W.Shape) -> object:
        adapter = self._mod.VllmAdapter()
        adapter.configure(
            EngineConfig(
                block_size=W.BLOCK_SIZE,
                num_blocks=shape.num_blocks,
                max_num_batched_tokens=shape.max_num_batched_tokens,
                max_num_seqs=shape.max_num_seqs,
                enable_prefix_caching=shape.prefix_caching,
            )
        )
        for i in range(shape.n):
            adapter.add_request(RequestSpec(W.request_id(i), tuple(W.prompt(i)), W.MAX_TOKENS))
        sched = adapter.scheduler
        reqs = sched.requests
        while any(r.num_output_tokens == 0 for r in reqs.values()):
            out = sched.schedule()
            sched.update_from_output(out, self._runner_output(sched, out, W.PREFILL_TOKEN))
        decoding = sum(1 for r in reqs.values() if r.num_computed_tokens == r.num_tokens - 1)
        if len(sched.running) != shape.n or decoding != shape.n:
            raise RuntimeError(
                f"{len(sched.running)} running, {decoding} decoding of {shape.n} after prefill"
            )
        return sched

    def step(self, state: object) -> tuple[int, ...]:
        sched: Any = state
        t0 = time.perf_counter_ns()
        out = sched.schedule()
        t1 = time.perf_counter_ns()
        runner_output = self._runner_output(sched, out, W.SAMPLED)  # the model's output
        t2 = time.perf_counter_ns()
        sched.update_from_output(out, runner_output)
        t3 = time.perf_counter_ns()
        if len(out.num_scheduled_tokens) != len(sched.running):
            raise RuntimeError(f"a step scheduled {len(out.num_scheduled_tokens)} requests")
        return (t1 - t0, t3 - t2)


def _chain(state: _PoolState, tokens: list[int], num_blocks: int) -> list[Any]:
    """The chained hashes of the first ``num_blocks`` full blocks of ``tokens``, each
    function called directly as its engine calls it (no wrapper in the timed loop)."""
    bs, fn = W.BLOCK_SIZE, state.hash_fn
    parent = state.root
    hashes = []
    if state.hashing == "same":
        for i in range(num_blocks):
            parent = fn(parent, tokens[i * bs : (i + 1) * bs])
            hashes.append(parent)
        return hashes
    sha256 = state.sha256
    for i in range(num_blocks):
        parent = fn(sha256, parent, tokens[i * bs : (i + 1) * bs], None)
        hashes.append(parent)
    return hashes


if __name__ == "__main__":
    raise SystemExit(serve(VllmBench))
