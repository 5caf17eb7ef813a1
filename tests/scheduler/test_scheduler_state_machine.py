"""Hypothesis state machine: Scheduler + BlockPool + a scripted simulator executor.

Every engine step goes through ``EngineCore(check_invariants=True)``, which builds a
``spec.StepSnapshot`` from the executor's real inputs and raises ``InvariantViolation`` on
any TOKEN / BLOCK / KVLEN / POS / CAP / PREFIX / PROGRESS violation (and checks ATOMIC
after a failed execute). On top of that the test keeps its own books and never trusts the
scheduler's counters:

* per request: prompt, the tokens the executor sampled for it (from a per-request script,
  so eos / stop ids can be forced), its KV length (reset on a recompute preemption or a
  dropped tool wait, kept by a swap, advanced by each chunk) and where that KV is
  (device, host or nowhere). After every step the scheduler's ``token_ids``,
  ``num_computed_tokens``, status, live / paused sets, which pool holds each request and
  finish reasons must equal the books;
* the swap rules are replayed from the books in the scheduler's order: paused turns
  retained on the host move first, then idle paused KV is reclaimed, then victims swap
  or recompute (auto: by the drawn ``SwapCost``), each only while the host pool has
  room, so the host-full fallbacks are checked exactly;
* a **fake KV memory** (slot -> token id) and a **fake host memory**: the executor
  applies ``plan.swap_out`` (device -> host), ``plan.swap_in`` (host -> device),
  ``plan.copies``, then writes ``input_ids`` at ``slot_mapping`` (both from
  ``refserve.core.inputs.build_inputs``, i.e. what a kernel would get); every scheduled request
  (swapped-in ones included) must read back its own tokens through its block table;
  after the step every live block table, every prefix-cache entry and every host table
  must read back the tokens it claims;
* agent turns: ``pause`` (each retention, or chosen by expected wait; host without a host
  pool is rejected) and ``resume`` (new prompt = conversation + tool tokens, new stop and
  script; past the length limit or the device pool it is rejected) with nothing changed
  on a rejection;
* a failing step leaves ``Scheduler.snapshot()`` (host pool and prefix-cache entries
  included), the waiting/running/paused order, both fake memories and the step index
  exactly as before, and the next step works. The executor journals its fake memories
  (``begin`` / ``rollback`` / ``commit``, ref/core/executor.py) and fails at a drawn point:
  before any write, after the swaps, after the forward's writes, after ``execute``
  returned, or with a token ``validate_output`` rejects; so the K/V read-backs above
  also hold after every rollback (``test_kv_readback_catches_unrestored_memory`` shows
  them failing when the memory is not restored);
* teardown resumes (or aborts) every paused turn, drains the engine within a step bound
  derived from the workload, then ``check_quiescent`` on both pools and
  ``check_starvation`` (over the StepSnapshots the test rebuilds from the same executor
  inputs) must report nothing.

Configs are drawn per example: tiny pools (preemption, capacity finishes), budgets from
1, max_num_seqs from 1, block sizes 1..5, prefix caching / chunked prefill / aligned
chunks on or off, the three admission modes, watermark, prefill reserve, the three
policies, the three preemption modes with host pools of 0..12 blocks.
Rare paths are labelled with ``event()``; run with ``--hypothesis-show-statistics``.

Copy-on-write is unreachable through the scheduler: only full blocks are ever shared
(prefix hits), and a shared *partial* block needs ``refserve.kv.fork``, which this state machine
never drives. The event is kept so a future fork/beam path shows up in the statistics.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from refserve.core.config import Admission, PolicyName, SchedulerConfig
from refserve.core.cost import StepCost
from refserve.core.engine_core import EngineCore
from refserve.core.executor import StepOutput
from refserve.core.executor_output import BadExecutorOutput
from refserve.core.inputs import ModelInputs, scheduled_requests
from refserve.core.plan import ScheduledChunk, StepPlan
from refserve.core.request import FinishReason, Request, StopParams
from refserve.core.scheduler import Scheduler
from refserve.core.swap import KVRetention, PreemptionMode, SwapCost
from refserve.errors import DuplicateRequest, ExceedsCapacity, InvalidArgument, UnknownRequest
from refserve.spec import EngineSnapshot, StepSnapshot, check_pool
from refserve.spec.arith import blocks_needed, max_cacheable_tokens
from refserve.spec.progress import check_quiescent, check_starvation
from refserve.spec.snapshot import RequestStatus
from tests.scheduler.scripted_kv import FAIL_POINTS, Boom, ScriptedExecutor, kv_readback_errors

S = RequestStatus
PROMPT_TOKEN = st.integers(0, 2)  # tiny alphabet: prefixes collide, cache hits are common
# Live requests are capped so the drain stays cheap: with <= 12 blocks and <= 6
# sequences, 8 live requests already keep a queue waiting behind the running batch.
MAX_LIVE = 8
STOP_ID = 4  # sampled tokens are 0..3 plus these two, forced by the script
EOS_ID = 5
POISONED = -1  # a rejected draft's slot in the fake memory: never a token id
# Where a live request's KV is, in the test's books (never read from the scheduler).
DEVICE, HOST, NOWHERE = "device", "host", "nowhere"


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ready = False
        self.in_rule = False
        self.pressure = False
        self.next_id = 0
        self.clock = 0.0
        self.prefixes: list[list[int]] = []
        # The test's own books, never read back from the scheduler.
        self.prompts: dict[str, list[int]] = {}
        self.outputs: dict[str, list[int]] = {}
        self.script: dict[str, list[int]] = {}
        self.stop: dict[str, StopParams] = {}
        self.computed: dict[str, int] = {}
        self.live: set[str] = set()
        self.work = 0  # sum of prompt + max_tokens over every request ever added
        self.memory: dict[int, int] = {}  # fake KV memory: slot -> token id
        self.host_memory: dict[int, int] = {}  # fake host memory: host slot -> token id
        self.kv_at: dict[str, str] = {}  # DEVICE / HOST / NOWHERE per live request
        self.paused: dict[str, KVRetention] = {}  # WAITING_TOOL -> the retention applied
        # Paused with HOST retention whose KV has not moved yet, in pause order.
        self.pending_host: list[str] = []
        self.steps: list[StepSnapshot] = []

    def tokens(self, rid: str) -> list[int]:
        return self.prompts[rid] + self.outputs[rid]

    def next_tokens(self, rid: str) -> list[int]:
        """What the target (the script) samples next for ``rid``, in order."""
        return self.script[rid][len(self.outputs[rid]) :]

    # ------------------------------------------------------------------ setup
    @initialize(data=st.data())
    def setup(self, data: st.DataObject) -> None:
        d = data.draw
        # Half the examples are "pressure" configs: a few blocks, several sequences,
        # first-chunk admission, long outputs, so decode growth runs out of blocks and
        # preemption (and aborts of preempted requests) is common. The rest draw broadly.
        pressure = self.pressure = d(st.booleans(), label="pressure")
        bs = d(st.integers(1, 5), label="block_size")
        if pressure:
            event("pressure config")
            num_blocks = d(st.integers(3, 7), label="num_blocks")
            chunked, align, caching = True, d(st.booleans(), label="align_chunks"), True
            budget = d(st.integers(1, 12), label="budget")
            max_model_len = d(st.integers(20, 40), label="max_model_len")
            max_num_seqs = d(st.integers(2, 6), label="max_num_seqs")
            admission, watermark = Admission.FIRST_CHUNK, 0
            # Every policy meets preemption, swap and reclaimed tool waits here.
            policy = d(
                st.sampled_from(
                    [PolicyName.DECODE_FIRST] * 2 + [PolicyName.STATIC, PolicyName.TENANT_FAIR]
                ),
                label="policy",
            )
        else:
            num_blocks = d(st.integers(1, 12), label="num_blocks")
            chunked = d(st.sampled_from([True, True, True, False]), label="chunked_prefill")
            budget = d(st.integers(1 if chunked else 2, 24), label="budget")
            max_model_len = d(st.integers(2, 40), label="max_model_len")
            align = d(st.booleans(), label="align_chunks")
            caching = d(st.sampled_from([True, True, True, False]), label="prefix_caching")
            max_num_seqs = d(st.integers(1, 6), label="max_num_seqs")
            admission = d(st.sampled_from(list(Admission)), label="admission")
            watermark = min(d(st.sampled_from([0, 0, 1, 2]), label="watermark"), num_blocks - 1)
            policy = d(
                st.sampled_from(
                    [PolicyName.DECODE_FIRST] * 3 + [PolicyName.STATIC, PolicyName.TENANT_FAIR]
                )
            )
        reserve = d(st.integers(0, budget - 1), label="prefill_reserve") if budget > 1 else 0
        # Preemption by swap in every policy. Small host pools (1..3 blocks) fill up, so
        # the fallback to recompute (victims) and KV kept on the device (paused turns) are
        # reached; recompute configs sometimes have no host pool at all, so pausing on
        # the host is rejected there. Pressure configs, where most preemptions happen,
        # lean to swap and auto.
        modes = list(PreemptionMode)
        if pressure:
            modes += [PreemptionMode.SWAP, PreemptionMode.AUTO]
        mode = d(st.sampled_from(modes), label="preemption_mode")
        if mode is PreemptionMode.RECOMPUTE:
            host_blocks = d(st.sampled_from([0, 0, 1, 2, 4, 12]), label="num_host_blocks")
        else:
            host_blocks = d(
                st.one_of(st.integers(1, 3), st.integers(4, 12)), label="num_host_blocks"
            )
        swap_cost = None
        if mode is PreemptionMode.AUTO:
            # 1 us per token over the link against 0.5 ms per recomputed token: swap wins
            # iff L > 2 * latency / 0.498 (ref/core/swap.py's break-even), i.e. from L = 1,
            # 5, 9 or 17 tokens. Victims hold 1..~35 tokens here, so the drawn models
            # both swap and recompute, by length.
            swap_cost = SwapCost(
                kv_bytes_per_token=1000,
                link_gb_per_s=1.0,
                latency_ms=d(st.sampled_from([0.0, 1.0, 2.0, 4.0]), label="swap latency"),
                iteration=StepCost(b=0.5),
            )
        kw = dict(
            max_num_batched_tokens=budget,
            max_num_seqs=max_num_seqs,
            block_size=bs,
            num_blocks=num_blocks,
            max_model_len=max_model_len,
            enable_prefix_caching=caching,
            enable_chunked_prefill=chunked,
            admission=admission,
            watermark_blocks=watermark,
            prefill_reserve_tokens=reserve,
            prefill_reserve_after_steps=d(st.integers(0, 4), label="reserve_after"),
            policy=policy,
            aging_steps=d(st.sampled_from([0, 0, 1, 3]), label="aging_steps"),
            queue_timeout_ms=d(st.sampled_from([None, None, None, 3.0, 12.0]), label="timeout"),
            tenant_weights=(("a", 1.0), ("b", 2.0)),
            tenant_quantum_tokens=d(st.integers(1, 8), label="tenant quantum"),
            tenant_max_running=d(st.sampled_from([None, 1, 2]), label="tenant cap"),
            preemption_mode=mode,
            num_host_blocks=host_blocks,
            swap_cost=swap_cost,
            num_speculative_tokens=d(st.sampled_from([0, 0, 1, 2, 4]), label="k"),
        )
        if align and budget < bs:
            with pytest.raises(InvalidArgument, match="align_chunks_to_blocks"):
                SchedulerConfig(**kw, align_chunks_to_blocks=True)  # type: ignore[arg-type]
            align = False
        self.config = SchedulerConfig(**kw, align_chunks_to_blocks=align)  # type: ignore[arg-type]
        self.bs = bs
        self.sched = Scheduler(self.config)
        self.executor = ScriptedExecutor(self)
        self.core = EngineCore(self.sched, self.executor, check_invariants=True)
        self.prefixes = [
            d(st.lists(PROMPT_TOKEN, min_size=1, max_size=3 * bs), label="prefix") for _ in range(2)
        ]
        event(f"policy {self.config.policy}")
        event(f"preemption mode {mode}")
        if not chunked:
            event("chunked prefill off")
        self.ready = True
        for _ in range(d(st.integers(0, 5), label="initial requests")):
            self._add_request(data)

    # ---------------------------------------------------------------- requests
    @rule(data=st.data(), k=st.integers(1, 4))
    def add_requests(self, data: st.DataObject, k: int) -> None:
        self.in_rule = True
        for _ in range(k):
            if len(self.live) >= MAX_LIVE:
                event("queue full: add skipped")
                break
            self._add_request(data)
        self.in_rule = False

    def _add_request(self, data: st.DataObject) -> None:
        cfg = self.config
        d = data.draw
        base = d(st.sampled_from([[], *self.prefixes]), label="shared prefix")
        tail = d(st.lists(PROMPT_TOKEN, max_size=2 * self.bs + 2), label="tail")
        # Without chunked prefill the budget caps the length (config.max_len): a longer
        # prompt, or a preempted request's recompute, could never be scheduled.
        limit = min(cfg.max_len - 1, cfg.num_blocks * cfg.block_size)
        prompt = (base + tail)[:limit] or [d(PROMPT_TOKEN, label="first")]
        max_tokens = d(
            st.integers(3, 12) if self.pressure else st.integers(1, 8), label="max_tokens"
        )
        script = d(st.lists(st.integers(0, 3), min_size=max_tokens, max_size=max_tokens))
        force = d(st.sampled_from([None, None, None, STOP_ID, EOS_ID]), label="forced stop")
        if force is not None:
            script[d(st.integers(0, max_tokens - 1), label="forced at")] = force
        stop = StopParams(
            max_tokens=max_tokens,
            stop_token_ids=d(st.sampled_from([(), (STOP_ID,)]), label="stop ids"),
            eos_token_id=d(st.sampled_from([None, EOS_ID]), label="eos"),
            ignore_eos=d(st.booleans(), label="ignore_eos"),
        )
        self.next_id += 1
        rid = f"r{self.next_id}"
        req = Request(rid, list(prompt), stop, priority=d(st.integers(0, 2), label="priority"))
        req.tenant = d(st.sampled_from(["a", "b"]), label="tenant")
        self.sched.add_request(req)
        self.prompts[rid], self.outputs[rid], self.script[rid] = list(prompt), [], script
        self.stop[rid], self.computed[rid] = stop, 0
        self.kv_at[rid] = NOWHERE
        self.live.add(rid)
        self.work += len(prompt) + max_tokens

    @rule(data=st.data())
    def bad_request(self, data: st.DataObject) -> None:
        """Bad input at a random moment: a typed error and nothing changes."""
        self.in_rule = True
        cfg = self.config
        kind = data.draw(st.sampled_from(["duplicate", "too long", "too big", "bad token"]))
        rid = "bad"
        prompt = [0]
        if kind == "duplicate":
            if not self.live:
                self.in_rule = False
                return
            rid = data.draw(st.sampled_from(sorted(self.live)))
            expected: type[Exception] = DuplicateRequest
        elif kind == "too long":
            prompt = [0] * cfg.max_len
            expected = InvalidArgument
        elif kind == "too big":
            if cfg.num_blocks * cfg.block_size + 1 >= cfg.max_len:
                self.in_rule = False
                return
            prompt = [1] * (cfg.num_blocks * cfg.block_size + 1)
            expected = ExceedsCapacity
        else:
            prompt = [0, -1]
            expected = InvalidArgument
        before = self._state()
        with pytest.raises(expected):
            self.sched.add_request(Request(rid, prompt))
        assert self._state() == before
        event(f"rejected: {kind}")
        self.in_rule = False

    @precondition(lambda self: self.ready and bool(self.live))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        self.in_rule = True
        by_state: dict[str, list[str]] = {}
        for x in sorted(self.live):
            by_state.setdefault(self.sched.requests[x].status.value, []).append(x)
        # Pick the state first, so rare ones (preempted, mid-prefill) get aborted often.
        state_name = data.draw(st.sampled_from(sorted(by_state)), label="abort state")
        rid = data.draw(st.sampled_from(by_state[state_name]), label="abort id")
        self._abort(rid)
        self.in_rule = False

    def _abort(self, rid: str) -> None:
        sched = self.sched
        r = sched.requests[rid]
        event(f"abort while {r.status}")
        before = sched.snapshot()
        host_before = sched.host.snapshot()
        held = sched.pool.block_table(rid) if sched.pool.has_request(rid) else ()
        host_held = sched.host.table(rid).block_ids if sched.host.has_request(rid) else ()
        if host_held:
            event(f"abort while {r.status} with KV on the host")
        sched.abort(rid, self.clock)
        assert r.status is S.ABORTED and r.finish_reason is FinishReason.ABORT
        assert not sched.pool.has_request(rid) and not sched.host.has_request(rid)
        assert rid not in sched.requests and rid not in sched.paused
        assert r not in sched.waiting and r not in sched.running
        # Its host blocks, exactly, went back to the host free list (at a step boundary
        # nothing is quarantined), and no other host table changed.
        host_after = sched.host.snapshot()
        assert host_after.free_queue == host_before.free_queue + tuple(host_held)
        assert host_after.tables == tuple(t for t in host_before.tables if t.request_id != rid)
        assert check_pool(host_after) == []
        # Exactly the blocks only it referenced went back to the free queue, and nothing
        # else in the pool changed.
        after = sched.pool.snapshot()
        freed = [b for b in reversed(held) if before.pool.ref_cnt[b] == 1]
        assert after.free_queue == before.pool.free_queue + tuple(freed)
        assert after.tables == tuple(t for t in before.pool.tables if t.request_id != rid)
        assert check_pool(after) == []
        with pytest.raises(UnknownRequest):
            sched.abort(rid)
        self._forget(rid)

    def _forget(self, rid: str) -> None:
        """A request left the engine: drop it from the live books."""
        self.live.discard(rid)
        self.kv_at.pop(rid, None)
        self.paused.pop(rid, None)
        if rid in self.pending_host:
            self.pending_host.remove(rid)

    # ------------------------------------------------------------- tool waits
    @precondition(
        lambda self: (
            self.ready and any(r.status is S.DECODING for r in self.sched.requests.values())
        )
    )
    @rule(data=st.data())
    def pause(self, data: st.DataObject) -> None:
        self.in_rule = True
        decoding = sorted(x for x in self.live if self.sched.requests[x].status is S.DECODING)
        self._pause(data, data.draw(st.sampled_from(decoding), label="pause id"))
        self.in_rule = False

    def _pause(self, data: st.DataObject, rid: str) -> None:
        """An agent turn stops for a tool call; the retention drawn, or chosen by wait."""
        sched, cfg, d = self.sched, self.config, data.draw
        # Without a host pool, ask for it often: the rejection is the path to check.
        extra = [] if cfg.num_host_blocks else [KVRetention.HOST] * 3
        retention = d(st.sampled_from([*KVRetention, None, *extra]), label="retention")
        wait = 0.0
        host_room = blocks_needed(self.computed[rid], self.bs) <= sched.host.num_free_blocks
        if retention is None:
            # The thresholds of the default RetentionPolicy (1 s, 60 s) and on each side.
            wait = d(
                st.sampled_from([0.0, 999.0, 1_000.0, 5_000.0, 60_000.0, 120_000.0]), label="wait"
            )
            policy = cfg.retention
            if wait < policy.device_max_wait_ms:
                want = KVRetention.DEVICE
            elif wait < policy.host_max_wait_ms and host_room:
                want = KVRetention.HOST
            else:
                want = KVRetention.DROP
            event(f"pause by expected wait: {want}")
        else:
            want = retention
        if want is KVRetention.HOST and not cfg.num_host_blocks:
            before = self._state()
            with pytest.raises(InvalidArgument, match="num_host_blocks is 0"):
                sched.pause(rid, retention, expected_wait_ms=wait)
            assert self._state() == before
            event("pause on the host rejected: no host pool")
            return
        assert sched.pause(rid, retention, expected_wait_ms=wait) is want
        event(f"pause {want}")
        self.paused[rid] = want
        if want is KVRetention.DROP:
            self.computed[rid] = 0
            self.kv_at[rid] = NOWHERE
        elif want is KVRetention.HOST:
            if not host_room:
                event("pause on a full host pool: the KV waits on the device")
            self.pending_host.append(rid)
        self._check_books(sched.snapshot())

    @precondition(lambda self: self.ready and bool(self.paused))
    @rule(data=st.data())
    def resume(self, data: st.DataObject) -> None:
        self.in_rule = True
        self._resume_drawn(data, data.draw(st.sampled_from(sorted(self.paused)), label="rid"))
        self.in_rule = False

    def _resume_drawn(self, data: st.DataObject, rid: str) -> None:
        """The tool answered: conversation + tool tokens are the next turn's prompt."""
        sched, cfg, d = self.sched, self.config, data.draw
        room = cfg.max_len - len(self.tokens(rid))  # >= 1: a live request is below max_len
        if d(st.integers(0, 7), label="resume at the limit") == 0:
            tool = [1] * room  # exactly at the limit: no room left for an output token
        else:
            tool = d(st.lists(PROMPT_TOKEN, min_size=1, max_size=4), label="tool tokens")
        max_tokens = d(st.integers(1, 8), label="turn max_tokens")
        script = d(st.lists(st.integers(0, 3), min_size=max_tokens, max_size=max_tokens))
        force = d(st.sampled_from([None, None, STOP_ID, EOS_ID]), label="turn forced stop")
        if force is not None:
            script[d(st.integers(0, max_tokens - 1), label="turn forced at")] = force
        stop = StopParams(
            max_tokens=max_tokens,
            stop_token_ids=d(st.sampled_from([(), (STOP_ID,)]), label="turn stop ids"),
            eos_token_id=d(st.sampled_from([None, EOS_ID]), label="turn eos"),
            ignore_eos=d(st.booleans(), label="turn ignore_eos"),
        )
        if len(tool) >= room:
            before = self._state()
            with pytest.raises(InvalidArgument, match="the limit is"):
                sched.resume(rid, tool, stop)
            assert self._state() == before
            event("resume rejected: past the length limit")
        elif not self._fits(len(self.tokens(rid)) + len(tool)):
            before = self._state()
            with pytest.raises(ExceedsCapacity):
                sched.resume(rid, tool, stop)
            assert self._state() == before
            event("resume rejected: the turn outgrows the device pool")
        else:
            self._resume(rid, tool, stop, script)

    def _fits(self, num_tokens: int) -> bool:
        return blocks_needed(num_tokens, self.bs) <= self.config.num_blocks

    def _resume(self, rid: str, tool: list[int], stop: StopParams, script: list[int]) -> None:
        sched = self.sched
        at = self.kv_at[rid]
        r = sched.requests[rid]
        # In place only where admission would take it: a running slot, and the policy
        # admits now (no static batch in flight, its tenant under the cap).
        slot = (
            len(sched.running) < self.config.max_num_seqs
            and sched.policy.admission_open(len(sched.running))
            and sched.policy.may_admit(r, sched.running)
        )
        if not slot and len(sched.running) < self.config.max_num_seqs:
            event("resume not in place: the policy would not admit it now")
        before_move = rid in self.pending_host
        sched.resume(rid, tool, stop)
        del self.paused[rid]
        if before_move:
            self.pending_host.remove(rid)
        self.prompts[rid] = self.tokens(rid) + tool
        self.outputs[rid], self.script[rid], self.stop[rid] = [], script, stop
        self.work += len(self.prompts[rid]) + stop.max_tokens
        if at == DEVICE and slot:
            assert r.status is S.PREFILLING and r in sched.running
            event("resume in place: KV on the device")
            if before_move:
                event("resume before the KV moved to the host")
        elif at == DEVICE:
            # It may not run now: the blocks go back and the turn recomputes later.
            assert r.status is S.WAITING and r in sched.waiting
            self.computed[rid] = 0
            self.kv_at[rid] = NOWHERE
            event("resume without a running slot: KV released")
        elif at == HOST:
            assert r.status is S.SWAPPED and r in sched.waiting
            event("resume with KV on the host: queued swapped")
        else:
            assert r.status is S.WAITING and r in sched.waiting
            event("resume after drop: recompute")
        self._check_books(sched.snapshot())

    # ------------------------------------------------------------------ steps
    @precondition(lambda self: self.ready)
    @rule(n=st.integers(1, 6), data=st.data())
    def step(self, n: int, data: st.DataObject) -> None:
        self.in_rule = True
        for _ in range(n):
            self._propose(data)
            self._step()
            # Preempted and mid-prefill are short-lived states: sometimes abort one
            # right away, so aborts in every state are reached often.
            rare = [
                rid
                for rid in sorted(self.live)
                if self.sched.requests[rid].status in (S.PREEMPTED, S.PREFILLING, S.SWAPPED)
            ]
            if rare and data.draw(st.integers(0, 3), label="abort a rare state") == 0:
                self._abort(data.draw(st.sampled_from(rare), label="rare abort id"))
            # Agent turns between steps too: a pause needs a decoding request and the
            # pause rule rarely finds one in a config the steps have not warmed up, so
            # without this most tool waits would happen in a handful of examples.
            action = data.draw(st.integers(0, 7), label="agent action")
            decoding = [x for x in sorted(self.live) if self.sched.requests[x].status is S.DECODING]
            if action == 0 and decoding:
                self._pause(data, data.draw(st.sampled_from(decoding), label="pause id"))
            elif action == 1 and self.paused:
                self._resume_drawn(data, data.draw(st.sampled_from(sorted(self.paused))))
        self.in_rule = False

    @precondition(lambda self: self.ready)
    @rule(point=st.sampled_from(FAIL_POINTS), data=st.data())
    def failing_step(self, point: str, data: st.DataObject) -> None:
        self.in_rule = True
        sched = self.sched
        before = self._state()
        mem, host_mem = dict(self.memory), dict(self.host_memory)
        pending = list(self.pending_host)
        self._propose(data)
        self.executor.fail_at = point
        # EngineCore rolls back (memory, then books) and checks ATOMIC itself
        # (InvariantViolation otherwise).
        with pytest.raises((Boom, BadExecutorOutput)):
            self.core.step(self.clock)
        assert self.executor.fail_at is None, "the executor never reached its fault point"
        # Memory is restored exactly, so nothing is dropped: the prefix cache keeps every
        # entry, and every entry still reads back its tokens (checked below).
        assert self._state() == before
        assert self.memory == mem and self.host_memory == host_mem
        assert self.pending_host == pending
        assert sched._pending is None
        self._check_books(sched.snapshot())
        event(f"failed step rolled back ({point})")
        failed = self.executor.began
        assert failed is not None
        if point != "before_execute" and failed.preempted:
            event("failed step had preempted (its blocks went to others), then rolled back")
        if point != "before_execute" and (failed.swap_out or failed.swap_in):
            event("failed step had swapped, then rolled back")
        self._step()  # the next normal step works
        self.in_rule = False

    # ---------------------------------------------------------------- helpers
    def _propose(self, data: st.DataObject) -> None:
        """Drafts for some decoding requests (speculative decoding): the script's next
        tokens up to a drawn point, then drawn tokens, so the test chooses how many are
        accepted (a drawn token may still match: the executor compares)."""
        k = self.config.num_speculative_tokens
        if not k:
            return
        running = {r.request_id for r in self.sched.running}
        for rid in sorted(running & self.live):
            if self.sched.requests[rid].status is not S.DECODING:
                continue
            n = data.draw(st.integers(0, k), label="drafts")
            right = data.draw(st.integers(0, n), label="right drafts")
            wrong = data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n), label="drawn")
            drafts = [*self.next_tokens(rid)[:right], *wrong][:n]
            if data.draw(st.integers(0, 15), label="bad proposal") == 0:
                with pytest.raises(InvalidArgument, match="propose"):
                    self.sched.propose(rid, [*drafts, 0] if len(drafts) == k else [-1])
                event("bad proposal refused")
            self.sched.propose(rid, drafts)

    def _state(self) -> tuple[object, ...]:
        s = self.sched
        return (
            s.snapshot(),
            [r.request_id for r in s.waiting],
            [r.request_id for r in s.running],
            s.step_index,
            sorted(s.requests),
            list(s.paused),
            list(s.suspension.to_host),  # paused turns still to move to the host: order matters
        )

    def _expected_finish(self, rid: str) -> FinishReason | None:
        out = self.outputs[rid]
        stop = self.stop[rid]
        last = out[-1]
        if not stop.ignore_eos and stop.eos_token_id is not None and last == stop.eos_token_id:
            return FinishReason.STOP
        if last in stop.stop_token_ids:
            return FinishReason.STOP
        if len(out) >= stop.max_tokens:
            return FinishReason.LENGTH
        if len(self.prompts[rid]) + len(out) >= self.config.max_len:
            event("length by max_model_len")
            return FinishReason.LENGTH
        return None

    def _step(self) -> None:
        sched, cfg, bs = self.sched, self.config, self.bs
        before = sched.snapshot()
        was_running = [r.request_id for r in sched.running]
        keys_before = {e.key for e in before.pool.cache_entries}
        host_free = sched.host.num_free_blocks  # at a boundary: nothing quarantined
        was_swapped = {r.request_id for r in sched.waiting if r.status is S.SWAPPED}
        self.executor.last = None
        record = self.core.step(self.clock)
        assert self.executor.last is not None and self.executor.last[0] is record.plan
        plan, inputs, sampled = self.executor.last
        after = sched.snapshot(extra=sched.retired)
        self.clock = record.end_ms
        self.steps.append(_step_snapshot(plan, inputs, cfg, before, after, sched.retired))

        if plan.preempted:
            event("preemption")
            event(f"preemption in a {'pressure' if self.pressure else 'broad'} config")
        if cfg.policy is PolicyName.STATIC and plan.admitted:
            assert was_running == [], "static policy admitted while a batch was running"
        if keys_before - {e.key for e in after.pool.cache_entries}:
            event("prefix-cache eviction")
        self._check_swaps(plan, inputs, host_free, was_swapped)
        for c in plan.chunks:
            rid = c.request_id
            if c.num_new_cached_tokens:
                event("prefix hit")
                assert cfg.enable_prefix_caching and rid in plan.admitted
                assert c.num_new_cached_tokens % bs == 0
                assert c.num_new_cached_tokens <= max_cacheable_tokens(len(self.tokens(rid)), bs)
                if c.num_new_cached_tokens == max_cacheable_tokens(len(self.tokens(rid)), bs):
                    event("prompt cached up to its last block")
            assert c.start == self.computed[rid] + c.num_new_cached_tokens, c
            drafts = c.draft_token_ids
            end = c.start + c.num_new_tokens - len(drafts)
            assert end <= len(self.tokens(rid))
            assert c.samples == (end == len(self.tokens(rid)))
            self.computed[rid] = end
            self.kv_at[rid] = DEVICE
            if drafts:
                self._verified(c, inputs, sampled[rid])
            elif c.samples:
                self.outputs[rid].append(sampled[rid])
        planned = {cf.request_id: cf.reason for cf in plan.finished}
        for rid in plan.preempted:  # its known tokens outgrew the pool: never fits again
            if rid not in plan.swapped_out and blocks_needed(len(self.tokens(rid)), bs) > (
                cfg.num_blocks
            ):
                planned[rid] = FinishReason.CAPACITY
        retired = {r.request_id: r for r in sched.retired}
        for rid in sorted(self.live):
            if rid in planned:
                want: FinishReason | None = planned[rid]
                event(f"{want} finish")
                if want is FinishReason.TIMEOUT:  # only requests never admitted time out
                    assert not self.outputs[rid] and self.computed[rid] == 0
            elif rid in sampled:
                want = self._expected_finish(rid)
            else:
                want = None
            if want is None:
                assert rid not in retired and rid in sched.requests
                continue
            if want is FinishReason.STOP:
                event("stopped by eos / stop id")
            if want is FinishReason.CAPACITY and any(self.kv_at[p] == DEVICE for p in self.paused):
                event("capacity finish while a paused turn holds device blocks")
            r = retired[rid]
            assert r.status is S.FINISHED and r.finish_reason is want, (rid, r.finish_reason, want)
            self._forget(rid)
        assert set(retired) <= set(self.prompts) and not set(retired) & self.live
        self._check_books(after)

    def _verified(self, c: ScheduledChunk, inputs: ModelInputs, token: int) -> None:
        """The books after a verification: the accepted drafts and the script's token
        join the outputs up to a stop; the KV covers the accepted drafts; the slots of
        the rejected ones are poisoned in the fake memory, so a later read of them as
        context (a block not returned, a kept cache entry) fails the read-back."""
        rid, drafts = c.request_id, c.draft_token_ids
        accepted = self.executor.accepted[rid]
        event(f"verification: {'all' if accepted == len(drafts) else accepted or 'no'} accepted")
        self.computed[rid] += accepted
        i = inputs.request_ids.index(rid)
        lo, hi = inputs.query_start_loc.tolist()[i : i + 2]
        for slot in inputs.slot_mapping.tolist()[lo + 1 + accepted : hi]:
            self.memory[slot] = POISONED
        for j, t in enumerate((*drafts[:accepted], token)):
            self.outputs[rid].append(t)
            if self._expected_finish(rid) is not None:
                if j < accepted:
                    event("verification: stopped at an accepted draft")
                break

    def _check_swaps(
        self, plan: StepPlan, inputs: ModelInputs, host_free: int, was_swapped: set[str]
    ) -> None:
        """Replay the swap rules against the books, in the order the scheduler applies
        them: paused turns retained on the host move first; then, while blocks are short,
        idle paused KV is reclaimed (oldest pause first) before any running victim; each
        goes to the host when it still has room, else is dropped / recomputed."""
        cfg, bs = self.config, self.bs
        swapped = set(plan.swapped_out)
        # Host blocks only get scarcer within a step (a swap-in's blocks are quarantined
        # until commit), so "room" is the free count at the step start minus what the
        # earlier swap-outs of the step took.
        moved: list[str] = []
        for rid in self.pending_host:
            need = blocks_needed(self.computed[rid], bs)
            if need <= host_free:
                moved.append(rid)
                host_free -= need
            else:
                event("host pool full: a paused turn's KV stays on the device")
        for rid in moved:
            event("swap out: paused turn moves to the host")
            self.pending_host.remove(rid)
            self.kv_at[rid] = HOST
        # Reclaimed paused turns: a prefix, in pause order, of those still on the device.
        idle = [p for p in self.paused if self.kv_at[p] == DEVICE]
        reclaimed = [p for p in idle if p in swapped or p in plan.dropped]
        assert reclaimed == idle[: len(reclaimed)], (idle, reclaimed)
        assert len(reclaimed) == len(set(plan.dropped) | (swapped & set(idle)))
        reclaim_swaps: list[str] = []
        for rid in reclaimed:
            need = blocks_needed(self.computed[rid], bs)
            if need <= host_free:
                assert rid in swapped and rid not in plan.dropped, rid
                host_free -= need
                reclaim_swaps.append(rid)
                event("paused KV reclaimed for others: to the host")
                self.kv_at[rid] = HOST
            else:
                assert rid in plan.dropped and rid not in swapped, rid
                event("paused KV reclaimed for others: dropped")
                self.computed[rid] = 0
                self.kv_at[rid] = NOWHERE
            if rid in self.pending_host:
                event("paused KV reclaimed before its host move")
                self.pending_host.remove(rid)
        if reclaimed and plan.preempted:
            event("paused KV reclaimed and a running victim preempted in one step")
        victim_swaps = [v for v in plan.preempted if v in swapped]
        assert list(plan.swapped_out) == moved + reclaim_swaps + victim_swaps
        # Victims, in preemption order: swap exactly when the mode (and for auto, the cost
        # model) says so and the host pool still has room; otherwise recompute.
        mode = cfg.preemption_mode
        for rid in plan.preempted:
            assert rid in self.live and rid not in self.paused
            stored = self.computed[rid]
            need = blocks_needed(stored, bs)
            eligible = (
                mode is not PreemptionMode.RECOMPUTE
                and stored > 0
                and blocks_needed(len(self.tokens(rid)), bs) <= cfg.num_blocks
            )
            if eligible and mode is PreemptionMode.AUTO:
                assert cfg.swap_cost is not None
                eligible = cfg.swap_cost.prefers_swap(stored)
                event(f"auto mode picks {'swap' if eligible else 'recompute'}")
            if rid in swapped:
                assert eligible and need <= host_free, (rid, stored, host_free)
                host_free -= need
                event("swap out: preemption victim")
                event(f"swap out of a victim under {cfg.policy}")
                self.kv_at[rid] = HOST
            else:
                if eligible:
                    assert need > host_free, f"{rid} recomputed with room on the host"
                    event("host pool full: preemption falls back to recompute")
                self.computed[rid] = 0
                self.kv_at[rid] = NOWHERE
        # Swap-ins: only swapped requests, each scheduled in the same step from its
        # stored length (the chunk checks in _step verify the start).
        scheduled = set(plan.request_ids)
        for rid in plan.swapped_in:
            assert rid in was_swapped and rid in scheduled and rid in plan.admitted
            assert self.kv_at[rid] == HOST
            event("swap in")
            event(f"swap in under {cfg.policy}")
            if len(self.tokens(rid)) - self.computed[rid] > 1:
                event("swap in of a resumed turn (incremental prefill)")
        # The host rule of the step: a host block released by a swap-in is not reused by
        # a swap-out of the same step (it would be overwritten before it is read).
        assert not {c.src for c in plan.swap_in} & {c.dst for c in plan.swap_out}
        if plan.swap_out:
            written = {s // bs for s in inputs.slot_mapping.tolist()}
            written |= {c.dst for c in plan.swap_in}
            if written & {c.src for c in plan.swap_out}:
                event("device block swapped out and reused in the same step")

    def _check_books(self, after: EngineSnapshot) -> None:
        sched = self.sched
        assert set(sched.requests) == self.live
        assert set(sched.paused) == set(self.paused)
        running = {r.request_id for r in sched.running}
        waiting = {r.request_id for r in sched.waiting}
        for rid in self.live:
            r = sched.requests[rid]
            assert r.token_ids == self.tokens(rid)
            assert r.num_output_tokens <= self.stop[rid].max_tokens
            assert r.num_tokens <= self.config.max_len
            assert r.num_computed_tokens == self.computed[rid]
            # Where its KV is, by the books: exactly one pool holds it, or none.
            at = self.kv_at[rid]
            assert sched.pool.has_request(rid) == (at == DEVICE), (rid, at)
            assert sched.host.has_request(rid) == (at == HOST), (rid, at)
            if rid in self.paused:
                assert r.status is S.WAITING_TOOL and rid not in running | waiting
                # Device KV may since have been reclaimed for others (host or dropped).
                if self.paused[rid] is KVRetention.DROP:
                    assert at == NOWHERE
                if rid in self.pending_host:
                    assert at == DEVICE
                assert (self.computed[rid] == 0) == (at == NOWHERE)
            elif at == DEVICE:
                assert rid in running and r.status in (S.PREFILLING, S.DECODING)
            elif at == HOST:
                # Swapped: waits in its arrival place with its KV length kept.
                assert rid in waiting and r.status is S.SWAPPED and self.computed[rid] > 0
            else:
                assert rid in waiting and r.status in (S.WAITING, S.PREEMPTED)
                assert self.computed[rid] == 0
        # A preempted request keeps its arrival place: the queue stays in arrival order.
        seqs = [r.seq for r in sched.waiting]
        assert seqs == sorted(seqs)
        assert len(sched.waiting) + len(sched.running) + len(sched.paused) == len(self.live)
        errors = kv_readback_errors(
            after.pool, sched.host.snapshot(), self.memory, self.host_memory, self.tokens
        )
        assert not errors, "\n".join(errors)

    def teardown(self) -> None:
        if not self.ready or self.in_rule:
            return  # a rule failed: let its error be the one reported
        # Drain. Every step schedules >= 1 token (PROGRESS, checked by EngineCore); what
        # is left is at most each live request's prompt + outputs, recomputed after each
        # preemption. Preemptions are bounded by the work of the others, so this quadratic
        # bound is generous; the measured worst case is far below it.
        # Paused turns do not run by themselves: answer every tool call that still fits
        # (one tool token, one output token), abort the rest.
        for rid in sorted(self.paused):
            n = len(self.tokens(rid)) + 1
            if n < self.config.max_len and self._fits(n):
                self._resume(rid, [0], StopParams(max_tokens=1), [0])
            else:
                event("teardown aborts a paused turn that cannot grow")
                self._abort(rid)
        left = sum(len(self.prompts[r]) + self.stop[r].max_tokens for r in self.live)
        bound = 10 + left * (len(self.live) + 1)
        n = 0
        while self.sched.has_unfinished:
            assert n < bound, f"not drained within {bound} steps; live {sorted(self.live)}"
            self._step()
            n += 1
        assert not self.live and not self.sched.paused
        assert check_quiescent(self.sched.pool.snapshot()) == []
        assert check_quiescent(self.sched.host.snapshot()) == []
        # Starvation: no runnable request goes unscheduled for more consecutive steps than
        # the whole workload's work (prompt + max_tokens of every request ever added),
        # counted once per preemption round too. Each step advances some request by >= 1
        # token, so a longer wait would mean the others did more work than exists.
        starve_bound = self.work * 2 + 10
        assert check_starvation(self.steps, starve_bound) == []
        longest = _longest_wait(self.steps)
        if longest > self.work:
            event("waited longer than one pass over the workload")


def _longest_wait(steps: list[StepSnapshot]) -> int:
    waited: dict[str, int] = {}
    best = 0
    for step in steps:
        scheduled = {s.request_id for s in step.scheduled}
        for r in step.before.requests:
            if r.status.is_runnable and r.request_id not in scheduled:
                waited[r.request_id] = waited.get(r.request_id, 0) + 1
                best = max(best, waited[r.request_id])
            else:
                waited[r.request_id] = 0
    return best


def _step_snapshot(
    plan: StepPlan,
    inputs: ModelInputs,
    cfg: SchedulerConfig,
    before: EngineSnapshot,
    after: EngineSnapshot,
    retired: list[Request],
) -> StepSnapshot:
    """The step as spec sees it, rebuilt from the same executor inputs EngineCore uses."""
    scheduled = scheduled_requests(plan, inputs, cfg.block_size)
    return StepSnapshot(
        step_index=plan.step_index,
        token_budget=cfg.max_num_batched_tokens,
        max_num_seqs=cfg.max_num_seqs,
        before=before,
        scheduled=scheduled,
        after=after,
        preempted=plan.preempted + plan.dropped,  # as EngineCore builds it
        finished=tuple(r.request_id for r in retired),
        num_speculative_tokens=cfg.num_speculative_tokens,
    )


# CI budget: 500 examples x 50 steps. Measured on this 2-core machine with CI=true
# (derandomized, explain phase off): before swap and tool waits 44 s wall (30 s user);
# with them (7 rules, host memory, pause/resume between steps) 39-67 s wall, 32-38 s
# user, the spread being other load on the shared machine: inside the ~120 s budget
# without cutting examples. The deep profile (HYPOTHESIS_PROFILE=deep: 2000 x 200)
# raises both via settings.default.
SchedulerMachine.TestCase.settings = settings(
    max_examples=max(500, settings.default.max_examples),
    stateful_step_count=max(50, settings.default.stateful_step_count),
)
TestSchedulerStateMachine = SchedulerMachine.TestCase


# ---------------------------------------------------------------- the read-back can fail
class _PreemptThenFail:
    """Writes ``input_ids`` at ``slot_mapping`` into a fake memory, samples, and
    fails after the writes of the first step that preempts. ``restores``: its rollback
    puts the overwritten slots back; ``transactional_kv``: what it claims."""

    needs_inputs = True

    def __init__(
        self, requests: Mapping[str, Request], restores: bool, transactional_kv: bool
    ) -> None:
        self.requests = requests
        self.restores = restores
        self.transactional_kv = transactional_kv
        self.memory: dict[int, int] = {}
        self.saved: dict[int, int | None] = {}
        self.failed: StepPlan | None = None

    def begin(self, plan: StepPlan, inputs: ModelInputs | None) -> None:
        assert inputs is not None
        self.saved = {s: self.memory.get(s) for s in inputs.slot_mapping.tolist()}

    def rollback(self) -> None:
        if self.restores:
            for slot, tok in self.saved.items():
                if tok is None:
                    self.memory.pop(slot, None)
                else:
                    self.memory[slot] = tok

    def commit(self) -> None:
        self.saved = {}

    def execute(self, plan: StepPlan, inputs: ModelInputs | None) -> StepOutput:
        assert inputs is not None
        for slot, tok in zip(inputs.slot_mapping.tolist(), inputs.input_ids.tolist(), strict=True):
            self.memory[slot] = tok
        if plan.preempted and self.failed is None:
            self.failed = plan
            raise Boom("fault after the forward's writes")
        # A token unique to the request and position, so a slot written for another
        # request never reads back right by accident.
        reqs = self.requests
        sampled = {
            rid: 1000 * int(rid[1:]) + len(reqs[rid].token_ids)
            for rid, smp in zip(plan.request_ids, plan.samples, strict=True)
            if smp
        }
        return StepOutput(sampled, 1.0)


@pytest.mark.parametrize(
    ("restores", "transactional_kv"),
    [(True, True), (False, True), (False, False)],
    ids=["journaled", "not-restored", "non-transactional"],
)
def test_kv_readback_catches_unrestored_memory(restores: bool, transactional_kv: bool) -> None:
    """The preempt-and-reuse case: the failing step preempts r1, gives
    one of its blocks to r0, r0's token is written there, then the step fails. The
    scheduler's rollback gives the block back to r1; unless the executor restores the
    slot, r1's table reads r0's token, and the state machine's read-back check says so.
    Dropping cache entries (the non-transactional fallback) does not repair a live table."""
    cfg = SchedulerConfig(max_num_batched_tokens=16, block_size=4, num_blocks=6, max_model_len=64)
    sched = Scheduler(cfg)
    ex = _PreemptThenFail(sched.requests, restores, transactional_kv)
    core = EngineCore(sched, ex, check_invariants=True)
    for i in range(2):
        prompt = [10 * (i + 1) + k for k in range(8)]
        sched.add_request(Request(f"r{i}", prompt, StopParams(max_tokens=12)))

    def tokens(rid: str) -> list[int]:
        return sched.requests[rid].token_ids

    while ex.failed is None:
        with contextlib.suppress(Boom):
            core.step(0.0)
        errors = kv_readback_errors(
            sched.pool.snapshot(), sched.host.snapshot(), ex.memory, {}, tokens
        )
        if ex.failed is None:
            assert errors == []
    assert ex.failed.preempted
    assert (errors == []) is restores, errors
    if not restores:
        victim = ex.failed.preempted[0]
        assert any(e.startswith(victim) for e in errors)
