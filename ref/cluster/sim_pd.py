"""Prefill/decode roles in the cluster simulator (docs/CLUSTER.md, "The cluster
simulator"; docs/DISAGG.md).

:class:`SimRoles` is the simulator's book of a disaggregated run: where each arrival is
placed (``disagg.place``, the deflection decision with it), which of a prefill
replica's requests are due for a handoff after its step, which decode replica takes one
(``disagg.choose_decode`` over the replicas' load figures, the handoffs still on the
link counted against their destinations), and the records the ROLES rules of spec/pd.py
read (:meth:`SimRoles.snapshot`, :meth:`SimRoles.decode_step`). Moving a request is the
simulator's, with the one migration driver.

:func:`breakdowns` splits each request's TTFT into queueing (arrival to first
scheduled) and prefill execution (first scheduled to first token), and its time to the
second token into the TTFT, the transfer (first token to landing on the decode replica;
0 when it was not handed off) and the wait there (landing, or the first token, to the
second token). The first token streams from the prefill replica, so a handoff's
transfer is never in the TTFT: it is in the gap before the second token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from refserve.cluster.disagg import (
    Deflection,
    HandoffBook,
    HandoffDecision,
    Phase,
    Placement,
    Role,
    Roles,
    choose_decode,
    decode_step,
    place,
)
from refserve.cluster.records import LoadFigures
from refserve.cluster.router import Router
from refserve.core.config import SchedulerConfig
from refserve.core.cost import StepCost
from refserve.core.engine_core import StepRecord
from refserve.core.request import Request
from refserve.core.request_metrics import RequestMetrics
from refserve.errors import InvalidArgument
from refserve.spec.pd import (
    DecodeStep,
    Handoff,
    PDRequest,
    PDSnapshot,
    RoleName,
)


@dataclass(frozen=True)
class SimHandoff:
    """One handoff that landed: from prefill replica ``source`` to decode replica
    ``destination``; the first token's time, the departure and the landing, and how
    many of the destination's boundaries it waited on the link for room."""

    request_id: str
    source: int
    destination: int
    first_token_ms: float
    depart_ms: float
    land_ms: float
    waits: int
    kv_tokens: int
    num_bytes: int

    @property
    def transfer_ms(self) -> float:
        """The first token (streamed from the prefill replica) to the landing."""
        return self.land_ms - self.first_token_ms


@dataclass(frozen=True)
class PDRun:
    """A disaggregated run's records: the placements (when decisions are kept), the
    handoffs, the requests kept on their prefill replica (no decode replica had room)
    and those deflected to a decode replica, and the landings that waited for room."""

    roles: str
    deflection: bool
    placements: tuple[Placement, ...]
    handoffs: tuple[SimHandoff, ...]
    kept: tuple[str, ...]
    deflected: tuple[str, ...]
    landing_waits: int


class Path(StrEnum):
    """How a request went through a disaggregated cluster."""

    COLOCATED = "colocated"  # a replica that does both (or no roles)
    HANDED_OFF = "handed_off"
    KEPT = "kept"  # its handoff found no decode replica with room
    DEFLECTED = "deflected"
    FIRST_ONLY = "first_only"  # finished at its first token on its prefill replica


@dataclass(frozen=True)
class TTFTBreakdown:
    """One request's TTFT = ``queueing_ms + prefill_ms``, and its time to the second
    token = TTFT + ``transfer_ms`` + ``decode_wait_ms`` (module doc)."""

    request_id: str
    path: Path
    ttft_ms: float
    queueing_ms: float
    prefill_ms: float
    second_token_ms: float | None
    transfer_ms: float
    decode_wait_ms: float | None


def _path(m: RequestMetrics, pd: PDRun | None, kept: set[str], deflected: set[str]) -> Path:
    if pd is None:
        return Path.COLOCATED
    if m.request_id in kept:
        return Path.KEPT
    if m.request_id in deflected:
        return Path.DEFLECTED
    return Path.FIRST_ONLY if m.num_output_tokens == 1 else Path.COLOCATED


