"""The migration rules, over a cluster of engines (docs/MIGRATION.md, "The rules").

A :class:`ClusterSnapshot` is every engine's :class:`~refserve.spec.snapshot.EngineSnapshot` by
name (a :class:`Node`, with the token ids of its live requests and, where the engine
exposes one, its fake K/V memory), the requests in transit between them
(:class:`Transit`) and, per request, the output tokens delivered to its client so far
(:class:`Delivered`). Five rules, one checker each:

* OWNER (:func:`check_owner`): every live request is owned by exactly one engine; in
  transit it stays listed by its source until the source releases it after the ack, and
  the destination only stages it.
* CONSERVE (:func:`check_conserve`): between two consecutive snapshots a request's token
  ids grow by exactly what the operation sampled for it, on the one engine that owns it,
  and its delivered outputs by the same tokens; it leaves the cluster only by finishing.
  No token sampled twice, none lost across a move, every output delivered once.
* MOVED (:func:`check_moved`): the source does not change a request while it is in
  transit, and it lands with the source's token ids, counters, KV length and positions
  (a transfer) or with no KV at all (a recompute).
* KVCOPY (:func:`check_kv_copy`): every K/V slot a table reads back, the destination's
  staged table included once acknowledged, holds the token its position claims: the
  source's bits (checked on a fake K/V memory, slot -> token id).
* LEAK (:func:`check_leak`): no block leaked or double-freed on any engine: ref counts
  equal the tables holding them, every table belongs to a request its engine owns or
  stages, the staged blocks are the transit's, and an aborted move leaves the
  destination's pool exactly as it was before the stage.

"Consecutive" means one operation apart (a step of one engine, an add, abort, pause or
resume, or one phase of the protocol), so every phase of a move is observed: a request
that changes engines between two snapshots without having been in transit breaks MOVED.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from enum import StrEnum

from refserve.spec.arith import slot_of
from refserve.spec.block import check_block
from refserve.spec.snapshot import EngineSnapshot, PoolSnapshot, RequestSnapshot, RequestStatus
from refserve.spec.violation import Invariant, Violation, violation

OWNER = Invariant.OWNER
CONSERVE = Invariant.CONSERVE
MOVED = Invariant.MOVED
KVCOPY = Invariant.KVCOPY
LEAK = Invariant.LEAK


class TransitPhase(StrEnum):
    """Where a move is, in protocol order (docs/MIGRATION.md, "The protocol")."""

    EXPORTED = "exported"
    """The source exported the request (a pure read); nothing is staged yet."""
    STAGED = "staged"
    """The destination reserved its own blocks; the K/V is being written."""
    ACKED = "acked"
    """Every needed slot is written and acknowledged; the source releases next."""
    RELEASED = "released"
    """The source let go of the request; the destination commits next."""

    @property
    def source_holds(self) -> bool:
        return self is not TransitPhase.RELEASED

    @property
    def staged(self) -> bool:
        return self is not TransitPhase.EXPORTED

    @property
    def copied(self) -> bool:
        return self in (TransitPhase.ACKED, TransitPhase.RELEASED)


_PHASE_ORDER = tuple(TransitPhase)


@dataclass(frozen=True)
class Transit:
    """One request on its way from ``source`` to ``destination`` (engine names).

    ``request``, ``token_ids`` and ``kv_length`` are the source's record of it at the
    export (``kv_length`` 0 when its KV was nowhere); ``with_kv`` says the K/V travels
    (a transfer) rather than being recomputed. ``staged_blocks`` are the destination's
    own blocks staged for it, its prefix hit of ``num_hit_tokens`` tokens first;
    ``pool_before`` is the destination's pool before the stage, what an abort restores.
    """

    request_id: str
    source: str
    destination: str
    phase: TransitPhase
    with_kv: bool
    request: RequestSnapshot
    token_ids: tuple[int, ...]
    kv_length: int
    num_hit_tokens: int = 0
    staged_blocks: tuple[int, ...] = ()
    pool_before: PoolSnapshot | None = None
    sent_slots: tuple[int, ...] | None = None
    """The slots the source sends, position by position (``MigrationExport.kv_slots``);
    None: not recorded (rule ``handoff``, spec/handoff.py, is then not checked)."""
    sent_on_host: bool = False
    """``sent_slots`` are in the source's host pool (a swapped request)."""
    received_slots: tuple[int, ...] | None = None
    """The destination slots that receive positions ``num_hit_tokens ..`` once staged
    (``MigrationStaged.kv_slots``); None: not staged or not recorded."""

    @property
    def moves_kv(self) -> bool:
        """The destination stages blocks for it: a transfer of some K/V, past the export."""
        return self.with_kv and self.kv_length > 0 and self.phase.staged


