"""vllm PR#44560 re-applied on vLLM 0.33.0: asynchronous loads admitted without reserving
what the loads already in flight still need; each holds part of the pool and none can
finish its prefill.

* Tracker: https://github.com/vllm-project/vllm/pull/44560 ("[BugFix] Resolve multiple
  async kv load deadlock", merged 2026-06-04; the fix for the FCFS form of
  https://github.com/vllm-project/vllm/issues/45388, as its reporter confirmed on the
  issue). Its description: "we avoid async-loading new kv if it would occupy blocks
  required for other in-flight chunked prefills or async-loading requests"; the throttle
  applies to async loads only, because a chunked prefill is throttled by the batch and can
  be preempted, and a load cannot.

The bug. A request the connector admits as an asynchronous load (``load_kv_async``)
allocates the blocks of the tokens it loads and holds them, status
``WAITING_FOR_REMOTE_KVS``, until the load lands; it cannot be preempted and computes
nothing meanwhile. Before the fix, admission compared the load's blocks with the free
blocks only. With ``scheduler_reserve_full_isl`` (the default) each admission checks that
its own whole sequence fits in the free blocks, but not that the loads already admitted
can still take the rest of theirs: two loads admitted together each pass, each takes its
loaded prefix, and once both have landed the first in the queue needs more blocks than
are free, the scan ``break``s at it (``scheduler.py`` 1454-1461) and the second, which
holds the blocks the first needs, is never reached. Neither is running, neither can be
preempted: nothing is scheduled again.

The fix's hunk as vLLM 0.33.0 has it (before -> after)::

    # vllm/v1/core/kv_cache_manager.py 582-587 (allocate_slots; ``reserved_blocks`` is
    # the keyword the fix added, line 391, default 0)
    -        available_blocks = self.block_pool.get_num_free_blocks()
    +        available_blocks = self.block_pool.get_num_free_blocks() - reserved_blocks
             required_blocks = num_blocks_to_allocate + watermark_blocks
             if required_blocks > available_blocks:
                 # Cannot allocate new blocks
                 return None
    # vllm/v1/core/sched/scheduler.py 1420-1430 and 1450 (the waiting scan)
    +                reserved_blocks = 0
    +                if load_kv_async:
    +                    (five lines of comment: admit a load only if it fits in
    +                    free - other in-flight reservations)
    +                    reserved_blocks = (
    +                        self._inflight_prefill_reserved_blocks()
    +                        + self._spec_decode_step_blocks
    +                    )
    ...
    +                    reserved_blocks=reserved_blocks,
    # vllm/v1/core/sched/scheduler.py 3432-3436
    +    def _inflight_prefill_reserved_blocks(self) -> int:
    +        (docstring: "Num blocks in-flight prefills still need to finish")
    +        return sum(
    +            self._request_remaining_blocks(req) for req in self._inflight_prefills
    +        )

The PR's own diff (its review thread, ``kv_cache_manager.py``) reads ``- if
num_blocks_to_allocate > self.block_pool.get_num_free_blocks():`` / ``+ available_blocks
= self.block_pool.get_num_free_blocks() - reserved_blocks``; the watermark on the
required side came later and is left alone. ``_inflight_prefills`` (line 493) gains a
load at its admission (line 1542) and a chunked prefill (line 1593);
``_spec_decode_step_blocks`` came later, with
https://github.com/vllm-project/vllm/pull/57104, and is 0 without speculative decoding,
as here.

This module takes the reservation out again on its own scheduler only:
``_inflight_prefill_reserved_blocks`` of that one ``Scheduler`` instance answers 0 (an
instance attribute shadowing the method; line 1428 is its only caller), so an async load
is admitted if its blocks fit in the free blocks, as before the fix. The watermark (0
here) and the full-sequence check are left as they are. Every other line is vLLM's; its
class and modules are not touched, so the fixed adapter in the same process keeps the
reservation (tested).

How it matches the tracker. The #45388 report (``OffloadingConnector``, FCFS, full-ISL
reservation): two requests whose prefixes were on the CPU are admitted together as async
loads, each reserving only its loaded prefix; after the loads land the queue head cannot
allocate the rest of its prompt and the scheduler breaks; "Running: 0, Waiting: 2".
0.33.0's queue split (waiting requests holding blocks drained first, re-applied by
:mod:`refserve.conformance.corpus.patches.vllm_45388`) does not help here: both loads hold
blocks, so both sit in ``kv_holding_waiting``, and its head is the one that cannot
finish. Workload (``tests/conformance/test_vllm_corpus_deadlocks.py``, FCFS, bs 4, 16
blocks): A0 (16 tokens) and B0 (24) are computed and offloaded, E (56 tokens) evicts them
from the device; R decodes throughout; A (A0's 16 + 28 tokens: 11 blocks) and B (B0's
24 + 6: 8 blocks) arrive together. Fixed: A is admitted as a load of 4 blocks; B's load
of 6 would leave less than the 7 A still needs, so B waits, A runs and finishes, then B.
Patched: both loads are admitted (10 of the 14 free blocks); A heads the queue needing 7
with 4 free, B holds 6 behind it; once R finishes nothing is scheduled again (PROGRESS,
"waiting request A got nothing").

The module refuses to import (:func:`refserve.conformance.corpus.hunk.require_lines`)
unless the installed
code still has the fix's lines, so the patch never lands on other code.
"""

from __future__ import annotations

import importlib
from typing import Any

from refserve.conformance.adapter import EngineConfig
from refserve.conformance.adapters.vllm import V
from refserve.conformance.adapters.vllm_offload import VllmOffloadAdapter
from refserve.conformance.corpus.hunk import require_lines

FIXED = "refserve.conformance.adapters.vllm_offload:make"
BUGGY = "refserve.conformance.corpus.patches.vllm_44560:make"

_KVCacheManager: Any = importlib.import_module("vllm.v1.core.kv_cache_manager").KVCacheManager

_FIXED_SCHEDULER_LINES = (
    "self._inflight_prefill_reserved_blocks()",
    "reserved_blocks=reserved_blocks,",
    "self._request_remaining_blocks(req) for req in self._inflight_prefills",
)
_FIXED_MANAGER_LINES = (
    "available_blocks = self.block_pool.get_num_free_blocks() - reserved_blocks",
    "if required_blocks > available_blocks:",
)
require_lines("vllm PR#44560", V.Scheduler, _FIXED_SCHEDULER_LINES)
require_lines("vllm PR#44560", _KVCacheManager.allocate_slots, _FIXED_MANAGER_LINES)


def _no_reservation() -> int:
    return 0


def undo_inflight_reservation(scheduler: Any) -> None:
    """Async loads admitted against the free blocks alone, on this scheduler only."""
    scheduler._inflight_prefill_reserved_blocks = _no_reservation


class Vllm44560Adapter(VllmOffloadAdapter):
    """The offload adapter whose scheduler admits async loads without the in-flight
    reservation (vllm PR#44560 undone)."""

    @property
    def name(self) -> str:
        return f"{super().name} [vllm PR#44560 re-applied: no reservation for in-flight loads]"

    def configure(self, config: EngineConfig) -> None:
        super().configure(config)
        undo_inflight_reservation(self._sched)


def make() -> Vllm44560Adapter:
    """vLLM (fcfs) with ``OffloadingConnector``, the in-flight reservation undone."""
    return Vllm44560Adapter()
