"""Requests whose KV leaves the device: swapped preemption victims and paused agent turns.

The rules live in ref/core/swap.py (recompute or swap, where a tool wait keeps its KV);
this module is their mechanics: an attachment, the spine's suspension manager
(ref/core/hooks.py ``SuspensionManager``), plugged in by ref/core/scheduler.py:

- **tool waits**: ``pause`` moves a decoding turn to WAITING_TOOL with its KV on the
  device, bound for the host (moved at the start of the next step) or dropped;
  ``resume`` turns the tool's answer into the next turn's prompt;
- **within a step** (all inside the step's pool and host transactions): paused KV bound
  for the host moves there, paused KV is reclaimed before running work is preempted, a
  victim is swapped out or dropped, a swapped request is swapped back in on admission;
- **at commit**: the paused turns' bookkeeping catches up with the plan.

On a hybrid model's grouped pool (ref/kv/groups.py) a swap moves, in every layer group,
the blocks the request's next query reads (a window group's from the block holding
``window_start`` on), and a swap-in restores every group's table before the copies.
"""

from __future__ import annotations

from collections.abc import Sequence

from refserve.core.capacity import never_fits, require_fit
from refserve.core.config import SchedulerConfig
from refserve.core.hooks import Fits
from refserve.core.loop import SchedulerLoop
from refserve.core.plan import StepPlan
from refserve.core.prefill import chunk
from refserve.core.request import Request, StopParams
from refserve.core.step_build import StepBuild
from refserve.core.swap import KVRetention, preempt_by_swap
from refserve.errors import InvalidArgument, UnknownRequest
from refserve.kv import BlockCopy, BlockPool
from refserve.kv.groups import GroupBlocks, GroupedPool, Restored
from refserve.kv.host_pool import HostPool
from refserve.spec.snapshot import PoolSnapshot, RequestStatus
from refserve.values import is_number


