"""When a cluster migrates: the trigger rules the simulator (ref/cluster/sim.py) and the
in-process cluster (ref/cluster/cluster.py) share (docs/CLUSTER.md, "Migration
policy").

Each rule is a pure decision over what a replica reports at a step boundary (its
:class:`~refserve.cluster.records.LoadFigures`, its scheduler's requests, its free blocks):
which request to move and to which peer, or None. Acting on it (a simulated link, or
``refserve.engine.migration.migrate``) is the caller's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from refserve.cluster.records import LoadFigures
from refserve.cluster.router import load_score
from refserve.core.migration_cost import KVMode
from refserve.core.request import Request
from refserve.errors import InvalidArgument
from refserve.spec.arith import blocks_needed
from refserve.spec.snapshot import RequestStatus as S

#: A running request a pressure move may take (a paused one holds no seat to free).
MOVABLE = frozenset({S.DECODING, S.PREFILLING})


@dataclass(frozen=True)
class MigrationPolicy:
    """When a cluster migrates (docs/CLUSTER.md, "Migration policy"); all off by default.

    ``pressure``: a replica with a queue and at least ``high_watermark`` of its K/V used
    moves its youngest running request to the least-loaded peer with room for it.
    ``rebalance``: a replica with a queue moves its youngest waiting request to a peer
    with no queue that caches at least as much of its prompt. A peer qualifies only if
    its load (``router.load_score``) is ``margin`` below the source's. ``kv`` is the
    migration's K/V mode (``auto``: the cost rule decides). ``split_min_tokens``: a
    running prompt at least this long, once half of it is computed, moves mid-prefill
    with its K/V to a less-loaded peer with room, and finishes its prefill there (a
    split at a token boundary; each request at most once)."""

    pressure: bool = False
    rebalance: bool = False
    split_min_tokens: int | None = None
    high_watermark: float = 0.9
    margin: float = 0.25
    kv: KVMode = KVMode.AUTO

    def __post_init__(self) -> None:
        if not 0.0 <= self.high_watermark <= 1.0:
            raise InvalidArgument(
                f"MigrationPolicy.high_watermark must be in [0, 1], got {self.high_watermark!r}"
            )
        if self.margin < 0.0:
            raise InvalidArgument(f"MigrationPolicy.margin must be >= 0, got {self.margin!r}")
        if self.split_min_tokens is not None and self.split_min_tokens < 1:
            raise InvalidArgument(
                f"MigrationPolicy.split_min_tokens must be >= 1, got {self.split_min_tokens!r}"
            )

    @property
    def enabled(self) -> bool:
        return self.pressure or self.rebalance or self.split_min_tokens is not None


def under_pressure(f: LoadFigures, policy: MigrationPolicy) -> bool:
    """A queue waits and the K/V is at the high watermark (about to preempt or stall)."""
    return bool(f.num_waiting) and f.kv_blocks_used >= policy.high_watermark * f.kv_blocks_total


def pressure_victim(running: Iterable[Request]) -> Request | None:
    """The youngest movable running request: the one the scheduler would preempt."""
    movable = [r for r in running if r.status in MOVABLE]
    return max(movable, key=lambda r: r.seq) if movable else None


def rebalance_candidate(requests: Iterable[Request]) -> Request | None:
    """The youngest waiting request (never started: no K/V travels, only the wait)."""
    waiting = [r for r in requests if r.status is S.WAITING]
    return max(waiting, key=lambda r: r.seq) if waiting else None


def split_candidate(
    running: Iterable[Request], min_tokens: int, already_split: AbstractSet[str]
) -> list[Request]:
    """The running prompts a split may move, in running order: still prefilling (no
    output yet), at least ``min_tokens`` long, at least half computed, not split before
    (a request moves once: a second split would only bounce it)."""
    return [
        r
        for r in running
        if r.status is S.PREFILLING
        and r.num_prompt_tokens >= min_tokens
        and not r.num_output_tokens
        and r.num_computed_tokens * 2 >= r.num_prompt_tokens
        and r.request_id not in already_split
    ]


def rebalance_gains(hits: Mapping[int, int], src: int, dst: int) -> bool:
    """A move that loses the source's cached prefix recomputes it: not a gain."""
    return hits.get(dst, 0) >= hits.get(src, 0)


def pick_peer(
    i: int,
    loads: Mapping[int, LoadFigures],
    r: Request,
    policy: MigrationPolicy,
    *,
    free_blocks: Mapping[int, int],
    need_room: bool,
    idle_queue: bool = False,
) -> int | None:
    """The least-loaded peer whose load is ``margin`` below replica ``i``'s, with a
    running seat and the blocks for ``r``'s tokens (``need_room``) or an empty queue
    (``idle_queue``); None if there is none."""
    best: tuple[float, int] | None = None
    mine = load_score(loads[i])
    for j, f in loads.items():
        if j == i:
            continue
        score = load_score(f)
        if score > mine - policy.margin:
            continue
        if idle_queue and f.num_waiting:
            continue
        if need_room:
            blocks = blocks_needed(r.num_tokens + 1, f.block_size)
            if f.num_running >= f.max_num_seqs or free_blocks[j] < blocks:
                continue
        if best is None or (score, j) < best:
            best = (score, j)
    return None if best is None else best[1]
