"""ORDER: a declared admission order is kept (a policy, checked only when declared).

Why it matters: admission order is a design choice, so refserve never assumes one; but
an engine that promises first-come-first-served (or strict priority) and then lets a
later arrival overtake an earlier one that would have fitted has a bug its users will
see as unexplained tail latency. The rule is stated so that no correct engine of either
admission style fails it: a request is *passed over* only if it had been waiting since
before the step, was never run, is ahead in the declared order, and visibly fits in
what the overtaking request took:

* its whole prompt (plus the declared lookahead slots) needs no more blocks than the
  overtaking request newly took in this step (so a watermark that admitted the one
  admits the other),
* its whole prompt fits in the tokens the overtaking request got plus the budget the
  step left unused (so an engine that never chunks could have taken it),
* and the overtaking request's sequence slot would have held it.

Preempted and swapped requests are left out: where a victim re-enters the queue is a
separate convention (front of the queue, or its arrival place).

The strict orders (``fcfs_strict``, ``priority_strict``: head-of-line blocking, as vLLM's
and nano-vllm's FCFS admit and as refserve's queue does) promise more, and are checked
by :func:`check_strict_admission_order` instead: a waiting request that is not admitted
blocks every never-run request behind it in the declared order, whether it fits or not.
That is the promise an engine with a small head behind a large one breaks when it lets
the small one in, which the rule above deliberately allows (docs/CONFORMANCE.md, "The
declared admission order").

A declared step order is a promise too (rule ``declared-step-order``,
:func:`check_decode_first`): an engine that says it serves running decodes before it
admits new work may not admit a request in a step that leaves a decoding request with
nothing, unless that request was preempted or retired in the step. A chunk of a prompt
already running is not an admission: how running prefills share the budget with decodes
is the engine's business. The dual, :func:`check_prefill_first`, holds an engine that
says it serves its waiting queue first: no decode is served in a step that passes over
the first waiting request when it visibly fitted at its turn.

A preemptive multi-level queue (a multi-level feedback queue) reorders by design: a
request's level, not its arrival, ranks it, and a running request may be preempted for
a higher one. Such an engine declares that discipline instead of an admission and a step
order, and reports every live request's level at each step boundary; its two rules read
those levels (the ones the step was planned with) and the step:

* :func:`check_level_admission` (rule ``level-admission``): no request waiting since
  before the step that visibly fitted (as above) is passed over for one the step admits
  at a lower level (a larger number), whether the one passed over never ran or was
  preempted and recomputes; within a level, no never-run request is passed over for a
  later arrival that never ran either (where a victim re-enters its level is the
  engine's convention, as above). Swapped requests are left out: what bringing one back
  costs is a copy the snapshot does not price.
* :func:`check_level_preemption` (rule ``level-preemption``): a step that preempts a
  request and admits another at the victim's level or lower must also admit one at a
  strictly higher level, unless the running requests could not all grow in the step.
  Preemption makes room for higher levels only: room taken from a victim and handed to
  its equals or inferiors is two requests of one level taking turns, the thrash a
  multi-level queue exists to avoid. The snapshots do not say which admission a
  preemption made room for, so one admission above the victim excuses the step (the
  room left after it may go to anyone); nor whether a victim went for a running
  request's next block, so the step is excused when the blocks the running requests
  newly took, plus each victim's blocks for one more token, exceed the blocks free
  before it (the surplus of a forced preemption may go to anyone in queue order, which
  ``level-admission`` checks). A preemption in a step that admits nobody is not judged.
"""

from __future__ import annotations

from collections.abc import Mapping

from refserve.spec.arith import blocks_needed
from refserve.spec.snapshot import RequestSnapshot, RequestStatus, StepSnapshot
from refserve.spec.violation import Invariant, Violation, violation

ORD = Invariant.ORDER