class Suspension:
    def __init__(self, config: SchedulerConfig, pool: BlockPool, host: HostPool) -> None:
        self.config = config
        self.pool = pool
        self.host = host
        # A hybrid model's layer groups: swaps move every group's blocks.
        self.groups = pool if isinstance(pool, GroupedPool) else None
        self.paused: dict[str, Request] = {}  # WAITING_TOOL: agent turns waiting for a tool
        # Paused turns whose KV the next step moves to the host pool (pause order).
        self.to_host: list[str] = []
        # Swap traffic, in blocks (bytes = blocks x the KV bytes of one block).
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0

    # ------------------------------------------------------------------ tool waits
    def pause(
        self, r: Request, retention: KVRetention | str | None, expected_wait_ms: float
    ) -> KVRetention:
        """``Scheduler.pause`` without the running list: see its docstring."""
        rid = r.request_id
        if r.status is not RequestStatus.DECODING:
            raise InvalidArgument(f"pause: request {rid!r} must be decoding (it is {r.status})")
        kind = self._retention(r, retention, expected_wait_ms)
        if kind is KVRetention.HOST and not self.host.num_blocks:
            raise InvalidArgument(
                f"pause: request {rid!r} cannot wait on the host: num_host_blocks is 0"
            )
        if kind is KVRetention.DROP:
            self.pool.free(rid)
            r.num_computed_tokens = 0
        elif kind is KVRetention.HOST:
            self.to_host.append(rid)
        r.transition(RequestStatus.WAITING_TOOL)
        self.paused[rid] = r
        return kind

    def _retention(
        self, r: Request, retention: KVRetention | str | None, expected_wait_ms: float
    ) -> KVRetention:
        if retention is None:
            if not is_number(expected_wait_ms):
                raise InvalidArgument(
                    f"pause: expected_wait_ms must be a number, got {expected_wait_ms!r}"
                )
            return self.config.retention.choose(
                expected_wait_ms, host_available=self.host.can_hold(r.num_computed_tokens)
            )
        try:
            return KVRetention(retention)
        except ValueError:
            allowed = ", ".join(m.value for m in KVRetention)
            raise InvalidArgument(
                f"pause: retention must be one of {allowed}, got {retention!r}"
            ) from None

    def resume(self, request_id: str, tool_token_ids: Sequence[int], stop: StopParams) -> Request:
        """The paused turn leaves the tool wait with ``tool_token_ids`` appended to its
        prompt, its KV where it was; the scheduler decides where it goes next."""
        r = self.paused.get(request_id)
        if r is None:
            raise UnknownRequest(request_id, "resume (not waiting for a tool)")
        tool = list(tool_token_ids)
        if not tool or any(type(t) is not int or t < 0 for t in tool):
            raise InvalidArgument(f"resume: request {request_id!r} needs tool token ids >= 0")
        num_tokens = r.num_tokens + len(tool)
        if num_tokens >= self.config.max_len:
            raise InvalidArgument(
                f"resume: request {request_id!r} would hold {num_tokens} tokens; "
                f"the limit is {self.config.max_len - 1} before an output token"
            )
        require_fit(self.config, request_id, num_tokens)
        del self.paused[request_id]
        if request_id in self.to_host:  # the tool answered before the KV moved
            self.to_host.remove(request_id)
        r.prompt_token_ids = [*r.token_ids, *tool]
        r.token_ids = list(r.prompt_token_ids)
        r.num_prompt_tokens = len(r.token_ids)
        r.stop = stop
        return r

    def forget(self, request_id: str) -> bool:
        """An aborted or finished request leaves the host pool and the tool wait;
        True if it was paused."""
        if self.host.has_request(request_id):
            self.host.release(request_id)
        if request_id in self.to_host:
            self.to_host.remove(request_id)
        return self.paused.pop(request_id, None) is not None

    # ------------------------------------------------------------------ within a step
    def move_to_host(self, step: StepBuild) -> None:
        """Paused turns retained on the host leave the device at the start of a step,
        so this step can already use their blocks (the swap-out copies run first)."""
        for rid in self.to_host:
            r = self.paused[rid]
            if self.host.can_hold(r.num_computed_tokens):
                self._swap_out(r, step)
            # else: the host pool is full; the KV stays on the device and the move is
            # retried next step.

    def reclaim(self, step: StepBuild) -> bool:
        """Free the device blocks of one paused turn (the longest paused): to the host
        if it has room, else dropped. False if no paused turn holds device blocks.

        A tool wait never blocks progress: paused KV is reclaimed before a running
        request is preempted, and before admission stalls with nothing running.
        """
        for rid, r in self.paused.items():
            if not self.pool.has_request(rid):
                continue  # its KV is on the host already, or was dropped
            if r.num_computed_tokens and self.host.can_hold(r.num_computed_tokens):
                self._swap_out(r, step)
            else:
                self.pool.free(rid)
                step.dropped.append(rid)
            return True
        return False

    def evict(self, victim: Request, step: StepBuild) -> None:
        """Free a preemption victim's device blocks: swapped out, or dropped for recompute."""
        if self._should_swap(victim):
            self._swap_out(victim, step)
        else:
            self.pool.free(victim.request_id)

    def park(self, victim: Request, step: StepBuild) -> None:
        """A victim expected back soon (the multi-level queue's): swapped out whenever
        the host pool can hold it and it could fit the device again, whatever the
        preemption mode; else dropped for recompute."""
        stored = victim.num_computed_tokens
        if stored and self.host.can_hold(stored) and not never_fits(self.config, victim.num_tokens):
            self._swap_out(victim, step)
        else:
            self.pool.free(victim.request_id)

    def host_room(self) -> int:
        return self.host.num_free_blocks if self.host.num_blocks else 0

    def _should_swap(self, victim: Request) -> bool:
        """Recompute or swap a preemption victim (ref/core/swap.py documents the rule)."""
        cfg = self.config
        stored = victim.num_computed_tokens
        # The facts are read-only queries, asked eagerly so the rule stays one pure
        # function: a preemption is rare and each is O(1). The config gives AUTO, the only
        # mode that reads swap_is_cheaper, a swap cost.
        cost = cfg.swap_cost
        return preempt_by_swap(
            cfg.preemption_mode,
            stored,
            never_fits=never_fits(cfg, victim.num_tokens),
            host_has_room=self.host.can_hold(stored),
            swap_is_cheaper=cost is not None and cost.prefers_swap(stored),
        )

    def _swap_out(self, r: Request, step: StepBuild) -> None:
        rid = r.request_id
        if self.groups is not None:
            held = self.groups.held_blocks(rid)
            copies = self.host.swap_out_groups(rid, held, r.num_computed_tokens, r.token_ids)
        else:
            device = self.pool.block_table_view(rid)
            copies = self.host.swap_out(rid, device, r.num_computed_tokens, r.token_ids)
        step.swap_out.extend(copies)
        step.swapped_out.append(rid)
        self.pool.free(rid)

    def readmit(self, r: Request, step: StepBuild, fits: Fits) -> bool | None:
        """A swapped request's admission: its next tokens, if ``fits`` says their blocks
        are free, are swapped in with its KV; None for any other request. On a grouped
        pool the KV it brings back counts as a :class:`Restored` (every group's blocks
        at its KV length), the blocks of its next tokens on top."""
        if r.status is not RequestStatus.SWAPPED:
            return None
        stored = r.num_computed_tokens
        n = chunk(self.config, r.num_tokens - stored, step.budget, stored)
        if n < 1:
            return False
        # A decode joins only a step its TBT bound has room in, and bounds what the step
        # prefills after it (tbt_prefill_left).
        left = (
            tbt_prefill_left(self.config, step, stored + 1)
            if n == r.num_tokens - stored == 1
            else None
        )
        if left is not None and left < 0:
            return False
        if self.groups is not None:
            if not fits(n, Restored.of(stored, self.config.block_size)):
                return False
        elif not fits(stored + n, None):
            return False
        self.swap_in(r, n, step)
        step.budget -= n
        if left is not None:
            step.budget = min(step.budget, left)
        return True

    def kept(self, r: Request, plan: StepPlan) -> bool:
        """A victim swapped out by ``plan`` waits as SWAPPED, its KV on the host (its
        ``num_computed_tokens`` stays)."""
        if r.request_id not in plan.swapped_out:
            return False
        r.transition(RequestStatus.SWAPPED)
        return True

    def hold(self, r: Request) -> None:
        """A tool wait arriving from elsewhere (a migration) waits here."""
        self.paused[r.request_id] = r

    def swap_in(self, r: Request, n: int, step: StepBuild) -> None:
        """Admit a swapped request whose ``n`` next tokens fit: restore its KV from the
        host and schedule them in the same step (the swap-in copies run before the
        forward)."""
        rid = r.request_id
        stored = r.num_computed_tokens
        if self.groups is not None:
            restored = self.groups.restore(rid, r.token_ids, stored, namespace=r.namespace)
            step.swap_in.extend(_copies_in(rid, self.host.release(rid).groups, restored))
        else:
            self.pool.allocate(rid, r.token_ids, stored, namespace=r.namespace)
            host = self.host.release(rid)
            device = self.pool.block_table_view(rid)
            step.swap_in.extend(
                BlockCopy(h, v) for h, v in zip(host.block_ids, device, strict=True)
            )
        step.swapped_in.append(rid)
        alloc = self.pool.allocate(rid, r.token_ids, n, namespace=r.namespace)
        assert not alloc.copies, "a swapped-in request shares no block"
        # A swapped decode has one token left (the last sampled one); anything longer
        # is a resumed agent turn's incremental prefill.
        step.plan.add(rid, stored, n, stored + n == r.num_tokens, r.num_tokens - stored > 1)

    # ------------------------------------------------------------------ the transaction
    def begin(self) -> None:
        self.host.begin()

    def rollback(self) -> None:
        self.host.rollback()

    def close(self) -> None:
        self.host.commit()

    def snapshot(self) -> PoolSnapshot | None:
        """The host pool, when there is one (num_host_blocks > 0)."""
        return self.host.snapshot() if self.host.num_blocks else None

    # ------------------------------------------------------------------ at commit
    def commit(self, plan: StepPlan) -> None:
        """Paused turns whose KV the plan moved to the host or released; the traffic."""
        self.num_swapped_out_blocks += len(plan.swap_out)
        self.num_swapped_in_blocks += len(plan.swap_in)
        if plan.swapped_out:
            swapped = set(plan.swapped_out)
            self.to_host = [rid for rid in self.to_host if rid not in swapped]
        for rid in plan.dropped:
            self.paused[rid].num_computed_tokens = 0
            if rid in self.to_host:
                self.to_host.remove(rid)


