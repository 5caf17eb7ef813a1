"""vllm PR#57104 re-applied on vLLM 0.33.0: with speculative decoding, asynchronous loads
admitted without reserving the blocks of the step each must take once its load lands;
the loads fill the pool and the first one promoted cannot take that step.

* Tracker: https://github.com/vllm-project/vllm/pull/57104 ("[BugFix][KV Connector] Fix
  Deadlock with KVConnector + MTP under KV Pressure", merged 2026-09-16; no separate
  issue). Its description: two async loads fill the pool; the first lands and is
  promoted, then needs one more block for its speculative step, none is free, the
  scheduler stops there, and the second is never promoted; it repeats every step. Seen
  with MTP and an offloading connector.

The bug. A request the connector admits as an asynchronous load (``load_kv_async``)
holds the blocks of the tokens it loads until they land, cannot be preempted and
computes nothing meanwhile. vllm PR#44560 made such an admission leave free what the
loads already in flight still need (``_inflight_prefill_reserved_blocks``: the blocks
each needs to hold its whole sequence). With speculative decoding that is not enough: a
request's first step after its load verifies drafts, ``1 + num_speculative_tokens``
tokens (with a drafter of its own forward pass, ``num_lookahead_tokens`` slots more),
and those slots need blocks too. Neither the new load's own step nor the in-flight
loads' steps were reserved, so two loads could take every free block, and once they
landed the first could not be scheduled, the waiting scan stopped at it
(``scheduler.py`` 1454-1461), and the second was never reached.

The fix's hunk as vLLM 0.33.0 has it (``vllm/v1/core/sched/scheduler.py``)::

    # 371-381 (__init__)
    +        num_spec_decode_tokens = (
    +            1 + self.num_spec_tokens + self.num_lookahead_tokens
    +            if self.num_spec_tokens
    +            else 0
    +        )
    +        self._spec_decode_step_blocks = sum(
    +            cdiv(num_spec_decode_tokens, manager.block_size)
    +            for manager in self.kv_cache_manager.coordinator.single_type_managers
    +            if not isinstance(manager.kv_cache_spec, MambaSpec)
    +        )
    # 1427-1430 (the waiting scan, an async load's admission)
                     reserved_blocks = (
                         self._inflight_prefill_reserved_blocks()
    +                    + self._spec_decode_step_blocks
                     )
    # 3408-3409 (_request_remaining_blocks, what an in-flight load still needs)
    +        if self.num_spec_tokens:
    +            num_tokens += 1 + self.num_spec_tokens + self.num_lookahead_tokens

This module takes both parts out again on its own scheduler only:
``_spec_decode_step_blocks`` of that one ``Scheduler`` instance is 0 (an int read only at
line 1429), and its ``_request_remaining_blocks`` (an instance attribute shadowing the
method; ``_inflight_prefill_reserved_blocks`` is its only caller, line 3435) calls vLLM's
own method with the instance's ``num_spec_tokens`` at 0 for the duration of the call: the
method reads it only in the addend the fix added, so the answer is the one before the
fix. Every other line is vLLM's; its class and modules are not touched, so the fixed
adapter in the same process keeps the reservation (tested).

How it matches the tracker. The adapter runs vLLM's n-gram speculative config
(conformance/adapters/vllm.py): no lookahead slots, so the step after a load needs its
extra block through the drafts alone. A load of a whole block-aligned prompt lands one
token short of it (vLLM recomputes the last prompt token for its logit), and vLLM pads
that one-token step to ``1 + k`` tokens (placeholder drafts, for uniform decode batches):
the block after the prompt. Workload ``pressure-loads-land-with-drafts`` (FCFS, bs 4, 7
blocks, 3 drafts): A0 (16 tokens) and B0 (12) are computed and offloaded, E (27 tokens)
evicts them from the device; A (A0's prompt) and B (B0's) arrive together. Fixed: A is
admitted as a load of its 4 blocks; B's load of 3 would leave none of the 2 reserved (A's
step after its load and B's own), so B waits, A runs and finishes, then B. Patched: both
loads are admitted and fill the pool; A, promoted, needs a fifth block with none free,
and nothing is scheduled again (PROGRESS).

The module refuses to import (:func:`refserve.conformance.corpus.hunk.require_lines`)
unless the installed code still has the fix's lines, so the patch never lands on other
code.
"""

from __future__ import annotations

from typing import Any

from refserve.conformance.adapter import EngineConfig
from refserve.conformance.adapters.vllm import V
from refserve.conformance.adapters.vllm_offload import VllmOffloadAdapter
from refserve.conformance.corpus.hunk import require_lines

FIXED = "refserve.conformance.adapters.vllm_offload:make"
BUGGY = "refserve.conformance.corpus.patches.vllm_57104:make"

_FIXED_INIT_LINES = (
    "1 + self.num_spec_tokens + self.num_lookahead_tokens",
    "self._spec_decode_step_blocks = sum(",
)
_FIXED_SCAN_LINES = ("+ self._spec_decode_step_blocks",)
_FIXED_REMAINING_LINES = (
    "if self.num_spec_tokens:",
    "num_tokens += 1 + self.num_spec_tokens + self.num_lookahead_tokens",
)
require_lines("vllm PR#57104", V.Scheduler.__init__, _FIXED_INIT_LINES)
require_lines("vllm PR#57104", V.Scheduler.schedule, _FIXED_SCAN_LINES)
require_lines("vllm PR#57104", V.Scheduler._request_remaining_blocks, _FIXED_REMAINING_LINES)


def undo_spec_step_reservation(scheduler: Any) -> None:
    """Async loads admitted without the blocks of anyone's speculative step, on this
    scheduler only."""
    scheduler._spec_decode_step_blocks = 0
    remaining = scheduler._request_remaining_blocks  # vLLM's method, bound

    def remaining_without_spec_step(request: Any) -> int:
        saved = scheduler.num_spec_tokens
        scheduler.num_spec_tokens = 0
        try:
            return int(remaining(request))
        finally:
            scheduler.num_spec_tokens = saved

    scheduler._request_remaining_blocks = remaining_without_spec_step


class Vllm57104Adapter(VllmOffloadAdapter):
    """The offload adapter whose scheduler admits async loads without reserving their
    speculative steps (vllm PR#57104 undone)."""

    @property
    def name(self) -> str:
        return f"{super().name} [vllm PR#57104 re-applied: no blocks reserved for the spec step]"

    def configure(self, config: EngineConfig) -> None:
        super().configure(config)
        undo_spec_step_reservation(self._sched)


def make() -> Vllm57104Adapter:
    """vLLM (fcfs) with ``OffloadingConnector``, the speculative-step reservation undone."""
    return Vllm57104Adapter()
