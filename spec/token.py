"""TOKEN: the step respects the token budget and max_num_seqs, and counters move exactly.

Why it matters: example 1 of docs/ARCHITECTURE.md walks budget 8 / 3 sequences round
by round (A:1 B:7, then A:1 B:5 C:2): the budget is compute per step and must hold
exactly, and each later chunk of B must continue from the state the earlier ones left. A
counter that
advances by more than was computed skips positions whose K/V were never written; one
that advances past ``num_tokens`` is the preemption-storm bug seen in public trackers.
"""

from __future__ import annotations

from refserve.spec.snapshot import RequestSnapshot, RequestStatus, ScheduledRequest, StepSnapshot
from refserve.spec.violation import Invariant, Violation, violation

T = Invariant.TOKEN


# A preempted request whose KV was dropped: a running victim (recompute), or a paused
# agent turn whose device KV was reclaimed for others. A swapped victim keeps its count.
_DROPPED = (RequestStatus.PREEMPTED, RequestStatus.WAITING_TOOL)


def check_token(step: StepSnapshot) -> list[Violation]:
    out: list[Violation] = []
    total = sum(s.num_new_tokens for s in step.scheduled)
    if total > step.token_budget:
        out.append(
            violation(
                T,
                "step",
                "scheduled tokens exceed the token budget",
                f"<= {step.token_budget}",
                total,
            )
        )
    if len(step.scheduled) > step.max_num_seqs:
        out.append(
            violation(
                T,
                "step",
                "scheduled requests exceed max_num_seqs",
                f"<= {step.max_num_seqs}",
                len(step.scheduled),
            )
        )
    scheduled: dict[str, ScheduledRequest] = {}
    for s in step.scheduled:
        if s.request_id in scheduled:
            out.append(violation(T, f"request {s.request_id}", "scheduled twice in one step", 1, 2))
        scheduled[s.request_id] = s
        if s.num_new_tokens < 1:
            out.append(
                violation(
                    T,
                    f"request {s.request_id}",
                    "scheduled with no tokens",
                    ">= 1",
                    s.num_new_tokens,
                )
            )
        if s.request_id in step.preempted:
            out.append(
                violation(T, f"request {s.request_id}", "both scheduled and preempted in one step")
            )
        out.extend(_check_drafts(s, step.num_speculative_tokens))
    for after in step.after.requests:
        rid = after.request_id
        if after.num_computed_tokens > after.num_tokens:
            out.append(
                violation(
                    T,
                    f"request {rid}",
                    "num_computed_tokens exceeds num_tokens",
                    f"<= {after.num_tokens}",
                    after.num_computed_tokens,
                )
            )
        before = step.before.request(rid)
        if before is None or after.status.is_done:
            continue
        if rid in step.preempted and after.status in _DROPPED:
            if after.num_computed_tokens != 0:
                out.append(
                    violation(
                        T,
                        f"request {rid}",
                        "recompute preemption must reset num_computed_tokens",
                        0,
                        after.num_computed_tokens,
                    )
                )
            continue
        sched = scheduled.get(rid)
        advance = (
            0
            if sched is None
            else sched.num_new_cached_tokens + sched.num_new_loaded_tokens + sched.num_new_tokens
        )
        rejected = 0 if sched is None else _rejected(sched, before, after)
        expected = before.num_computed_tokens + advance - rejected
        if after.num_computed_tokens != expected:
            out.append(
                violation(
                    T,
                    f"request {rid}",
                    "num_computed_tokens did not advance by the scheduled count"
                    + (f" less the {rejected} rejected drafts" if rejected else ""),
                    expected,
                    after.num_computed_tokens,
                )
            )
    return out


def _check_drafts(s: ScheduledRequest, limit: int) -> list[Violation]:
    """A verifying entry keeps one token that is not a draft (the last sampled one) and
    verifies at most the declared ``num_speculative_tokens``."""
    d = s.num_draft_tokens
    who = f"request {s.request_id}"
    if not 0 <= d < max(s.num_new_tokens, 1):
        return [
            violation(
                T,
                who,
                "draft tokens must leave the last sampled token to verify them after",
                f"0..{s.num_new_tokens - 1}",
                d,
            )
        ]
    if d > limit:
        return [
            violation(T, who, "more draft tokens than num_speculative_tokens", f"<= {limit}", d)
        ]
    return []


def _rejected(s: ScheduledRequest, before: RequestSnapshot, after: RequestSnapshot) -> int:
    """The drafts a verification rejected: all but the emitted tokens less the one of the
    target's own (docs/SPECULATIVE.md). Their K/V was written and is dropped, so the KV
    length advances by that much less than was scheduled."""
    accepted = after.num_output_tokens - before.num_output_tokens - 1
    return s.num_draft_tokens - min(max(accepted, 0), s.num_draft_tokens)