@dataclass(frozen=True)
class Node:
    """One engine of the cluster: its snapshot, the token ids of each live request (by
    request id) and, where the engine exposes them, its fake K/V memories (slot -> token
    id, device and host), which :func:`check_kv_copy` reads."""

    name: str
    engine: EngineSnapshot
    token_ids: tuple[tuple[str, tuple[int, ...]], ...] = ()
    memory: tuple[tuple[int, int], ...] | None = None
    host_memory: tuple[tuple[int, int], ...] | None = None

    def tokens(self, request_id: str) -> tuple[int, ...] | None:
        for rid, ids in self.token_ids:
            if rid == request_id:
                return ids
        return None

    def live(self, request_id: str) -> RequestSnapshot | None:
        """The request if this engine lists it and it is not finished."""
        r = self.engine.request(request_id)
        return None if r is None or r.status.is_done else r

    def live_ids(self) -> list[str]:
        return [r.request_id for r in self.engine.requests if not r.status.is_done]


@dataclass(frozen=True)
class Delivered:
    """What the client of one request has received: its output tokens so far, in order
    (every turn's), and whether its final output came."""

    request_id: str
    token_ids: tuple[int, ...] = ()
    done: bool = False


@dataclass(frozen=True)
class ClusterSnapshot:
    nodes: tuple[Node, ...]
    transits: tuple[Transit, ...] = ()
    delivered: tuple[Delivered, ...] = ()

    def node(self, name: str) -> Node | None:
        for n in self.nodes:
            if n.name == name:
                return n
        return None

    def transit(self, request_id: str) -> Transit | None:
        for t in self.transits:
            if t.request_id == request_id:
                return t
        return None

    def delivery(self, request_id: str) -> Delivered | None:
        for d in self.delivered:
            if d.request_id == request_id:
                return d
        return None

    def holders(self, request_id: str) -> list[str]:
        """The engines that list ``request_id`` as live."""
        return [n.name for n in self.nodes if n.live(request_id) is not None]

    def request_ids(self) -> set[str]:
        """Every request the snapshot mentions: live, in transit or delivered to."""
        ids = {rid for n in self.nodes for rid in n.live_ids()}
        return ids | {t.request_id for t in self.transits} | {d.request_id for d in self.delivered}

    def tokens_of(self, request_id: str) -> tuple[int, ...] | None:
        """The request's token ids where it is held: on the engine listing it (its
        source, in transit), or in the transit record once the source released it."""
        t = self.transit(request_id)
        if t is not None and not t.phase.source_holds:
            return t.token_ids
        for n in self.nodes:
            if n.live(request_id) is not None:
                return n.tokens(request_id)
        return None


@dataclass(frozen=True)
class Sample:
    """Tokens one operation added to one request on ``engine``."""

    engine: str
    request_id: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class ClusterStep:
    """Two consecutive cluster snapshots and what the operation between them added:
    ``sampled``, the tokens an engine's step sampled (which its client receives), and
    ``appended``, tokens added without sampling (a resumed turn's tool tokens)."""

    before: ClusterSnapshot
    after: ClusterSnapshot
    sampled: tuple[Sample, ...] = ()
    appended: tuple[Sample, ...] = ()


# ---------------------------------------------------------------------------- OWNER
def check_owner(snap: ClusterSnapshot) -> list[Violation]:
    """Every live request has exactly one owner (module doc)."""
    out = _check_transit_records(snap)
    for rid in sorted(snap.request_ids()):
        out.extend(_check_holders(snap, rid))
        out.extend(_check_client(snap, rid))
    return out