def breakdowns(
    requests: Iterable[RequestMetrics], pd: PDRun | None = None
) -> tuple[TTFTBreakdown, ...]:
    """Every request with a first token, broken down (module doc)."""
    landed = {h.request_id: h for h in pd.handoffs} if pd is not None else {}
    kept = set(pd.kept) if pd is not None else set()
    deflected = set(pd.deflected) if pd is not None else set()
    out: list[TTFTBreakdown] = []
    for m in requests:
        times = m.token_times_ms
        if not times or m.admitted_ms is None:
            continue
        h = landed.get(m.request_id)
        path = Path.HANDED_OFF if h is not None else _path(m, pd, kept, deflected)
        after = h.land_ms if h is not None else times[0]
        second = times[1] if len(times) > 1 else None
        out.append(
            TTFTBreakdown(
                m.request_id,
                path,
                times[0] - m.arrival_ms,
                m.admitted_ms - m.arrival_ms,
                times[0] - m.admitted_ms,
                None if second is None else second - m.arrival_ms,
                after - times[0],
                None if second is None else second - after,
            )
        )
    return tuple(out)


@dataclass
class _Flight:
    """A handoff on the link."""

    source: int
    destination: int
    first_token_ms: float
    depart_ms: float
    kv_tokens: int
    need_blocks: int
    waits: int = 0


