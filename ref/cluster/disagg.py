"""Prefill/decode disaggregation: replica roles, where a request prefills, when its
prefill is deflected to a decode replica, and which decode replica takes it after its
first token (docs/DISAGG.md).

Every figure here is a pure function of what replicas report (their
:class:`~refserve.cluster.records.LoadFigures`) and the global index's prefix hits, like
the router's, so the in-process cluster, the served cluster (both transports) and the
cluster simulator place and hand off requests with this code alone:

- :class:`Roles`: each replica prefills (``P``), decodes (``D``) or does both
  (``C``, colocated: the default, and what every replica was before roles);
- :func:`place`: the prefill replica, chosen by the cluster's :class:`Router` among the
  replicas that prefill (its prefix hits and prefill backlog), and, with a
  :class:`Deflection`, the decision to prefill on a decode replica instead, when the
  prefill side's predicted TTFT misses the request's TTFT SLO and a decode replica's,
  in chunks its decodes' TBT slack allows, is lower (:func:`deflect_chunk_tokens`);
- :func:`choose_decode`: after the first token, the decode replica with the most KV
  headroom for the least decode load that has a seat and the blocks;
- :class:`HandoffBook`: what each request is (deflected, handed off, kept where its
  handoff failed), the record the rules of spec/pd.py read;
- :func:`decode_step`: one step of a decode replica as rule ``deflect`` reads it.

Acting on a decision (queueing on the replica, moving a request with the migration
driver) is the caller's.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Container, Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum

from refserve.cluster.errors import UnknownReplica
from refserve.cluster.records import LoadFigures
from refserve.cluster.router import Router, RoutingDecision, load_score, predicted_ttft_ms
from refserve.core.cost import StepCost
from refserve.core.plan import StepPlan
from refserve.errors import InvalidArgument
from refserve.spec.arith import blocks_needed
from refserve.spec.pd import DecodeStep, PrefillChunk, StepCostModel
from refserve.values import is_int, is_number


class Role(StrEnum):
    """What a replica does: prefill only, decode only, or both (colocated)."""

    PREFILL = "P"
    DECODE = "D"
    COLOCATED = "C"

    @property
    def prefills(self) -> bool:
        """It takes new requests' prefills (a decode replica only deflected ones)."""
        return self is not Role.DECODE

    @property
    def decodes(self) -> bool:
        """It decodes past a request's first token."""
        return self is not Role.PREFILL


_PART = re.compile(r"(\d+)([A-Za-z]+)")


