"""lmdeploy#4100 re-applied on lmdeploy 0.18.0: prefill refused while fewer than a tenth
of the pool's blocks are free, counting the prefix trie's cached blocks as used.

* Tracker: https://github.com/InternLM/lmdeploy/pull/4100 ("fix bug: schedule ratio
  support prefix-caching"; its reproduction: Qwen3-0.6B with prefix caching under the
  ShareGPT benchmark ends in ``assert len(running) != 0``). The final fix,
  https://github.com/InternLM/lmdeploy/pull/4110 ("remove prefill free ratio threshold",
  commit b186cf0b4), removed the gate.
* Affected: main from dbd5810b6 (lmdeploy#4076, 2025-10-30, which added the gate) to
  b186cf0b4 (2025-11-07); the first tag holding either is v0.11.0, so no release
  shipped it.

The hunk lmdeploy#4076 added to ``Scheduler._schedule_prefill``
(``lmdeploy/pytorch/paging/scheduler.py``) and lmdeploy#4110 removed::

    +        # reserve some blocks for decoding to avoid too much eviction
    +        if self.cache_config.role != EngineRole.Prefill:
    +            num_free_blocks = self.block_manager.get_num_free_gpu_blocks()
    +            num_all_blocks = self.cache_config.num_gpu_blocks
    +            free_ratio = num_free_blocks / num_all_blocks
    +            if free_ratio < 0.1:
    +                return running, swap_in_map, swap_out_map, copy_map

``get_num_free_gpu_blocks`` counts the allocator's free blocks; a block only the prefix
trie holds (allocator reference 1) is not among them, though an admission evicts it on
demand. After a long request finishes, the trie keeps its blocks: the pool is free in
all but that figure, the gate refuses every prefill, and with nothing running the engine
falls through to a decode of nobody.

0.18.0's prefill scheduling is ``_PrefillScheduler.schedule``
(``paging/prefill_scheduler.py`` lines 835-892); it returns early only at::

    851          if max_batches <= 0 or not waiting:
    852              return running

and makes room through the eviction helper, which evicts trie leaves. This module puts
the gate back after that line, on the prefill scheduler of the schedulers its factory
builds and nowhere else (an instance attribute wrapping the bound method: the gate, then
0.18.0's own ``schedule``). The adapter builds a hybrid engine (``role`` is not
``EngineRole.Prefill``), where the gate applied.

How it matches the tracker: a request finishes and leaves its blocks cached, a new one
arrives that needs two blocks while the trie holds more than nine tenths of the pool:
it is never admitted, and nothing runs (PROGRESS).

The module refuses to import (:func:`refserve.conformance.corpus.hunk.require_lines`)
unless the installed ``schedule`` has that early return and no free-ratio gate.
"""

from __future__ import annotations

import functools
from typing import Any

from refserve.conformance.adapters.lmdeploy import L, LmdeployAdapter
from refserve.conformance.corpus.hunk import require_lines

FIXED = "refserve.conformance.adapters.lmdeploy:make"
BUGGY = "refserve.conformance.corpus.patches.lmdeploy_4100:make"

require_lines(
    "lmdeploy#4100",
    L.PrefillScheduler.schedule,
    (
        "max_batches = self.scheduler_config.max_batches - num_ready - num_running",
        "if max_batches <= 0 or not waiting:",
    ),
    absent=("free_ratio",),
)


def _gated(original: Any, prefill: Any, **kwargs: Any) -> Any:
    """The gate of lmdeploy#4076, then 0.18.0's ``schedule``."""
    max_batches = prefill.scheduler_config.max_batches - kwargs["num_ready"] - kwargs["num_running"]
    if max_batches <= 0 or not kwargs["waiting"]:
        return []
    # reserve some blocks for decoding to avoid too much eviction
    num_free_blocks = prefill.block_manager.get_num_free_gpu_blocks()
    num_all_blocks = prefill.cache_config.num_gpu_blocks
    free_ratio = num_free_blocks / num_all_blocks
    if free_ratio < 0.1:
        return []
    return original(**kwargs)


def free_ratio_gate(scheduler: Any) -> None:
    """Put lmdeploy#4100's gate back on this scheduler's prefill scheduler only."""
    prefill = scheduler._prefill_scheduler
    prefill.schedule = functools.partial(_gated, prefill.schedule, prefill)


class Lmdeploy4100Adapter(LmdeployAdapter):
    """The lmdeploy adapter whose prefill scheduler has the free-ratio gate."""

    @property
    def name(self) -> str:
        return f"{super().name} [lmdeploy#4100 re-applied: free-ratio prefill gate]"

    def make_scheduler(self, scheduler_config: Any, cache_config: Any, block_size: int) -> Any:
        sched = super().make_scheduler(scheduler_config, cache_config, block_size)
        free_ratio_gate(sched)
        return sched


def make() -> Lmdeploy4100Adapter:
    """lmdeploy 0.18.0 with lmdeploy#4100 re-applied (``prefill_interval=0``)."""
    return Lmdeploy4100Adapter()
