"""vllm PR#57841 re-applied on vLLM 0.33.0: a request whose lookup the connector deferred
waits, holding no block, ahead of an asynchronous load admitted behind it; once its lookup
answers it cannot allocate, and the scan stops before the load every step (FCFS).

* Tracker: https://github.com/vllm-project/vllm/pull/57841 ("[BugFix][Scheduler] Avoid
  Deadlocks in Skipped Waiting under KV Pressure", 2026-09-21, open in the stored copy
  of the thread). Its reproducer (one GPU, ``OffloadingConnector`` only, stepped by hand)
  ends with ``running=0 free_blocks=20``: ``H WAITING computed=0 holds=0`` in
  ``skipped_waiting`` ahead of ``L WAITING_FOR_REMOTE_KVS computed=4000 holds=250``;
  "L needs 5 more blocks and W needs 10; 20 are free. Neither is reached, because the
  scan stops at H, which needs 100." Its invariant, as the #45388 entry quotes it: "a
  request that holds KV blocks is never behind a request that holds none".

The bug. When the connector cannot answer a lookup yet (``get_num_new_matched_tokens``
returns ``None``: a chunk of the prefix is still being written, or is being loaded for
another request), the scheduler skips the request (``scheduler.py`` 1146-1151,
``skip_request``), goes on down the queue, and at the end of the scan puts the skipped
requests back at the queue's front in their order (lines 1606-1610, ``prepend_requests``).
The deferred request holds no block, but a later request in the same scan can be admitted
as an asynchronous load and take blocks; it too is skipped (line 1544) and put back, behind
the deferred one. Once the lookup answers, the deferred request heads the queue; if it
cannot allocate, the scan ``break``s (lines 1454-1461) before the parked load, whose
blocks are the ones missing: nothing runs again. The same terminal state as
https://github.com/vllm-project/vllm/issues/45388 (re-applied by
:mod:`refserve.conformance.corpus.patches.vllm_45388`), reached another way: there a
block-less request of higher priority arrives after the load (priority policy); here,
under FCFS, no priority is involved: the block-less request was first, and the
connector's deferral let a later request take blocks past it.

The fix. vLLM 0.33.0 keeps waiting requests that hold blocks in their own queue,
``kv_holding_waiting``, drained before ``waiting``; the skip path sorts skipped requests
the same way. This is the hunk of the #45388 entry, quoted here as installed (before ->
after; "before" is one queue)::

    # vllm/v1/core/sched/scheduler.py 1054-1060 (skip_request)
             request_to_skip = from_queue.pop_request()
             self.deferred_waiting.add(request_to_skip)
    -        step_skipped_waiting.appendleft(request_to_skip)
    +        if self._holds_kv_blocks(request_to_skip):
    +            step_skipped_kv_holding.appendleft(request_to_skip)
    +        else:
    +            step_skipped_waiting.appendleft(request_to_skip)
    # scheduler.py 1065-1067 (the scan's queue)
    -                request_queue = self.waiting
    +                request_queue = self.kv_holding_waiting
    +                if not request_queue and self._pause_state == PauseState.UNPAUSED:
    +                    request_queue = self.waiting
    # scheduler.py 1606-1610 (skipped requests put back)
    +            if step_skipped_kv_holding:
    +                self.kv_holding_waiting.prepend_requests(step_skipped_kv_holding)
                 if step_skipped_waiting:
                     self.waiting.prepend_requests(step_skipped_waiting)
    # scheduler.py 2696-2707
    +    @staticmethod
    +    def _holds_kv_blocks(request: Request) -> bool:
    +        return (
    +            request.num_computed_tokens > 0
    +            or request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    +        )

Whether the PR's own diff is this split line for line could not be read here (the stored
thread carries its description and reproducer, not the diff); the PR states the
invariant the split enforces, and its reproducer's end state is the one the patched
adapter reaches. The patch is that of the #45388 entry:
:func:`~refserve.conformance.corpus.patches.vllm_45388.undo_queue_split`:
``_holds_kv_blocks`` of this one ``Scheduler`` instance answers ``False`` (an instance
attribute shadowing the static method), so every skipped request goes back into
``self.waiting`` in its order and the scan never looks at ``kv_holding_waiting`` (empty,
so line 1066 falls through to ``self.waiting``). vLLM's class and modules are not
touched; the fixed adapter in the same process keeps the split (tested).

Is it a distinct entry? The code under repair is the same as #45388's; the bug report
and its trigger are not. Here the trigger is the connector deferring a lookup, under
FCFS with no priorities (the policy most deployments run); there it is a request of
higher priority arriving after the load. The workloads differ accordingly: the #45388
entry's (``pressure-parked-load-behind-large-head``) needs the priority policy (this
module's FCFS adapter cannot run it), and no scenario of the library catches this
module's adapter; this workload has no priorities and no late arrival, and is caught on
both patched adapters (it is the same hunk). So it counts as its own entry of the corpus
(a second way real traffic reaches the stranded load), not as a second fix.

How it matches the tracker. The PR's deferral is a chunk still being written (its H is
identical to a prompt whose offload is in flight); here it is the connector's other
deferral, a hit chunk already being loaded for another request (``offloading/
scheduler.py`` 1021-1045, keys added at line 1499 when the earlier request's load is
planned in the same scan): the scheduler takes the same ``None`` branch. (A deferral on a
pending store needs, with this adapter's fake worker, a block-aligned prompt identical to
one being stored, whose load back is a PREFIX misfire of the suite on the clean side.)
Workload (``tests/conformance/test_vllm_corpus_deadlocks.py``, FCFS, bs 4, 16 blocks): a
shared prefix p (16 tokens) and a conversation q (24) are computed and offloaded, E
evicts both from the device; R decodes; P (p + 2), H (p + 32: 12 blocks) and L (q + 2)
arrive together. P is admitted as a load of p; H's lookup is deferred (p is being
loaded); L is admitted as a load of q (6 blocks). Fixed: P and L are promoted from
``kv_holding_waiting`` and finish, then H runs on p, now on the device. Patched: H heads
the one queue holding nothing, needs 12 blocks with 10 free; L, holding 6 and needing 1,
is behind it; once P and R finish nothing is scheduled again (PROGRESS, "waiting request H
got nothing"): the PR's end state in small.

The module refuses to import (:func:`refserve.conformance.corpus.hunk.require_lines`)
unless the installed
scheduler still has the split's lines.
"""

