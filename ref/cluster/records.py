"""The cluster's records: the load figures the router and the migration triggers read
(docs/CLUSTER.md, "Replicas"), and the cluster's counters (``ClusterMetrics``).

Plain figures, no engine: the router (ref/cluster/router.py) is a pure function of them,
so importing it loads neither the engine nor torch (tests/cluster/test_router.py checks
that in a fresh interpreter). A replica reports them (ref/cluster/replica.py,
``load_figures``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from refserve.core.cost import StepCost


@dataclass(frozen=True)
class LoadFigures:
    """A replica's load at a step boundary, as the routing policies read it
    (ref/cluster/router.py).

    ``num_waiting`` counts the queued samples (waiting, preempted, swapped out),
    ``num_running`` those in the running batch (prefilling or decoding), of which
    ``num_decoding`` decode; paused ones (a tool wait) count in ``num_paused`` only.
    ``prefill_backlog_tokens`` are the tokens not yet computed of every sample that is
    queued or prefilling (its prefix hits not yet subtracted: they are looked up at
    admission). ``kv_blocks_used`` are the device blocks held by requests (a cached
    block nobody holds is free: it can be evicted), of ``kv_blocks_total``.
    """

    num_waiting: int
    num_running: int
    num_decoding: int
    num_paused: int
    prefill_backlog_tokens: int
    kv_blocks_used: int
    kv_blocks_total: int
    max_num_seqs: int
    token_budget: int
    block_size: int
    cost: StepCost


@dataclass
class ClusterMetrics:
    """What the cluster did, over its life (docs/CLUSTER.md, "Metrics")."""

    decisions_by_policy: Counter[str] = field(default_factory=Counter)
    routed_by_replica: Counter[int] = field(default_factory=Counter)
    prompt_tokens_routed: int = 0
    prefix_hit_tokens_at_routing: int = 0  # the chosen replica's cached prefix, summed
    migrations: int = 0
    migrations_by_reason: Counter[str] = field(default_factory=Counter)  # asked|pressure|...
    migrations_aborted: int = 0  # aborted or refused: the request stayed where it was
    migration_bytes: int = 0  # K/V bytes moved (transfer), inline and streamed
    migration_ms: float = 0.0
    index_resyncs: int = 0  # the index rebuilt from a replica's snapshot (a gap, a mismatch)
    replicas_dead: int = 0  # deaths: a slot whose replica was replaced can die again
    replicas_restarted: int = 0  # a fresh replica took a dead one's slot
    requests_failed: int = 0  # ended with ReplicaDead: their replica died holding them
    # Prefill/decode roles (docs/DISAGG.md): prefills placed on a decode replica, requests
    # moved to a decode replica after their first token, and handoffs that failed (the
    # request decodes on its prefill replica).
    deflections: int = 0
    handoffs: int = 0
    handoffs_kept: int = 0

    def routed(self, policy: str, replica: int, prompt_tokens: int, hit_tokens: int) -> None:
        """One request routed by ``policy`` to ``replica``, with ``hit_tokens`` of its
        ``prompt_tokens`` cached there."""
        self.decisions_by_policy[policy] += 1
        self.routed_by_replica[replica] += 1
        self.prompt_tokens_routed += prompt_tokens
        self.prefix_hit_tokens_at_routing += hit_tokens