def _check_holders(snap: ClusterSnapshot, rid: str) -> list[Violation]:
    """Who lists the request: its source only in transit until the release, then none;
    otherwise one engine, unless its client saw it finish."""
    who = f"request {rid}"
    holders = snap.holders(rid)
    t = snap.transit(rid)
    d = snap.delivery(rid)
    if t is not None:
        want = [t.source] if t.phase.source_holds else []
        if holders == want:
            return []
        whom = "its source only" if want else "no engine until the destination commits"
        return [
            violation(
                OWNER, who, f"in transit ({t.phase}) it must be listed by {whom}", want, holders
            )
        ]
    if len(holders) > 1:
        return [violation(OWNER, who, "live on more than one engine", 1, holders)]
    if d is not None and not d.done and not holders:
        return [violation(OWNER, who, "not finished, yet no engine owns it (lost)", 1, 0)]
    return []


def _check_client(snap: ClusterSnapshot, rid: str) -> list[Violation]:
    """An owned request is known to its client, and not as finished."""
    who = f"request {rid}"
    holders = snap.holders(rid)
    t = snap.transit(rid)
    d = snap.delivery(rid)
    if not holders and t is None:
        return []
    if d is None:
        return [violation(OWNER, who, "live, yet its client was never told of it")]
    if d.done:
        owned = holders or f"in transit ({t.phase if t else ''})"
        return [violation(OWNER, who, "finished, yet still owned", "no owner", owned)]
    return []


def _check_transit_records(snap: ClusterSnapshot) -> list[Violation]:
    out: list[Violation] = []
    names = [n.name for n in snap.nodes]
    if len(set(names)) != len(names):
        out.append(violation(OWNER, "cluster", "two engines share a name", "distinct", names))
    seen: set[str] = set()
    for t in snap.transits:
        who = f"request {t.request_id}"
        if t.request_id in seen:
            out.append(violation(OWNER, who, "in transit twice at once", 1, 2))
        seen.add(t.request_id)
        for end in (t.source, t.destination):
            if end not in names:
                out.append(
                    violation(OWNER, who, "in transit to or from an unknown engine", names, end)
                )
        if t.source == t.destination:
            out.append(
                violation(
                    OWNER, who, "in transit from an engine to itself", "two engines", t.source
                )
            )
    return out


# ------------------------------------------------------------------------- CONSERVE
def check_conserve(step: ClusterStep) -> list[Violation]:
    """Tokens are conserved across the cluster from one snapshot to the next (module doc)."""
    before, after = step.before, step.after
    out: list[Violation] = []
    grown: dict[str, tuple[int, ...]] = {}
    by_rid: dict[str, list[Sample]] = {}
    for s in step.sampled:
        by_rid.setdefault(s.request_id, []).append(s)
    for rid, samples in sorted(by_rid.items()):
        out.extend(_check_sampler(before, rid, samples))
        grown[rid] = tuple(tok for s in samples for tok in s.token_ids)
    extra = {s.request_id: s.token_ids for s in step.appended}
    for rid in sorted(before.request_ids() | after.request_ids()):
        new = grown.get(rid, ())
        out.extend(_check_tokens(before, after, rid, extra.get(rid, ()) + new))
        out.extend(_check_delivered(before, after, rid, new))
    return out


def _check_sampler(before: ClusterSnapshot, rid: str, samples: list[Sample]) -> list[Violation]:
    """The tokens of one request come from one engine, the one that owns it."""
    who = f"request {rid}"
    engines = [s.engine for s in samples]
    if len(engines) > 1:
        return [violation(CONSERVE, who, "sampled on more than one engine at once", 1, engines)]
    owner = before.holders(rid)
    d = before.delivery(rid)
    if d is not None and d.done:
        return [violation(CONSERVE, who, "sampled after it finished", "no token", samples[0])]
    if before.transit(rid) is not None or owner != engines:
        return [
            violation(CONSERVE, who, "sampled on an engine that does not own it", owner, engines[0])
        ]
    return []


def _check_tokens(
    before: ClusterSnapshot, after: ClusterSnapshot, rid: str, grow: tuple[int, ...]
) -> list[Violation]:
    tb, ta = before.tokens_of(rid), after.tokens_of(rid)
    who = f"request {rid}"
    if tb is None:
        return []
    if ta is None:
        d = after.delivery(rid)
        if d is None or not d.done:
            return [
                violation(
                    CONSERVE, who, "its tokens are lost: held before, held by nobody after", tb, ()
                )
            ]
        return []
    if ta != tb + grow:
        return [
            violation(
                CONSERVE,
                who,
                "token ids changed by other than what the operation added",
                tb + grow,
                ta,
            )
        ]
    return []


