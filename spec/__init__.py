"""refserve's executable specification.

Pure, typed predicates over plain snapshot data (frozen dataclasses of ints and tuples).
Nothing here imports the engine: ``ref/`` and ``conformance/`` depend on ``spec``, never
the other way round. Each invariant id of docs/CONFORMANCE.md (TOKEN, BLOCK, KVLEN,
POS, CAP, PREFIX, PROGRESS, ATOMIC, ORDER) has a module with a ``check_*`` function
returning a list of :class:`~refserve.spec.violation.Violation`; an empty list means the
invariant holds. The migration rules of docs/MIGRATION.md (OWNER, CONSERVE, MOVED,
KVCOPY, LEAK) are checked over a cluster of engines, in spec/cluster.py.
"""

from refserve.spec.checks import check_pool, check_step
from refserve.spec.snapshot import (
    CacheEntry,
    EngineSnapshot,
    PoolSnapshot,
    RequestSnapshot,
    RequestStatus,
    ScheduledRequest,
    StepSnapshot,
    TableSnapshot,
)
from refserve.spec.violation import Invariant, Violation

__all__ = [
    "CacheEntry",
    "EngineSnapshot",
    "Invariant",
    "PoolSnapshot",
    "RequestSnapshot",
    "RequestStatus",
    "ScheduledRequest",
    "StepSnapshot",
    "TableSnapshot",
    "Violation",
    "check_pool",
    "check_step",
]
