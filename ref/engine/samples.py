"""The engine's books of one request: its samples (the request and its forks) and what
they share (ref/engine/llm_engine.py keeps them; ref/engine/migration.py carries them
to another engine)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from refserve.core.migration_cost import MigrationDecision
from refserve.core.mlfq import MlfqChoice
from refserve.core.request import Request, StopParams
from refserve.model.sampler import SampleSpec, SamplingParams
from refserve.model.tokenizer import TextStream, Tokenizer


@dataclass
class Sample:
    """One sampled sequence (the request itself, or a fork of it)."""

    seq_id: str
    request_id: str
    index: int
    request: Request | None  # None for a fork that finished on its first token
    stream: TextStream
    logprobs: list[float] | None
    token_ids: list[int] = field(default_factory=list)
    delivered_tokens: int = 0
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    pending_stop: str | int | None = None  # a stop the scheduler does not know about
    metrics_from: Request | None = None  # for a fork without its own request
    # Agent turns: the turn this sequence is, whether it is paused for a tool, where its
    # token times start in the request's (which span every turn) and when it arrived.
    turn: int = 0
    paused: bool = False
    times_from: int = 0
    turn_arrival_ms: float | None = None
    # Speculative decoding: drafts verified for this sequence, and those accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def append(self, token: int, logprob: float | None) -> None:
        """One more token (a missing logprob recorded as NaN); a stop string it
        completes is noted in ``pending_stop``, for the step boundary to end it."""
        self.token_ids.append(token)
        if self.logprobs is not None:
            self.logprobs.append(float("nan") if logprob is None else logprob)
        if self.stream.add(token) and self.pending_stop is None:
            self.pending_stop = self.stream.stopped_by

    def finish(self, reason: str, stop_reason: str | int | None) -> None:
        """The sequence ends with ``reason``; its held-back text is released."""
        self.finished = True
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.stream.finish()


@dataclass
class SampleGroup:
    """The samples of one request (n of them) and what they share: params, stop rule,
    prompt and seed; ``turn`` counts agent turns."""

    request_id: str
    params: SamplingParams
    stop: StopParams
    prompt_token_ids: tuple[int, ...]
    seed: int
    seqs: list[Sample]
    child_ids: tuple[str, ...]
    turn: int = 0
    # Samples 1..n-1 were forked off sample 0 (or closed without a token): after that the
    # group's live samples may be any subset (a migrated group carries only those).
    forked: bool = False
    # Each migration of this request: the rule's decision and its inputs (docs/MIGRATION.md).
    migrations: list[MigrationDecision] = field(default_factory=list)
    # Each time the MLFQ displaced this request: the choice and its inputs (docs/MLFQ.md).
    displacements: list[MlfqChoice] = field(default_factory=list)


def sample_spec(sp: SamplingParams, seed: int) -> SampleSpec:
    """The sampler's spec of one sample drawn with ``seed`` under ``sp``."""
    return SampleSpec(
        temperature=float(sp.temperature),
        top_k=sp.top_k,
        top_p=float(sp.top_p),
        seed=seed,
        logprobs=sp.logprobs,
    )


class SampleBook:
    """The engine's books: the sample group of every live request, and every sample not
    yet retired, by id (a sample's final output retires it). The engine and its
    migration read and change them only through these methods."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._groups: dict[str, SampleGroup] = {}
        self._samples: dict[str, Sample] = {}

    def __bool__(self) -> bool:
        return bool(self._groups)

    @property
    def request_ids(self) -> tuple[str, ...]:
        """The live requests, in the order they joined."""
        return tuple(self._groups)

    @property
    def sample_ids(self) -> tuple[str, ...]:
        """The samples not retired yet, in the order they were booked."""
        return tuple(self._samples)

    def group(self, request_id: str) -> SampleGroup | None:
        """The live request's group, or None."""
        return self._groups.get(request_id)

    def sample(self, seq_id: str) -> Sample | None:
        """The sample ``seq_id`` (not retired yet), or None."""
        return self._samples.get(seq_id)

    def group_of(self, request_id: str) -> SampleGroup:
        """The live request's group (a KeyError if it has none)."""
        return self._groups[request_id]

    def sample_of(self, seq_id: str) -> Sample:
        """The sample ``seq_id`` (a KeyError if it is not booked)."""
        return self._samples[seq_id]

    def has_request(self, request_id: str) -> bool:
        return request_id in self._groups

    def has_sample(self, seq_id: str) -> bool:
        return seq_id in self._samples

    def new_sample(
        self,
        seq_id: str,
        request_id: str,
        index: int,
        req: Request | None,
        sp: SamplingParams,
        prompt_ids: Sequence[int],
    ) -> Sample:
        """A new sample, booked: its text stream starts after ``prompt_ids``."""
        stream = TextStream(
            self._tokenizer.detokenizer(prompt_ids),
            sp.stop,
            include_stop_str_in_output=sp.include_stop_str_in_output,
        )
        seq = Sample(seq_id, request_id, index, req, stream, [] if sp.logprobs else None)
        self._samples[seq_id] = seq
        return seq

    def open(self, group: SampleGroup) -> None:
        """A request joins (its samples booked with :meth:`new_sample`)."""
        self._groups[group.request_id] = group

    def retire(self, seq: Sample) -> None:
        """A finished sample's final output is out: it leaves the books, and its group
        with it when every sample of the group is finished. Forks happen in the step
        that samples the first token, before outputs are collected, so a group whose
        current samples are all finished is done."""
        del self._samples[seq.seq_id]
        group = self._groups.get(seq.request_id)
        if group is not None and all(s.finished for s in group.seqs):
            del self._groups[seq.request_id]

    def close(self, request_id: str) -> SampleGroup:
        """The request leaves (migrated away): its group and every sample of it."""
        group = self._groups.pop(request_id)
        for seq in group.seqs:
            self._samples.pop(seq.seq_id, None)
        return group
