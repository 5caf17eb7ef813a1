"""Run a workload on several instances of one engine, moving requests between them
(feature ``migration``; docs/ADAPTERS.md, "Migration"; docs/CONFORMANCE.md, "Migration").

Each instance is a :class:`refserve.conformance.instance.InstanceRun` with its own
configuration, its own fake KV memory and its own books (live requests, admission ranks,
steps); they share the run's result and the requests' tokens, which move with them.
Requests arrive at instance 0 (``A``). At every step boundary the suite adds the
arrivals, aborts what is due, makes the workload's moves
(:class:`~refserve.conformance.workload.MigrationPlan`; in a disaggregated workload,
every request on ``A`` that has its first output moves to ``B``), then steps every
instance that has live requests, checking each step as a single-engine run does.

The suite plays the link. One move of ``rid`` from ``src`` to ``dst``::

    exp = src.export_request(rid)             # a pure read: src's snapshot unchanged
    staged = dst.stage_import(exp, transfer)  # Rejected: dst unchanged, rid stays on src
    # the link copies src's fake K/V at exp.kv_slots[p] to dst's staged.kv_slots[i]
    # for p = staged.num_hit_tokens + i (buffered: it lands at the ack)
    src.release(rid)                          # after the ack
    dst.commit_import()                       # rid is live on dst

With a fault before the ack the link drops its buffer and ``dst.abort_import()`` must
leave the destination exactly as before the stage (ATOMIC); the request runs on as
before on the source (``before_ack``) or is aborted there by its client
(``abort_in_transit``). An export, a refusal and an aborted import are ATOMIC checks
(nothing changed), the pools are checked after a release and a commit, and each step is
checked as in a single-engine run.

After every operation (an add, an abort, one engine's step or rollback, and each phase
of a move: exported, staged, acknowledged, released, committed or aborted) the suite
builds a :class:`refserve.spec.cluster.ClusterSnapshot` (every instance's snapshot and fake K/V
memory, the move in transit, what each client received) and runs the migration rules
of spec/cluster.py on it and the one before (:func:`refserve.spec.checks.check_cluster`: OWNER,
CONSERVE, MOVED, KVCOPY, LEAK; MOVED's rule ``handoff``, spec/handoff.py, reads the slot
lists of the export and the stage recorded in the transit). The engines report token
counts, not token ids, so a node's token ids for a request are the suite's own (it
sampled them), cut or padded to the count the engine reports: an engine that loses or
repeats a token shows as tokens changed by other than what the step sampled (CONSERVE).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from refserve.conformance import validate
from refserve.conformance.adapter import (
    EngineAdapter,
    MigrationExport,
    MigrationStaged,
    Rejected,
)
from refserve.conformance.fake_kv import Slot
from refserve.conformance.guard import AdapterCallError, describe
from refserve.conformance.instance import (
    STALL_STEPS,
    STEP_INVARIANTS,
    InstanceRun,
    adapter_traits,
)
from refserve.conformance.probe import RunStopped
from refserve.conformance.run_result import Finding, RunResult
from refserve.conformance.workload import MigrationPlan, RequestPlan, Workload
from refserve.spec.atomic import check_atomic
from refserve.spec.checks import check_cluster, check_pool
from refserve.spec.cluster import (
    ClusterSnapshot,
    ClusterStep,
    Delivered,
    Node,
    Sample,
    Transit,
    TransitPhase,
)
from refserve.spec.snapshot import EngineSnapshot
from refserve.spec.violation import CLUSTER_INVARIANTS, Invariant, Violation, violation

NAMES = "ABCDEFGH"
"""Instance labels in findings and traces (``step on B``)."""

UNKNOWN_TOKEN = -1
"""Stands for a token an engine reports that the suite never sampled (never a token id)."""


def run_instances(
    adapters: Sequence[EngineAdapter], workload: Workload, call_timeout: float
) -> RunResult:
    """Run ``workload`` on ``adapters`` (fresh adapters of one engine, one per instance);
    never raises for engine bugs (a peer whose traits cannot be read is a finding)."""
    try:
        cluster = _Cluster(adapters, workload, call_timeout)
    except AdapterCallError as e:
        res = RunResult(workload)
        res.findings.append(Finding(violation(Invariant.PROGRESS, "adapter", str(e)), -1, "setup"))
        return res
    return cluster.run()


class MigrationInTransit:
    """The move in transit, as the suite (the link) knows it."""

    def __init__(self, rid: str, src: InstanceRun, dst: InstanceRun, plan: MigrationPlan) -> None:
        self.rid, self.src, self.dst, self.plan = rid, src, dst, plan
        self.phase = TransitPhase.EXPORTED
        self.transit: Transit | None = None
        """The spec's record (None when the source did not list the request)."""