def tbt_prefill_left(config: SchedulerConfig, step: StepBuild, kv_tokens: int) -> int | None:
    """The prefill tokens the step may still take with one more decode, reading
    ``kv_tokens`` positions, so that ``b*P <= tbt_slo_ms - (a + c*D + e*K)`` over its
    prefill tokens ``P`` and its decodes, this one included; negative when it already
    holds more; None without SLO-aware chunking. The chunk rule's cap
    (ref/core/prefill.py) is set for the decodes planned before admission, and a swapped
    decode rejoins at admission, so it applies the bound itself: to what the step holds
    and to what admission adds after it."""
    model = config.step_cost
    if config.tbt_slo_ms is None or model is None:
        return None
    p = step.plan
    rows = list(zip(p.starts, p.num_new_tokens, p.is_prefill, strict=True))
    prefill = sum(n for _, n, pre in rows if pre)
    decodes = [start for start, _, pre in rows if not pre]
    kv_read = sum(start + 1 for start in decodes) + kv_tokens
    return model.prefill_room(config.tbt_slo_ms, len(decodes) + 1, kv_read) - prefill


def _copies_in(
    request_id: str, host: Sequence[GroupBlocks], device: Sequence[GroupBlocks]
) -> list[BlockCopy]:
    """The host -> device copies of a grouped swap-in: each host block to the restored
    block at its group's place. Every host place must have one; a restored place the
    host does not cover gets no K/V (spec/host.py flags such a host table)."""
    out: list[BlockCopy] = []
    for h, d in zip(host, device, strict=True):
        assert h.group == d.group, (request_id, h.group, d.group)
        for i, b in enumerate(h.block_ids):
            place = h.first + i - d.first
            if not 0 <= place < len(d.block_ids):
                raise InvalidArgument(
                    f"swap_in: request {request_id!r}'s host block {b} is group {h.group}'s "
                    f"place {h.first + i}, which the restored table does not hold"
                )
            out.append(BlockCopy(b, d.block_ids[place]))
    return out


