"""The multi-level feedback queue's own rules: the starvation bound, no thrash, and the
queues' conservation (ref/core/mlfq.py is the policy they hold for).

Why they matter: a preemptive policy that reorders by attained service can starve a long
request forever (every new short one ranks above it), can preempt a request right after
letting it back in, paying a K/V round trip or a recompute for a token or two (thrash),
and keeps its requests in several structures at once, where a request dropped from all
of them never runs again and one in two runs twice.

Each rule reads one frozen :class:`MlfqSnapshot`, taken at a step boundary:

- **starvation** (PROGRESS, rule ``mlfq-starvation``): no waiting request has waited
  ``starvation_steps`` steps or more in a level below 0 (promotion moves it to level 0,
  where arrival order bounds its wait by the finitely many requests ahead of it);
- **no thrash** (ORDER, rule ``mlfq-no-thrash``): a request the policy displaced in the
  last step had been served at least the quantum it was protected for when it last
  joined the batch;
- **conservation** (ORDER, rule ``mlfq-queues``): every runnable live request is in
  exactly one place, one level's queue or the running batch, at a level that exists,
  and nothing else is.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from refserve.spec.violation import Invariant, Violation, violation

STARVATION = "mlfq-starvation"
NO_THRASH = "mlfq-no-thrash"
QUEUES = "mlfq-queues"


@dataclass(frozen=True)
class QueuedRecord:
    request_id: str
    level: int
    waited_steps: int  # steps since it was last queued


@dataclass(frozen=True)
class RunningRecord:
    request_id: str
    level: int


@dataclass(frozen=True)
class DisplacedRecord:
    """A request the policy preempted, with its service since it last joined the batch
    and the quantum it was protected for then."""

    request_id: str
    reason: str
    for_request: str | None
    resumed_ms: float
    protected_ms: float


@dataclass(frozen=True)
class MlfqSnapshot:
    step_index: int
    starvation_steps: int
    num_queues: int
    runnable: tuple[str, ...]  # every live request the scheduler could give a token
    running: tuple[RunningRecord, ...]
    queued: tuple[QueuedRecord, ...]
    displaced: tuple[DisplacedRecord, ...]  # by the last committed step


def check_starvation(s: MlfqSnapshot) -> list[Violation]:
    return [
        violation(
            Invariant.PROGRESS,
            f"request {q.request_id}",
            f"waited {q.waited_steps} steps at level {q.level}: past the starvation bound "
            "it must have been promoted to level 0",
            f"< {s.starvation_steps} steps below level 0",
            q.waited_steps,
            rule=STARVATION,
        )
        for q in s.queued
        if q.level > 0 and q.waited_steps >= s.starvation_steps
    ]


def check_no_thrash(s: MlfqSnapshot) -> list[Violation]:
    return [
        violation(
            Invariant.ORDER,
            f"request {d.request_id}",
            f"displaced ({d.reason}) after {d.resumed_ms:g} ms of service since it last "
            f"joined the batch, inside the quantum it was protected for",
            f">= {d.protected_ms:g} ms",
            f"{d.resumed_ms:g} ms",
            rule=NO_THRASH,
        )
        for d in s.displaced
        if d.resumed_ms < d.protected_ms
    ]


def check_queues(s: MlfqSnapshot) -> list[Violation]:
    out: list[Violation] = []
    places = Counter([*(q.request_id for q in s.queued), *(r.request_id for r in s.running)])
    runnable = set(s.runnable)
    for rid in sorted(runnable | set(places)):
        n = places.get(rid, 0)
        if rid in runnable and n != 1:
            where = "in no queue and not running" if n == 0 else f"in {n} places"
            out.append(
                violation(
                    Invariant.ORDER,
                    f"request {rid}",
                    f"a runnable request is {where}",
                    "exactly 1 place",
                    n,
                    rule=QUEUES,
                )
            )
        elif rid not in runnable:
            out.append(
                violation(
                    Invariant.ORDER,
                    f"request {rid}",
                    "queued or running but not a runnable live request",
                    "0 places",
                    n,
                    rule=QUEUES,
                )
            )
    for level, rid in [
        *((q.level, q.request_id) for q in s.queued),
        *((r.level, r.request_id) for r in s.running),
    ]:
        if not 0 <= level < s.num_queues:
            out.append(
                violation(
                    Invariant.ORDER,
                    f"request {rid}",
                    f"at level {level}, which does not exist",
                    f"0..{s.num_queues - 1}",
                    level,
                    rule=QUEUES,
                )
            )
    return out


def check_mlfq(s: MlfqSnapshot) -> list[Violation]:
    """Every rule of this module."""
    return [*check_starvation(s), *check_no_thrash(s), *check_queues(s)]
