"""``n > 1``: the samples 1..n-1 of a request, forked off sample 0 after its first
token, or closed without a token when the request ended before it (ref/engine/llm_engine.py,
module doc, "n > 1").

The request runs its prompt once. Its last prefill step draws all ``n`` first tokens
from the same logits; sample 0 continues as the request itself and samples 1..n-1 are
forked off it through :meth:`Scheduler.fork` (every block shared, the partial last block
copied on the first write), so the prompt's K/V is never recomputed. Sample ``i`` has the
id ``<request id>#<i>`` (``FORK_SEPARATOR``, ref/engine/intake.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from refserve.core.executor import DrawnToken
from refserve.core.request import FinishReason, Request
from refserve.core.scheduler import Scheduler
from refserve.engine.samples import SampleBook, SampleGroup, sample_spec
from refserve.model.executor import ModelExecutor
from refserve.model.sampler import derive_seed, sample_failed


class SampleFanOut:
    """Forks and closes the samples 1..n-1 of the engine's requests (module doc);
    ``num_forks`` counts the samples forked live over the engine's life."""

    def __init__(self, scheduler: Scheduler, executor: ModelExecutor, books: SampleBook) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.books = books
        self.num_forks = 0

    def fork(
        self,
        parent_id: str,
        samples: Sequence[DrawnToken],
        parent_finished: bool,
        parent_failed: bool = False,
    ) -> list[str]:
        """Samples 1..n-1 of ``parent_id`` after its first token; their ids, each with
        an output to collect.

        A sample the sampler could not draw ends with ``error`` and no token. When the
        parent's own sample failed, so do all of them: they come from the same row of
        logits, and the parent (about to end with ``error``) has nothing to fork from.
        """
        parent = self.books.sample_of(parent_id)
        group = self.books.group_of(parent.request_id)
        group.forked = True
        self.executor.forked(parent_id)
        preq = parent.request
        assert preq is not None
        assert len(samples) == len(group.child_ids), "one first token per sample 1..n-1"
        out: list[str] = []
        for i, drawn in enumerate(samples, start=1):
            if parent_failed or sample_failed(drawn.logprob):
                out.append(self._tokenless_sample(group, i, preq, FinishReason.ERROR.value))
            else:
                out.append(self._forked_sample(group, i, preq, drawn, parent_finished))
        if not parent_finished and not parent_failed:
            preq.stop = group.stop  # the real stop conditions, from the second token on
            if preq.request_id in self.scheduler.batch:
                # The bulk decode path reads the stop ids off the request's batch row.
                self.scheduler.batch.reload(preq, self.scheduler.pool)
            token = parent.token_ids[-1]
            if group.stop.is_stop(token) and parent.pending_stop is None:
                parent.pending_stop = token
        return out

    def close_unforked(self, group: SampleGroup, reason: str) -> list[str]:
        """Final outputs for samples 1..n-1 of a request that ended before its first token
        (so before they were forked): each ends like sample 0, with no tokens."""
        if group.forked or len(group.seqs) > 1 or not group.child_ids:
            return []  # forked already (forks come with the first token), or n == 1
        group.forked = True
        parent = group.seqs[0]
        preq = parent.request
        assert preq is not None
        self.executor.forked(parent.seq_id)  # their specs will never be drawn
        return [
            self._tokenless_sample(group, i, preq, reason)
            for i in range(1, len(group.child_ids) + 1)
        ]

    def _forked_sample(
        self,
        group: SampleGroup,
        index: int,
        parent: Request,
        drawn: DrawnToken,
        parent_finished: bool,
    ) -> str:
        """Sample ``index`` (>= 1) with its first token ``drawn``: a live request forked off
        ``parent`` in the scheduler, or, when the parent finished or the token stops it,
        a sequence finished on that token. Returns its id."""
        cid = group.child_ids[index - 1]
        is_stop = group.stop.is_stop(drawn.token)
        live = not parent_finished and not is_stop
        child_req = None
        if live:
            child_req = self.scheduler.fork(parent.request_id, cid, drawn.token, group.stop)
            self.executor.register(cid, sample_spec(group.params, derive_seed(group.seed, index)))
            self.num_forks += 1
        seq = self.books.new_sample(
            cid, group.request_id, index, child_req, group.params, group.prompt_token_ids
        )
        seq.metrics_from = None if live else parent
        group.seqs.append(seq)
        seq.append(drawn.token, drawn.logprob)
        if child_req is not None and child_req.finish_reason is not None:
            seq.finish(child_req.finish_reason.value, None)  # could never fit
        elif not live:
            reason = FinishReason.STOP if is_stop else FinishReason.LENGTH
            seq.finish(reason.value, drawn.token if is_stop else None)
        return cid

    def _tokenless_sample(
        self, group: SampleGroup, index: int, parent: Request, reason: str
    ) -> str:
        """Sample ``index`` (>= 1), never forked, finished with ``reason`` and no tokens;
        its metrics are the parent request's. Returns its id."""
        cid = group.child_ids[index - 1]
        seq = self.books.new_sample(
            cid, group.request_id, index, None, group.params, group.prompt_token_ids
        )
        seq.metrics_from = parent
        group.seqs.append(seq)
        seq.finish(reason, None)
        return cid
