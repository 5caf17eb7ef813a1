"""Prefill/decode disaggregation in the served cluster (docs/DISAGG.md, "Serving").

:class:`Handoffs` is what :class:`~refserve.serve.cluster_loop.ClusterLoop` keeps of it:
the replicas' :class:`~refserve.cluster.disagg.Roles`, the optional
:class:`~refserve.cluster.disagg.Deflection`, the
:class:`~refserve.cluster.disagg.HandoffBook` of the requests in flight, and the
counters. Every decision is ref/cluster/disagg.py's, over the load figures the replicas'
threads published (never a call into a replica):

- ``place``: where a new request prefills (the cluster's router among the replicas that
  prefill, the global index's hits; a decode replica when deflected);
- ``due``: after a prefill replica's step, which of its requests have their first token
  and are still live: each leaves it before its next step;
- ``choose``: the decode replica that takes one.

The move is the served cluster's migration (ref/serve/cluster_migration.py,
``hand_over``), run by the prefill replica's own thread between two of its steps
(``ReplicaLoop`` in ref/serve/cluster_loop.py); a handoff that cannot happen keeps the
request where it is (``kept``), and it decodes there.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Container, Mapping, Sequence
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
    place,
)
from refserve.cluster.errors import NoLiveReplica
from refserve.cluster.records import LoadFigures
from refserve.cluster.router import Router
from refserve.engine.outputs import RequestOutput
from refserve.errors import InvalidArgument
from refserve.serve.metrics import ClusterServeMetrics
from refserve.values import is_number

#: How long a prefill replica waits for a decode replica to import a handoff before it
#: keeps the request (its own steps wait meanwhile).
HANDOFF_TIMEOUT_S = 10.0


class KeptReason(StrEnum):
    """Why a request due for a handoff stayed on its prefill replica."""

    NO_DECODE = "no_decode"  # no live decode replica has a seat and the blocks
    FAILED = "failed"  # refused, aborted, the decode replica dead or not importing in time


@dataclass(frozen=True)
class Due:
    """A request to hand off now: its id and the tokens its K/V holds."""

    request_id: str
    kv_tokens: int


class Handoffs:
    """The served cluster's roles, deflection and handoff book (module doc). Thread-safe:
    the front places under its own lock, each prefill replica's thread asks what is due
    and records what became of it."""

    def __init__(
        self,
        roles: Roles | None,
        deflection: Deflection | None,
        num_replicas: int,
        *,
        metrics: ClusterServeMetrics | None = None,
        timeout_s: float = HANDOFF_TIMEOUT_S,
    ) -> None:
        roles = Roles.colocated(num_replicas) if roles is None else roles
        if not isinstance(roles, Roles):
            raise InvalidArgument(f"ClusterLoop: roles must be Roles, got {roles!r}")
        if len(roles) != num_replicas:
            raise InvalidArgument(
                f"ClusterLoop: roles {roles.text} name {len(roles)} replicas, the cluster "
                f"has {num_replicas}"
            )
        if deflection is not None:
            if not isinstance(deflection, Deflection):
                raise InvalidArgument(
                    f"ClusterLoop: deflection must be a Deflection, got {deflection!r}"
                )
            if Role.DECODE not in roles.roles:
                raise InvalidArgument(
                    "ClusterLoop: deflection needs a decode replica to deflect to "
                    f"(roles {roles.text})"
                )
        if not is_number(timeout_s) or not 0 < timeout_s < math.inf:
            raise InvalidArgument(
                f"ClusterLoop: handoff_timeout_s must be finite and > 0, got {timeout_s!r}"
            )
        self.roles = roles
        self.deflection = deflection
        self.metrics = metrics
        self.timeout_s = float(timeout_s)
        self._lock = threading.Lock()
        self._book = HandoffBook(roles)
        self._prompt_tokens: dict[str, int] = {}

    def hands_off(self, replica: int) -> bool:
        """``replica`` prefills only: its requests leave it after their first token."""
        return self.roles.of(replica) is Role.PREFILL

    def place(
        self,
        router: Router,
        request_id: str,
        token_ids: Sequence[int],
        loads: Mapping[int, LoadFigures],
        hits: Mapping[int, int],
    ) -> Placement:
        """Where ``request_id`` prefills among the live replicas ``loads`` (pure, like
        the router); :class:`NoLiveReplica` when none of them prefills."""
        if not self.roles.prefill_replicas(loads):
            raise NoLiveReplica(f"no live replica prefills (roles {self.roles.text})")
        return place(router, request_id, len(token_ids), loads, hits, self.roles, self.deflection)

    def placed(self, placement: Placement, num_prompt_tokens: int) -> None:
        """The request goes where ``placement`` says (before it is added there: its
        first step may hand it off)."""
        with self._lock:
            self._book.placed(placement.request_id, placement)
            self._prompt_tokens[placement.request_id] = num_prompt_tokens

    def forget(self, request_id: str) -> None:
        """It ended, or its add was refused."""
        with self._lock:
            self._book.forget(request_id)
            self._prompt_tokens.pop(request_id, None)

    def phase(self, request_id: str) -> Phase | None:
        with self._lock:
            return self._book.phase.get(request_id)

    def num_booked(self) -> int:
        """Requests in the book (those placed and not ended)."""
        with self._lock:
            return len(self._book.phase)

    def due(self, outputs: Sequence[RequestOutput], live: Container[str]) -> list[Due]:
        """The requests of a prefill replica's step that must leave it now: a first
        token sampled, still live there (``live``: its requests' output queues)."""
        tokens: dict[str, int] = {}
        for o in outputs:
            if o.request_id in live and not o.finished:
                tokens[o.request_id] = max(tokens.get(o.request_id, 0), len(o.token_ids))
        out = []
        with self._lock:
            for rid, n in tokens.items():
                if self._book.due(rid, n):
                    # The last sampled token is not in the K/V yet: choose_decode counts
                    # the blocks for it.
                    out.append(Due(rid, self._prompt_tokens.get(rid, 0) + n - 1))
        return out

    def choose(self, due: Due, source: int, loads: Mapping[int, LoadFigures]) -> HandoffDecision:
        return choose_decode(due.request_id, source, due.kv_tokens, loads, self.roles)

    def taken(self, request_id: str) -> None:
        """The decode replica imported it: on its thread, in the import's command, so
        before its next step (after which the request may end and be forgotten)."""
        with self._lock:
            # Never raises here: the import already ran, and an error in its command
            # would fail a move that the destination has completed.
            if self._book.phase.get(request_id) is Phase.PREFILL:
                self._book.handed_off(request_id)

    def handed_off(self, replica: int, kv_bytes: int) -> None:
        """A handoff to ``replica`` completed (counted)."""
        if self.metrics is not None:
            self.metrics.handed_off(replica, kv_bytes)

    def kept(self, request_id: str, reason: KeptReason) -> None:
        with self._lock:
            self._book.kept(request_id)
        if self.metrics is not None:
            self.metrics.handoff_kept(reason.value)
