"""vllm#54193 re-applied on vLLM 0.33.0: the offloading connector stores a finished
request's last block with a position no forward pass wrote.

* Tracker: https://github.com/vllm-project/vllm/issues/54193 ("KV offloading connector:
  finished-request store watermark includes a KV slot never written by any forward
  pass", with ``offload_prompt_only=False``; closed).
* Fix: https://github.com/vllm-project/vllm/pull/54288 ("Stop offloading the final
  sampled token's KV slot", merged 2026-09-06). vLLM 0.33.0 ships it (below).

The bug. When a request finishes, ``OffloadingConnectorScheduler._build_store_jobs``
(``vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py``) offloads its
blocks up to a watermark. Before the fix the watermark of a finished request was
``req.num_tokens``, which counts the last sampled token; that token is never fed back,
so its K/V slot is never written. When the answer ends on a block boundary the last
block is stored as full, under the hash of tokens that include the unwritten one, and a
later turn of the conversation (the same tokens and more) loads it back: its K/V at that
position is whatever the slot held. With ``offload_prompt_only=True`` (vLLM's default)
output blocks are never offloaded, so the issue needs ``False``.

The fix's hunk (``_build_store_jobs``, installed lines 1830-1839), after -> before; this
module runs the "before" side::

                elif req.is_finished():
    -               # Clamp to the GPU prefix cache's commit point. ...
    -               num_tokens_after_batch = max(req.num_prompt_tokens, req.num_tokens - 1)
    +               num_tokens_after_batch = req.num_tokens

(the "before" line as the issue quotes it; the comment lines are left in place).

How it is re-applied. ``_build_store_jobs`` is a long method (lines 1815-2102) and the
hunk is one statement in it, so the module does not copy it:
:func:`refserve.conformance.corpus.hunk.with_statement_reversed` recompiles the installed
method's source with exactly that statement replaced (refusing, like
:func:`~refserve.conformance.corpus.hunk.require_lines`, unless the installed source has
it, once), with the installed module's own globals, and the module binds it to the one
``OffloadingConnectorScheduler`` instance its adapter's scheduler builds (an instance
attribute; the class and the module are untouched, so the fixed adapter in the same
process keeps the fix; tested).

How it matches the tracker: the suite's ``pressure-next-turn`` (both sides run the offload
adapter with ``offload_prompt_only=False``, :func:`refserve.conformance.adapters
.vllm_offload.make_outputs`): A (6 tokens) answers with 2, so its 8 tokens end on a
block boundary and position 7 (its last answer token) is never computed; E evicts A's
blocks from the device; B is A's 8 tokens plus 2. Patched: A's second block is stored at
its finish and B loads it: B reads position 7 back unwritten (POS). Fixed: only A's
first block is stored, B loads it and computes from position 4.
"""

from __future__ import annotations

import importlib
import types
from typing import Any

from refserve.conformance.adapters.vllm_offload import VllmOffloadAdapter
from refserve.conformance.corpus.hunk import require_lines, with_statement_reversed

FIXED = "refserve.conformance.adapters.vllm_offload:make_outputs"
BUGGY = "refserve.conformance.corpus.patches.vllm_54193:make"

_sched_mod: Any = importlib.import_module(
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler"
)
_CLASS: Any = _sched_mod.OffloadingConnectorScheduler

FIXED_LINE = "num_tokens_after_batch = max(req.num_prompt_tokens, req.num_tokens - 1)"
BUGGY_LINE = "num_tokens_after_batch = req.num_tokens"

require_lines("vllm#54193", _CLASS._build_store_jobs, (FIXED_LINE,))


BUILD_STORE_JOBS_54193: Any = with_statement_reversed(
    _CLASS._build_store_jobs, _sched_mod, FIXED_LINE, BUGGY_LINE
)
"""The installed ``_build_store_jobs`` with the fixed watermark put back to
``req.num_tokens``."""


def reapply(connector_scheduler: Any) -> None:
    """Put the pre-fix watermark on this connector scheduler only."""
    connector_scheduler._build_store_jobs = types.MethodType(
        BUILD_STORE_JOBS_54193, connector_scheduler
    )


class Vllm54193Adapter(VllmOffloadAdapter):
    """The offload adapter (outputs offloaded) whose connector stores a finished
    request's blocks up to ``num_tokens`` (vllm#54193)."""

    @property
    def name(self) -> str:
        return f"{super().name} [vllm#54193 re-applied: finished watermark num_tokens]"

    def configure(self, config: Any) -> None:
        super().configure(config)
        reapply(self._sched.connector.connector_scheduler)


def make() -> Vllm54193Adapter:
    """vLLM with ``OffloadingConnector`` (``offload_prompt_only=False``), the fix undone."""
    return Vllm54193Adapter(offload_prompt_only=False)
