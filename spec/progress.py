"""PROGRESS: runnable work always moves, nobody starves past the bound, nothing leaks.

Why it matters: the starvation example (docs/ARCHITECTURE.md, example 2d: budget 8,
always 8 decodes waiting) shows
decode-first scheduling can starve prefill forever unless aging or a reserved share
admits it. Known bugs elsewhere: a fully cached prompt that schedules zero tokens and
spins; a single running request that cannot grow and has no victim; a preempted request
that never runs again; blocks still referenced after every request has finished.
"""

from __future__ import annotations

from collections.abc import Sequence

from refserve.spec.arith import blocks_needed
from refserve.spec.snapshot import PoolSnapshot, RequestSnapshot, RequestStatus, StepSnapshot
from refserve.spec.violation import Invariant, Violation, violation

G = Invariant.PROGRESS
B = Invariant.BLOCK


def check_progress(step: StepSnapshot, lookahead: int = 0) -> list[Violation]:
    """A step with runnable work schedules a token, retires someone or starts a load.

    Retiring counts (a lone request finished with reason ``capacity`` is progress), and so
    does admitting a request into a load of its K/V from another store; a preemption
    alone does not: a step that preempts makes room for someone it then
    schedules, and a step that only preempts is the first half of a livelock. The
    message names the oldest stuck request and what the step had to offer it, so two
    stalls with different causes never look alike.
    """
    runnable = [r for r in step.before.requests if r.status.is_runnable]
    if not runnable or step.scheduled:
        return []
    if step.finished or step.aborted:
        return []
    if _started_loads(step) or step.before.pool.transfers:
        # Waiting on its own transfer is not a stall: the copy completes outside the
        # scheduler, and a transfer that never does leaves the run unchanged until the
        # suite's stall limit reports it.
        return []
    stuck = min(runnable, key=lambda r: (r.arrival_step, r.request_id))
    return [
        violation(
            G,
            "step",
            f"runnable work but nothing scheduled, finished or aborted: {stuck.status} "
            f"request {stuck.request_id} got nothing ({_why_not(stuck, step, lookahead)})",
            ">= 1 token",
            f"0 tokens for {len(runnable)} runnable requests",
        )
    ]


def _started_loads(step: StepSnapshot) -> bool:
    """Whether the step admitted a request into a load of its K/V (a KV connector): the
    transfer now carries its work, so the step was not idle; a load that never lands
    leaves the request loading, and the run's stall limit reports it."""
    after = {r.request_id: r.status for r in step.after.requests}
    return any(
        r.status is not RequestStatus.LOADING and after.get(r.request_id) is RequestStatus.LOADING
        for r in step.before.requests
    )


def _why_not(r: RequestSnapshot, step: StepSnapshot, lookahead: int) -> str:
    """What the step offered ``r`` (PROGRESS; docs/CONFORMANCE.md, "Rules"): the blocks
    it needs for one more token (and the declared lookahead slots) vs the free ones, the
    whole budget, and the sequence slots. Which of them an engine consulted is its
    business; when all look sufficient the cause is the engine's policy.

    Except for a request that starts (or recomputes) its prompt with more tokens to
    compute than the whole budget: one token of budget is room only for an engine that
    chunks, and one that cannot chunk can never schedule it, so the message says that
    instead of blaming a policy.
    """
    pool = step.before.pool
    bs = pool.block_size
    table = pool.table(r.request_id)
    held = len(table.block_table) if table is not None else 0
    need = max(0, blocks_needed(r.num_computed_tokens + 1 + lookahead, bs) - held)
    free = len(pool.free_queue)
    running = sum(
        1
        for x in step.before.requests
        if x.status in (RequestStatus.PREFILLING, RequestStatus.DECODING)
    )
    todo = r.num_tokens - r.num_computed_tokens
    # A prefilling or decoding request is already past its first chunk.
    unchunked = (
        r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED, RequestStatus.SWAPPED)
        and todo > step.token_budget
    )
    budget = f"budget: {step.token_budget} tokens unused"
    if unchunked:
        budget += f", fewer than the {todo} it has to compute"
    parts = [
        f"blocks: needs {need} for its next token, {free} free",
        budget,
        f"seqs: {running} of {step.max_num_seqs} running",
    ]
    if (
        need <= free
        and step.token_budget >= 1
        and (
            running < step.max_num_seqs
            or r.status in (RequestStatus.PREFILLING, RequestStatus.DECODING)
        )
    ):
        parts.append(
            "unchunked: its tokens exceed the per-step token budget, so an engine that "
            "cannot chunk can never schedule it"
            if unchunked
            else "policy: every limit had room"
        )
    return "; ".join(parts)


def check_preempted_released(step: StepSnapshot) -> list[Violation]:
    """BLOCK: a request the step preempted holds no device block after it.

    Preemption exists to release memory (recompute drops the KV, swap moves it to the
    host); a victim that keeps its table leaks the blocks the preemption was for, and
    when it is admitted again the engine either allocates a second table or writes over
    KV it claims to have dropped.
    """
    out: list[Violation] = []
    for rid in step.preempted:
        t = step.after.pool.table(rid)
        if t is not None and t.block_table:
            out.append(
                violation(
                    B,
                    f"request {rid}",
                    "preempted but still holds device blocks",
                    0,
                    len(t.block_table),
                )
            )
    return out


def check_quiescent(pool: PoolSnapshot) -> list[Violation]:
    """After all requests finish or abort, no table remains and every ref count is 0."""
    out: list[Violation] = []
    for t in pool.tables:
        out.append(
            violation(
                G,
                f"request {t.request_id}",
                "holds a block table at quiescence",
                0,
                len(t.block_table),
            )
        )
    for b, rc in enumerate(pool.ref_cnt):
        if rc != 0:
            out.append(violation(G, f"block {b}", "still referenced at quiescence", 0, rc))
    return out


def check_starvation(steps: Sequence[StepSnapshot], bound: int) -> list[Violation]:
    """No request is runnable yet unscheduled for more than ``bound`` consecutive steps."""
    out: list[Violation] = []
    waited: dict[str, int] = {}
    reported: set[str] = set()
    for step in steps:
        scheduled = {s.request_id for s in step.scheduled}
        for r in step.before.requests:
            if not r.status.is_runnable or r.request_id in scheduled:
                waited[r.request_id] = 0
                continue
            waited[r.request_id] = waited.get(r.request_id, 0) + 1
            if waited[r.request_id] > bound and r.request_id not in reported:
                reported.add(r.request_id)
                out.append(
                    violation(
                        G,
                        f"request {r.request_id}",
                        f"starved up to step {step.step_index}",
                        f"<= {bound} steps",
                        waited[r.request_id],
                    )
                )
    return out
