"""The model executor: runs the real model on a step's flattened inputs and samples.

It plugs into :class:`ref.engine_core.EngineCore` exactly where the simulator's executor
does; the scheduler does not know which one it drives. One ``execute`` is: the plan's
swap-out copies (device -> host), its swap-in copies (host -> device), its copy-on-write
block copies, one forward over every scheduled token (prefill chunks and decodes mixed),
logits only at the rows that sample, then the sampler.

The swap order is the host pool's contract (ref/kv/host_pool.py): a device block freed
by a swap-out may be a swap-in's (or this step's forward's) destination in the same
step, so every swap-out reads before anything writes. Swaps are applied even in a step
that schedules no tokens (a paused turn moving to the host while nothing runs).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from ref.errors import RefserveError
from ref.executor import StepOutput
from ref.inputs import ModelInputs
from ref.model.attention import AttentionMetadata
from ref.model.llama import HostKVCache, KVCache, LlamaModel
from ref.plan import StepPlan
from ref.request import Request
from ref.sampler import SampleSpec, sample

#: ``(request ids, fp32 logits [N, vocab])`` of the rows sampled in a step, for tests.
LogitsHook = Callable[[tuple[str, ...], torch.Tensor], None]


class ExecutorError(RefserveError):
    """The executor was called without what it needs (inputs, a sampling spec)."""


class ModelExecutor:
    needs_inputs = True

    def __init__(
        self,
        model: LlamaModel,
        cache: KVCache,
        requests: Mapping[str, Request],
        host_cache: HostKVCache | None = None,
    ) -> None:
        self.model = model
        self.cache = cache
        self.host_cache = host_cache
        # Bytes the swap copies moved (K and V, every layer), counted when copied: a
        # step that fails after its copies still moved them (its plan is rolled back).
        self.swap_out_bytes = 0
        self.swap_in_bytes = 0
        self._requests = requests
        self._specs: dict[str, SampleSpec] = {}
        # n > 1: specs of samples 1..n-1, drawn from the parent's first logits.
        self._fork_specs: dict[str, tuple[SampleSpec, ...]] = {}
        self.logits_hook: LogitsHook | None = None
        # Side outputs of the last execute (read by the engine after commit).
        self.last_logprobs: dict[str, float] = {}
        self.last_fork_samples: dict[str, list[tuple[int, float | None]]] = {}

    def register(
        self, request_id: str, spec: SampleSpec, fork_specs: Sequence[SampleSpec] = ()
    ) -> None:
        self._specs[request_id] = spec
        if fork_specs:
            self._fork_specs[request_id] = tuple(fork_specs)

    def unregister(self, request_id: str) -> None:
        self._specs.pop(request_id, None)
        self._fork_specs.pop(request_id, None)

    def forked(self, request_id: str) -> None:
        """The parent's samples 1..n-1 were forked off; do not draw them again."""
        self._fork_specs.pop(request_id, None)

    def execute(self, plan: StepPlan, inputs: ModelInputs | None) -> StepOutput:
        self.last_logprobs = {}
        self.last_fork_samples = {}
        if plan.swap_out or plan.swap_in:
            self._apply_swaps(plan)
        if not plan.request_ids:
            return StepOutput({})
        if inputs is None:
            raise ExecutorError("ModelExecutor.execute needs the step's ModelInputs")
        dev = self.model.device
        meta = AttentionMetadata(
            slot_mapping=inputs.slot_mapping.to(dev),
            query_start_loc=inputs.query_start_loc.to(dev),
            seq_lens=inputs.seq_lens.to(dev),
            block_tables=inputs.block_tables.to(dev),
            query_start_loc_host=tuple(inputs.query_start_loc.tolist()),
            seq_lens_host=tuple(inputs.seq_lens.tolist()),
        )
        hidden = self.model.forward(
            inputs.input_ids.to(dev), inputs.positions.to(dev), meta, self.cache, plan.copies
        )
        rids = inputs.sample_request_ids
        if not rids:
            return StepOutput({})
        logits = self.model.logits(hidden[inputs.sample_rows.to(dev)])
        if self.logits_hook is not None:
            self.logits_hook(rids, logits.detach().cpu())
        specs: list[SampleSpec] = []
        indices: list[int] = []
        rows: list[int] = []
        for row, rid in enumerate(rids):
            spec = self._specs.get(rid)
            if spec is None:
                raise ExecutorError(f"no sampling spec registered for request {rid!r}")
            k = self._requests[rid].num_output_tokens
            specs.append(spec)
            indices.append(k)
            rows.append(row)
            if k == 0:
                for child in self._fork_specs.get(rid, ()):
                    specs.append(child)
                    indices.append(0)
                    rows.append(row)
        drawn = sample(logits[rows], specs, indices)
        sampled: dict[str, int] = {}
        j = 0
        for rid in rids:
            token, logprob = drawn[j]
            j += 1
            sampled[rid] = token
            if logprob is not None:
                self.last_logprobs[rid] = logprob
            if self._requests[rid].num_output_tokens == 0 and rid in self._fork_specs:
                n_children = len(self._fork_specs[rid])
                self.last_fork_samples[rid] = drawn[j : j + n_children]
                j += n_children
        return StepOutput(sampled)

    def _apply_swaps(self, plan: StepPlan) -> None:
        """Every swap-out, then every swap-in (the order StepPlan documents)."""
        host = self.host_cache
        if host is None or not host.num_blocks:
            raise ExecutorError(
                f"step {plan.step_index} swaps KV blocks but the executor has no host cache "
                "(num_host_blocks is 0)"
            )
        self.swap_out_bytes += host.swap_out(self.cache, plan.swap_out)
        self.swap_in_bytes += host.swap_in(self.cache, plan.swap_in)
