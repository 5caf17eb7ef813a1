"""Hypothesis state machine: two or three schedulers and requests migrating between them.

Each engine is a real ``Scheduler`` stepped through ``EngineCore(check_invariants=True)``
(every step-level invariant of one engine checked there) with the scripted executor of
tests/scheduler/scripted_kv.py and its own fake K/V memories (slot -> token id, device
and host). Configs are drawn per engine: distinct block sizes, small pools (preemption
and capacity finishes happen), chunked prefill and prefix caching on or off, recompute
or swap preemption with a host pool sometimes, its own length limit.

Rules: add a request to an engine, step an engine, abort, pause an agent turn (its KV
kept on the device, moved to the host, or dropped) and resume it, and migrate a drawn
live request, in any state, to another engine with ``PhasedMigration``
(tests/phased_migration.py): by transfer (in chunks of drawn size) or by recompute,
with a fault drawn at a point of the protocol (before the export, after the stage,
between chunks, inside a chunk's copy, before the ack, after the ack) or the client
aborting it mid-move. The K/V travels
through ``tests.harness.MemoryLink``, which copies the fake memory slot by slot and
saves what it overwrote, so an abort restores the destination's memory.

After every operation, and after every phase of every move, a cluster snapshot is taken
(spec/cluster.py: the engines' snapshots and memories, the request in transit, what
each client received) and every migration rule (``refserve.spec.checks.check_cluster``: OWNER,
CONSERVE, MOVED, KVCOPY, LEAK) is checked against the snapshot before it, with every
engine's pool rules (``refserve.spec.check_pool``). ``sampled`` comes from the executors (what
they sampled) and ``delivered`` from the schedulers' step outcomes (what they reported),
so the two are independent. A move that fails before the ack must leave both engines'
snapshots and the destination's memory exactly as before. Teardown resumes or aborts
every paused turn, drains every engine and requires every client's stream finished and
every pool quiescent.
"""

from __future__ import annotations

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from refserve.core.config import SchedulerConfig
from refserve.core.engine_core import EngineCore
from refserve.core.request import Request, StopParams
from refserve.core.scheduler import Scheduler
from refserve.core.swap import KVRetention, PreemptionMode
from refserve.core.transit import MIGRATION_FAULT_POINTS, MigrationError, MigrationRefused
from refserve.spec import check_pool
from refserve.spec.arith import blocks_needed
from refserve.spec.checks import check_cluster
from refserve.spec.cluster import ClusterSnapshot, ClusterStep, Delivered, Sample, Transit
from refserve.spec.progress import check_quiescent
from refserve.spec.snapshot import RequestStatus
from refserve.spec.violation import Violation
from tests.harness import Boom, MemoryLink
from tests.phased_migration import PhasedMigration, PhasedMigrationAborted, cluster_node
from tests.scheduler.scripted_kv import ScriptedExecutor

S = RequestStatus
PROMPT_TOKEN = st.integers(0, 2)  # tiny alphabet: prefixes repeat, prefix hits are common
MAX_LIVE = 8
#: What goes wrong during a move: a fault at a protocol point, inside a chunk's copy,
#: or the client aborting the request on its source before the ack.
FAULTS = (*MIGRATION_FAULT_POINTS, "mid_copy", "client_abort")
BEFORE_ACK = ("after_stage", "mid_stream", "before_ack")
_RARE = (S.PREFILLING, S.PREEMPTED, S.SWAPPED, S.DECODING)


class EngineBooks:
    """One engine of the cluster with its memories (what ScriptedExecutor reads)."""

    def __init__(self, machine: ClusterMachine, name: str, config: SchedulerConfig) -> None:
        self.machine, self.name, self.config = machine, name, config
        self.memory: dict[int, int] = {}
        self.host_memory: dict[int, int] = {}
        self.sched = Scheduler(config)
        self.executor = ScriptedExecutor(self)
        self.core = EngineCore(self.sched, self.executor, check_invariants=True)

    def __repr__(self) -> str:
        return f"engine {self.name}"  # what Hypothesis prints for a drawn engine

    @property
    def bs(self) -> int:
        return self.config.block_size

    def tokens(self, rid: str) -> list[int]:
        return self.machine.tokens(rid)

    def next_tokens(self, rid: str) -> list[int]:
        return self.machine.next_tokens(rid)

    def fits(self, num_tokens: int) -> bool:
        """``num_tokens`` known tokens may live here (length limit and pool)."""
        cfg = self.config
        return num_tokens < cfg.max_len and blocks_needed(num_tokens, cfg.block_size) <= (
            cfg.num_blocks
        )


class ClusterMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ready = False
        self.in_rule = False
        self.engines: list[EngineBooks] = []
        self.next_id = 0
        self.clock = 0.0
        self.prefixes: list[list[int]] = []
        # The test's books, one conversation per request wherever it runs.
        self.prompts: dict[str, list[int]] = {}
        self.outputs: dict[str, list[int]] = {}  # this turn's sampled tokens
        self.script: dict[str, list[int]] = {}
        self.where: dict[str, EngineBooks] = {}  # live requests
        self.delivered: dict[str, list[int]] = {}  # every turn's, from the step outcomes
        self.done: set[str] = set()
        self.last: ClusterSnapshot | None = None

    def tokens(self, rid: str) -> list[int]:
        return self.prompts[rid] + self.outputs[rid]

    def next_tokens(self, rid: str) -> list[int]:
        return self.script[rid][len(self.outputs[rid]) :]

    # ------------------------------------------------------------------ setup
    @initialize(data=st.data())
    def setup(self, data: st.DataObject) -> None:
        d = data.draw
        n = d(st.integers(2, 3), label="engines")
        sizes = d(st.lists(st.integers(1, 4), min_size=n, max_size=n, unique=True), label="bs")
        for i, bs in enumerate(sizes):
            self.engines.append(EngineBooks(self, f"e{i}", self._config(data, bs)))
        self.prefixes = [d(st.lists(PROMPT_TOKEN, min_size=4, max_size=8)) for _ in range(2)]
        self.ready = True
        self.last = self._snapshot()
        for _ in range(d(st.integers(0, 4), label="initial requests")):
            self._add(data, d(st.sampled_from(self.engines)))

    def _config(self, data: st.DataObject, bs: int) -> SchedulerConfig:
        d = data.draw
        chunked = d(st.booleans(), label="chunked prefill")
        swap, recompute = PreemptionMode.SWAP, PreemptionMode.RECOMPUTE
        mode = d(st.sampled_from([recompute, swap, swap]), label="mode")
        host = d(st.sampled_from([0, 2, 6]), label="host blocks")
        if mode is PreemptionMode.SWAP:
            host = max(host, 2)
        return SchedulerConfig(
            max_num_batched_tokens=d(st.integers(2, 8) if chunked else st.integers(12, 16)),
            max_num_seqs=d(st.integers(1, 4), label="max_num_seqs"),
            block_size=bs,
            # 8 to 16 tokens of KV: a few requests, so preemption is common.
            num_blocks=d(st.integers(max(3, 8 // bs), 16 // bs), label="num_blocks"),
            max_model_len=d(st.integers(12, 24), label="max_model_len"),
            enable_prefix_caching=d(st.booleans(), label="prefix caching"),
            enable_chunked_prefill=chunked,
            preemption_mode=mode,
            num_host_blocks=host,
        )

    # ---------------------------------------------------------------- requests
    @precondition(lambda self: self.ready)
    @rule(data=st.data())
    def add_request(self, data: st.DataObject) -> None:
        self.in_rule = True
        if len(self.where) < MAX_LIVE:
            self._add(data, data.draw(st.sampled_from(self.engines), label="add to"))
        self.in_rule = False

    def _add(self, data: st.DataObject, e: EngineBooks) -> None:
        d = data.draw
        cfg = e.config
        base = d(st.sampled_from([[], *self.prefixes, *self.prefixes]), label="shared prefix")
        tail = d(st.lists(PROMPT_TOKEN, max_size=6), label="tail")
        limit = min(cfg.max_len - 1, cfg.num_blocks * cfg.block_size)
        prompt = (base + tail)[:limit] or [0]
        max_tokens = d(st.integers(2, 10), label="max_tokens")
        self.next_id += 1
        rid = f"r{self.next_id}"
        e.sched.add_request(Request(rid, list(prompt), StopParams(max_tokens, ignore_eos=True)))
        self.prompts[rid], self.outputs[rid] = list(prompt), []
        self.script[rid] = d(st.lists(st.integers(0, 3), min_size=max_tokens, max_size=max_tokens))
        self.where[rid] = e
        self.delivered[rid] = []
        self._observe()

    @precondition(lambda self: self.ready and bool(self.where))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        self.in_rule = True
        rid = self._draw_live(data, "abort")
        self.where[rid].sched.abort(rid, self.clock)
        self._retire(rid)
        self._observe()
        self.in_rule = False

    @precondition(lambda self: self.ready and bool(self._decoding()))
    @rule(data=st.data())
    def pause(self, data: st.DataObject) -> None:
        self.in_rule = True
        rid = data.draw(st.sampled_from(self._decoding()), label="pause id")
        e = self.where[rid]
        kinds = [KVRetention.DEVICE, KVRetention.DROP]
        if e.config.num_host_blocks:
            kinds.append(KVRetention.HOST)
        kind = data.draw(st.sampled_from(kinds), label="retention")
        assert e.sched.pause(rid, kind) is kind
        event(f"pause: {kind}")
        self._observe()
        self.in_rule = False

    @precondition(lambda self: self.ready and bool(self._paused()))
    @rule(data=st.data())
    def resume(self, data: st.DataObject) -> None:
        self.in_rule = True
        rid = data.draw(st.sampled_from(self._paused()), label="resume id")
        tool = data.draw(st.lists(PROMPT_TOKEN, min_size=1, max_size=3), label="tool tokens")
        if self.where[rid].fits(len(self.tokens(rid)) + len(tool)):
            self._resume(rid, tool, data.draw(st.integers(1, 4), label="turn max_tokens"), data)
        else:
            event("resume skipped: the turn would not fit")
        self.in_rule = False

    def _resume(self, rid: str, tool: list[int], max_tokens: int, data: st.DataObject) -> None:
        e = self.where[rid]
        e.sched.resume(rid, tool, StopParams(max_tokens, ignore_eos=True))
        self.prompts[rid] = self.tokens(rid) + tool
        self.outputs[rid] = []
        self.script[rid] = data.draw(
            st.lists(st.integers(0, 3), min_size=max_tokens, max_size=max_tokens)
        )
        self._observe(appended=(Sample(e.name, rid, tuple(tool)),))

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
            # Mid-prefill, preempted, swapped and decoding are states a step just made:
            # sometimes move one right away, so every state moves often.
            rare = [r for r in sorted(self.where) if self._status(r) in _RARE]
            if rare and data.draw(st.integers(0, 2), label="move a rare state") == 0:
                self._migrate(data, data.draw(st.sampled_from(rare), label="rare move id"))
        self.in_rule = False

    def _step(self, e: EngineBooks) -> None:
        rec = e.core.step(self.clock)
        self.clock = rec.end_ms
        last = e.executor.last
        assert last is not None and last[0] is rec.plan  # this step's, not an earlier one
        plan, _, sampled = last
        if plan.preempted:
            event("preemption")
        if plan.swapped_out:
            event("swap out")
        samples = []
        for c in plan.chunks:
            if c.samples:
                tok = sampled[c.request_id]
                self.outputs[c.request_id].append(tok)
                samples.append(Sample(e.name, c.request_id, (tok,)))
        for rid, tok in rec.outcome.last_tokens():
            self.delivered[rid].append(tok)
        for r in e.sched.retired:
            self._retire(r.request_id)
        self._observe(sampled=tuple(samples))

    # ------------------------------------------------------------------ moves
    @precondition(lambda self: self.ready and bool(self.where))
    @rule(data=st.data())
    def migrate(self, data: st.DataObject) -> None:
        self.in_rule = True
        self._migrate(data, self._draw_live(data, "migrate"))
        self.in_rule = False

    def _migrate(self, data: st.DataObject, rid: str) -> None:
        d = data.draw
        src = self.where[rid]
        dst = d(st.sampled_from([e for e in self.engines if e is not src]), label="destination")
        fault = d(st.sampled_from([None, None, None, *FAULTS]), label="fault")
        with_kv = fault == "mid_copy" or d(st.booleans(), label="transfer")
        chunk = d(st.sampled_from([None, 1, 2]), label="chunk blocks")
        abort_at = d(st.sampled_from(BEFORE_ACK), label="client abort at")
        status = self._status(rid)
        if status is S.WAITING_TOOL and src.sched.host.has_request(rid):
            event("move of a paused turn with its KV on the host")
        link = MemoryLink(src, dst)
        if fault == "mid_copy":
            link.fail_after = d(st.integers(0, 3), label="slots before the link fails")
        move = PhasedMigration(
            src.sched, dst.sched, rid, with_kv=with_kv, link=link, chunk_blocks=chunk
        )

        def hook(point: str) -> None:
            if point == fault:
                raise Boom(f"fault at {point}")
            if fault == "client_abort" and point == abort_at and rid in src.sched.requests:
                src.sched.abort(rid, self.clock)
                self._retire(rid)
                event(f"client abort mid-move at {point}")

        def observe(m: PhasedMigration) -> None:
            self._observe(transit=m.transit(src.name, dst.name) if m.phase else None)

        before = (src.sched.snapshot(), dst.sched.snapshot(), dict(dst.memory))
        try:
            move.run(fault=hook, observe=observe)
        except (PhasedMigrationAborted, MigrationError) as e:
            self._moved_nothing(rid, src, dst, before, e)
        else:
            if fault not in (None, "after_ack"):
                event(f"move done: its fault point {fault} was not reached")
            assert move.fault == ("after_ack" if fault == "after_ack" else None)
            event(f"moved while {status} by {'transfer' if with_kv else 'recompute'}")
            if move.arrival is not None and move.arrival.num_hit_tokens:
                event("moved onto a prefix hit of the destination")
            self.where[rid] = dst
            self._observe()

    def _moved_nothing(
        self,
        rid: str,
        src: EngineBooks,
        dst: EngineBooks,
        before: tuple[object, object, dict[int, int]],
        e: MigrationError,
    ) -> None:
        """A move that ended before the ack: both engines as before, the destination's
        memory too (ATOMIC); only a client abort changed the source."""
        if isinstance(e, PhasedMigrationAborted):
            assert isinstance(e.cause, Boom), e
            event(f"move aborted: {e.point}" + (" inside a copy" if "link" in str(e) else ""))
        elif isinstance(e, MigrationRefused):
            event("move refused by the destination")
        elif "changed on the source" in str(e):
            event("move cancelled: the source changed")
        else:
            event(f"move failed: {type(e.__cause__).__name__}")
        assert dst.sched.snapshot() == before[1]
        assert dst.memory == before[2]
        if rid in self.done:
            assert "changed on the source" in str(e), e
        else:
            assert src.sched.snapshot() == before[0]
        self._observe()

    # ---------------------------------------------------------------- helpers
    def _draw_live(self, data: st.DataObject, what: str) -> str:
        by_state: dict[str, list[str]] = {}
        for rid in sorted(self.where):
            by_state.setdefault(self.where[rid].sched.requests[rid].status, []).append(rid)
        state = data.draw(st.sampled_from(sorted(by_state)), label=f"{what} state")
        return data.draw(st.sampled_from(by_state[state]), label=f"{what} id")

    def _status(self, rid: str) -> RequestStatus:
        return self.where[rid].sched.requests[rid].status

    def _decoding(self) -> list[str]:
        return [
            r for r in sorted(self.where) if self.where[r].sched.requests[r].status is S.DECODING
        ]

    def _paused(self) -> list[str]:
        return [r for r in sorted(self.where) if r in self.where[r].sched.paused]

    def _retire(self, rid: str) -> None:
        self.where.pop(rid)
        self.done.add(rid)

    def _snapshot(self, transit: Transit | None = None) -> ClusterSnapshot:
        return ClusterSnapshot(
            tuple(cluster_node(e.name, e.sched, e.memory, e.host_memory) for e in self.engines),
            () if transit is None else (transit,),
            tuple(
                Delivered(rid, tuple(toks), rid in self.done)
                for rid, toks in sorted(self.delivered.items())
            ),
        )

    def _observe(
        self,
        transit: Transit | None = None,
        sampled: tuple[Sample, ...] = (),
        appended: tuple[Sample, ...] = (),
    ) -> None:
        """Every migration rule between the last snapshot and this one; every pool rule."""
        assert self.last is not None
        snap = self._snapshot(transit)
        violations: list[Violation] = check_cluster(ClusterStep(self.last, snap, sampled, appended))
        for node in snap.nodes:
            violations += check_pool(node.engine.pool)
        assert not violations, "\n".join(str(v) for v in violations)
        for rid, e in self.where.items():
            if transit is None or rid != transit.request_id or transit.phase.source_holds:
                assert e.sched.requests[rid].token_ids == self.tokens(rid)
        self.last = snap

    def teardown(self) -> None:
        if not self.ready or self.in_rule:
            return  # a rule failed: let its error be the one reported
        for rid in self._paused():
            e = self.where[rid]
            if e.fits(len(self.tokens(rid)) + 1):
                e.sched.resume(rid, [0], StopParams(1, ignore_eos=True))
                self.prompts[rid] = [*self.tokens(rid), 0]
                self.outputs[rid], self.script[rid] = [], [1]
                self._observe(appended=(Sample(e.name, rid, (0,)),))
            else:
                e.sched.abort(rid, self.clock)
                self._retire(rid)
                self._observe()
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
        assert not self.where, f"not drained within {bound} rounds: {sorted(self.where)}"
        assert all(d.done for d in self._snapshot().delivered)
        for e in self.engines:
            assert check_quiescent(e.sched.pool.snapshot()) == []
            assert check_quiescent(e.sched.host.snapshot()) == []


# CI budget: see the measurement in the module's commit; the deep profile raises both.
_default = settings.default
assert _default is not None
ClusterMachine.TestCase.settings = settings(
    max_examples=max(200, _default.max_examples),
    stateful_step_count=max(30, _default.stateful_step_count),
)
TestMigrationStateMachine = ClusterMachine.TestCase
