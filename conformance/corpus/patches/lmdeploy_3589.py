"""lmdeploy#3589 re-applied on lmdeploy 0.18.0: the eviction helper frees a victim's
blocks but keeps its step, so the victim goes on with a KV length and no blocks.

* Tracker: https://github.com/InternLM/lmdeploy/pull/3589 ("[Fix]: reset step after
  eviction", commit 51e5dbf92). Affected: every release with the recompute eviction
  helper up to v0.8.0; fixed in v0.9.0.

The fix's hunk (``lmdeploy/pytorch/paging/eviction_helper/recompute_eviction_helper.py``,
``evict_for_seq``, as of v0.8.0)::

     evict_seq = evictable_seqs.pop(0)
     block_manager.free(evict_seq)
    +evict_seq.set_step(0)

0.18.0 has the fixed logic, moved. ``RecomputeEvictionHelper._reclaim_candidate``
(``eviction_helper/recompute_eviction_helper.py`` lines 104-118) releases a victim with::

    117          seq.state.release_paging_resources()

which is ``SequenceLifecycle.release_paging_resources`` (``seq_states/states.py`` lines
67-82): it frees the blocks and resets the step::

     79              self._block_manager.free(seq)
     82          seq.set_step(0)

This module puts the old release back on the eviction helper of the schedulers its
factory builds, and nowhere else: ``_reclaim_candidate`` of that one helper instance (an
instance attribute) runs 0.18.0's body with ``self.block_manager.free(seq)`` in place of
``seq.state.release_paging_resources()``, so the victim's blocks go back to the pool and
its ``num_history_ids`` stays. Every other release (a finished request's
``end_session``, a rolled-back prefix match) keeps 0.18.0's code, as before the fix,
where only the eviction loop lacked the reset.

How it matches the tracker. A soft-preempted sequence (WAITING with its KV) is taken as
a victim when another sequence needs blocks. Before the fix it kept its step: a KV
length with an empty block table, and on re-admission the scheduler allocated blocks for
every token but the model computed only the tokens after the stale history, reading
positions ``0..h-1`` from blocks that hold another request's K/V (or none). The suite
sees both halves: at the reclaim, a request with a KV length and no block table (POS);
at the re-admission, position 0 read back from a block another request overwrote
(BLOCK).

The module refuses to import (:func:`refserve.conformance.corpus.hunk.require_lines`)
unless the installed helper releases through ``release_paging_resources`` and that
release resets the step.
"""

from __future__ import annotations

import importlib
import types
from typing import Any

from refserve.conformance.adapters.lmdeploy import L, LmdeployAdapter
from refserve.conformance.corpus.hunk import require_lines

FIXED = "refserve.conformance.adapters.lmdeploy:make"
BUGGY = "refserve.conformance.corpus.patches.lmdeploy_3589:make"

require_lines(
    "lmdeploy#3589",
    L.RecomputeEvictionHelper._reclaim_candidate,
    ("seq.state.release_paging_resources()",),
)
_STATES = importlib.import_module("lmdeploy.pytorch.paging.seq_states.states")
require_lines(
    "lmdeploy#3589",
    _STATES.SequenceLifecycle.release_paging_resources,
    ("self._block_manager.free(seq)", "seq.set_step(0)"),
)


def _reclaim_without_reset(self: Any, seq: Any) -> bool:
    """0.18.0's ``_reclaim_candidate`` with the release of before the fix: the blocks
    are freed, the step is not reset."""
    if self.load_coordinator.is_remote_ready(seq):
        return False
    if seq.num_blocks == 0 and (not self._is_ssm or seq.logical_state < 0):
        return False
    if self.block_trie.enabled:
        seq.prefix_cache.suppress_match_stats = True
    self.load_coordinator.release_tracking(seq)
    self.block_manager.free(seq)
    return True


def reclaim_without_reset(scheduler: Any) -> None:
    """Put lmdeploy#3589 back on this scheduler's eviction helper only."""
    helper = scheduler.eviction_helper
    helper._reclaim_candidate = types.MethodType(_reclaim_without_reset, helper)


class Lmdeploy3589Adapter(LmdeployAdapter):
    """The lmdeploy adapter whose eviction helper keeps a victim's step."""

    @property
    def name(self) -> str:
        return f"{super().name} [lmdeploy#3589 re-applied: eviction keeps the step]"

    def make_scheduler(self, scheduler_config: Any, cache_config: Any, block_size: int) -> Any:
        sched = super().make_scheduler(scheduler_config, cache_config, block_size)
        reclaim_without_reset(sched)
        return sched


def make() -> Lmdeploy3589Adapter:
    """lmdeploy 0.18.0 with lmdeploy#3589 re-applied (``prefill_interval=0``)."""
    return Lmdeploy3589Adapter()