def check_admission_order(
    step: StepSnapshot,
    keys: Mapping[str, tuple[int, ...]],
    lookahead: int = 0,
    order: str = "fcfs",
) -> list[Violation]:
    """No never-run waiting request that fits is passed over for one later in ``keys``.

    ``keys[rid]`` is a request's place in the declared order (smaller first): its
    submission rank for FCFS, (priority, rank) for priority order. Requests without a
    key are not judged.
    """
    out: list[Violation] = []
    bs = step.before.pool.block_size
    free_before = set(step.before.pool.free_queue)
    scheduled = {s.request_id: s for s in step.scheduled}
    unused = step.token_budget - sum(s.num_new_tokens for s in step.scheduled)
    waiting = [
        r
        for r in step.before.requests
        if r.status is RequestStatus.WAITING and r.num_computed_tokens == 0 and r.request_id in keys
    ]
    admitted = [r for r in waiting if r.request_id in scheduled]
    passed = [r for r in waiting if r.request_id not in scheduled]
    for y in admitted:
        s = scheduled[y.request_id]
        table = step.after.pool.table(y.request_id)
        taken_blocks = set(s.block_table) | (set(table.block_table) if table else set())
        taken = len(taken_blocks & free_before)
        for x in passed:
            if keys[x.request_id] >= keys[y.request_id]:
                continue
            need = blocks_needed(x.num_tokens + lookahead, bs)
            if need > taken or x.num_tokens > s.num_new_tokens + unused:
                continue
            out.append(
                violation(
                    ORD,
                    f"request {x.request_id}",
                    f"passed over for {y.request_id}, later in {order} order, although it "
                    f"fitted (needs {need} blocks and {x.num_tokens} tokens; "
                    f"{y.request_id} took {taken} blocks and {s.num_new_tokens} tokens, "
                    f"{unused} tokens unused)",
                    f"admitted before {y.request_id}",
                    "still waiting",
                )
            )
            break
    return out


def check_strict_admission_order(
    step: StepSnapshot,
    keys: Mapping[str, tuple[int, ...]],
    order: str = "fcfs_strict",
) -> list[Violation]:
    """ORDER, strict (head-of-line blocking): no never-run waiting request is admitted
    while one earlier in ``keys`` that was waiting before the step is not admitted.

    docs/CONFORMANCE.md, "The declared admission order". ``keys`` as for
    :func:`check_admission_order`. A request retired while the step was planned (for
    example finished for ``capacity``) no longer waits, so it blocks nobody; preempted
    and swapped requests are left out as there. One violation per passed-over request,
    naming the first request behind it that was admitted.
    """
    out: list[Violation] = []
    scheduled = {s.request_id for s in step.scheduled}
    gone = set(step.finished) | set(step.aborted)
    waiting = sorted(
        (
            r
            for r in step.before.requests
            if r.status is RequestStatus.WAITING
            and r.num_computed_tokens == 0
            and r.request_id in keys
        ),
        key=lambda r: keys[r.request_id],
    )
    admitted = [r for r in waiting if r.request_id in scheduled]
    for x in waiting:
        if x.request_id in scheduled or x.request_id in gone:
            continue
        behind = [y for y in admitted if keys[y.request_id] > keys[x.request_id]]
        if not behind:
            continue
        first = behind[0].request_id
        more = f" and {len(behind) - 1} more" if len(behind) > 1 else ""
        out.append(
            violation(
                ORD,
                f"request {x.request_id}",
                f"passed over for {first}{more}, later in {order} order: with head-of-line "
                f"blocking a waiting request that is not admitted holds back everyone "
                f"behind it, fitting or not",
                f"{first} waits behind it",
                f"{first} admitted",
            )
        )
    return out


#: The named rule of ORDER for a declared step order.
DECLARED_STEP_ORDER = "declared-step-order"

_ADMITTED_FROM = frozenset({RequestStatus.WAITING, RequestStatus.PREEMPTED, RequestStatus.SWAPPED})


def check_decode_first(step: StepSnapshot) -> list[Violation]:
    """Decode-first, as declared: no admission in a step that passes over a decode."""
    status = {r.request_id: r.status for r in step.before.requests}
    admitted = [s.request_id for s in step.scheduled if status.get(s.request_id) in _ADMITTED_FROM]
    if not admitted:
        return []
    served = {s.request_id for s in step.scheduled}
    excused = served | set(step.preempted) | set(step.finished) | set(step.aborted)
    return [
        violation(
            ORD,
            f"request {r.request_id}",
            f"decoding request got no token while request {admitted[0]} was admitted "
            "(declared decode_first)",
            ">= 1 token",
            "0 tokens",
            rule=DECLARED_STEP_ORDER,
        )
        for r in step.before.requests
        if r.status is RequestStatus.DECODING and r.request_id not in excused
    ]


