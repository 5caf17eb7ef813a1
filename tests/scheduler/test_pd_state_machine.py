"""Hypothesis state machine: a disaggregated cluster (docs/DISAGG.md) of three or four
schedulers with prefill/decode roles, its requests placed, deflected and handed off.

Each engine is a real ``Scheduler`` stepped through ``EngineCore(check_invariants=True)``
with the scripted executor of tests/scheduler/scripted_kv.py and its own fake K/V memory,
as in tests/scheduler/test_migration_state_machine.py. The roles are drawn (``2P2D``,
``1P2D``, ``2P1D``, ``1P1D1C``, ``1P1C``). One virtual clock, shared by the engines,
advances by the cost model ``a + b*P + c*D + e*K`` of each step; decode replicas run with
``SchedulerConfig(tbt_slo_ms, step_cost)``, the SLO-aware chunk rule, so a deflected
prefill beside decodes is chunked to their TBT slack.

Rules:

- add a request, placed by ``disagg.place`` over every engine's ``load_figures`` with a
  drawn ``Deflection`` (sometimes none), so that both deflected and plain placements
  happen;
- step an engine; after a step, before any other operation on it, every request the
  ``HandoffBook`` says is due is handed off: ``choose_decode``, then a
  ``PhasedMigration`` with its K/V (tests/phased_migration.py) through ``MemoryLink``,
  with a drawn fault: at a protocol point, the link failing inside a chunk's copy (the
  decode replica dying mid-handoff), or the client aborting mid-move. A handoff that
  fails (no decode replica has room, the move is refused or aborted) leaves the request
  on its prefill replica, *kept*;
- abort a request.

After every operation and every phase of every move, the migration rules
(``refserve.spec.checks.check_cluster``: OWNER, CONSERVE, MOVED, KVCOPY (the K/V a decode
replica reads is the prefill replica's), LEAK) and the snapshot rules of ROLES
(``check_roles``: first, once) on a ``PDSnapshot`` built from the machine's books. After
every step of a decode replica, rule deflect (``check_deflect``) on that step: its
decodes, the K/V they read and the prompt tokens it computed per request, each marked
deflected (the book's) or a recompute (preempted on that engine before). Teardown drains
every engine (handing off as it goes) and requires every client's stream finished.

The planted bugs at the end show the machine catching what the rules exist for.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import pytest
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    precondition,
    rule,
    run_state_machine_as_test,
)

from refserve.cluster.disagg import (
    Deflection,
    HandoffBook,
    Role,
    Roles,
    TTFTBound,
    choose_decode,
    place,
)
from refserve.cluster.disagg import (
    Phase as PDPhase,
)
from refserve.cluster.replica import load_figures
from refserve.cluster.router import Router, RoutingPolicy
from refserve.core.config import SchedulerConfig
from refserve.core.cost import StepCost
from refserve.core.engine_core import EngineCore
from refserve.core.executor import StepOutput
from refserve.core.inputs import ModelInputs
from refserve.core.plan import StepPlan
from refserve.core.request import Request, StopParams
from refserve.core.scheduler import Scheduler
from refserve.core.swap import PreemptionMode
from refserve.core.transit import MIGRATION_FAULT_POINTS, MigrationError
from refserve.spec import check_pool
from refserve.spec.checks import check_cluster
from refserve.spec.cluster import ClusterSnapshot, ClusterStep, Delivered, Sample, Transit
from refserve.spec.pd import (
    DecodeStep,
    Handoff,
    PDRequest,
    PDSnapshot,
    PrefillChunk,
    RoleName,
    StepCostModel,
    check_deflect,
    check_roles,
    tbt_bound_tokens,
)
from refserve.spec.progress import check_quiescent
from refserve.spec.violation import Violation
from tests.harness import Boom, MemoryLink
from tests.phased_migration import PhasedMigration, PhasedMigrationAborted, cluster_node
from tests.scheduler.scripted_kv import ScriptedExecutor

PROMPT_TOKEN = st.integers(0, 2)  # tiny alphabet: prefixes repeat, prefix hits are common
MAX_LIVE = 8
ROLE_MIXES = ("2P2D", "1P2D", "2P1D", "1P1D1C", "1P1C")
#: What goes wrong during a handoff: a fault at a protocol point, the link failing
#: inside a chunk's copy, or the client aborting the request on its source.
FAULTS = (*MIGRATION_FAULT_POINTS, "mid_copy", "client_abort")
BEFORE_ACK = ("after_stage", "mid_stream", "before_ack")
#: A fault after the stage and before the ack, where the decode replica holds staged
#: blocks and half-written K/V: the decode replica dying mid-handoff.
DECODE_DIES = ("after_stage", "mid_stream", "before_ack", "mid_copy")


class Engine:
    """One replica of the cluster: its role, its scheduler and its fake memories (what
    ScriptedExecutor reads), and the requests it preempted (a later prefill of theirs
    here is a recompute)."""

    def __init__(self, machine: PDMachine, index: int, role: Role, config: SchedulerConfig) -> None:
        self.machine, self.index, self.role, self.config = machine, index, role, config
        self.name = f"{role.value.lower()}{index}"
        self.memory: dict[int, int] = {}
        self.host_memory: dict[int, int] = {}
        self.sched = Scheduler(config)
        self.executor = CostedExecutor(self, machine.cost)
        self.core = EngineCore(self.sched, self.executor, check_invariants=True)
        self.preempted: set[str] = set()

    def __repr__(self) -> str:
        return f"engine {self.name}"  # what Hypothesis prints for a drawn engine

    @property
    def bs(self) -> int:
        return self.config.block_size

    def tokens(self, rid: str) -> list[int]:
        return self.machine.tokens(rid)

    def next_tokens(self, rid: str) -> list[int]:
        return self.machine.next_tokens(rid)

    def prompt_limit(self) -> int:
        """The longest prompt that may live here (length limit and pool)."""
        cfg = self.config
        return min(cfg.max_len - 1, cfg.num_blocks * cfg.block_size)


class CostedExecutor(ScriptedExecutor):
    """The scripted executor whose step takes what the cost model says, so the shared
    clock (and every token's time) is the cost model's: the SLO-aware chunk rule reads
    the decodes' token times against it."""

    def __init__(self, engine: Engine, cost: StepCost) -> None:
        super().__init__(engine)
        self.cost = cost

    def execute(self, plan: StepPlan, inputs: ModelInputs | None) -> StepOutput:
        out = super().execute(plan, inputs)
        ms = self.cost.step_ms(plan.num_prefill_tokens, plan.num_decode_requests, kv_read(plan))
        return dataclasses.replace(out, duration_ms=ms)


def kv_read(plan: StepPlan) -> int:
    """K/V positions the step's decodes read (each its computed tokens and the new one):
    the ``K`` of the cost model, as the SLO-aware chunk rule counts it."""
    return sum(c.start + 1 for c in plan.chunks if not c.is_prefill)


class PDMachine(RuleBasedStateMachine):
    #: The planted bugs (the tests at the end), all off here.
    roles_text: ClassVar[str | None] = None  # None: drawn
    uncapped_decode: ClassVar[bool] = False  # decode replicas without the TBT cap
    late_handoff: ClassVar[bool] = False  # a prefill replica steps once more before it
    book_kind: ClassVar[type[HandoffBook]] = HandoffBook

    def __init__(self) -> None:
        super().__init__()
        self.ready = False
        self.in_rule = False
        self.engines: list[Engine] = []
        self.roles = Roles.colocated(1)
        self.book = self.book_kind(self.roles)
        self.router = Router()
        self.cost = StepCost()
        self.tbt_slo_ms = 0.0
        self.next_id = 0
        self.clock = 0.0
        self.prefixes: list[list[int]] = []
        # The test's books, one conversation per request wherever it runs.
        self.prompts: dict[str, list[int]] = {}
        self.outputs: dict[str, list[int]] = {}  # this turn's sampled tokens
        self.script: dict[str, list[int]] = {}
        self.where: dict[str, Engine] = {}  # live requests
        self.sampled_here: dict[str, int] = {}  # by the engine it is on, this turn
        self.handoffs: dict[str, list[Handoff]] = {}
        self.delivered: dict[str, list[int]] = {}  # from the step outcomes
        self.done: set[str] = set()
        self.last: ClusterSnapshot | None = None
        self.late: dict[Engine, list[str]] = {}  # late_handoff: due at the last step

    def tokens(self, rid: str) -> list[int]:
        return self.prompts[rid] + self.outputs[rid]

    def next_tokens(self, rid: str) -> list[int]:
        return self.script[rid][len(self.outputs[rid]) :]

    # ------------------------------------------------------------------ setup
    @initialize(data=st.data())
    def setup(self, data: st.DataObject) -> None:
        d = data.draw
        text = self.roles_text or d(st.sampled_from(ROLE_MIXES), label="roles")
        self.roles = Roles.parse(text)
        self.book = self.book_kind(self.roles)
        policy = d(st.sampled_from(list(RoutingPolicy)), label="routing")
        self.router = Router(policy)
        # Dyadic coefficients and whole-ms SLOs: every clock reading is exact, so the
        # scheduler's slack and the checker's bound agree to the last token.
        self.cost = StepCost(
            a=2.0,
            b=d(st.sampled_from([0.5, 1.0]), label="b"),
            c=1.0,
            e=d(st.sampled_from([0.0, 0.25]), label="e"),
        )
        self.tbt_slo_ms = float(d(st.integers(4, 12), label="tbt_slo_ms"))
        for i, role in enumerate(self.roles.roles):
            self.engines.append(Engine(self, i, role, self._config(data, role)))
        self.prefixes = [d(st.lists(PROMPT_TOKEN, min_size=4, max_size=8)) for _ in range(2)]
        self.ready = True
        self.last = self._snapshot()
        for _ in range(d(st.integers(0, 4), label="initial requests")):
            self._add(data)

    def _config(self, data: st.DataObject, role: Role) -> SchedulerConfig:
        d = data.draw
        bs = d(st.integers(1, 4), label="bs")
        swap, recompute = PreemptionMode.SWAP, PreemptionMode.RECOMPUTE
        decode = role is Role.DECODE
        # Decode replicas swap too: a swapped decode rejoins at admission, after the
        # SLO-aware cap on prefill was set, and checks the TBT bound itself.
        mode = d(st.sampled_from([recompute, swap]), label="mode")
        host = 2 if mode is swap else 0
        chunked = decode or d(st.booleans(), label="chunked prefill")
        capped = decode and not self.uncapped_decode
        return SchedulerConfig(
            # A decode replica's budget is larger than its decodes' TBT slack often
            # leaves: the cap, not the budget, bounds its deflected chunks.
            max_num_batched_tokens=d(
                st.integers(8, 16)
                if decode
                else st.integers(4, 12)
                if chunked
                else st.integers(12, 16)
            ),
            max_num_seqs=d(st.integers(2, 4), label="max_num_seqs"),
            block_size=bs,
            # 12 to 24 tokens of KV: a few requests, so preemption happens.
            num_blocks=d(st.integers(max(3, 12 // bs), 24 // bs), label="num_blocks"),
            max_model_len=d(st.integers(14, 24), label="max_model_len"),
            enable_prefix_caching=d(st.booleans(), label="prefix caching"),
            enable_chunked_prefill=chunked,
            preemption_mode=mode,
            num_host_blocks=host,
            tbt_slo_ms=self.tbt_slo_ms if capped else None,
            step_cost=self.cost if capped else None,
        )

    # ---------------------------------------------------------------- requests
    @precondition(lambda self: self.ready)
    @rule(data=st.data())
    def add_request(self, data: st.DataObject) -> None:
        self.in_rule = True
        if len(self.where) < MAX_LIVE:
            self._add(data)
        self.in_rule = False

    def _add(self, data: st.DataObject) -> None:
        d = data.draw
        base = d(st.sampled_from([[], *self.prefixes, *self.prefixes]), label="shared prefix")
        tail = d(st.lists(PROMPT_TOKEN, max_size=8), label="tail")
        limit = min(e.prompt_limit() for e in self.engines)
        prompt = (base + tail)[:limit] or [0]
        max_tokens = d(st.integers(1, 8), label="max_tokens")
        deflection = d(
            st.sampled_from([None, 0.0, 4.0, 8.0, 16.0]), label="TTFT SLO base (None: none)"
        )
        self.next_id += 1
        rid = f"r{self.next_id}"
        loads = {e.index: load_figures(e.sched, self.cost) for e in self.engines}
        how = (
            None
            if deflection is None
            else Deflection(TTFTBound(deflection, 0.5), tbt_slo_ms=self.tbt_slo_ms)
        )
        placement = place(self.router, rid, len(prompt), loads, {}, self.roles, how)
        if not placement.deflected:
            self.router.accepted(placement.routing)
        e = self.engines[placement.replica]
        event(f"placed on {e.role.value}" + (" (deflected)" if placement.deflected else ""))
        e.sched.add_request(Request(rid, list(prompt), StopParams(max_tokens, ignore_eos=True)))
        self.book.placed(rid, placement)
        self.prompts[rid], self.outputs[rid] = list(prompt), []
        self.script[rid] = d(st.lists(st.integers(0, 3), min_size=max_tokens, max_size=max_tokens))
        self.where[rid] = e
        self.sampled_here[rid] = 0
        self.handoffs[rid] = []
        self.delivered[rid] = []
        self._observe()

    @precondition(lambda self: self.ready and bool(self.where))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        self.in_rule = True
        rid = data.draw(st.sampled_from(sorted(self.where)), label="abort id")
        self.where[rid].sched.abort(rid, self.clock)
        self._retire(rid)
        self._observe()
        self.in_rule = False

    # ------------------------------------------------------------------ steps
    @precondition(lambda self: self.ready)
    @rule(data=st.data(), n=st.integers(1, 6))
    def step(self, data: st.DataObject, n: int) -> None:
        self.in_rule = True
        which = data.draw(st.sampled_from([None, *self.engines]), label="step engine (all: None)")
        for _ in range(n):
            for e in self.engines if which is None else [which]:
                if e.sched.has_unfinished:
                    self._step(e)
                    self._hand_off_due(e, data)
        self.in_rule = False

    def _step(self, e: Engine) -> None:
        rec = e.core.step(self.clock)
        self.clock = rec.end_ms
        last = e.executor.last
        assert last is not None and last[0] is rec.plan  # this step's, not an earlier one
        plan, _, sampled = last
        if e.role is Role.DECODE:
            self._check_decode_step(e, plan)
        e.preempted.update(plan.preempted, plan.dropped, plan.swapped_out)
        samples = []
        for c in plan.chunks:
            if c.samples:
                tok = sampled[c.request_id]
                self.outputs[c.request_id].append(tok)
                self.sampled_here[c.request_id] += 1
                samples.append(Sample(e.name, c.request_id, (tok,)))
        for rid, tok in rec.outcome.last_tokens():
            self.delivered[rid].append(tok)
        for r in e.sched.retired:
            self._retire(r.request_id)
        self._observe(sampled=tuple(samples))

    def _check_decode_step(self, e: Engine, plan: StepPlan) -> None:
        """Rule deflect on one step of a decode replica."""
        chunks = tuple(
            PrefillChunk(
                c.request_id,
                c.num_new_tokens,
                deflected=self.book.is_deflected(c.request_id),
                recompute=c.request_id in e.preempted,
            )
            for c in plan.chunks
            if c.is_prefill
        )
        decodes = plan.num_decode_requests
        if chunks and decodes:
            event("decode replica: prefill beside decodes")
        cost = self.cost
        step = DecodeStep(
            e.name,
            decodes,
            kv_read(plan),
            chunks,
            StepCostModel(cost.a, cost.b, cost.c, cost.e),
            self.tbt_slo_ms,
        )
        bound = tbt_bound_tokens(step)
        if chunks and bound is not None and sum(ch.tokens for ch in chunks) == bound:
            event("decode replica: prefill tokens at the TBT bound")
        if any(ch.recompute for ch in chunks):
            event("decode replica: a recompute after its own preemption")
        violations = check_deflect(step)
        assert not violations, "\n".join(str(v) for v in violations)

    # ------------------------------------------------------------------ handoffs
    def _hand_off_due(self, e: Engine, data: st.DataObject | None) -> None:
        """Every request of ``e`` its book says is due, handed off before ``e`` steps
        again (rule first). ``late_handoff`` (a planted bug) waits one step more."""
        due = [r for r in sorted(self.where) if self.where[r] is e and self._due(r)]
        if self.late_handoff:
            due, self.late[e] = [r for r in self.late.get(e, []) if r in due], due
        for rid in due:
            if rid in self.where and self._due(rid):
                self._hand_off(rid, data)

    def _due(self, rid: str) -> bool:
        return self.book.due(rid, len(self.outputs[rid]))

    def _hand_off(self, rid: str, data: st.DataObject | None) -> None:
        src = self.where[rid]
        r = src.sched.requests[rid]
        loads = {e.index: load_figures(e.sched, self.cost) for e in self.engines}
        decision = choose_decode(rid, src.index, r.num_computed_tokens, loads, self.roles)
        if decision.replica is None:
            event("handoff: no decode replica has room")
            self.book.kept(rid)
            self._observe()
            return
        dst = self.engines[decision.replica]

        fault: str | None = None
        chunk: int | None = None
        abort_at = "after_stage"
        link = MemoryLink(src, dst)
        if data is not None:  # the teardown's handoffs take no draws: no faults there
            fault = data.draw(st.sampled_from([None, None, None, *FAULTS]), label="fault")
            chunk = data.draw(st.sampled_from([None, 1, 2]), label="chunk blocks")
            abort_at = data.draw(st.sampled_from(BEFORE_ACK), label="client abort at")
            if fault == "mid_copy":
                link.fail_after = data.draw(st.integers(0, 3), label="slots before it fails")
        move = PhasedMigration(
            src.sched, dst.sched, rid, with_kv=True, link=link, chunk_blocks=chunk
        )

        def hook(point: str) -> None:
            if point == fault:
                raise Boom(f"fault at {point}")
            if fault == "client_abort" and point == abort_at and rid in src.sched.requests:
                src.sched.abort(rid, self.clock)
                self._retire(rid)
                event(f"client abort mid-handoff at {point}")

        def observe(m: PhasedMigration) -> None:
            self._observe(transit=m.transit(src.name, dst.name) if m.phase else None)

        tokens_of_turn = len(self.outputs[rid])
        before = (src.sched.snapshot(), dst.sched.snapshot(), dict(dst.memory))
        try:
            move.run(fault=hook, observe=observe)
        except (PhasedMigrationAborted, MigrationError) as err:
            self._kept(rid, src, dst, before, err, fault)
            return
        self.where[rid] = dst
        self.sampled_here[rid] = 0
        self.handoffs[rid].append(
            Handoff(RoleName(src.role.value), RoleName(dst.role.value), tokens_of_turn)
        )
        self.book.handed_off(rid)
        event(f"handed off {src.role.value} to {dst.role.value}")
        self._observe()

    def _kept(
        self,
        rid: str,
        src: Engine,
        dst: Engine,
        before: tuple[object, object, dict[int, int]],
        err: MigrationError,
        fault: str | None,
    ) -> None:
        """A handoff that ended before the ack: both engines as before, the decode
        replica's memory too (ATOMIC); the request decodes where it is, kept (unless its
        client aborted it meanwhile)."""
        if isinstance(err, PhasedMigrationAborted):
            assert isinstance(err.cause, Boom), err
            dies = fault in DECODE_DIES
            event("handoff aborted: " + ("the decode replica died" if dies else str(fault)))
        elif "changed on the source" in str(err):
            event("handoff cancelled: the client aborted")
        else:  # refused: no room, or past its length limit
            event(f"handoff refused by the decode replica ({type(err).__name__})")
        assert dst.sched.snapshot() == before[1]
        assert dst.memory == before[2]
        if rid in self.done:
            assert fault == "client_abort", err
        else:
            assert src.sched.snapshot() == before[0]
            self.book.kept(rid)
        self._observe()

    # ---------------------------------------------------------------- helpers
    def _retire(self, rid: str) -> None:
        self.where.pop(rid)
        self.done.add(rid)
        self.book.forget(rid)

    def _snapshot(self, transit: Transit | None = None) -> ClusterSnapshot:
        return ClusterSnapshot(
            tuple(cluster_node(e.name, e.sched, e.memory, e.host_memory) for e in self.engines),
            () if transit is None else (transit,),
            tuple(
                Delivered(rid, tuple(toks), rid in self.done)
                for rid, toks in sorted(self.delivered.items())
            ),
        )

    def pd_snapshot(self) -> PDSnapshot:
        """The live requests as the roles see them, from the machine's books."""
        return PDSnapshot(
            tuple(
                PDRequest(
                    rid,
                    e.name,
                    RoleName(e.role.value),
                    self.sampled_here[rid],
                    deflected=self.book.is_deflected(rid),
                    kept=self.book.phase.get(rid) is PDPhase.KEPT,
                    handoffs=tuple(self.handoffs[rid]),
                )
                for rid, e in sorted(self.where.items())
            )
        )

    def _observe(self, transit: Transit | None = None, sampled: tuple[Sample, ...] = ()) -> None:
        """Every migration rule between the last snapshot and this one, every pool rule,
        and ROLES' first and once."""
        assert self.last is not None
        snap = self._snapshot(transit)
        violations: list[Violation] = check_cluster(ClusterStep(self.last, snap, sampled, ()))
        for node in snap.nodes:
            violations += check_pool(node.engine.pool)
        violations += check_roles(self.pd_snapshot())
        assert not violations, "\n".join(str(v) for v in violations)
        for rid, e in self.where.items():
            if transit is None or rid != transit.request_id or transit.phase.source_holds:
                assert e.sched.requests[rid].token_ids == self.tokens(rid)
        self.last = snap

    def teardown(self) -> None:
        if not self.ready or self.in_rule:
            return  # a rule failed: let its error be the one reported
        # Each step schedules >= 1 token (PROGRESS, checked by EngineCore): a generous
        # bound on what is left, recomputes after preemptions included.
        left = sum(len(self.tokens(r)) + len(self.script[r]) for r in self.where)
        bound = 20 + left * (len(self.where) + 1) * 2
        for _ in range(bound):
            busy = [e for e in self.engines if e.sched.has_unfinished]
            if not busy:
                break
            for e in busy:
                self._step(e)
                self._hand_off_due(e, None)
        assert not self.where, f"not drained within {bound} rounds: {sorted(self.where)}"
        assert all(d.done for d in self._snapshot().delivered)
        for e in self.engines:
            assert check_quiescent(e.sched.pool.snapshot()) == []
            assert check_quiescent(e.sched.host.snapshot()) == []


# CI budget: see the measurement in the module's commit; the deep profile raises both.
_default = settings.default
assert _default is not None
PDMachine.TestCase.settings = settings(
    max_examples=max(80, _default.max_examples),
    stateful_step_count=max(30, _default.stateful_step_count),
)
TestPDStateMachine = PDMachine.TestCase


# ------------------------------------------------------------------ planted bugs
class _AlwaysDueBook(HandoffBook):
    """The bug of a double handoff: the book counts the handoff but leaves the request
    in its prefill phase, so it stays due on its decode replica."""

    def handed_off(self, request_id: str) -> None:
        self.handoffs[request_id] = self.handoffs.get(request_id, 0) + 1


class DoubleHandoff(PDMachine):
    roles_text = "2P2D"  # a second decode replica to hand off to
    book_kind = _AlwaysDueBook


class UncappedDecode(PDMachine):
    uncapped_decode = True


class LateHandoff(PDMachine):
    late_handoff = True


#: A bug search: deterministic, generation only (no shrinking: the report is the rule
#: it broke, not the smallest example).
_HUNT = settings(
    max_examples=200,
    stateful_step_count=30,
    derandomize=True,
    database=None,
    deadline=None,
    phases=(Phase.generate,),
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.mark.parametrize(
    ("machine", "rule_name"),
    [(DoubleHandoff, "once"), (UncappedDecode, "deflect"), (LateHandoff, "first")],
    ids=["double-handoff", "uncapped-deflected-chunk", "step-before-handoff"],
)
def test_the_machine_catches_a_planted_bug(machine: type[PDMachine], rule_name: str) -> None:
    with pytest.raises(AssertionError, match=rf"\(rule {rule_name}\)"):
        run_state_machine_as_test(machine, settings=_HUNT)
