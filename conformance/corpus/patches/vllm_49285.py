"""vllm PR#49285 re-applied on vLLM 0.33.0: the offloading connector stores an aborted
request's blocks up to its whole prompt, computed or not.

* Fix: https://github.com/vllm-project/vllm/pull/49285 ("Fix num_tokens_after_batch for
  different termination types", merged 2026-07-21). vLLM 0.33.0 ships it (below).

The bug, as the pull request states it: ``OffloadingConnectorScheduler._build_store_jobs``
(``vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py``) stored a
finished request's blocks up to ``req.num_tokens`` whatever the reason it finished. An
aborted request may have computed only part of its prompt (``num_computed_tokens <
num_tokens``), so its store took blocks whose K/V was never computed: the blocks its
first chunk was allocated, written only up to the chunk's end. They are stored under the
hashes of the prompt's tokens, and a later request with that prompt loads them back.
(The clamp to the blocks a request was allocated, ``min(num_chunks,
num_allocated_chunks)``, keeps blocks it never had out, not the unwritten part of a
block it had.)

The fix's hunk (``_build_store_jobs``, installed lines 1830-1831), after -> before; this
module runs the "before" side on the aborted branch::

                if req.status is RequestStatus.FINISHED_ABORTED:
    -               num_tokens_after_batch = req.num_computed_tokens
    +               num_tokens_after_batch = req.num_tokens

(before the fix one branch served every finished request with ``req.num_tokens``; the
other finished requests' branch, which vllm#54193 later changed, is left as installed:
:mod:`refserve.conformance.corpus.patches.vllm_54193` re-applies that one.)

How it is re-applied: as vllm#54193's patch does, by
:func:`refserve.conformance.corpus.hunk.with_statement_reversed` (the installed method
recompiled with that one statement replaced, bound to the one
``OffloadingConnectorScheduler`` instance its adapter's scheduler builds; vLLM's class
and module untouched).

How it matches the pull request: the suite's ``pressure-aborted-prompt-again`` (the
offload adapter as shipped, ``vllm_offload:make``): X (16 tokens) computes a first chunk
of 6 and is aborted; E evicts it from the device; Y repeats X's prompt. Patched: X's
store takes the blocks of its first chunk, the second holding positions 4-5 computed and
6-7 not; Y loads both and reads position 6 back unwritten (POS). Fixed: only the block
X computed whole is stored.
"""

from __future__ import annotations

import importlib
import types
from typing import Any

from refserve.conformance.adapters.vllm_offload import VllmOffloadAdapter
from refserve.conformance.corpus.hunk import require_lines, with_statement_reversed

FIXED = "refserve.conformance.adapters.vllm_offload:make"
BUGGY = "refserve.conformance.corpus.patches.vllm_49285:make"

_sched_mod: Any = importlib.import_module(
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler"
)
_CLASS: Any = _sched_mod.OffloadingConnectorScheduler

# The aborted branch's statement; the line break tells it from the running branch's
# ``num_tokens_after_batch = req.num_computed_tokens + num_scheduled_tokens``.
FIXED_LINE = "num_tokens_after_batch = req.num_computed_tokens\n"
BUGGY_LINE = "num_tokens_after_batch = req.num_tokens\n"

require_lines("vllm PR#49285", _CLASS._build_store_jobs, (FIXED_LINE,))

BUILD_STORE_JOBS_49285: Any = with_statement_reversed(
    _CLASS._build_store_jobs, _sched_mod, FIXED_LINE, BUGGY_LINE
)
"""The installed ``_build_store_jobs`` whose aborted branch stores up to ``num_tokens``."""


def reapply(connector_scheduler: Any) -> None:
    """Put the pre-fix watermark of aborted requests on this connector scheduler only."""
    connector_scheduler._build_store_jobs = types.MethodType(
        BUILD_STORE_JOBS_49285, connector_scheduler
    )


class Vllm49285Adapter(VllmOffloadAdapter):
    """The offload adapter whose connector stores an aborted request's blocks up to its
    whole prompt (vllm PR#49285)."""

    @property
    def name(self) -> str:
        return f"{super().name} [vllm PR#49285 re-applied: aborted watermark num_tokens]"

    def configure(self, config: Any) -> None:
        super().configure(config)
        reapply(self._sched.connector.connector_scheduler)


def make() -> Vllm49285Adapter:
    """vLLM with ``OffloadingConnector``, the aborted-request watermark fix undone."""
    return Vllm49285Adapter()