def check_prefill_first(
    step: StepSnapshot, keys: Mapping[str, tuple[int, ...]], lookahead: int = 0
) -> list[Violation]:
    """Prefill-first, as declared (rule ``declared-step-order``): no decode is served in
    a step that passes over a waiting request which fitted when the queue was served.

    The dual of :func:`check_decode_first`. A prefill-first engine serves its waiting
    queue before its decodes, so a step that gives a decoding request a token and admits
    no never-run request ``X``, the first in ``keys`` not admitted, must have had no
    room for ``X`` at its turn. ``X`` is judged to have fitted only when it visibly did,
    whatever the engine's own rule: its whole prompt fits the tokens the decodes took
    plus the budget left unused; its whole prompt (plus the declared ``lookahead``
    slots) fits the blocks free before the step less every block the step's prefills and
    admissions newly took; and a sequence slot was left besides the requests running
    before the step and those admitted in it. Not judged: a step that preempted (an
    engine may admit nobody in such a step) and a step with a preempted or swapped
    request waiting (where a victim re-enters the queue is the engine's convention, so
    the head of the queue is not known).
    """
    status = {r.request_id: r.status for r in step.before.requests}
    decodes = [s for s in step.scheduled if status.get(s.request_id) is RequestStatus.DECODING]
    victims = (RequestStatus.PREEMPTED, RequestStatus.SWAPPED)
    if not decodes or step.preempted or any(r.status in victims for r in step.before.requests):
        return []
    scheduled = {s.request_id for s in step.scheduled}
    gone = set(step.finished) | set(step.aborted)
    queue = sorted(
        (
            r
            for r in step.before.requests
            if r.status is RequestStatus.WAITING
            and r.num_computed_tokens == 0
            and r.request_id in keys
        ),
        key=lambda r: keys[r.request_id],
    )
    head = next((r for r in queue if r.request_id not in scheduled | gone), None)
    if head is None:
        return []
    bs = step.before.pool.block_size
    free_before = set(step.before.pool.free_queue)
    taken: set[int] = set()
    admitted = 0
    for s in step.scheduled:
        if status.get(s.request_id) is RequestStatus.DECODING:
            continue
        admitted += status.get(s.request_id) is RequestStatus.WAITING
        table = step.after.pool.table(s.request_id)
        held = set(s.block_table) | (set(table.block_table) if table else set())
        taken |= held & free_before
    room_blocks = len(free_before) - len(taken)
    room_tokens = step.token_budget - sum(
        s.num_new_tokens for s in step.scheduled if s not in decodes
    )
    running = sum(
        1
        for r in step.before.requests
        if r.status in (RequestStatus.PREFILLING, RequestStatus.DECODING)
    )
    need = blocks_needed(head.num_tokens + lookahead, bs)
    if (
        need > room_blocks
        or head.num_tokens > room_tokens
        or running + admitted >= step.max_num_seqs
    ):
        return []
    return [
        violation(
            ORD,
            f"request {head.request_id}",
            f"waiting request passed over while decoding request {decodes[0].request_id} got "
            f"a token (declared prefill_first), although it fitted (needs {need} blocks and "
            f"{head.num_tokens} tokens; {room_blocks} blocks and {room_tokens} tokens were "
            "left when the queue was served)",
            "admitted",
            "still waiting",
            rule=DECLARED_STEP_ORDER,
        )
    ]


#: The named rules of ORDER for a declared preemptive multi-level queue.
LEVEL_ADMISSION = "level-admission"
LEVEL_PREEMPTION = "level-preemption"


def _admitted(step: StepSnapshot, levels: Mapping[str, int]) -> list[RequestSnapshot]:
    """The requests the step admitted (waiting, preempted or swapped before it, given
    tokens in it) that have a level."""
    scheduled = {s.request_id for s in step.scheduled}
    return [
        r
        for r in step.before.requests
        if r.status in _ADMITTED_FROM and r.request_id in scheduled and r.request_id in levels
    ]