def _check_delivered(
    before: ClusterSnapshot, after: ClusterSnapshot, rid: str, new: tuple[int, ...]
) -> list[Violation]:
    """Each sampled token reaches the client once, in order; a finished stream stays so."""
    db, da = before.delivery(rid), after.delivery(rid)
    who = f"request {rid}"
    if da is None:
        if db is None:
            return []
        return [violation(CONSERVE, who, "its delivered outputs vanished", db.token_ids, None)]
    was = () if db is None else db.token_ids
    out: list[Violation] = []
    if da.token_ids != was + new:
        out.append(
            violation(
                CONSERVE,
                who,
                "delivered outputs differ from those delivered before plus the tokens sampled",
                was + new,
                da.token_ids,
            )
        )
    if db is not None and db.done and not da.done:
        out.append(violation(CONSERVE, who, "its finished stream was reopened", True, False))
    return out


# ---------------------------------------------------------------------------- MOVED
def check_moved(step: ClusterStep) -> list[Violation]:
    """A move changes nothing but where the request runs (module doc)."""
    before, after = step.before, step.after
    out: list[Violation] = []
    for t in after.transits:
        out.extend(_check_in_transit(after, t))
        was = before.transit(t.request_id)
        if was is not None and _PHASE_ORDER.index(t.phase) < _PHASE_ORDER.index(was.phase):
            out.append(
                violation(
                    MOVED,
                    f"request {t.request_id}",
                    "its transit went back a phase",
                    was.phase,
                    t.phase,
                )
            )
    for t in before.transits:
        dst = after.node(t.destination)
        if after.transit(t.request_id) is not None or dst is None:
            continue
        r = dst.live(t.request_id)
        if r is not None:
            out.extend(_check_landed(t, dst, r))
    out.extend(_check_unannounced(before, after))
    return out


def _check_in_transit(snap: ClusterSnapshot, t: Transit) -> list[Violation]:
    """The source keeps the request as exported, and the destination's staged table
    holds the exported KV length and positions."""
    who = f"request {t.request_id}"
    out: list[Violation] = []
    src = snap.node(t.source)
    r = None if src is None else src.live(t.request_id)
    if src is not None and r is not None and t.phase.source_holds:
        if r != t.request or src.tokens(t.request_id) != t.token_ids:
            out.append(
                violation(
                    MOVED,
                    who,
                    f"changed on its source {t.source} while in transit",
                    (t.request, t.token_ids),
                    (r, src.tokens(t.request_id)),
                )
            )
        table = _any_table(src.engine, t.request_id)
        if t.kv_length and (table is None or table[1] != t.token_ids[: t.kv_length]):
            out.append(
                violation(
                    MOVED,
                    who,
                    f"its KV on the source {t.source} is not what was exported",
                    t.token_ids[: t.kv_length],
                    None if table is None else table[1],
                )
            )
    dst = snap.node(t.destination)
    staged = None if dst is None else dst.engine.pool.table(t.request_id)
    if t.moves_kv and staged is not None:
        got = (staged.num_stored, staged.token_ids)
        want = (t.kv_length, t.token_ids[: t.kv_length])
        if got != want:
            out.append(
                violation(
                    MOVED,
                    who,
                    f"the table staged on {t.destination} does not hold the source's KV length "
                    "and positions",
                    want,
                    got,
                )
            )
    return out


def _check_landed(t: Transit, dst: Node, r: RequestSnapshot) -> list[Violation]:
    """The request as the destination committed it, against the source's export."""
    who = f"request {t.request_id}"
    out: list[Violation] = []
    if t.phase is not TransitPhase.RELEASED:
        out.append(
            violation(MOVED, who, "committed before its source released it", "released", t.phase)
        )
    kv = t.kv_length if t.with_kv else 0
    src = t.request
    want = (src.num_prompt_tokens, src.num_output_tokens, src.max_tokens, kv)
    got = (r.num_prompt_tokens, r.num_output_tokens, r.max_tokens, r.num_computed_tokens)
    if got != want:
        out.append(
            violation(
                MOVED,
                who,
                f"landed on {dst.name} with other counters (prompt, outputs, max_tokens, "
                "KV length) than the source's"
                + ("" if t.with_kv else "; a recompute has KV length 0"),
                want,
                got,
            )
        )
    if dst.tokens(t.request_id) != t.token_ids:
        out.append(
            violation(
                MOVED,
                who,
                f"landed on {dst.name} with other token ids than the source's",
                t.token_ids,
                dst.tokens(t.request_id),
            )
        )
    out.extend(_check_landed_status(t, dst, r, kv))
    table = _any_table(dst.engine, t.request_id)
    held = None if table is None else table[1]
    if held != (t.token_ids[:kv] if kv else None):
        out.append(
            violation(
                MOVED,
                who,
                f"its table on {dst.name} does not hold the source's positions"
                + ("" if kv else " (a recompute holds no KV)"),
                t.token_ids[:kv] if kv else "no table",
                held if held is not None else "no table",
            )
        )
    return out