# ---------------------------------------------------------------------- at the scheduler
def pause(
    sched: SchedulerLoop,
    suspension: Suspension,
    request_id: str,
    retention: KVRetention | str | None,
    expected_wait_ms: float,
) -> KVRetention:
    """``Scheduler.pause`` (ref/core/scheduler.py has the contract): the turn leaves the
    running batch for the tool wait."""
    sched.require_boundary("pause")
    r = sched.requests.get(request_id)
    if r is None:
        raise UnknownRequest(request_id, "pause")
    kind = suspension.pause(r, retention, expected_wait_ms)
    sched.batch.remove(r)
    return kind


def resume(
    sched: SchedulerLoop,
    suspension: Suspension,
    request_id: str,
    tool_token_ids: Sequence[int],
    stop: StopParams,
) -> None:
    """``Scheduler.resume`` (ref/core/scheduler.py has the contract): the next turn runs
    in place, queues as SWAPPED, or queues to recompute."""
    sched.require_boundary("resume")
    r = suspension.resume(request_id, tool_token_ids, stop)
    running = sched.running
    in_place = (
        len(running) < sched.config.max_num_seqs
        and sched.policy.admission_open(len(running))
        and sched.policy.may_admit(r, running)
    )
    if sched.pool.has_request(request_id) and in_place:
        r.transition(RequestStatus.PREFILLING)
        sched.enter_batch(r, prefilling=True)
        return
    if sched.pool.has_request(request_id):  # it may not run now: give the blocks back
        sched.pool.free(request_id)
        r.num_computed_tokens = 0
    swapped = suspension.host.has_request(request_id)
    r.transition(RequestStatus.SWAPPED if swapped else RequestStatus.WAITING)
    sched.requeue(r)
