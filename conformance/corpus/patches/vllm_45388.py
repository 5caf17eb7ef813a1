"""vllm#45388 re-applied on vLLM 0.33.0: a waiting request that holds no block stops the
scan before a finished async load that holds blocks; Running 0 forever.

* Tracker: https://github.com/vllm-project/vllm/issues/45388 ("Running: 0, Waiting: N,
  0 tok/s" with ``OffloadingConnector``; duplicate #45387). Fixes: the admission
  reservation of https://github.com/vllm-project/vllm/pull/44560 (re-applied separately:
  :mod:`refserve.conformance.corpus.patches.vllm_44560`) and the queue split that vLLM
  0.33.0 ships: waiting requests that hold KV blocks sit in their own queue,
  ``kv_holding_waiting``, drained before ``waiting`` (the invariant that
  https://github.com/vllm-project/vllm/pull/57841 states: "a request that holds KV
  blocks is never behind a request that holds none").

The bug. ``Scheduler.schedule()`` walks the waiting queue from its head and ``break``s at
the first request whose ``allocate_slots`` fails (``vllm/v1/core/sched/scheduler.py``
lines 1455-1461, still there in 0.33.0). A request admitted as an asynchronous load
(``WAITING_FOR_REMOTE_KVS``) holds its blocks while the load is in flight and is put back
into the waiting queue (``skip_request``); it is promoted only when the walk reaches it
(``_handle_blocked_waiting_request``). With one queue ordered by priority (or arrival), a
block-less request ahead of it that cannot allocate ends every walk: the load has landed,
its blocks are held, nothing runs, and the blocks the head needs are the ones the parked
load holds.

The fix's hunk as 0.33.0 ships it (before -> after; the "before" side is one queue, as
before the split)::

    # scheduler.py 1062-1066 (the scan's queue)
    -                request_queue = self.waiting
    +                request_queue = self.kv_holding_waiting
    +                if not request_queue and self._pause_state == PauseState.UNPAUSED:
    +                    request_queue = self.waiting
    # scheduler.py 1052-1060 (skip_request) and 2710-2716 (_enqueue_waiting_request)
    -        self.waiting.add_request(request)
    +        if self._holds_kv_blocks(request):
    +            self.kv_holding_waiting.add_request(request)
    +        else:
    +            self.waiting.add_request(request)
    # scheduler.py 2696-2707
    +    @staticmethod
    +    def _holds_kv_blocks(request: Request) -> bool:
    +        return (
    +            request.num_computed_tokens > 0
    +            or request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    +        )

This module takes the split out again on its own scheduler only: ``_holds_kv_blocks`` of
that one ``Scheduler`` instance answers ``False`` (an instance attribute shadowing the
static method), so every waiting request goes to ``self.waiting`` and the scan never
looks at ``kv_holding_waiting`` (empty, so line 1066 falls through to ``self.waiting``).
Every other line is vLLM's; vLLM's class and modules are not touched, so the fixed
adapter in the same process keeps the split (tested).

How it matches the tracker. The #45388 thread's root-cause comment: two requests whose
prefixes live on the CPU are admitted as async loads; after the loads land the queue head
cannot allocate its remaining prefill and the scheduler breaks, so the parked loads
behind it, which hold the blocks it needs, are never promoted ("Running: 0, Waiting: 2,
GPU KV 0-60%"). The reporter's two-load FCFS form also needs #44560 undone (its
reservation keeps the second load out); with the split alone undone, the #57841 /
priority form reproduces: a block-less request of higher priority arrives after the load
and heads the queue. Scenario (the workload in conformance/FINDINGS_vllm.md, "vLLM with
its offloading connector"; ``make_priority`` of the offload adapter): L's 8-token prefix
is offloaded to the CPU and evicted from the device; L (priority 1) is admitted as an
async load beside a short decode R; H (priority 0, 11 of the pool's 12 blocks) arrives
next. Fixed: L is promoted from ``kv_holding_waiting``, runs and finishes, then H runs.
Patched: H heads the one queue, fails, ``break``; L is never promoted; once R finishes
nothing is scheduled again (PROGRESS).

The module refuses to import (:func:`refserve.conformance.corpus.hunk.require_lines`)
unless the installed
scheduler still has the split's lines, so the patch never lands on other code.
"""

from __future__ import annotations

from typing import Any

from refserve.conformance.adapters.vllm import V
from refserve.conformance.adapters.vllm_offload import VllmOffloadAdapter
from refserve.conformance.corpus.hunk import require_lines

FIXED = "refserve.conformance.adapters.vllm_offload:make_priority"
BUGGY = "refserve.conformance.corpus.patches.vllm_45388:make"

_FIXED_LINES = (
    "request_queue = self.kv_holding_waiting",
    "if self._holds_kv_blocks(request_to_skip):",
    "or request.status == RequestStatus.WAITING_FOR_REMOTE_KVS",
)
require_lines("vllm#45388", V.Scheduler, _FIXED_LINES)


def _holds_no_blocks(request: Any) -> bool:
    del request
    return False


def undo_queue_split(scheduler: Any) -> None:
    """One queue again, on this scheduler only: nobody counts as holding KV blocks."""
    scheduler._holds_kv_blocks = _holds_no_blocks


class Vllm45388Adapter(VllmOffloadAdapter):
    """The offload adapter whose scheduler has one waiting queue (vllm#45388)."""

    @property
    def name(self) -> str:
        return f"{super().name} [vllm#45388 re-applied: one waiting queue]"

    def configure(self, config: Any) -> None:
        super().configure(config)
        undo_queue_split(self._sched)


def make() -> Vllm45388Adapter:
    """vLLM (``policy="priority"``) with ``OffloadingConnector``, the queue split undone."""
    return Vllm45388Adapter(policy="priority")


def make_fcfs() -> Vllm45388Adapter:
    """As :func:`make` under ``policy="fcfs"``."""
    return Vllm45388Adapter()