@dataclass(frozen=True)
class Roles:
    """One role per replica slot, in slot order (``Roles.parse("2P2D", 4)``: slots 0 and
    1 prefill, 2 and 3 decode). A cluster with a prefill replica needs one that decodes,
    and one with a decode replica needs one that prefills."""

    roles: tuple[Role, ...]

    def __post_init__(self) -> None:
        if not self.roles:
            raise InvalidArgument("roles: a cluster has at least one replica")
        for i, r in enumerate(self.roles):
            if not isinstance(r, Role):
                raise InvalidArgument(f"roles: slot {i} is {r!r}, not a Role")
        if any(r is Role.PREFILL for r in self.roles) and not any(r.decodes for r in self.roles):
            raise InvalidArgument(
                f"roles {self.text}: prefill replicas but none that decodes (add D or C)"
            )
        if any(r is Role.DECODE for r in self.roles) and not any(r.prefills for r in self.roles):
            raise InvalidArgument(
                f"roles {self.text}: decode replicas but none that prefills (add P or C)"
            )

    @classmethod
    def colocated(cls, num_replicas: int) -> Roles:
        """Every replica prefills and decodes (the cluster without roles)."""
        if not is_int(num_replicas) or num_replicas < 1:
            raise InvalidArgument(f"roles: num_replicas must be an int >= 1, got {num_replicas!r}")
        return cls((Role.COLOCATED,) * num_replicas)

    @classmethod
    def parse(cls, text: str, num_replicas: int | None = None) -> Roles:
        """``"2P2D"``, ``"1P2D1C"``, ``"4C"``: counts and roles, in slot order. With
        ``num_replicas`` the counts must add up to it. Each bad part is named."""
        if not isinstance(text, str) or not text.strip():
            raise InvalidArgument(f"roles: expected something like '2P2D', got {text!r}")
        compact = text.replace(" ", "")
        roles: list[Role] = []
        pos = 0
        for m in _PART.finditer(compact):
            if m.start() != pos:
                break
            count, letter = int(m.group(1)), m.group(2).upper()
            if letter not in {r.value for r in Role}:
                raise InvalidArgument(
                    f"roles {text!r}: {m.group(0)!r} names no role (P prefill, D decode, "
                    "C colocated)"
                )
            if count < 1:
                raise InvalidArgument(f"roles {text!r}: {m.group(0)!r} counts no replica")
            roles.extend([Role(letter)] * count)
            pos = m.end()
        if pos != len(compact):
            raise InvalidArgument(
                f"roles {text!r}: cannot read {compact[pos:]!r}; expected counts and roles "
                "like '2P2D'"
            )
        if num_replicas is not None and len(roles) != num_replicas:
            raise InvalidArgument(
                f"roles {text!r} name {len(roles)} replicas but the cluster has {num_replicas}"
            )
        return cls(tuple(roles))

    @property
    def text(self) -> str:
        """The roles as ``parse`` reads them, runs of one role merged (``"2P2D"``)."""
        out: list[str] = []
        run: list[Role] = []
        for r in (*self.roles, None):
            if run and r is not run[-1]:
                out.append(f"{len(run)}{run[-1].value}")
                run = []
            if r is not None:
                run.append(r)
        return "".join(out)

    @property
    def disaggregated(self) -> bool:
        """Some replica prefills or decodes only."""
        return any(r is not Role.COLOCATED for r in self.roles)

    def __len__(self) -> int:
        return len(self.roles)

    def of(self, replica: int) -> Role:
        if not is_int(replica) or not 0 <= replica < len(self.roles):
            raise UnknownReplica(replica, f"roles {self.text}")
        return self.roles[replica]

    def prefill_replicas(self, live: Iterable[int]) -> list[int]:
        """The live replicas a new request may prefill on (P and C)."""
        return [r for r in live if self.of(r).prefills]

    def decode_replicas(self, live: Iterable[int]) -> list[int]:
        """The live replicas a handoff may go to (D; C where the cluster has no D)."""
        live = list(live)
        ds = [r for r in live if self.of(r) is Role.DECODE]
        return ds or [r for r in live if self.of(r) is Role.COLOCATED]


@dataclass(frozen=True)
class TTFTBound:
    """A request's TTFT SLO: ``base_ms + per_token_ms * prompt tokens``."""

    base_ms: float
    per_token_ms: float = 0.0

    def __post_init__(self) -> None:
        for name in ("base_ms", "per_token_ms"):
            v = getattr(self, name)
            if not is_number(v) or not 0 <= v < math.inf:
                raise InvalidArgument(f"TTFTBound.{name} must be a finite number >= 0, got {v!r}")

    def of(self, num_prompt_tokens: int) -> float:
        return self.base_ms + self.per_token_ms * num_prompt_tokens


@dataclass(frozen=True)
class Deflection:
    """When a prefill goes to a decode replica: the prefill side's predicted TTFT
    (queueing included) exceeds ``ttft`` and a decode replica's predicted TTFT, in
    chunks that keep its decodes' steps within ``tbt_slo_ms``, is lower."""

    ttft: TTFTBound
    tbt_slo_ms: float

    def __post_init__(self) -> None:
        if not isinstance(self.ttft, TTFTBound):
            raise InvalidArgument(f"Deflection.ttft must be a TTFTBound, got {self.ttft!r}")
        v = self.tbt_slo_ms
        if not is_number(v) or not 0 < v < math.inf:
            raise InvalidArgument(f"Deflection.tbt_slo_ms must be a finite number > 0, got {v!r}")


def deflect_chunk_tokens(f: LoadFigures, tbt_slo_ms: float) -> int:
    """Prefill tokens one step of a decode replica may take beside its ``D`` decodes so
    that the step stays within ``tbt_slo_ms`` by its cost model: the largest ``k`` with
    ``b*k <= tbt_slo_ms - (a + c*D)`` (the SLO-aware chunk rule of ref/core/prefill.py
    with a full TBT of slack), at most the token budget the decodes leave; 0 when the
    decodes alone fill the bound."""
    cost, d = f.cost, f.num_decoding
    room = f.token_budget - d
    if room <= 0 or cost.step_ms(0, d) > tbt_slo_ms:
        return 0
    if cost.b == 0:  # a replica's reported model may charge prefill nothing
        return room
    return max(0, min(room, cost.prefill_room(tbt_slo_ms, d)))