class SimRoles:
    """The simulator's prefill/decode book (module doc)."""

    def __init__(self, roles: Roles, deflection: Deflection | None, num_replicas: int) -> None:
        if not isinstance(roles, Roles):
            raise InvalidArgument(f"roles must be a Roles (Roles.parse('2P2D', n)), got {roles!r}")
        if len(roles) != num_replicas:
            raise InvalidArgument(
                f"roles {roles.text} name {len(roles)} replicas but the simulator has "
                f"{num_replicas}"
            )
        if deflection is not None and not isinstance(deflection, Deflection):
            raise InvalidArgument(f"deflection must be a Deflection, got {deflection!r}")
        if deflection is not None and Role.DECODE not in roles.roles:
            raise InvalidArgument(f"deflection needs a decode replica; roles are {roles.text}")
        self.roles = roles
        self.deflection = deflection
        self.book = HandoffBook(roles)
        self.placements: list[Placement] = []
        self.handoffs: list[SimHandoff] = []
        self.kept: list[str] = []
        self.deflected: list[str] = []
        self.landing_waits = 0
        self._flight: dict[str, _Flight] = {}
        self._records: dict[str, list[Handoff]] = {}
        self._tokens_at_handoff: dict[str, int] = {}
        self._preempted: dict[int, set[str]] = {}

    # ------------------------------------------------------------------ configs
    def config_for(self, replica: int, config: SchedulerConfig, cost: StepCost) -> SchedulerConfig:
        """A decode replica's scheduler keeps deflected chunks within the TBT SLO (its
        SLO-aware chunk rule, ref/core/prefill.py) when deflection is on."""
        if self.deflection is None or self.roles.of(replica) is not Role.DECODE:
            return config
        return dataclasses.replace(config, tbt_slo_ms=self.deflection.tbt_slo_ms, step_cost=cost)

    def tbt_slo_ms(self, replica: int) -> float | None:
        """The TBT bound of a decode replica's steps (None: no bound, without deflection)."""
        del replica
        return None if self.deflection is None else self.deflection.tbt_slo_ms

    # ------------------------------------------------------------------ placement
    def place(
        self,
        router: Router,
        r: Request,
        loads: Mapping[int, LoadFigures],
        hits: Mapping[int, int],
    ) -> Placement:
        return place(
            router, r.request_id, r.num_prompt_tokens, loads, hits, self.roles, self.deflection
        )

    def placed(self, p: Placement, *, keep: bool) -> None:
        """The replica took the request."""
        self.book.placed(p.request_id, p)
        if p.deflected:
            self.deflected.append(p.request_id)
        if keep:
            self.placements.append(p)

    # ------------------------------------------------------------------ handoff
    def due(self, requests: Iterable[Request]) -> list[Request]:
        """A replica's requests to hand off now: on a prefill replica with their first
        token, still live."""
        return [r for r in requests if self.book.due(r.request_id, r.num_output_tokens)]

    def choose(self, r: Request, source: int, loads: Mapping[int, LoadFigures]) -> HandoffDecision:
        """``choose_decode`` over ``loads``, each destination's handoffs still on the link
        counted as its running requests and blocks (they hold both once they land)."""
        seen = dict(loads)
        for f in self._flight.values():
            if f.destination in seen:
                lf = seen[f.destination]
                seen[f.destination] = dataclasses.replace(
                    lf,
                    num_running=lf.num_running + 1,
                    kv_blocks_used=lf.kv_blocks_used + f.need_blocks,
                )
        return choose_decode(r.request_id, source, r.num_computed_tokens, seen, self.roles)

    def keep(self, request_id: str) -> None:
        """No decode replica has room: it decodes where it is."""
        self.book.kept(request_id)
        self.kept.append(request_id)

    def departed(self, r: Request, d: HandoffDecision, at_ms: float) -> None:
        """``r`` left its prefill replica for the decode replica ``d`` chose, with its
        K/V (called before the move, which reads ``r`` as it is now)."""
        assert d.replica is not None, "a handoff needs a destination"
        source, destination = d.source, d.replica
        self.book.handed_off(r.request_id)
        first = r.token_times_ms[0] if r.token_times_ms else at_ms
        self._flight[r.request_id] = _Flight(
            source, destination, first, at_ms, r.num_computed_tokens, d.need_blocks
        )
        self._records.setdefault(r.request_id, []).append(
            Handoff(
                RoleName(self.roles.of(source).value),
                RoleName(self.roles.of(destination).value),
                r.num_output_tokens,
            )
        )
        self._tokens_at_handoff[r.request_id] = r.num_output_tokens

    def waited(self, request_id: str) -> None:
        """The destination had no room: the handoff waits on the link."""
        self._flight[request_id].waits += 1
        self.landing_waits += 1

    def landed(self, request_id: str, at_ms: float, num_bytes: int) -> None:
        f = self._flight.pop(request_id)
        self.handoffs.append(
            SimHandoff(
                request_id,
                f.source,
                f.destination,
                f.first_token_ms,
                f.depart_ms,
                at_ms,
                f.waits,
                f.kv_tokens,
                num_bytes,
            )
        )

    def finished(self, request_id: str) -> None:
        self.book.forget(request_id)
        self._records.pop(request_id, None)
        self._tokens_at_handoff.pop(request_id, None)
        for s in self._preempted.values():
            s.discard(request_id)

    # ------------------------------------------------------------------ the rules' records
    def snapshot(self, replicas: Sequence[Mapping[str, Request]]) -> PDSnapshot:
        """Every live request on a replica as spec/pd.py's rules see it."""
        reqs: list[PDRequest] = []
        for i, live in enumerate(replicas):
            role = RoleName(self.roles.of(i).value)
            for rid, r in live.items():
                phase = self.book.phase.get(rid)
                before = self._tokens_at_handoff.get(rid, 0)
                reqs.append(
                    PDRequest(
                        rid,
                        f"r{i}",
                        role,
                        r.num_output_tokens - before,
                        deflected=phase is Phase.DEFLECTED,
                        kept=phase is Phase.KEPT,
                        handoffs=tuple(self._records.get(rid, ())),
                    )
                )
        return PDSnapshot(tuple(reqs))

    def decode_step(self, replica: int, record: StepRecord, cost: StepCost) -> DecodeStep:
        """A decode replica's step as rule ``deflect`` reads it (``disagg.decode_step``):
        a prefill chunk is deflected, or a recompute of a request it preempted itself."""
        preempted = self._preempted.setdefault(replica, set())
        step = decode_step(
            f"r{replica}",
            record.plan,
            cost,
            self.tbt_slo_ms(replica),
            self.book.is_deflected,
            preempted,
        )
        preempted.update(record.outcome.preempted)
        return step

    def result(self) -> PDRun:
        return PDRun(
            self.roles.text,
            self.deflection is not None,
            tuple(self.placements),
            tuple(self.handoffs),
            tuple(self.kept),
            tuple(self.deflected),
            self.landing_waits,
        )
