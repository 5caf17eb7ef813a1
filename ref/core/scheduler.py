"""The scheduler refserve runs: the reference loop (ref/core/loop.py, the spine) with every
attachment plugged in at its named point (ref/core/hooks.py). Not spine: a newcomer reads
the loop first, then whichever attachment they need.

- swaps and tool waits: ref/core/suspend.py (the suspension manager; the rules in
  ref/core/swap.py), with :meth:`Scheduler.pause` and :meth:`Scheduler.resume`;
- speculative decoding: ref/core/speculation.py (the proposal source), with
  :meth:`Scheduler.propose`;
- n > 1 forks: ref/core/forks.py, with :meth:`Scheduler.fork`;
- the bulk decode path: ref/core/bulk.py (the decode strategy);
- a hybrid model's layer groups (``config.kv_groups``): ref/kv/groups.py, the pool the
  loop is given;
- the skip-join multi-level feedback queue (``policy="mlfq"``): ref/core/mlfq.py, a policy
  object that also displaces running requests at the named point ``Policy.displace``;
- migration: ref/core/transit.py, through the loop's transfer point (``require_boundary``,
  ``join``, ``leave``).

Deleting an attachment means deleting its module, its tests and its lines here.
"""

from __future__ import annotations

from collections.abc import Sequence

from refserve.core import forks, suspend
from refserve.core.bulk import BulkBatch, BulkDecodes
from refserve.core.config import PolicyName, SchedulerConfig
from refserve.core.loop import SchedulerLoop, StepInProgress
from refserve.core.mlfq import SkipJoinMlfq
from refserve.core.policy import Policy
from refserve.core.request import Request, StopParams
from refserve.core.speculation import Proposals
from refserve.core.suspend import Suspension
from refserve.core.swap import KVRetention
from refserve.errors import UnknownRequest
from refserve.kv import HostPool
from refserve.kv.groups import GroupedPool

__all__ = ["Scheduler", "StepInProgress"]


class Scheduler(SchedulerLoop):
    """The loop with swaps, tool waits, speculative drafts, forks and the bulk path."""

    def __init__(self, config: SchedulerConfig, policy: Policy | None = None) -> None:
        self._bulk = BulkBatch(config.block_size, config.max_len)
        if policy is None and config.policy is PolicyName.MLFQ:
            policy = SkipJoinMlfq(config)
        # A layout of several layer groups keeps a table per group (ref/kv/groups.py).
        pool = (
            GroupedPool(
                config.num_blocks, config.block_size, config.kv_groups, **config.pool_options
            )
            if config.grouped
            else None
        )
        super().__init__(config, policy, batch=self._bulk, pool=pool)
        # The host-side pool that swapped and paused KV waits in (ref/kv/host_pool.py).
        self.host = HostPool(config.num_host_blocks, config.block_size, config.kv_groups)
        self._suspension = Suspension(config, self.pool, self.host)  # swaps and tool waits
        self._proposals = Proposals(config.num_speculative_tokens, self.pool, config.max_len)
        # The bulk decode path grows one table per request: a grouped pool's decodes take
        # the reference path, one allocation (every group's) each.
        decodes = None if config.grouped else BulkDecodes(self._bulk, self.pool, config.max_len)
        self.plug(
            suspension=self._suspension,
            proposals=self._proposals,
            decodes=decodes,
            layer_groups=pool,  # every group's tables reach the step's inputs and checks
        )

    @property
    def batch(self) -> BulkBatch:
        """The running requests' arrays, with the bulk step's operations."""
        return self._bulk

    @property
    def paused(self) -> dict[str, Request]:
        """WAITING_TOOL: agent turns waiting for a tool, in pause order."""
        return self._suspension.paused

    @property
    def num_swapped_out_blocks(self) -> int:
        """Swap traffic out, in blocks (bytes = blocks x the KV bytes of one block)."""
        return self._suspension.num_swapped_out_blocks

    @property
    def num_swapped_in_blocks(self) -> int:
        """Swap traffic in, in blocks."""
        return self._suspension.num_swapped_in_blocks

    def fork(self, parent_id: str, child_id: str, first_token: int, stop: StopParams) -> Request:
        """n > 1 sampling (ref/core/forks.py): a sibling of a parent that has just
        sampled its first token. While ``max_num_seqs`` leaves room it shares every KV
        block of the parent (copy-on-write on the first write to the shared partial
        block) and enters in decode, exactly the parent's state. Otherwise it waits in
        the state of a recompute-preempted request and is admitted later like one, the
        prompt's full blocks coming from the prefix cache.
        """
        return forks.fork(self, parent_id, child_id, first_token, stop)

    def pause(
        self,
        request_id: str,
        retention: KVRetention | str | None = None,
        *,
        expected_wait_ms: float = 0.0,
    ) -> KVRetention:
        """An agent turn stops for a tool call (WAITING_TOOL) at a step boundary.

        Retention (ref/core/swap.py): ``device`` keeps the request's blocks (short waits:
        resuming computes only the new tokens); ``host`` moves its KV to the host pool in
        the next step (the device blocks serve others meanwhile; kept on the device if
        the host pool is full by then); ``drop`` releases its blocks now (long waits: the
        resumed turn recomputes, its full blocks coming back from the prefix cache unless
        evicted meanwhile). ``None`` lets ``config.retention`` choose from
        ``expected_wait_ms``. Returns the retention applied.
        """
        return suspend.pause(self, self._suspension, request_id, retention, expected_wait_ms)

    def resume(self, request_id: str, tool_token_ids: Sequence[int], stop: StopParams) -> None:
        """The tool answered: the conversation so far plus ``tool_token_ids`` becomes the
        prompt of the request's next turn (an incremental prefill), sampled under ``stop``.

        With its KV on the device and a running slot free (that the policy would admit it
        to: a static batch in flight, or its tenant at its cap, says no), the turn
        continues in place;
        with its KV on the host it queues as SWAPPED (admission swaps it in); otherwise
        it queues in its arrival place and recomputes through the prefix cache.
        """
        suspend.resume(self, self._suspension, request_id, tool_token_ids, stop)

    def propose(self, request_id: str, draft_token_ids: Sequence[int]) -> None:
        """Draft tokens for a decoding request's next step (ref/core/speculation.py,
        docs/SPECULATIVE.md): that step verifies them after its last token, within
        ``num_speculative_tokens``; the planner may verify fewer (budget, blocks, the
        tokens the request may still emit). An empty sequence withdraws them."""
        self.require_boundary("propose")
        r = self.requests.get(request_id)
        if r is None:
            raise UnknownRequest(request_id, "propose")
        self._proposals.propose(r, request_id in self.batch, draft_token_ids)