class _Cluster:
    def __init__(
        self, adapters: Sequence[EngineAdapter], workload: Workload, call_timeout: float
    ) -> None:
        self.w = workload
        n = workload.instances
        if len(adapters) < n or n > len(NAMES):
            raise ValueError(f"{n} instances need {n} adapters (at most {len(NAMES)})")
        props = [adapter_traits(a, call_timeout)[1] for a in adapters[:n]]
        head = InstanceRun(adapters[0], workload, props[0], call_timeout, label=NAMES[0])
        self.runs = [head]
        for i in range(1, n):
            self.runs.append(
                InstanceRun(
                    adapters[i],
                    workload,
                    props[i],
                    call_timeout,
                    config=workload.config_of(i),
                    shared=head,
                    label=NAMES[i],
                )
            )
        self.res = head.res
        self.moves = sorted(workload.migrations, key=lambda m: m.at)
        self.added: list[str] = []
        """Requests the suite submitted and the engine took, in order (their clients)."""
        self.move: MigrationInTransit | None = None
        self.last: ClusterSnapshot | None = None

    # ------------------------------------------------------------------ the run
    def run(self) -> RunResult:
        try:
            self.drive()
        except RunStopped:
            pass
        except Exception as e:  # the suite's own bookkeeping tripped on the adapters' data
            self.res.findings.append(
                Finding(
                    violation(
                        Invariant.PROGRESS,
                        "adapter",
                        f"the suite could not follow the adapter's records: {describe(e)}",
                    ),
                    self.res.observed.steps,
                    "migrate",
                )
            )
        return self.res

    def drive(self) -> None:
        self.begin()
        pending = sorted(self.w.requests, key=lambda r: r.arrival)
        limit = self.w.step_limit
        boundary = step = i = j = 0
        while True:
            i = self.arrive(pending, i, boundary, step)
            j = self.make_moves(j, boundary, step)
            boundary += 1
            if not any(r.live for r in self.runs):
                if i >= len(pending) and j >= len(self.moves):
                    break
                continue  # idle until the next arrival or move
            if step >= limit:
                self.not_quiesced(step, limit)
                return
            self.step_all(step)
            step += 1
            if self.stalled(pending[i:], j, step):
                return
        for r in self.runs:
            r.quiesce(step)
        self.check_cluster(step, "quiescence")

    def begin(self) -> None:
        """Configure every instance; what the run checks."""
        for r in self.runs:
            r.configure()
            r.probe.snapshot(-1, "configure")
        self.res.checked.update(STEP_INVARIANTS)
        self.res.checked.update(CLUSTER_INVARIANTS)
        self.res.checked.add(Invariant.ATOMIC)  # every export, refusal and aborted import
        # Whatever order an instance declares (admission, step, multi-level queue), its
        # steps check it (InstanceRun.step), so ORDER is reported as checked.
        if any(r.conventions.declared for r in self.runs):
            self.res.checked.add(Invariant.ORDER)
        self.check_cluster(-1, "configure")

    def not_quiesced(self, step: int, limit: int) -> None:
        self.runs[0].probe.not_quiesced(step, limit, [rid for r in self.runs for rid in r.live])

    def step_all(self, step: int) -> None:
        """One step of every instance with live requests (a planned rollback first), each
        followed by the migration rules."""
        for r in self.runs:
            if not r.live:
                continue
            if step in self.w.rollback_at:
                r.rollback(step)
                self.check_cluster(step, r.probe.where("rollback"))
            r.step(step)
            sampled = tuple(
                Sample(r.probe.label, rid, tuple(toks))
                for rid, toks in sorted(r.last_gained.items())
            )
            self.check_cluster(step, r.probe.where("step"), sampled)

    def arrive(self, pending: list[RequestPlan], i: int, boundary: int, step: int) -> int:
        """The single-engine runner's arrivals (at instance 0) and aborts (wherever the
        request is), each followed by the migration rules."""
        head = self.runs[0]
        while i < len(pending) and pending[i].arrival <= boundary:
            rid = pending[i].request_id
            head.add(pending[i], step)
            i += 1
            if rid in head.live:
                self.added.append(rid)
            head.probe.snapshot(step, "add")
            self.check_cluster(step, head.probe.where("add"))
        for r in self.runs:
            for rid in sorted(r.live):
                p = r.plans[rid]
                if p.abort_at is not None and p.abort_at <= boundary:
                    r.abort(rid, step)
                    self.check_cluster(step, r.probe.where("abort"))
        return i

    def stalled(self, pending: list[RequestPlan], j: int, step: int) -> bool:
        """PROGRESS: every instance with live requests changed nothing for
        :data:`~refserve.conformance.runner.STALL_STEPS` steps and nothing ahead (an arrival, an
        abort, a move) could unstick them."""
        busy = [r for r in self.runs if r.live]
        if not busy or any(r.unchanged < STALL_STEPS for r in busy):
            return False
        if any(r.events_ahead(pending) for r in busy) or self.moves_ahead(j):
            return False
        if not any(f.invariant is Invariant.PROGRESS for f in self.res.findings):
            live = sorted(rid for r in busy for rid in r.live)
            busy[0].probe.fail(
                Invariant.PROGRESS,
                step,
                "step",
                "run",
                f"stalled: {STALL_STEPS} steps in a row changed nothing",
                "progress",
                f"{live} still live",
            )
        return True

    def moves_ahead(self, j: int) -> bool:
        live = {rid for r in self.runs for rid in r.live}
        return any(m.request_id in live for m in self.moves[j:])

    # ------------------------------------------------------------------ moves
    def holder(self, rid: str) -> InstanceRun | None:
        return next((r for r in self.runs if rid in r.live), None)

    def make_moves(self, j: int, boundary: int, step: int) -> int:
        """The moves due at ``boundary`` (``self.moves[j:]`` in order), then the
        disaggregated hand-offs; the index of the next move still to come."""
        while j < len(self.moves) and self.moves[j].at <= boundary:
            m = self.moves[j]
            j += 1
            src = self.holder(m.request_id)
            if src is None or m.to >= len(self.runs) or src is self.runs[m.to]:
                continue  # not live (yet, or any more), or already there
            self.migrate(src, self.runs[m.to], m, step)
        if self.w.disaggregated:
            head, decode = self.runs[0], self.runs[1]
            for rid in sorted(head.live):
                if len(head.tokens[rid]) > len(head.plans[rid].prompt):
                    self.migrate(head, decode, MigrationPlan(boundary, rid, 1), step)
        return j

    def migrate(self, src: InstanceRun, dst: InstanceRun, m: MigrationPlan, step: int) -> None:
        """One move, every operation checked (module docstring)."""
        rid = m.request_id
        phase = "migrate"
        entry: dict[str, object] = {
            "boundary": step,
            "migrate": rid,
            "from": src.probe.label,
            "to": dst.probe.label,
            "kv": m.kv,
        }
        self.res.trace.append(entry)
        src_before = src.probe.snapshot(step, phase)
        dst_before = dst.probe.snapshot(step, phase)
        move = self.move = MigrationInTransit(rid, src, dst, m)
        try:
            self._migrate(move, entry, src_before, dst_before, step)
        finally:
            self.move = None

    def _migrate(
        self,
        move: MigrationInTransit,
        entry: dict[str, object],
        src_before: EngineSnapshot,
        dst_before: EngineSnapshot,
        step: int,
    ) -> None:
        rid, src, dst, m = move.rid, move.src, move.dst, move.plan
        phase = "migrate"
        exp: MigrationExport = src.probe.call(
            step,
            phase,
            f"export_request({rid!r})",
            lambda: src.probe.a.export_request(rid),  # type: ignore[attr-defined]  # feature-gated
        )
        src.probe.malformed(
            step, phase, "export_request()", validate.check_migration_export(exp, rid)
        )
        entry["kv_length"] = len(exp.kv_slots)
        entry["host"] = exp.kv_on_host
        exported = src.probe.snapshot(step, phase)
        src.probe.checked(step, phase, lambda: _pure_read(src_before, exported))
        move.transit = self.transit_of(move, src_before, dst_before, exp, None)
        self.check_cluster(step, "migrate: exported")
        try:
            staged: MigrationStaged = dst.probe.call(
                step,
                phase,
                f"stage_import({rid!r})",
                lambda: dst.probe.a.stage_import(exp, m.kv),  # type: ignore[attr-defined]
                (Rejected,),
            )
        except Rejected as e:
            refused = dst.probe.snapshot(step, phase)
            dst.probe.checked(step, phase, lambda: check_atomic(dst_before, refused))
            entry["refused"] = str(e)
            self.move = None
            self.check_cluster(step, "migrate: refused")
            return
        dst.probe.malformed(
            step, phase, "stage_import()", validate.check_migration_staged(staged, rid)
        )
        entry["hit"] = staged.num_hit_tokens
        entry["sent"] = len(staged.kv_slots)
        held = dst.probe.snapshot(step, phase)
        dst.probe.checked(step, phase, lambda: check_pool(held.pool, dst.props.lookahead_slots))
        move.phase = TransitPhase.STAGED
        move.transit = self.transit_of(move, src_before, dst_before, exp, (staged, held))
        self.check_cluster(step, "migrate: staged")
        link = self.transfer(src, exp, staged)
        if m.fault is not None:
            entry["fault"] = m.fault
            self.fail_link(move, src_before, dst_before, step)
            return
        for slot, value in link.items():  # every staged position has landed: the ack
            if value is None:
                dst.memory.device.pop(slot, None)
            else:
                dst.memory.device[slot] = value
        self.advance(move, TransitPhase.ACKED)
        self.check_cluster(step, "migrate: acknowledged")
        src.probe.call(step, phase, f"release({rid!r})", lambda: src.probe.a.release(rid))  # type: ignore[attr-defined]
        src.live.discard(rid)
        released = src.probe.snapshot(step, phase)
        src.probe.checked(step, phase, lambda: check_pool(released.pool, src.props.lookahead_slots))
        self.advance(move, TransitPhase.RELEASED)
        self.check_cluster(step, "migrate: released")
        dst.probe.call(step, phase, "commit_import()", lambda: dst.probe.a.commit_import())  # type: ignore[attr-defined]
        dst.join(rid)
        after = dst.probe.snapshot(step, phase)
        dst.probe.checked(step, phase, lambda: check_pool(after.pool, dst.props.lookahead_slots))
        self.move = None
        self.check_cluster(step, "migrate: committed")

    def transit_of(
        self,
        move: MigrationInTransit,
        src_before: EngineSnapshot,
        dst_before: EngineSnapshot,
        exp: MigrationExport,
        staged: tuple[MigrationStaged, EngineSnapshot] | None,
    ) -> Transit | None:
        """The spec's record of ``move``: the source's request and tokens as they were
        when exported, its K/V length the slots it sent; once staged, whether K/V
        travels (the destination took the source's KV length, or none: a recompute),
        the hit and the blocks staged."""
        r = src_before.request(move.rid)
        if r is None:
            return None  # the source never listed it: OWNER's finding
        with_kv, hit = move.plan.kv, 0
        blocks: tuple[int, ...] = ()
        received: tuple[int, ...] | None = None
        if staged is not None:
            rec, held = staged
            with_kv, hit = rec.kv_length > 0, rec.num_hit_tokens
            table = held.pool.table(move.rid)
            blocks = table.block_table if with_kv and table is not None else ()
            received = tuple(rec.kv_slots)
        return Transit(
            request_id=move.rid,
            source=move.src.probe.label,
            destination=move.dst.probe.label,
            phase=move.phase,
            with_kv=with_kv,
            request=r,
            token_ids=self.node_tokens(move.src, r.request_id, r.num_tokens),
            kv_length=len(exp.kv_slots),
            num_hit_tokens=hit,
            staged_blocks=blocks,
            pool_before=dst_before.pool,
            sent_slots=tuple(exp.kv_slots),
            sent_on_host=exp.kv_on_host,
            received_slots=received,
        )

    def advance(self, move: MigrationInTransit, phase: TransitPhase) -> None:
        move.phase = phase
        if move.transit is not None:
            move.transit = dataclasses.replace(move.transit, phase=phase)

    def transfer(
        self, src: InstanceRun, exp: MigrationExport, staged: MigrationStaged
    ) -> dict[int, Slot | None]:
        """What the link carries: destination slot -> the source's K/V (a fake value) of
        the position it receives, None where the source has none (never written, or a
        position past what it exported: KVCOPY then names it)."""
        memory = src.memory.host if exp.kv_on_host else src.memory.device
        out: dict[int, Slot | None] = {}
        for i, slot in enumerate(staged.kv_slots):
            p = staged.num_hit_tokens + i
            out[slot] = memory.get(exp.kv_slots[p]) if p < len(exp.kv_slots) else None
        return out

    def fail_link(
        self,
        move: MigrationInTransit,
        src_before: EngineSnapshot,
        dst_before: EngineSnapshot,
        step: int,
    ) -> None:
        """The link fails before the ack: the destination aborts its import and must be
        as before the stage; the source still owns the request, unchanged, and (for
        ``abort_in_transit``) aborts it for its client."""
        rid, src, dst = move.rid, move.src, move.dst
        phase = "migrate"
        dst.probe.call(step, phase, "abort_import()", lambda: dst.probe.a.abort_import())  # type: ignore[attr-defined]
        undone = dst.probe.snapshot(step, phase)
        dst.probe.checked(step, phase, lambda: check_atomic(dst_before, undone))
        kept = src.probe.snapshot(step, phase)
        src.probe.checked(step, phase, lambda: _pure_read(src_before, kept))
        self.move = None
        self.check_cluster(step, "migrate: aborted")
        if move.plan.fault == "abort_in_transit":
            src.abort(rid, step)
            self.check_cluster(step, src.probe.where("abort"))

    # ------------------------------------------------------------------ the rules
    def node_tokens(self, r: InstanceRun, rid: str, count: int) -> tuple[int, ...]:
        """The request's token ids on an engine that reports ``count`` of them: the
        suite's own, cut or padded with :data:`UNKNOWN_TOKEN` (module docstring)."""
        known = r.tokens.get(rid, [])
        return tuple(known[:count]) + (UNKNOWN_TOKEN,) * (count - len(known))

    def cluster_now(self) -> ClusterSnapshot:
        nodes = []
        for r in self.runs:
            snap = r.probe.latest
            assert snap is not None, "every instance is snapshotted after configure"
            ids = tuple(
                (x.request_id, self.node_tokens(r, x.request_id, x.num_tokens))
                for x in snap.requests
                if not x.status.is_done and x.request_id in r.tokens
            )
            nodes.append(
                Node(
                    r.probe.label,
                    snap,
                    ids,
                    r.memory.tokens_on("device"),
                    r.memory.tokens_on("host"),
                )
            )
        move = self.move
        transits = () if move is None or move.transit is None else (move.transit,)
        in_transit = {t.request_id for t in transits}
        live = {rid for r in self.runs for rid in r.live} | in_transit
        delivered = tuple(
            Delivered(
                rid,
                tuple(self.runs[0].tokens[rid][len(self.runs[0].plans[rid].prompt) :]),
                rid not in live,
            )
            for rid in self.added
        )
        return ClusterSnapshot(tuple(nodes), transits, delivered)

    def check_cluster(self, step: int, phase: str, sampled: tuple[Sample, ...] = ()) -> None:
        """The migration rules (spec/cluster.py) between the last cluster snapshot and
        this one, one operation (``phase``) apart."""
        now = self.cluster_now()
        if self.last is not None:
            last = self.last
            try:
                vs = check_cluster(ClusterStep(last, now, sampled))
            except Exception as e:
                self.runs[0].probe.fail(
                    Invariant.PROGRESS,
                    step,
                    phase,
                    "adapter",
                    f"the migration rules could not read the adapters' records: {describe(e)}",
                )
                raise RunStopped from None
            self.res.findings.extend(Finding(v, step, phase) for v in vs)
        self.last = now


def _pure_read(before: EngineSnapshot, after: EngineSnapshot) -> list[Violation]:
    """ATOMIC: an export (and a failed move, for the source) leaves the source exactly
    as it was: the request keeps its state, its table and every block it holds."""
    return [
        Violation(
            v.invariant,
            v.subject,
            v.message.replace("by a failed operation", "by an export (a pure read)"),
            v.expected,
            v.seen,
        )
        for v in check_atomic(before, after)
    ]