def check_level_admission(
    step: StepSnapshot,
    levels: Mapping[str, int],
    keys: Mapping[str, tuple[int, ...]],
    lookahead: int = 0,
) -> list[Violation]:
    """Admission by level, then by ``keys`` (arrival, or (priority, arrival)) within a
    level: no waiting request that visibly fitted is passed over for one admitted at a
    lower level, nor, never run, for a later never-run arrival of its own level.

    ``levels`` are the levels the adapter reported at the boundary before the step.
    Judged only: requests that have a level, waited since before the step with no K/V
    (``waiting`` never run, or ``preempted`` to recompute) and were neither scheduled
    nor retired in it. *Visibly fitted* as in :func:`check_admission_order`: the whole
    of its tokens (plus ``lookahead`` slots) within the blocks the admitted request
    newly took, and within its tokens plus the budget the step left unused.
    """
    out: list[Violation] = []
    bs = step.before.pool.block_size
    free_before = set(step.before.pool.free_queue)
    scheduled = {s.request_id: s for s in step.scheduled}
    gone = set(step.finished) | set(step.aborted)
    unused = step.token_budget - sum(s.num_new_tokens for s in step.scheduled)
    passed = [
        r
        for r in step.before.requests
        if r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        and r.num_computed_tokens == 0
        and r.request_id in levels
        and r.request_id not in scheduled
        and r.request_id not in gone
    ]
    for y in _admitted(step, levels):
        s = scheduled[y.request_id]
        table = step.after.pool.table(y.request_id)
        taken_blocks = set(s.block_table) | (set(table.block_table) if table else set())
        taken = len(taken_blocks & free_before)
        ly = levels[y.request_id]
        for x in passed:
            lx = levels[x.request_id]
            if lx < ly:
                why = f"admitted at level {ly} while it waited at level {lx}"
            elif (
                lx == ly
                and x.status is RequestStatus.WAITING
                and y.status is RequestStatus.WAITING
                and x.request_id in keys
                and y.request_id in keys
                and keys[x.request_id] < keys[y.request_id]
            ):
                why = f"a later arrival at its own level {lx}"
            else:
                continue
            need = blocks_needed(x.num_tokens + lookahead, bs)
            if need > taken or x.num_tokens > s.num_new_tokens + unused:
                continue
            out.append(
                violation(
                    ORD,
                    f"request {x.request_id}",
                    f"passed over for {y.request_id}, {why}, although it fitted (needs "
                    f"{need} blocks and {x.num_tokens} tokens; {y.request_id} took {taken} "
                    f"blocks and {s.num_new_tokens} tokens, {unused} tokens unused)",
                    f"admitted before {y.request_id}",
                    "still waiting",
                    rule=LEVEL_ADMISSION,
                )
            )
            break
    return out


def check_level_preemption(
    step: StepSnapshot, levels: Mapping[str, int], lookahead: int = 0
) -> list[Violation]:
    """Preemption only for higher levels: a victim's room goes to its equals or
    inferiors only when the running requests' own growth forced the preemption.

    A request preempted at level ``v`` is a violation when the step admits a request at
    a level ``>= v``, admits none at a level ``< v``, and the running requests' growth
    fitted without any preemption: the blocks newly taken by the requests that ran
    before the step, plus each victim's next token (its blocks for one more token, with
    the declared ``lookahead``, beyond those it held), were no more than the blocks free
    before the step. ``levels`` as for :func:`check_level_admission`; a victim without a
    level is not judged. One violation per victim, naming the first admission at its
    level or lower.
    """
    admitted = _admitted(step, levels)
    if not step.preempted or not admitted:
        return []
    top = min(levels[r.request_id] for r in admitted)
    judged = [rid for rid in step.preempted if rid in levels and top >= levels[rid]]
    if not judged:
        return []
    bs = step.before.pool.block_size
    free_before = set(step.before.pool.free_queue)
    before = {r.request_id: r for r in step.before.requests}
    running = (RequestStatus.PREFILLING, RequestStatus.DECODING)
    grown = 0
    for s in step.scheduled:
        r = before.get(s.request_id)
        if r is None or r.status not in running:
            continue
        table = step.after.pool.table(s.request_id)
        held = set(s.block_table) | (set(table.block_table) if table else set())
        grown += len(held & free_before)
    for rid in step.preempted:
        v = before.get(rid)
        table = step.before.pool.table(rid)
        if v is None or v.status not in running:
            continue
        have = len(table.block_table) if table else 0
        grown += max(0, blocks_needed(v.num_computed_tokens + 1 + lookahead, bs) - have)
    if grown > len(free_before):
        return []  # the running requests could not all grow: someone had to go
    out: list[Violation] = []
    for rid in judged:
        lv = levels[rid]
        w = next(r for r in admitted if levels[r.request_id] >= lv)
        lw = levels[w.request_id]
        out.append(
            violation(
                ORD,
                f"request {rid}",
                f"preempted at level {lv} in a step that admitted {w.request_id} at level "
                f"{lw} and nobody above level {lv}, although the running requests' growth "
                f"fitted without it ({grown} blocks of {len(free_before)} free): "
                "preemption makes room only for a higher level",
                f"an admission above level {lv}, or no preemption",
                f"{w.request_id} admitted at level {lw}",
                rule=LEVEL_PREEMPTION,
            )
        )
    return out
