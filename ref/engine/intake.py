"""Request intake, shared by the engine (ref/engine/llm_engine.py) and the cluster
(ref/cluster/cluster.py): a request id and a prompt are checked the same way in both,
with the same typed errors and messages, before anything is registered."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

from refserve.core.request import check_room_for_output
from refserve.errors import DuplicateRequest, InvalidArgument

Prompt = str | Sequence[int]

#: Joins a request id and a sample index into the internal id of samples 1..n-1
#: (``"x#2"``); caller-chosen request ids may not contain it, so no caller id can ever
#: name a sample that another request is about to fork.
FORK_SEPARATOR = "#"


class InvalidPrompt(InvalidArgument):
    """The prompt is empty, too long, or has token ids outside the vocabulary."""


def request_id(
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
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
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
