"""The engine's outputs: what a step produced for each sequence
(:class:`RequestOutput`), a finished request of ``generate`` (:class:`GenerationResult`),
speculative decoding's figures (:class:`SpeculationStats`), and the collector that builds
outputs from the engine's samples and holds those the next step delivers
(:class:`Outputs`; ref/engine/llm_engine.py, module doc, "Faults")."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from refserve.core.request_metrics import RequestMetrics
from refserve.engine.samples import Sample, SampleBook
from refserve.model.executor import ModelExecutor


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one sequence (``index`` is the sample, 0..n-1).

    ``new_*`` fields are this step's delta; ``text`` / ``token_ids`` are cumulative over
    the current turn (``turn``: 0, then one more after each :meth:`LLMEngine.resume`).
    ``text`` may lag ``token_ids`` by a few characters while they could still be the
    start of a stop string, or while a UTF-8 character is incomplete; the output that
    :meth:`LLMEngine.pause` queues carries that held-back text (no new tokens).
    """

    request_id: str
    index: int
    new_text: str
    new_token_ids: tuple[int, ...]
    new_logprobs: tuple[float, ...] | None
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None
    finished: bool
    finish_reason: str | None
    stop_reason: str | int | None
    metrics: RequestMetrics
    turn: int = 0


@dataclass(frozen=True)
class GenerationResult:
    """A finished request of :meth:`LLMEngine.generate`: one final output per sample."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[RequestOutput, ...]


@dataclass(frozen=True)
class SpeculationStats:
    """Speculative decoding over an engine's life (docs/SPECULATIVE.md): verifications
    (a request's step with drafts), drafts verified and drafts accepted."""

    num_verifications: int
    num_draft_tokens: int
    num_accepted_tokens: int

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / verified drafts; None before any draft."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted(self) -> float | None:
        """Drafts accepted per verification (each also emits one token of the target's)."""
        n = self.num_verifications
        return self.num_accepted_tokens / n if n else None

    def __str__(self) -> str:
        rate = self.acceptance_rate
        shown = "n/a" if rate is None else f"{100 * rate:.1f} %"
        return (
            f"{self.num_accepted_tokens} of {self.num_draft_tokens} drafts accepted ({shown}) "
            f"in {self.num_verifications} verifications"
        )


class Outputs:
    """Builds outputs from the engine's samples (:meth:`collect`) and keeps the outputs
    held for the next step (an abort's final output, the text a pause flushes, what a
    drive loop's caller did not want), in order, each delivered once."""

    def __init__(self, books: SampleBook, executor: ModelExecutor) -> None:
        self.books = books
        self.executor = executor
        self._held: list[RequestOutput] = []

    def __bool__(self) -> bool:
        """Some output is held."""
        return bool(self._held)

    def hold(self, outputs: Sequence[RequestOutput]) -> None:
        """Keep ``outputs`` for the next step, after those held already."""
        self._held.extend(outputs)

    def take(self, wants: Callable[[RequestOutput], bool] | None = None) -> list[RequestOutput]:
        """Remove the held outputs ``wants`` (all, for None) and return them; the rest
        stay, in order."""
        taken: list[RequestOutput] = []
        kept: list[RequestOutput] = []
        for o in self._held:
            (taken if wants is None or wants(o) else kept).append(o)
        self._held = kept
        return taken

    def holds_for(self, request_id: str) -> bool:
        """Some held output is of ``request_id``."""
        return any(o.request_id == request_id for o in self._held)

    def collect(self, seq_ids: Sequence[str]) -> list[RequestOutput]:
        """The outputs of the samples ``seq_ids`` (each once, in that order): what each
        produced since its last output; a finished sample's final output retires it."""
        outs: list[RequestOutput] = []
        for sid in dict.fromkeys(seq_ids):
            seq = self.books.sample(sid)
            if seq is None:
                continue
            new_ids = tuple(seq.token_ids[seq.delivered_tokens :])
            new_lp = None if seq.logprobs is None else tuple(seq.logprobs[seq.delivered_tokens :])
            seq.delivered_tokens = len(seq.token_ids)
            ended = seq.finished or seq.paused  # the turn's text is complete
            outs.append(
                RequestOutput(
                    request_id=seq.request_id,
                    index=seq.index,
                    new_text=seq.stream.take(final=ended),
                    new_token_ids=new_ids,
                    new_logprobs=new_lp,
                    text=seq.stream.text if ended else seq.stream.emitted_text,
                    token_ids=tuple(seq.token_ids),
                    logprobs=None if seq.logprobs is None else tuple(seq.logprobs),
                    finished=seq.finished,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    metrics=self.metrics(seq),
                    turn=seq.turn,
                )
            )
            if seq.finished:
                self._retire(seq)
        return outs

    def metrics(self, seq: Sample) -> RequestMetrics:
        """The sample's figures for its output (a fork without a request of its own
        reports its parent's)."""
        req = seq.request if seq.request is not None else seq.metrics_from
        assert req is not None
        group = self.books.group(seq.request_id)
        # A resumed turn's figures are the turn's: its token times, from its resume.
        first = seq.times_from
        times = tuple(req.token_times_ms[first : first + len(seq.token_ids)])
        return RequestMetrics(
            request_id=seq.seq_id,
            arrival_ms=req.arrival_ms if seq.turn_arrival_ms is None else seq.turn_arrival_ms,
            admitted_ms=req.admitted_ms if seq.turn == 0 else None,
            token_times_ms=times,
            finished_ms=req.finished_ms if seq.finished else None,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=len(seq.token_ids),
            num_cached_tokens=req.num_cached_tokens,
            num_preemptions=req.num_preemptions,
            num_draft_tokens=seq.num_draft_tokens,
            num_accepted_tokens=seq.num_accepted_tokens,
            migrations=tuple(group.migrations) if group is not None else (),
            displacements=tuple(group.displacements) if group is not None else (),
        )

    def _retire(self, seq: Sample) -> None:
        self.executor.unregister(seq.seq_id)
        self.books.retire(seq)
