"""The model executor: runs the real model on a step's flattened inputs and samples.

It plugs into :class:`refserve.core.engine_core.EngineCore` exactly where the simulator's executor
does; the scheduler does not know which one it drives. One ``execute`` is: the plan's
swap-out copies (device -> host), its swap-in copies (host -> device), its copy-on-write
block copies, one forward over every scheduled token (prefill chunks and decodes mixed),
logits only at the rows that sample, then the sampler.

The swap order is the host pool's contract (ref/kv/host_pool.py): a device block freed
by a swap-out may be a swap-in's (or this step's forward's) destination in the same
step, so every swap-out reads before anything writes. Swaps are applied even in a step
that schedules no tokens (a paused turn moving to the host while nothing runs).

K/V memory joins the step's transaction (ref/core/executor.py; docs/ARCHITECTURE.md,
"Atomic steps"):
:meth:`ModelExecutor.begin` saves, before anything is written, exactly what the step may
overwrite: the K and V at every slot of ``slot_mapping`` in every layer, the device
blocks that are destinations of ``swap_in`` and ``copies``, and the host blocks that are
destinations of ``swap_out`` (on a grouped pool, each layer group's slots in that
group's layers). :meth:`ModelExecutor.rollback` writes them back, so a step
that failed after its forward (a preempted victim's block reused, then the sampler or
``validate_output`` failing) leaves every block as it was and the retry computes the
same tokens. The cost is O(tokens written + blocks copied) gathers per step, never
O(cache).

Everything a step produced comes back in its :class:`~refserve.core.executor.StepOutput`:
the tokens the scheduler commits, their logprobs, and the first tokens of the samples
1..n-1 of an ``n > 1`` request, which the engine forks off after the commit. Nothing is
left on the executor for the engine to read afterwards, so a failed step leaves nothing
behind either.

A grouped KV pool (a hybrid model's layer groups, ref/kv/groups.py) gives the step one
table and slot mapping per group (``ModelInputs.groups``); the executor hands each
layer its group's (ref/model/llama.py). The layout is the model's
(``refserve.model.config.kv_groups``): inputs with another number of groups are refused.
A window group's table holds ``NULL_BLOCK`` where a block left the window;
:func:`window_tables` checks that no window layer reads such a place this step
(:class:`~refserve.core.inputs.NullBlockAccess` otherwise) and only then gives those
places block 0, which the backends need to index: the torch backend gathers from the
block of the first query's window start on, and the Triton kernel masks every key
before the window (it may load the first tile's, as it loads a plain table's blocks
before the window), so no substituted block reaches a result.

The step's :class:`~refserve.core.inputs.ModelInputs` are numpy arrays (the core knows no
torch); :func:`_tensor` wraps each with ``torch.from_numpy``, sharing its memory (no
copy on the CPU), before it moves to the model's device.

``fault_hook`` (tests): called with a point name at ``before_swaps``, ``after_swaps``,
``after_forward``, ``in_sampler`` (just before sampling) and ``after_execute``; raising
from it fails the step there.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt
import torch

from refserve.core.executor import DrawnToken, StepOutput
from refserve.core.inputs import ModelInputs, NullBlockAccess
from refserve.core.plan import StepPlan
from refserve.core.request import Request
from refserve.errors import RefserveError
from refserve.model.attention import AttentionMetadata
from refserve.model.config import describe_layout, kv_groups
from refserve.model.llama import HostKVCache, KVCache, LlamaModel
from refserve.model.rejection import Verification, verify
from refserve.model.sampler import SampleSpec, sample
from refserve.spec.arith import blocks_needed_rows, logical_block_rows
from refserve.spec.groups import NULL_BLOCK, KVGroup

#: ``(request ids, fp32 logits [N, vocab])`` of the rows sampled in a step, for tests.
LogitsHook = Callable[[tuple[str, ...], torch.Tensor], None]
#: Called with a fault point's name (module doc); raising there fails the step, for tests.
FaultHook = Callable[[str], None]
FAULT_POINTS = ("before_swaps", "after_swaps", "after_forward", "in_sampler", "after_execute")


@dataclass(frozen=True)
class SavedRows:
    """What rows ``index`` along dim 0 of one cache's per-layer K/V tensors held before
    the step: whole blocks (``[num_blocks, block_size, H, D]`` tensors) or single slots
    (the same tensors viewed as ``[num_blocks * block_size, H, D]``)."""

    key_cache: Sequence[torch.Tensor]  # the per-layer tensors, as indexed (a view for slots)
    value_cache: Sequence[torch.Tensor]
    index: torch.Tensor  # int64, on the cache's device
    key: tuple[torch.Tensor, ...]  # per layer, the saved rows
    value: tuple[torch.Tensor, ...]

    @staticmethod
    def save(
        key_cache: Sequence[torch.Tensor], value_cache: Sequence[torch.Tensor], index: torch.Tensor
    ) -> SavedRows:
        return SavedRows(
            key_cache,
            value_cache,
            index,
            tuple(t.index_select(0, index) for t in key_cache),
            tuple(t.index_select(0, index) for t in value_cache),
        )

    def restore(self) -> None:
        # Duplicate indices (a slot listed twice) saved the same original value, so
        # index_copy_ writes the right one whichever copy wins.
        for caches, saved in ((self.key_cache, self.key), (self.value_cache, self.value)):
            for t, rows in zip(caches, saved, strict=True):
                t.index_copy_(0, self.index, rows)


@dataclass(frozen=True)
class _Draw:
    """One sequence to sample in a step: the row of logits it reads, its spec and its
    output index (the seed's counter). A fork's draw (``fork``) reads its parent's row;
    the parent's draw counts the forks that follow it."""

    request_id: str
    row: int
    spec: SampleSpec
    index: int
    num_forks: int = 0
    fork: bool = False


class ExecutorError(RefserveError):
    """The executor was called without what it needs (inputs, a sampling spec)."""


class ModelExecutor:
    needs_inputs = True
    transactional_kv = True  # begin/rollback restore every slot and block (module doc)

    def __init__(
        self,
        model: LlamaModel,
        cache: KVCache,
        requests: Mapping[str, Request],
        host_cache: HostKVCache | None = None,
    ) -> None:
        self.model = model
        self.cache = cache
        # The model's KV layout, and the layers of each group (ref/model/llama.py).
        self.kv_groups: tuple[KVGroup, ...] = kv_groups(model.config)
        self._all_layers = tuple(range(len(cache.key)))
        self._group_layers = tuple(
            tuple(i for i, g in enumerate(model.layer_groups) if g == k)
            for k in range(len(self.kv_groups))
        )
        self.host_cache = host_cache
        # Bytes the swap copies moved (K and V, every layer), counted when copied: a
        # step that fails after its copies still moved them over the link (rolling back
        # restores the destinations from saved copies, and the retry moves them again).
        self.swap_out_bytes = 0
        self.swap_in_bytes = 0
        self._requests = requests
        self._specs: dict[str, SampleSpec] = {}
        # n > 1: specs of samples 1..n-1, drawn from the parent's first logits.
        self._fork_specs: dict[str, tuple[SampleSpec, ...]] = {}
        self.logits_hook: LogitsHook | None = None
        # Speculative decoding: the proposer's distribution at each draft of a request
        # (``[d, V]``), set by the engine before the step; absent for point-mass drafts.
        self.draft_probs: dict[str, torch.Tensor] = {}
        self.fault_hook: FaultHook | None = None
        # What the step in flight may overwrite, in write order (begin .. commit/rollback).
        self._journal: list[SavedRows] = []

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

    # ------------------------------------------------------------------ transaction
    def begin(self, plan: StepPlan, inputs: ModelInputs | None) -> None:
        """Save everything this step may write, before any of it is written (module doc).

        Saved in the order ``execute`` writes: host blocks (swap-out), device blocks
        (swap-in, then copy-on-write), then the forward's slots."""
        self._journal = []
        dev_key, dev_value = self.cache.key, self.cache.value
        if not dev_key:
            return
        device = dev_key[0].device
        host = self.host_cache
        if plan.swap_out and host is not None and host.key:
            self._save(host.key, host.value, [c.dst for c in plan.swap_out], host.key[0].device)
        blocks = [c.dst for c in plan.swap_in] + [c.dst for c in plan.copies]
        if blocks:
            self._save(dev_key, dev_value, blocks, device)
        if inputs is not None:
            for layers, slot_mapping in self._written_slots(inputs):
                if layers and slot_mapping.size:
                    self._save_slots(layers, _tensor(slot_mapping))

    def _written_slots(
        self, inputs: ModelInputs
    ) -> list[tuple[tuple[int, ...], npt.NDArray[np.int64]]]:
        """The layers each slot mapping of the step writes: every layer the first
        group's on a plain pool, each group's layers its own on a grouped one."""
        if not inputs.groups:
            return [(self._all_layers, inputs.slot_mapping)]
        self._check_group_count(inputs)
        slots = (inputs.slot_mapping, *(g.slot_mapping for g in inputs.groups))
        return list(zip(self._group_layers, slots, strict=True))

    def _check_group_count(self, inputs: ModelInputs) -> None:
        if len(inputs.groups) + 1 != len(self.kv_groups):
            raise ExecutorError(
                f"the step's inputs carry {len(inputs.groups) + 1} layer groups; the model's "
                f"KV layout has {len(self.kv_groups)}: {describe_layout(self.kv_groups)}"
            )

    def _save_slots(self, layers: Sequence[int], slot_mapping: torch.Tensor) -> None:
        """Save the K/V at every slot the forward writes, in ``layers``."""
        dev_key = [self.cache.key[i] for i in layers]
        dev_value = [self.cache.value[i] for i in layers]
        slots = slot_mapping[slot_mapping >= 0]  # -1 is padding: the kernels skip it
        nb, bs, h, d = dev_key[0].shape
        flat_key = [t.view(nb * bs, h, d) for t in dev_key]
        flat_value = [t.view(nb * bs, h, d) for t in dev_value]
        self._journal.append(SavedRows.save(flat_key, flat_value, slots.to(dev_key[0].device)))

    def _save(
        self,
        key: Sequence[torch.Tensor],
        value: Sequence[torch.Tensor],
        blocks: Sequence[int],
        device: torch.device,
    ) -> None:
        n = key[0].shape[0]
        # An out-of-range copy is refused by the copy itself before it writes anything;
        # saving it would raise here first, with a less precise message.
        index = [b for b in blocks if 0 <= b < n]
        if index:
            idx = torch.tensor(index, dtype=torch.int64, device=device)
            self._journal.append(SavedRows.save(key, value, idx))

    def rollback(self) -> None:
        """Write back what :meth:`begin` saved, newest first (ATOMIC for memory; module
        doc)."""
        journal, self._journal = self._journal, []
        with torch.inference_mode():
            for saved in reversed(journal):
                saved.restore()

    def commit(self) -> None:
        self._journal = []
        self.draft_probs = {}  # a rolled-back step keeps them: the retry verifies again

    # ------------------------------------------------------------------ the step
    def _fault(self, point: str) -> None:
        if self.fault_hook is not None:
            self.fault_hook(point)

    def execute(self, plan: StepPlan, inputs: ModelInputs | None) -> StepOutput:
        output = self._execute(plan, inputs)
        self._fault("after_execute")
        return output

    def _execute(self, plan: StepPlan, inputs: ModelInputs | None) -> StepOutput:
        self._fault("before_swaps")
        if plan.swap_out or plan.swap_in:
            self._apply_swaps(plan)
        self._fault("after_swaps")
        if not plan.request_ids:
            return StepOutput({})
        if inputs is None:
            raise ExecutorError("ModelExecutor.execute needs the step's ModelInputs")
        hidden = self._forward(plan, inputs)
        self._fault("after_forward")
        if not inputs.sample_request_ids:
            return StepOutput({})
        return self._sample(plan, inputs, hidden)

    def _forward(self, plan: StepPlan, inputs: ModelInputs) -> torch.Tensor:
        """One forward over every scheduled token; the hidden state of each."""
        dev = self.model.device
        meta = AttentionMetadata(
            slot_mapping=_tensor(inputs.slot_mapping, dev),
            query_start_loc=_tensor(inputs.query_start_loc, dev),
            seq_lens=_tensor(inputs.seq_lens, dev),
            block_tables=_tensor(inputs.block_tables, dev),
            query_start_loc_host=tuple(inputs.query_start_loc.tolist()),
            seq_lens_host=tuple(inputs.seq_lens.tolist()),
        )
        groups: list[AttentionMetadata] = []
        if inputs.groups:
            self._check_group_count(inputs)
        for group, gi in zip(self.kv_groups[1:], inputs.groups, strict=False):
            tables = window_tables(gi.block_tables, inputs, group.window, self.cache.block_size)
            groups.append(
                replace(
                    meta,
                    slot_mapping=_tensor(gi.slot_mapping, dev),
                    block_tables=_tensor(tables, dev),
                )
            )
        return self.model.forward(
            _tensor(inputs.input_ids, dev),
            _tensor(inputs.positions, dev),
            meta,
            self.cache,
            plan.copies,
            groups,
        )

    def _sample(self, plan: StepPlan, inputs: ModelInputs, hidden: torch.Tensor) -> StepOutput:
        """Logits at the sampling rows, then one draw per sequence: each sampling
        request's, and right after it, for an ``n > 1`` request drawing its first token,
        samples 1..n-1 from the same row. A request that verifies drafts is verified
        instead, on the logits of all its rows (:meth:`_verify`)."""
        rids = inputs.sample_request_ids
        logits = self.model.logits(hidden[_tensor(inputs.sample_rows, self.model.device)])
        if self.logits_hook is not None:
            self.logits_hook(rids, logits.detach().cpu())
        draws = self._draws(rids, skip=plan.drafts)
        self._fault("in_sampler")
        drawn = sample(
            logits[[d.row for d in draws]], [d.spec for d in draws], [d.index for d in draws]
        )
        self._check_vocab(rids, drawn)
        sampled: dict[str, int] = {}
        logprobs: dict[str, float] = {}
        forks: dict[str, tuple[DrawnToken, ...]] = {}
        it = iter(zip(draws, drawn, strict=True))
        for draw, (token, logprob) in it:
            assert not draw.fork, "a fork's draw follows its parent's"
            sampled[draw.request_id] = token
            if logprob is not None:
                logprobs[draw.request_id] = logprob
            if draw.num_forks:
                forks[draw.request_id] = tuple(
                    DrawnToken(t, lp) for _, (t, lp) in itertools.islice(it, draw.num_forks)
                )
        if not plan.drafts:
            return StepOutput(sampled, logprobs=logprobs, fork_samples=forks)
        accepted: dict[str, int] = {}
        emitted: dict[str, tuple[float, ...]] = {}
        for rid, v in self._verify(plan, inputs, hidden).items():
            sampled[rid], accepted[rid] = v.tokens[-1], v.num_accepted
            if v.logprobs is not None:
                logprobs[rid] = v.logprobs[-1]
                emitted[rid] = v.logprobs
            elif v.failed:  # as the sampler reports a row it could not sample
                logprobs[rid] = math.nan
        return StepOutput(sampled, None, logprobs, forks, accepted, emitted)

    def _verify(
        self, plan: StepPlan, inputs: ModelInputs, hidden: torch.Tensor
    ) -> dict[str, Verification]:
        """Each verifying request's drafts against the target's logits at all its rows
        (its last token's and each draft's: docs/SPECULATIVE.md, "Verification"), with
        the proposer's distributions from :attr:`draft_probs` (none: a point-mass
        proposer such as n-gram lookup)."""
        row = {rid: i for i, rid in enumerate(inputs.request_ids)}
        qsl = inputs.query_start_loc.tolist()
        out: dict[str, Verification] = {}
        for rid, drafts in plan.drafts.items():
            i = row[rid]
            logits = self.model.logits(hidden[qsl[i] : qsl[i + 1]])
            probs = self.draft_probs.get(rid)  # the planner may verify fewer than drafted
            v = verify(
                logits,
                drafts,
                self.spec(rid),
                self._requests[rid].num_output_tokens,
                None if probs is None else probs[: len(drafts)],
            )
            self._check_vocab((rid,), [(t, None) for t in v.tokens])
            out[rid] = v
        return out

    def spec(self, rid: str) -> SampleSpec:
        """The sampling spec registered for ``rid``."""
        spec = self._specs.get(rid)
        if spec is None:
            raise ExecutorError(f"no sampling spec registered for request {rid!r}")
        return spec

    def _draws(self, rids: Sequence[str], skip: Container[str] = ()) -> list[_Draw]:
        """What to draw for the sampling rows ``rids`` (row ``i`` is ``rids[i]``), but
        for those in ``skip``."""
        draws: list[_Draw] = []
        for row, rid in enumerate(rids):
            if rid in skip:
                continue
            spec = self.spec(rid)
            k = self._requests[rid].num_output_tokens
            children = self._fork_specs.get(rid, ()) if k == 0 else ()
            draws.append(_Draw(rid, row, spec, k, num_forks=len(children)))
            draws.extend(_Draw(rid, row, child, 0, fork=True) for child in children)
        return draws

    def _check_vocab(self, rids: Sequence[str], drawn: Sequence[tuple[int, float | None]]) -> None:
        """A token outside the vocabulary would be committed and detokenized as something
        else (a silent wrong answer): fail the step instead, so it rolls back (ATOMIC)."""
        vocab = self.model.config.vocab_size
        for token, _ in drawn:
            if not 0 <= token < vocab:
                raise ExecutorError(
                    f"the sampler drew token {token} for a step of {list(rids)!r}; "
                    f"token ids must be in [0, {vocab})"
                )

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


def window_tables(
    tables: npt.NDArray[np.int32], inputs: ModelInputs, window: int, block_size: int
) -> npt.NDArray[np.int32]:
    """A window group's ``tables`` as the backends take them (module doc): every place
    its layers read this step checked to hold a block (sequence ``s``'s queries read
    from the block of ``window_start(its first query's position, window)`` to the last
    block of its KV), then each ``NULL_BLOCK`` place, none of them read, given block 0.
    A read place that is null raises :class:`NullBlockAccess`, naming the request."""
    seq_lens = inputs.seq_lens.astype(np.int64)
    starts = seq_lens - np.diff(inputs.query_start_loc.astype(np.int64))
    # refserve.spec.groups.window_start of every sequence's first query.
    first = logical_block_rows(np.maximum(starts - window + 1, 0), block_size)
    end = blocks_needed_rows(seq_lens, block_size)
    cols = np.arange(tables.shape[1])
    read = (cols[None, :] >= first[:, None]) & (cols[None, :] < end[:, None])
    bad = np.argwhere(read & (tables == NULL_BLOCK))
    if bad.size:
        s, block = (int(x) for x in bad[0])
        raise NullBlockAccess(
            f"request {inputs.request_ids[s]!r}: a layer of window {window} reads logical "
            f"block {block} (its queries read KV positions from "
            f"{max(0, int(starts[s]) - window + 1)} to {int(seq_lens[s]) - 1}), a place its "
            "group released"
        )
    return np.maximum(tables, 0)


def _tensor(
    values: npt.NDArray[np.int64] | npt.NDArray[np.int32], device: torch.device | None = None
) -> torch.Tensor:
    """One array of the step's inputs as a torch tensor of its dtype: the same memory on
    the CPU (``from_numpy`` copies nothing), copied once to another ``device``."""
    t = torch.from_numpy(values)
    return t if device is None else t.to(device)
