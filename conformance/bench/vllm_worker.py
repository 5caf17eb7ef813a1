"""vLLM's side of ``make bench-peers`` (runs in ``.venv-vllm``).

The engine is built exactly as the conformance adapter builds it
(``conformance.adapters.vllm.VllmAdapter.configure``: vLLM 0.33.0's synchronous V1
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
"""

from __future__ import annotations

import time
from typing import Any

from conformance.adapter import EngineConfig, RequestSpec
from conformance.bench import workload as W
from conformance.bench.worker import serve


class VllmBench:
    phases = ("schedule", "update_from_output")
    includes = (
        "Scheduler.schedule() + Scheduler.update_from_output(); input preparation lives in "
        "vLLM's GPU model runner (GPUModelRunner._prepare_inputs) and is not included"
    )

    def __init__(self) -> None:
        from conformance.adapters import vllm as adapter_module

        self._mod: Any = adapter_module
        self._v: Any = adapter_module.V

    @property
    def name(self) -> str:
        return f"vLLM {self._v.version}"

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
        sched = adapter._sched
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


if __name__ == "__main__":
    raise SystemExit(serve(VllmBench))
