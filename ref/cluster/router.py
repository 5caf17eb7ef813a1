"""The router: which replica a new request goes to (docs/CLUSTER.md, "Routing
policies").

The router is a pure function of figures, plus the round-robin cursor: the cluster
hands it the request's prompt length, each replica's :class:`LoadFigures` and its
cached prefix (from the global index, ref/cluster/index.py), and gets back a
:class:`RoutingDecision` record naming the replica, the policy, the prefix hit there and
every figure it compared. It never calls a replica, so the same router drives any
transport.

The figures, per replica ``r`` (each documented on its function):

- load (:func:`load_score`): ``(waiting + running) / max_num_seqs + kv_used / kv_total``,
  the share of its seats plus the share of its KV memory in use;
- predicted TTFT (:func:`predicted_ttft_ms`): the replica's cost model summed over the
  steps its prefill backlog plus this prompt's uncached tokens take.

The policies:

- ``round_robin``: the next replica id after the last one chosen, in id order;
- ``least_loaded``: the least load;
- ``prefix_aware``: among the replicas whose load is within ``balance_margin`` of the
  least load, the longest cached prefix (so a hit never sends work to a replica that is
  far busier than another); ties to the lesser load;
- ``slo_aware``: the least predicted TTFT (a cached prefix shortens it by its tokens'
  prefill time); ties to the lesser load.

Remaining ties go to the lowest replica id.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from refserve.cluster.errors import UnknownPolicy, UnknownReplica
from refserve.cluster.records import LoadFigures
from refserve.errors import InvalidArgument
from refserve.values import is_int, is_number


class RoutingPolicy(StrEnum):
    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"
    PREFIX_AWARE = "prefix_aware"
    SLO_AWARE = "slo_aware"

    @classmethod
    def parse(cls, name: RoutingPolicy | str) -> RoutingPolicy:
        """The policy named ``name``; :class:`UnknownPolicy` naming the choices if none."""
        if isinstance(name, RoutingPolicy):
            return name
        try:
            return cls(name)
        except ValueError:
            choices = ", ".join(p.value for p in cls)
            raise UnknownPolicy(
                f"unknown routing policy {name!r}; choose one of: {choices}"
            ) from None


@dataclass(frozen=True)
class ReplicaFigures:
    """What the router compared for one replica."""

    replica: int
    load: float
    hit_tokens: int
    predicted_ttft_ms: float


@dataclass(frozen=True)
class RoutingDecision:
    """One routing: the replica chosen, by which policy, the prefix hit it has for the
    prompt (``prefix_hit_tokens``) and the figures of every replica."""

    request_id: str
    replica: int
    policy: RoutingPolicy
    num_prompt_tokens: int
    prefix_hit_tokens: int
    figures: tuple[ReplicaFigures, ...]


def load_score(f: LoadFigures) -> float:
    """``(num_waiting + num_running) / max_num_seqs + kv_blocks_used / kv_blocks_total``:
    each term a share of the replica's own capacity (seats, memory), so replicas of
    different sizes compare; 0 for an idle replica, above 2 only with a queue longer
    than its seats."""
    seats = (f.num_waiting + f.num_running) / f.max_num_seqs
    return seats + f.kv_blocks_used / f.kv_blocks_total


def predicted_ttft_ms(f: LoadFigures, num_prompt_tokens: int, hit_tokens: int) -> float:
    """The replica's cost model ``a + b*P + c*D`` over the steps until a new prompt's
    prefill ends: ``Q = prefill_backlog_tokens + num_prompt_tokens - hit_tokens``
    prefill tokens go first come, first served, ``B - D`` a step (``B`` the token
    budget, the ``D = num_decoding`` decodes take one each, and at least one prefill
    token a step), so ``n = ceil(Q / max(1, B - D))`` steps cost
    ``n * (a + c*D) + b*Q`` ms. Not modelled: admission waiting for a seat or for
    blocks, the decodes that finish meanwhile, the ``e*K`` term."""
    cost = f.cost
    q = f.prefill_backlog_tokens + num_prompt_tokens - hit_tokens
    d = f.num_decoding
    steps = math.ceil(q / max(1, f.token_budget - d))
    return steps * (cost.a + cost.c * d) + cost.b * q


class Router:
    """Routes by one policy (module doc). ``balance_margin`` is the load window of
    ``prefix_aware`` (a number of load units, see :func:`load_score`)."""

    def __init__(
        self,
        policy: RoutingPolicy | str = RoutingPolicy.PREFIX_AWARE,
        *,
        balance_margin: float = 0.25,
    ) -> None:
        self.policy = RoutingPolicy.parse(policy)
        m = balance_margin
        if not is_number(m) or not 0 <= m < math.inf:
            raise InvalidArgument(f"balance_margin must be a finite number >= 0, got {m!r}")
        self.balance_margin = float(m)
        self._last: int | None = None  # round robin: the replica chosen last

    def route(
        self,
        request_id: str,
        num_prompt_tokens: int,
        loads: Mapping[int, LoadFigures],
        hits: Mapping[int, int],
    ) -> RoutingDecision:
        """Choose a replica for a prompt of ``num_prompt_tokens`` tokens, given each
        replica's load and cached prefix (``hits``, missing ones 0). Pure: the
        round-robin cursor moves only at :meth:`accepted`."""
        if not loads:
            raise InvalidArgument("route: there is no replica to route to")
        if not is_int(num_prompt_tokens):
            raise InvalidArgument(
                f"route: num_prompt_tokens must be an int, got {num_prompt_tokens!r}"
            )
        if num_prompt_tokens < 1:
            raise InvalidArgument(
                f"route: a prompt has at least one token, got {num_prompt_tokens}"
            )
        for r in hits:
            if r not in loads:
                raise UnknownReplica(r, "route (a prefix hit on a replica with no load figures)")
        rows: list[ReplicaFigures] = []
        for r in sorted(loads):
            f, hit = loads[r], hits.get(r, 0)
            rows.append(
                ReplicaFigures(r, load_score(f), hit, predicted_ttft_ms(f, num_prompt_tokens, hit))
            )
        figures = tuple(rows)
        chosen = self._choose(figures)
        return RoutingDecision(
            request_id, chosen.replica, self.policy, num_prompt_tokens, chosen.hit_tokens, figures
        )

    def accepted(self, decision: RoutingDecision) -> None:
        """The request went where ``decision`` said (the replica took it)."""
        self._last = decision.replica

    def _choose(self, figures: tuple[ReplicaFigures, ...]) -> ReplicaFigures:
        p = self.policy
        if p is RoutingPolicy.ROUND_ROBIN:
            last = self._last
            later = [f for f in figures if last is None or f.replica > last]
            return later[0] if later else figures[0]
        if p is RoutingPolicy.LEAST_LOADED:
            return min(figures, key=lambda f: (f.load, f.replica))
        if p is RoutingPolicy.PREFIX_AWARE:
            ceiling = min(f.load for f in figures) + self.balance_margin
            near = [f for f in figures if f.load <= ceiling]
            return min(near, key=lambda f: (-f.hit_tokens, f.load, f.replica))
        return min(figures, key=lambda f: (f.predicted_ttft_ms, f.load, f.replica))
