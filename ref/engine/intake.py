"""Request intake, shared by the engine (ref/engine/llm_engine.py) and the cluster
(ref/cluster/cluster.py): a request id and a prompt are checked the same way in both,
with the same typed errors and messages, before anything is registered."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import cast

from refserve.core.request import StopParams, check_room_for_output
from refserve.errors import DuplicateRequest, InvalidArgument
from refserve.model.config import ModelConfig
from refserve.model.sampler import InvalidSamplingParams, SamplingParams
from refserve.model.tokenizer import Tokenizer
from refserve.values import is_int

Prompt = str | Sequence[int]

#: Joins a request id and a sample index into the internal id of samples 1..n-1
#: (``"x#2"``); caller-chosen request ids may not contain it, so no caller id can ever
#: name a sample that another request is about to fork.
FORK_SEPARATOR = "#"


class InvalidPrompt(InvalidArgument):
    """The prompt is empty, too long, or has token ids outside the vocabulary."""


def check_request_id(
    request_id: str | None, in_use: Callable[[str], bool], draw: Callable[[], str]
) -> str:
    """The id of a new request: the caller's, checked (a non-empty str without
    :data:`FORK_SEPARATOR`, else :class:`InvalidArgument`; not ``in_use``, else
    :class:`DuplicateRequest`), or, for None, the first id ``draw()`` gives that is not
    in use."""
    if request_id is None:
        while True:
            rid = draw()
            if not in_use(rid):
                return rid
    if not isinstance(request_id, str) or not request_id:
        raise InvalidArgument(f"request_id must be a non-empty str, got {request_id!r}")
    if FORK_SEPARATOR in request_id:
        # Sample ids "<id>#<i>" are the engine's: "x#1" taken by a caller would collide
        # with sample 1 of "x" when it forks, after its step committed.
        raise InvalidArgument(
            f"request_id must not contain {FORK_SEPARATOR!r} (reserved for the ids of "
            f"samples 1..n-1, '<id>{FORK_SEPARATOR}<i>'), got {request_id!r}"
        )
    if in_use(request_id):
        raise DuplicateRequest(request_id, "add_request")
    return request_id


def prompt_token_ids(
    prompt: Prompt, vocab_size: int, encode: Callable[[str], list[int]], *, what: str = "prompt"
) -> list[int]:
    """``prompt`` as token ids (text through ``encode``), each checked against the
    vocabulary; :class:`InvalidPrompt` names what is wrong (``what``: the prompt, or a
    tool's output)."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidPrompt(f"{what} is an empty string")
        ids = encode(prompt)
    elif isinstance(prompt, Sequence) and not isinstance(prompt, bytes | bytearray):
        ids = list(cast("Sequence[int]", prompt))  # each element is checked below
    else:
        raise InvalidPrompt(
            f"{what} must be a str or a sequence of token ids, got {type(prompt).__name__}"
        )
    if not ids:
        raise InvalidPrompt(f"{what} has no tokens")
    for i, t in enumerate(ids):
        if not is_int(t) or not 0 <= t < vocab_size:
            raise InvalidPrompt(
                f"{what} token {i} is {t!r}; token ids must be ints in [0, {vocab_size})"
            )
    return ids


def check_room(num_tokens: int, max_model_len: int, subject: str) -> None:
    """A prompt or resumed turn must leave room for an output token under
    ``max_model_len`` (:func:`refserve.core.request.check_room_for_output`), raising
    :class:`InvalidPrompt`."""
    check_room_for_output(
        num_tokens,
        max_model_len,
        subject=subject,
        limit=f"max_model_len is {max_model_len}",
        error=InvalidPrompt,
    )


def sampling_params(params: SamplingParams | Mapping[str, object] | None) -> SamplingParams:
    """The caller's sampling params, checked (:class:`InvalidSamplingParams`)."""
    if params is None:
        return SamplingParams()
    if isinstance(params, SamplingParams):
        # Built again, so validated again: a frozen dataclass can still be altered with
        # object.__setattr__, and a value that cannot be sampled must not reach a step.
        return replace(params)
    if isinstance(params, Mapping):
        return SamplingParams.from_dict(params)
    raise InvalidSamplingParams(
        f"params must be SamplingParams or a mapping, got {type(params).__name__}"
    )


class Intake:
    """An engine's intake: what a new request or turn is made of, checked with the
    module's rules against this engine's tokenizer, vocabulary and length limit; the ids
    it draws and the seeds of unseeded requests (one random stream, from the engine's
    seed)."""

    def __init__(
        self, tokenizer: Tokenizer, model_config: ModelConfig, max_model_len: int, seed: int
    ) -> None:
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.max_model_len = max_model_len
        self._rng = random.Random(seed)
        self._next_id = 0

    def prompt_ids(
        self, prompt: Prompt, *, what: str = "prompt", add_special_tokens: bool = True
    ) -> list[int]:
        """:func:`prompt_token_ids` with this engine's tokenizer and vocabulary."""

        def encode(text: str) -> list[int]:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

        return prompt_token_ids(prompt, self.model_config.vocab_size, encode, what=what)

    def check_room(self, num_tokens: int, subject: str) -> None:
        """:func:`check_room` under this engine's ``max_model_len``."""
        check_room(num_tokens, self.max_model_len, subject)

    def new_id(self, request_id: str | None, in_use: Callable[[str], bool]) -> str:
        """:func:`check_request_id`, drawing ``req-<k>`` for None."""
        return check_request_id(request_id, in_use, self._draw_id)

    def _draw_id(self) -> str:
        self._next_id += 1
        return f"req-{self._next_id - 1}"

    def stop_params(self, sp: SamplingParams) -> StopParams:
        """The scheduler's stop rule for ``sp``: its stop ids and the model's end tokens
        (the tokenizer's when the model names none)."""
        eos_ids = self.model_config.eos_token_ids
        tok_eos = self.tokenizer.eos_token_id
        if not eos_ids and tok_eos is not None:
            eos_ids = (tok_eos,)
        extra = () if sp.ignore_eos else eos_ids[1:]
        return StopParams(
            max_tokens=sp.max_tokens,
            stop_token_ids=tuple(dict.fromkeys((*sp.stop_token_ids, *extra))),
            eos_token_id=eos_ids[0] if eos_ids else None,
            ignore_eos=sp.ignore_eos,
        )

    def seed(self, seed: int | None) -> int:
        """``seed``, or a fresh draw of this engine's random stream for None."""
        return seed if seed is not None else self._rng.randrange(1 << 62)
