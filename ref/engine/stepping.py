"""What one engine step means for the sequences (ref/engine/llm_engine.py, module doc):
the core step (ref/core/engine_core.py), then its new tokens, the forks of ``n > 1``
samples, the requests the scheduler finished, the failed samples and the stop strings,
in that order; the outputs of every sequence it touched. Speculative decoding's drafts
are proposed before the step (docs/SPECULATIVE.md)."""

from __future__ import annotations

from collections.abc import Sequence

from refserve.core.engine_core import EngineCore, StepRecord
from refserve.core.mlfq import SkipJoinMlfq
from refserve.core.outcome import Outcome
from refserve.core.request import FinishReason
from refserve.core.scheduler import Scheduler
from refserve.engine.fanout import SampleFanOut
from refserve.engine.outputs import Outputs, RequestOutput
from refserve.engine.samples import SampleBook
from refserve.model.executor import ModelExecutor
from refserve.model.proposers import Proposer
from refserve.model.sampler import sample_failed
from refserve.spec.snapshot import RequestStatus


class Stepper:
    """Runs the engine's steps (module doc) and keeps their records and figures over the
    engine's life: every step's record, preemptions, prefix-hit tokens, and speculative
    decoding's verifications and drafts."""

    def __init__(
        self,
        core: EngineCore,
        scheduler: Scheduler,
        executor: ModelExecutor,
        books: SampleBook,
        fanout: SampleFanOut,
        outputs: Outputs,
        proposer: Proposer | None,
    ) -> None:
        self.core = core
        # The core steps the spine's loop; proposals and finishes need the assembled
        # scheduler (ref/core/scheduler.py) the core was built with.
        assert scheduler is core.scheduler
        self.scheduler = scheduler
        self.executor = executor
        self.books = books
        self.fanout = fanout
        self.outputs = outputs
        self.proposer = proposer
        self.steps: list[StepRecord] = []
        self.num_preemptions = 0
        self.num_prefix_hit_tokens = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_verifications = 0

    def run(self, now_ms: float) -> list[RequestOutput]:
        """One core step (ref/core/engine_core.py), then what it means for the sequences,
        in this order (module doc): new tokens, forks of ``n > 1`` samples, requests the
        scheduler finished, failed samples, stop strings. Returns the outputs of every
        sequence the step touched."""
        if self.proposer is not None:
            self._propose(self.proposer)
        record = self.core.step(now_ms)
        self._count(record)
        outcome = record.outcome
        # A list, not the outcome's id-keyed mapping: it is walked twice, never looked up.
        new_tokens = list(outcome.last_tokens())
        # The sampler could not sample their row (module doc, "Faults").
        failed = [sid for sid, _ in new_tokens if sample_failed(_last_logprob(record, sid))]
        touched = self._append_tokens(new_tokens, record)
        for parent_id, samples in record.fork_samples.items():
            touched.extend(
                self.fanout.fork(
                    parent_id, samples, parent_id in outcome.finished, parent_id in failed
                )
            )
        self._close_finished(outcome.finished, failed, touched)
        self._end_failed(failed, record.end_ms)
        self._end_at_stop_strings(touched, record.end_ms)
        return self.outputs.collect(touched)

    def _count(self, record: StepRecord) -> None:
        self.steps.append(record)
        self.num_preemptions += len(record.outcome.preempted)
        self.num_prefix_hit_tokens += sum(record.plan.num_new_cached_tokens)
        policy = self.scheduler.policy
        if isinstance(policy, SkipJoinMlfq) and record.plan.preempted:
            for choice in policy.last_choices:
                # A request of n > 1 samples runs its later samples under their own ids.
                sample = self.books.sample(choice.request_id)
                rid = choice.request_id if sample is None else sample.request_id
                group = self.books.group(rid)
                if group is not None:
                    group.displacements.append(choice)

    def _propose(self, proposer: Proposer) -> None:
        """Drafts for every decoding request's next step (docs/SPECULATIVE.md), no more
        than it may still emit less one; the proposer's distributions, when it has
        them, go to the executor for the verification."""
        sched, executor = self.scheduler, self.executor
        for r in sched.running:
            if r.status is not RequestStatus.DECODING:
                continue
            rid = r.request_id
            limit = r.stop.max_tokens - r.num_output_tokens - 1
            draft = proposer.draft(r.token_ids, executor.spec(rid), r.num_output_tokens, limit)
            if draft.probs is not None:
                executor.draft_probs[rid] = draft.probs
            sched.propose(rid, draft.tokens)

    def _append_tokens(
        self, new_tokens: Sequence[tuple[str, int]], record: StepRecord
    ) -> list[str]:
        """Each committed token to its sequence (all of a verification's, up to a stop
        string); the ids, in commit order."""
        touched: list[str] = []
        verified = record.outcome.verified
        for sid, token in new_tokens:
            seq = self.books.sample_of(sid)
            v = verified.get(sid)
            if v is None:
                emitted = [(token, record.logprobs.get(sid))]
            else:
                seq.num_draft_tokens += v.num_drafts
                seq.num_accepted_tokens += v.num_accepted
                self.num_draft_tokens += v.num_drafts
                self.num_accepted_tokens += v.num_accepted
                self.num_verifications += 1
                emitted = _verified_tokens(record, sid, v)
            for t, logprob in emitted:
                # A failed sample's token is a placeholder, not the model's: never shown.
                if not sample_failed(logprob) and seq.pending_stop is None:
                    seq.append(t, logprob)
            touched.append(sid)
        return touched

    def _close_finished(
        self, finished: Sequence[str], failed: Sequence[str], touched: list[str]
    ) -> None:
        """Sequences the scheduler finished in the step (max_tokens, a stop id, a limit),
        with its reason; a failed sample ends with ``error`` instead (:meth:`_end_failed`).
        Adds to ``touched`` what now has a final output."""
        for sid in finished:
            seq = self.books.sample_of(sid)
            if seq.finished or sid in failed:
                continue
            req = seq.request
            assert req is not None and req.finish_reason is not None
            if seq.index == 0 and not seq.token_ids:  # ended before its first token
                group = self.books.group_of(seq.request_id)
                touched.extend(self.fanout.close_unforked(group, req.finish_reason.value))
            if seq.pending_stop is not None:  # a stop string on the same token wins
                seq.finish(FinishReason.STOP.value, seq.pending_stop)
                continue
            stopped_by_token = req.finish_reason is FinishReason.STOP and seq.token_ids
            seq.finish(req.finish_reason.value, seq.token_ids[-1] if stopped_by_token else None)
            if sid not in touched:
                touched.append(sid)

    def _end_failed(self, failed: Sequence[str], now_ms: float) -> None:
        """End each failed sample with ``error``, at the step boundary like a stop string:
        the step committed for everyone (the placeholder token included) and only this
        request ends. Its placeholder may already have ended it in commit (max_tokens, a
        stop id): then only the reason is corrected; the token is still not shown."""
        for sid in failed:
            if sid in self.scheduler.requests:
                self.scheduler.finish(sid, FinishReason.ERROR, now_ms)
            self.books.sample_of(sid).finish(FinishReason.ERROR.value, None)

    def _end_at_stop_strings(self, touched: Sequence[str], now_ms: float) -> None:
        """End the sequences whose text reached a stop string (the scheduler does not
        know about stop strings: the request is finished from here)."""
        for sid in touched:
            seq = self.books.sample_of(sid)
            if seq.pending_stop is not None and not seq.finished:
                if sid in self.scheduler.requests:
                    self.scheduler.finish(sid, FinishReason.STOP, now_ms)
                seq.finish(FinishReason.STOP.value, seq.pending_stop)


def _verified_tokens(record: StepRecord, sid: str, v: Outcome) -> list[tuple[int, float | None]]:
    """The tokens a verification gave ``sid``, each with its logprob: the accepted
    drafts, then the target's token, as the commit kept them (cut at a stop,
    docs/SPECULATIVE.md). The executor's logprobs cover the whole verification, so they
    are matched by position: after a cut, ``record.logprobs`` (the target token's) is
    not the last kept token's."""
    per_token = record.verified_logprobs.get(sid)
    target = record.logprobs.get(sid) if len(v.tokens) == v.num_accepted + 1 else None
    return [
        (t, per_token[j] if per_token is not None else (target if j == v.num_accepted else None))
        for j, t in enumerate(v.tokens)
    ]


def _last_logprob(record: StepRecord, sid: str) -> float | None:
    """The logprob of the last token a step gave ``sid`` (NaN: its row failed)."""
    v = record.outcome.verified.get(sid)
    return record.logprobs.get(sid) if v is None else _verified_tokens(record, sid, v)[-1][1]