def _check_landed_status(t: Transit, dst: Node, r: RequestSnapshot, kv: int) -> list[Violation]:
    """A tool wait stays one; otherwise a request with KV runs and one without waits."""
    if t.request.status is RequestStatus.WAITING_TOOL or r.status is RequestStatus.WAITING_TOOL:
        ok = t.request.status is r.status
        want: object = RequestStatus.WAITING_TOOL
    elif kv:
        ok = r.status in (RequestStatus.PREFILLING, RequestStatus.DECODING)
        want = "prefilling or decoding"
    else:
        ok = r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        want = "waiting or preempted"
    if ok:
        return []
    return [
        violation(
            MOVED,
            f"request {t.request_id}",
            f"landed on {dst.name} in a state its KV does not allow",
            want,
            r.status,
        )
    ]


def _check_unannounced(before: ClusterSnapshot, after: ClusterSnapshot) -> list[Violation]:
    """A request that changes engines passes through transit first."""
    out: list[Violation] = []
    for n in before.nodes:
        for rid in n.live_ids():
            t = before.transit(rid)
            now = [h for h in after.holders(rid) if h != n.name]
            if not now or (t is not None and now == [t.destination]):
                continue
            out.append(
                violation(
                    MOVED,
                    f"request {rid}",
                    f"moved from {n.name} without being in transit to where it landed",
                    None if t is None else t.destination,
                    now,
                )
            )
    return out


def _any_table(engine: EngineSnapshot, rid: str) -> tuple[str, tuple[int, ...]] | None:
    """(pool, token ids) of the request's table, device first, then host."""
    t = engine.pool.table(rid)
    if t is not None:
        return "device", t.token_ids
    h = None if engine.host is None else engine.host.table(rid)
    return None if h is None else ("host", h.token_ids)


# --------------------------------------------------------------------------- KVCOPY
def check_kv_copy(snap: ClusterSnapshot) -> list[Violation]:
    """Every slot read back holds its token: each node's live tables (device and host),
    cache entries, and the destination's table of an acknowledged move (module doc).
    Nodes without a memory are skipped."""
    out: list[Violation] = []
    for node in snap.nodes:
        if node.memory is None:
            continue
        incoming = {t.request_id: t for t in snap.transits if t.destination == node.name}
        out.extend(_check_device_reads(node, incoming))
        if node.engine.host is not None and node.host_memory is not None:
            out.extend(_check_reads(node, node.engine.host, dict(node.host_memory), {}, "host"))
    return out