@dataclass(frozen=True)
class DecodeFigures:
    """What placement and handoff compared for one decode replica."""

    replica: int
    load: float
    free_blocks: int
    num_decoding: int
    chunk_tokens: int  # deflect_chunk_tokens at placement (0: not considered)
    deflected_ttft_ms: float  # math.inf where no chunk fits


@dataclass(frozen=True)
class Placement:
    """Where a new request prefills, and every figure that decided it.

    ``routing`` is the router's decision among the replicas that prefill;
    ``ttft_slo_ms`` the request's TTFT SLO (None without deflection);
    ``deflected``: it prefills on ``replica``, a decode replica, instead, because the
    prefill side's predicted TTFT (``routing``'s chosen replica's) exceeded the SLO and
    that replica's ``deflected_ttft_ms`` was lower; ``decode`` every decode replica's
    figures when deflection was considered."""

    request_id: str
    replica: int
    routing: RoutingDecision
    deflected: bool
    prefill_ttft_ms: float
    prefix_hit_tokens: int
    ttft_slo_ms: float | None = None
    decode: tuple[DecodeFigures, ...] = ()


def _decode_figures(r: int, f: LoadFigures, chunk: int, ttft: float) -> DecodeFigures:
    free = f.kv_blocks_total - f.kv_blocks_used
    return DecodeFigures(r, load_score(f), free, f.num_decoding, chunk, ttft)


def place(
    router: Router,
    request_id: str,
    num_prompt_tokens: int,
    loads: Mapping[int, LoadFigures],
    hits: Mapping[int, int],
    roles: Roles,
    deflection: Deflection | None = None,
) -> Placement:
    """Where a new request prefills (module doc). ``loads`` are the live replicas';
    ``hits`` their cached prefix of the prompt. Pure: the router's cursor moves only at
    its ``accepted``."""
    prefill = roles.prefill_replicas(sorted(loads))
    if not prefill:
        raise InvalidArgument(f"place {request_id!r}: no live replica prefills ({roles.text})")
    ploads = {r: loads[r] for r in prefill}
    phits = {r: h for r, h in hits.items() if r in ploads}
    routing = router.route(request_id, num_prompt_tokens, ploads, phits)
    chosen = next(f for f in routing.figures if f.replica == routing.replica)
    base = Placement(
        request_id,
        routing.replica,
        routing,
        False,
        chosen.predicted_ttft_ms,
        routing.prefix_hit_tokens,
    )
    if deflection is None or not roles.disaggregated:
        return base
    slo = deflection.ttft.of(num_prompt_tokens)
    rows: list[DecodeFigures] = []
    for r in sorted(loads):
        if roles.of(r) is not Role.DECODE:
            continue
        f = loads[r]
        k = deflect_chunk_tokens(f, deflection.tbt_slo_ms)
        # Chunks of ``k`` tokens beside the decodes: the router's formula with the token
        # budget the decodes' TBT slack leaves (its hits are not the router's to use).
        chunked = replace(f, token_budget=k + f.num_decoding)
        ttft = math.inf if k < 1 else predicted_ttft_ms(chunked, num_prompt_tokens, hits.get(r, 0))
        rows.append(_decode_figures(r, f, k, ttft))
    base = replace(base, ttft_slo_ms=slo, decode=tuple(rows))
    if chosen.predicted_ttft_ms <= slo or not rows:
        return base
    best = min(rows, key=lambda d: (d.deflected_ttft_ms, d.load, d.replica))
    if not best.deflected_ttft_ms < chosen.predicted_ttft_ms:
        return base
    hit = hits.get(best.replica, 0)
    return replace(base, replica=best.replica, deflected=True, prefix_hit_tokens=hit)


@dataclass(frozen=True)
class HandoffDecision:
    """Which decode replica takes a request after its first token: ``replica`` (None:
    none live has a seat and the blocks), and every candidate's figures."""

    request_id: str
    source: int
    replica: int | None
    need_blocks: int
    figures: tuple[DecodeFigures, ...]


