"""The request state machine and its fields (docs/ARCHITECTURE.md, "Vocabulary").

WAITING -> PREFILLING -> DECODING -> FINISHED, with PREEMPTED (blocks released, every
token id kept, back to the waiting queue), SWAPPED (preempted with its KV copied to the
host pool, back to the waiting queue with ``num_computed_tokens`` kept), WAITING_TOOL
(an agent turn paused for a tool) and ABORTED reachable from any live state.
``num_computed_tokens`` (KV length) and the sampled count (``len(output_token_ids)``) are
separate fields and neither is derived from the other (KVLEN invariant).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from functools import cached_property

from refserve.errors import InvalidArgument
from refserve.spec.arith import length_limit, reaches_length
from refserve.spec.hashing import DEFAULT_NAMESPACE, Namespace
from refserve.spec.snapshot import RequestSnapshot, RequestStatus
from refserve.values import is_int

LEGAL_TRANSITIONS: dict[RequestStatus, frozenset[RequestStatus]] = {
    RequestStatus.WAITING: frozenset(
        {
            RequestStatus.PREFILLING,
            RequestStatus.DECODING,
            RequestStatus.FINISHED,
            RequestStatus.ABORTED,
        }
    ),
    RequestStatus.PREFILLING: frozenset(
        {
            RequestStatus.PREFILLING,
            RequestStatus.DECODING,
            RequestStatus.PREEMPTED,
            RequestStatus.SWAPPED,
            RequestStatus.FINISHED,
            RequestStatus.ABORTED,
        }
    ),
    RequestStatus.DECODING: frozenset(
        {
            RequestStatus.DECODING,
            RequestStatus.PREEMPTED,
            RequestStatus.SWAPPED,
            RequestStatus.WAITING_TOOL,
            RequestStatus.FINISHED,
            RequestStatus.ABORTED,
        }
    ),
    RequestStatus.PREEMPTED: frozenset(
        {
            RequestStatus.PREFILLING,
            RequestStatus.DECODING,
            RequestStatus.FINISHED,
            RequestStatus.ABORTED,
        }
    ),
    RequestStatus.SWAPPED: frozenset(
        {
            RequestStatus.DECODING,
            RequestStatus.PREFILLING,
            RequestStatus.ABORTED,
            RequestStatus.FINISHED,
        }
    ),
    RequestStatus.WAITING_TOOL: frozenset(
        {
            RequestStatus.PREFILLING,
            RequestStatus.WAITING,
            RequestStatus.SWAPPED,
            RequestStatus.FINISHED,
            RequestStatus.ABORTED,
        }
    ),
    RequestStatus.FINISHED: frozenset(),
    RequestStatus.ABORTED: frozenset(),
}


class IllegalTransition(InvalidArgument):
    """A state change the request state machine does not allow."""


class FinishReason(StrEnum):
    STOP = "stop"  # eos or a stop token id
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"
    CAPACITY = "capacity"  # a lone request that can never grow in this pool
    TIMEOUT = "timeout"  # waited past the queue timeout without being admitted
    # Its logits could not be sampled (a non-finite row): this request alone ends, the
    # step commits for everyone else (ref/model/sampler.py; docs/GUIDE.md, "The engine
    # from Python").
    ERROR = "error"


@dataclass(frozen=True)
class StopParams:
    """When to stop sampling: ``max_tokens`` outputs, eos, or a stop token id."""

    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    eos_token_id: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not is_int(self.max_tokens):
            raise InvalidArgument(f"max_tokens must be an int, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise InvalidArgument(f"max_tokens must be >= 1, got {self.max_tokens}")

    @cached_property
    def stopping_ids(self) -> frozenset[int]:
        """The stop rule, the one place it is written: the token ids that end sampling,
        each stop token id and eos unless ``ignore_eos``. :meth:`is_stop` asks it for one
        token (the scheduler's per-request commit, the engine's fork); the persistent
        batch loads it into a row of its stop-id matrix for the bulk commit."""
        ids = set(self.stop_token_ids)
        if self.eos_token_id is not None and not self.ignore_eos:
            ids.add(self.eos_token_id)
        return frozenset(ids)

    def is_stop(self, token: int) -> bool:
        return token in self.stopping_ids


@dataclass(slots=True)
class Request:
    """One generation request. Timestamps are in ms on the engine's clock.

    Slotted: the bulk commit writes ``num_computed_tokens`` of every running request each
    step, and a slot is one cache line fewer to touch than an instance dict.
    """

    request_id: str
    prompt_token_ids: list[int]
    stop: StopParams = field(default_factory=StopParams)
    arrival_ms: float = 0.0
    priority: int = 0
    tenant: str = "default"
    namespace: Namespace = DEFAULT_NAMESPACE
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    # Order of arrival at the scheduler; ties in arrival_ms keep submission order.
    seq: int = 0
    # The step at which it last entered the waiting queue (aging counts from here).
    queued_step: int = 0
    # Metrics (ms on the engine clock).
    admitted_ms: float | None = None
    token_times_ms: list[float] = field(default_factory=list)
    finished_ms: float | None = None

    # Prompt then sampled tokens in one list: the pool slices new positions out of it
    # each step without building a concatenation.
    token_ids: list[int] = field(init=False)
    num_prompt_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_done(self) -> bool:
        return self.status.is_done

    def transition(self, new: RequestStatus) -> None:
        if new not in LEGAL_TRANSITIONS[self.status]:
            raise IllegalTransition(
                f"request {self.request_id!r}: illegal transition {self.status} -> {new}"
            )
        self.status = new

    def snapshot(self, max_model_len: int) -> RequestSnapshot:
        return RequestSnapshot(
            request_id=self.request_id,
            status=self.status,
            num_prompt_tokens=self.num_prompt_tokens,
            num_output_tokens=self.num_output_tokens,
            num_computed_tokens=self.num_computed_tokens,
            max_tokens=self.stop.max_tokens,
            num_cached_tokens=self.num_cached_tokens,
            max_model_len=max_model_len,
        )


def check_room_for_output(
    num_tokens: int,
    max_len: int,
    *,
    subject: str,
    limit: str,
    error: type[InvalidArgument] = InvalidArgument,
) -> None:
    """The one rule for a sequence about to be queued (a prompt, a resumed turn): it must
    leave room for at least one output token, ``num_tokens < max_len``, or it could never
    sample (docs/ARCHITECTURE.md, "Vocabulary": ``num_tokens``).

    Raises ``error`` with ``"<subject> <num_tokens> tokens; <limit>, leaving no room for an
    output token"``: ``subject`` names the sequence (``"prompt has"``), ``limit`` the cap
    that applies (``"max_model_len is 32"``).
    """
    if num_tokens >= max_len:
        raise error(f"{subject} {num_tokens} tokens; {limit}, leaving no room for an output token")


def finish_reason(r: Request, token: int, max_len: int) -> FinishReason | None:
    """After ``token`` joined ``r``: a stop id (:meth:`StopParams.is_stop`), else the
    length limit (refserve.spec.arith ``length_limit``), else None. The scheduler's commit and a
    verification ask it; the persistent batch applies the same two rules to its rows
    (ref/core/batch.py, ``commit_decodes``)."""
    if r.stop.is_stop(token):
        return FinishReason.STOP
    limit = length_limit(r.num_prompt_tokens, r.stop.max_tokens, max_len)
    if reaches_length(r.num_tokens, limit):
        return FinishReason.LENGTH
    return None


def check_new_request(request: Request, max_len: int, max_model_len: int) -> None:
    """A request fit to queue: a non-empty str id, fresh (waiting, nothing computed or
    sampled), a prompt of token ids >= 0 that leaves room for an output token within
    ``max_len`` (:func:`check_room_for_output`). Raises :class:`InvalidArgument` naming
    what is wrong."""
    rid = request.request_id
    if not isinstance(rid, str) or not rid:
        raise InvalidArgument(f"add_request: request id must be a non-empty str, got {rid!r}")
    if (
        request.status is not RequestStatus.WAITING
        or request.num_computed_tokens
        or request.num_output_tokens
    ):
        raise InvalidArgument(
            f"add_request: request {rid!r} is not fresh (status {request.status})"
        )
    if request.num_prompt_tokens < 1:
        raise InvalidArgument(f"add_request: request {rid!r} has an empty prompt")
    for t in request.prompt_token_ids:
        if not is_int(t) or t < 0:
            raise InvalidArgument(f"add_request: request {rid!r} has a bad token id {t!r}")
    check_room_for_output(
        request.num_prompt_tokens,
        max_len,
        subject=f"add_request: request {rid!r} prompt has",
        limit=(
            f"max_model_len is {max_len}"
            if max_len == max_model_len
            else f"without chunked prefill the token budget {max_len} caps the length"
        ),
    )