def _check_device_reads(node: Node, incoming: Mapping[str, Transit]) -> list[Violation]:
    pool = node.engine.pool
    mem = dict(node.memory or ())
    out = _check_reads(node, pool, mem, incoming, "device")
    bs = pool.block_size
    # A staged block is written by the copy: until the ack its cache entry may not read
    # back yet. The hit's blocks were the destination's own and must.
    unwritten = {
        b
        for t in incoming.values()
        if not t.phase.copied
        for b in t.staged_blocks[t.num_hit_tokens // bs :]
    }
    for e in pool.cache_entries:
        if e.block_id in unwritten:
            continue
        got = tuple(mem.get(e.block_id * bs + off) for off in range(bs))
        if got != e.token_ids:
            out.append(
                violation(
                    KVCOPY,
                    f"engine {node.name}: block {e.block_id}",
                    "its prefix-cache entry does not read back its tokens",
                    e.token_ids,
                    got,
                )
            )
    return out


def _check_reads(
    node: Node,
    pool: PoolSnapshot,
    mem: Mapping[int, int],
    incoming: Mapping[str, Transit],
    where: str,
) -> list[Violation]:
    """Each table of ``pool`` reads its tokens through its block table; the first wrong
    position of a table is reported."""
    out: list[Violation] = []
    bs = pool.block_size
    for table in pool.tables:
        rid = table.request_id
        t = incoming.get(rid)
        if t is not None and not t.phase.copied:
            continue  # partly written until the ack
        tokens = t.token_ids if t is not None else node.tokens(rid)
        if tokens is None:
            continue  # a table nobody owns: LEAK's finding
        for p in range(min(table.num_stored, len(tokens))):
            block = table.block_table[p // bs] if p // bs < len(table.block_table) else None
            slot = None if block is None else slot_of(block, p, bs)
            got = None if slot is None else mem.get(slot)
            if got != tokens[p]:
                out.append(
                    violation(
                        KVCOPY,
                        f"request {rid}",
                        f"on {node.name}, {where} slot {slot} (position {p}) does not hold "
                        + ("the source's token" if t is not None else "its token"),
                        tokens[p],
                        got,
                    )
                )
                break
    return out


# ----------------------------------------------------------------------------- LEAK
def check_leak(step: ClusterStep) -> list[Violation]:
    """No block leaked or double-freed on either side of a move (module doc)."""
    out = _check_leak_snapshot(step.after)
    for t in step.before.transits:
        dst = step.after.node(t.destination)
        if dst is None or step.after.transit(t.request_id) is not None:
            continue
        if dst.live(t.request_id) is None and t.pool_before is not None:
            out.extend(_check_restored(t, dst.engine.pool))
    return out


def _check_leak_snapshot(snap: ClusterSnapshot) -> list[Violation]:
    out: list[Violation] = []
    for node in snap.nodes:
        staged = {t.request_id: t for t in snap.transits if t.destination == node.name}
        pools = [("device", node.engine.pool)]
        if node.engine.host is not None:
            pools.append(("host", node.engine.host))
        for where, pool in pools:
            out.extend(
                replace(
                    v,
                    invariant=LEAK,
                    subject=f"engine {node.name}: {v.subject}",
                    message=f"{where} pool (BLOCK): {v.message}",
                )
                for v in check_block(pool)
            )
            out.extend(_check_owned_tables(node, pool, staged if where == "device" else {}, where))
        out.extend(_check_staged(node, staged.values()))
    return out


def _check_owned_tables(
    node: Node, pool: PoolSnapshot, staged: Mapping[str, Transit], where: str
) -> list[Violation]:
    """Every table belongs to a request the engine owns, or stages for a move."""
    out: list[Violation] = []
    for table in pool.tables:
        rid = table.request_id
        t = staged.get(rid)
        if node.live(rid) is not None or (t is not None and t.moves_kv):
            continue
        out.append(
            violation(
                LEAK,
                f"engine {node.name}: request {rid}",
                f"holds {where} blocks but is neither live here nor staged for a move here",
                "no table",
                table.block_table,
            )
        )
    return out


def _check_staged(node: Node, incoming: Iterable[Transit]) -> list[Violation]:
    """The destination holds exactly the blocks each transit to it staged."""
    out: list[Violation] = []
    for t in incoming:
        table = node.engine.pool.table(t.request_id)
        held = () if table is None else table.block_table
        want = t.staged_blocks if t.moves_kv else ()
        if held != want or (not t.moves_kv and t.staged_blocks):
            out.append(
                violation(
                    LEAK,
                    f"engine {node.name}: request {t.request_id}",
                    f"the blocks staged here ({t.phase}) are not the transit's",
                    want,
                    held,
                )
            )
    return out


def _check_restored(t: Transit, pool: PoolSnapshot) -> list[Violation]:
    """An aborted move: the destination's pool is the one before the stage."""
    before = t.pool_before
    assert before is not None
    if pool == before:
        return []
    changed = [
        b for b, (x, y) in enumerate(zip(before.ref_cnt, pool.ref_cnt, strict=False)) if x != y
    ]
    tables = sorted({x.request_id for x in pool.tables} ^ {x.request_id for x in before.tables})
    return [
        violation(
            LEAK,
            f"request {t.request_id}",
            f"an aborted move left the pool of {t.destination} changed "
            "(ref counts of blocks, tables, free queue or cache entries)",
            "the pool before the stage",
            f"blocks {changed}, tables {tables}, free queue "
            f"{'same' if pool.free_queue == before.free_queue else 'changed'}",
        )
    ]