def choose_decode(
    request_id: str,
    source: int,
    kv_tokens: int,
    loads: Mapping[int, LoadFigures],
    roles: Roles,
) -> HandoffDecision:
    """The decode replica for a handoff: among the live decode replicas with a seat and
    the blocks for ``kv_tokens`` tokens plus the next one, the greatest KV headroom
    (free share of its blocks) less its decode load (decoding share of its seats);
    ties to the lowest id."""
    rows: list[DecodeFigures] = []
    fits: list[tuple[float, int]] = []
    need = 0
    for r in roles.decode_replicas(sorted(loads)):
        if r == source:
            continue
        f = loads[r]
        need = blocks_needed(kv_tokens + 1, f.block_size)
        row = _decode_figures(r, f, 0, math.inf)
        rows.append(row)
        seat = f.num_waiting + f.num_running < f.max_num_seqs
        if seat and row.free_blocks >= need:
            score = row.free_blocks / f.kv_blocks_total - f.num_decoding / f.max_num_seqs
            fits.append((-score, r))
    chosen = min(fits)[1] if fits else None
    return HandoffDecision(request_id, source, chosen, need, tuple(rows))


class Phase(StrEnum):
    """Where a request is in its disaggregated life (this turn)."""

    PREFILL = "prefill"  # on the replica it was placed on, no token yet
    DEFLECTED = "deflected"  # prefilling and decoding on a decode replica
    HANDED_OFF = "handed_off"  # on its decode replica after the first token
    KEPT = "kept"  # its handoff failed: it decodes where it is
    COLOCATED = "colocated"  # placed on a replica that does both


@dataclass
class HandoffBook:
    """Each live request's phase and handoffs in a disaggregated cluster (module doc).

    ``due`` says which of a prefill replica's requests must leave it now: it sampled its
    first token and is still live. A request is handed off at most once a turn
    (:meth:`handed_off` refuses a second) and a failed handoff keeps it where it is."""

    roles: Roles
    phase: dict[str, Phase] = field(default_factory=dict)
    handoffs: dict[str, int] = field(default_factory=dict)

    def placed(self, request_id: str, placement: Placement) -> None:
        role = self.roles.of(placement.replica)
        if placement.deflected:
            p = Phase.DEFLECTED
        else:
            p = Phase.PREFILL if role is Role.PREFILL else Phase.COLOCATED
        self.phase[request_id] = p
        self.handoffs[request_id] = 0

    def due(self, request_id: str, num_output_tokens: int) -> bool:
        """A request to hand off now: prefilling on a prefill replica, and it has its
        first token."""
        return self.phase.get(request_id) is Phase.PREFILL and num_output_tokens >= 1

    def check_handoff(self, request_id: str) -> None:
        """Raise what :meth:`handed_off` would, changing nothing: a caller checks before
        it moves the request, so a second handoff never moves it."""
        n = self.handoffs.get(request_id, 0)
        if self.phase.get(request_id) is not Phase.PREFILL or n:
            raise InvalidArgument(
                f"handoff of {request_id!r}: it is {self.phase.get(request_id)}, handed off "
                f"{n} time(s) this turn; a request is handed off once a turn, from prefill"
            )

    def handed_off(self, request_id: str) -> None:
        self.check_handoff(request_id)
        n = self.handoffs.get(request_id, 0)
        self.phase[request_id] = Phase.HANDED_OFF
        self.handoffs[request_id] = n + 1

    def kept(self, request_id: str) -> None:
        """Its handoff failed (refused, aborted, no decode replica): it decodes here."""
        if self.phase.get(request_id) is Phase.PREFILL:
            self.phase[request_id] = Phase.KEPT

    def forget(self, request_id: str) -> None:
        self.phase.pop(request_id, None)
        self.handoffs.pop(request_id, None)

    def is_deflected(self, request_id: str) -> bool:
        return self.phase.get(request_id) is Phase.DEFLECTED

    def is_kept(self, request_id: str) -> bool:
        return self.phase.get(request_id) is Phase.KEPT


def decode_step(
    replica: str,
    plan: StepPlan,
    cost: StepCost,
    tbt_slo_ms: float | None,
    deflected: Callable[[str], bool],
    preempted: Container[str],
) -> DecodeStep:
    """One step of a decode replica as rule ``deflect`` (spec/pd.py) reads it: its
    decodes and the K/V they read (each its computed tokens and the new one, the ``K`` of
    the SLO-aware chunk rule), and every prefill chunk, ``deflected`` to it or a
    recompute of a request in ``preempted`` (one it preempted itself)."""
    chunks = tuple(
        PrefillChunk(
            c.request_id, c.num_new_tokens, deflected(c.request_id), c.request_id in preempted
        )
        for c in plan.chunks
        if c.is_prefill
    )
    kv_read = sum(c.start + 1 for c in plan.chunks if not c.is_prefill)
    model = StepCostModel(cost.a, cost.b, cost.c, cost.e)
    return DecodeStep(replica, plan.num_decode_requests, kv_read, chunks, model, tbt_slo_ms)
