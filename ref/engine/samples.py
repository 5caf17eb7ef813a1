"""The engine's books of one request: its samples (the request and its forks) and what
they share (ref/engine/llm_engine.py keeps them; ref/engine/migration.py carries them
to another engine)."""

from __future__ import annotations

from dataclasses import dataclass, field

from refserve.core.migration_cost import MigrationDecision
from refserve.core.request import Request, StopParams
from refserve.model.sampler import SampleSpec, SamplingParams
from refserve.model.tokenizer import TextStream


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


def sample_spec(sp: SamplingParams, seed: int) -> SampleSpec:
    """The sampler's spec of one sample drawn with ``seed`` under ``sp``."""
    return SampleSpec(
        temperature=float(sp.temperature),
        top_k=sp.top_k,
        top_p=float(sp.top_p),
        seed=seed,
        logprobs=sp.logprobs,
    )
