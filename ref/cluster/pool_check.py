"""An engine's KV pools held to the spec, for a caller outside the engine's thread
(``/debug/pools``: a soak's leak check, conformance/bench/soak.py).

:func:`pool_report` takes the engine's snapshot (:meth:`Scheduler.snapshot`, what the
conformance suite reads) and runs the pool checkers on it: every check of
:func:`refserve.spec.checks.check_pool` on the device pool, and the LEAK rule of
spec/cluster.py on the engine as a one-node cluster (every block free or referenced by a
table, every table owned by a live request, on the device pool and the host pool).
So a block held by a request the engine no longer serves is a LEAK violation, and a
request that still lives when its client has long gone shows in ``live_requests``.

It runs on the thread that owns the engine (a replica's loop or an actor), between two
steps: the snapshot is a consistent state, never one mid-step. ``rss_bytes`` is the
resident memory of the process the engine lives in (in-process replicas share one).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from refserve.engine.llm_engine import LLMEngine
from refserve.spec.checks import check_pool
from refserve.spec.cluster import ClusterSnapshot, ClusterStep, Node, check_leak


@dataclass(frozen=True)
class PoolReport:
    """One engine's pools between two steps, checked (module doc)."""

    num_blocks: int
    free_blocks: int
    """Blocks in the device pool's free queue (cached blocks nobody holds count)."""
    live_requests: tuple[str, ...]
    tables: int
    """Block tables in the device pool: one per request holding blocks."""
    violations: tuple[str, ...]
    """Each spec violation found, as its one-line text; empty when the pools hold."""
    rss_bytes: int
    """Resident memory of the engine's process (0 where /proc is not readable)."""
    pid: int


def rss_bytes(pid: int | None = None) -> int:
    """Resident memory of process ``pid`` (this one by default), from /proc; 0 where that
    is not readable (another OS, a process gone)."""
    try:
        fields = Path(f"/proc/{pid or 'self'}/statm").read_text(encoding="ascii").split()
        return int(fields[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def pool_report(engine: LLMEngine) -> PoolReport:
    """``engine``'s pools held to the spec (module doc); on the engine's own thread."""
    snap = engine.scheduler.snapshot()
    one = ClusterSnapshot((Node("engine", snap),))
    found = [*check_pool(snap.pool), *check_leak(ClusterStep(one, one))]
    if snap.host is not None:
        found.extend(check_pool(snap.host))
    live = tuple(r.request_id for r in snap.requests if not r.status.is_done)
    return PoolReport(
        num_blocks=snap.pool.num_blocks,
        free_blocks=len(snap.pool.free_queue),
        live_requests=live,
        tables=len(snap.pool.tables),
        violations=tuple(str(v) for v in found),
        rss_bytes=rss_bytes(),
        pid=os.getpid(),
    )
