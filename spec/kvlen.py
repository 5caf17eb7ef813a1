"""KVLEN: KV length and sampled count are separate, and sampling happens only at the end.

Why it matters: in decode the last sampled token has no K/V yet, so
``num_computed_tokens == num_tokens - 1`` before the step (docs/ARCHITECTURE.md,
"Vocabulary"). Example 1 there shows B's prompt finishing in round 2 and only then
producing its first output
token: a chunk that stops short of the known tokens has no logit worth sampling. Engines
that derive one count from the other drift by one after a preemption or a cache hit.
"""

from __future__ import annotations

from refserve.spec.snapshot import RequestSnapshot, RequestStatus, ScheduledRequest, StepSnapshot
from refserve.spec.violation import Invariant, Violation, violation

K = Invariant.KVLEN


def check_kvlen_request(r: RequestSnapshot) -> list[Violation]:
    """Per-request relations that hold between steps."""
    out: list[Violation] = []
    who = f"request {r.request_id}"
    if r.num_output_tokens > r.max_tokens:
        out.append(
            violation(
                K, who, "outputs exceed max_tokens", f"<= {r.max_tokens}", r.num_output_tokens
            )
        )
    if r.num_tokens > r.max_model_len:
        out.append(
            violation(
                K, who, "num_tokens exceeds max_model_len", f"<= {r.max_model_len}", r.num_tokens
            )
        )
    if r.num_computed_tokens > r.num_tokens:
        out.append(
            violation(
                K,
                who,
                "KV length exceeds known tokens",
                f"<= {r.num_tokens}",
                r.num_computed_tokens,
            )
        )
    if r.status is RequestStatus.DECODING and r.num_computed_tokens != r.num_tokens - 1:
        out.append(
            violation(
                K,
                who,
                "decoding request must have KV for all but the last sampled token",
                r.num_tokens - 1,
                r.num_computed_tokens,
            )
        )
    if r.status is RequestStatus.PREFILLING and r.num_computed_tokens >= r.num_tokens:
        out.append(
            violation(
                K,
                who,
                "prefilling request has no token left to compute",
                f"< {r.num_tokens}",
                r.num_computed_tokens,
            )
        )
    if r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) and r.num_computed_tokens != 0:
        out.append(violation(K, who, f"{r.status} request holds KV", 0, r.num_computed_tokens))
    return out


def check_kvlen(step: StepSnapshot) -> list[Violation]:
    """Sampling only when a chunk reaches ``num_tokens``; one token per sampling request,
    or, for a step that verifies ``d`` draft tokens, from one to ``d + 1`` (the accepted
    drafts, then the target's own token: docs/SPECULATIVE.md)."""
    out: list[Violation] = []
    for r in step.after.requests:
        out.extend(check_kvlen_request(r))
    scheduled = {s.request_id: s for s in step.scheduled}
    for after in step.after.requests:
        rid = after.request_id
        before = step.before.request(rid)
        if before is None:
            continue
        s = scheduled.get(rid)
        if s is None:
            if after.num_output_tokens != before.num_output_tokens:
                out.append(
                    violation(
                        K,
                        f"request {rid}",
                        "sampled without being scheduled",
                        before.num_output_tokens,
                        after.num_output_tokens,
                    )
                )
            continue
        out.extend(_check_chunk(before, s, after))
    return out


def _check_chunk(
    before: RequestSnapshot, s: ScheduledRequest, after: RequestSnapshot
) -> list[Violation]:
    """One scheduled request: its samples flag, and what it sampled."""
    out: list[Violation] = []
    rid = s.request_id
    drafts = s.num_draft_tokens
    # The drafts sit beyond the known tokens: the chunk before them must reach the end.
    end = (
        before.num_computed_tokens
        + s.num_new_cached_tokens
        + s.num_new_loaded_tokens
        + s.num_new_tokens
        - drafts
    )
    reaches_end = end == before.num_tokens
    if s.samples != reaches_end:
        out.append(
            violation(
                K,
                f"request {rid}",
                "samples flag disagrees with whether the chunk reaches num_tokens",
                reaches_end,
                s.samples,
            )
        )
    if drafts and not reaches_end:
        out.append(
            violation(
                K,
                f"request {rid}",
                "draft tokens verified after a chunk that does not reach num_tokens",
                before.num_tokens,
                end,
            )
        )
    if after.status is RequestStatus.ABORTED:
        return out
    gained = after.num_output_tokens - before.num_output_tokens
    if drafts and reaches_end:
        if not 1 <= gained <= drafts + 1:
            out.append(
                violation(
                    K,
                    f"request {rid}",
                    f"a step verifying {drafts} drafts must emit 1 to {drafts + 1} tokens",
                    f"1..{drafts + 1}",
                    gained,
                )
            )
        return out
    expected = 1 if reaches_end else 0
    if gained != expected:
        out.append(
            violation(
                K,
                f"request {rid}",
                "sampled count changed by other than one per sampling step",
                before.num_output_tokens + expected,
                after.num_output_tokens,
            )
        )
    return out