from __future__ import annotations

from refserve.conformance.adapter import EngineConfig
from refserve.conformance.adapters.vllm import V
from refserve.conformance.adapters.vllm_offload import VllmOffloadAdapter
from refserve.conformance.corpus.hunk import require_lines
from refserve.conformance.corpus.patches.vllm_45388 import undo_queue_split

FIXED = "refserve.conformance.adapters.vllm_offload:make"
BUGGY = "refserve.conformance.corpus.patches.vllm_57841:make"

_FIXED_LINES = (
    "if self._holds_kv_blocks(request_to_skip):",
    "request_queue = self.kv_holding_waiting",
    "self.kv_holding_waiting.prepend_requests(step_skipped_kv_holding)",
    "or request.status == RequestStatus.WAITING_FOR_REMOTE_KVS",
    "if ext_tokens is None:",
)
require_lines("vllm PR#57841", V.Scheduler, _FIXED_LINES)


class Vllm57841Adapter(VllmOffloadAdapter):
    """The offload adapter (FCFS) whose scheduler puts deferred and loading requests back
    into one waiting queue (vllm PR#57841)."""

    @property
    def name(self) -> str:
        return f"{super().name} [vllm PR#57841 re-applied: skipped requests in one queue]"

    def configure(self, config: EngineConfig) -> None:
        super().configure(config)
        undo_queue_split(self._sched)


def make() -> Vllm57841Adapter:
    """vLLM (fcfs) with ``OffloadingConnector``, the queue split undone."""
    return Vllm57841Adapter()
