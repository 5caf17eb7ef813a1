"""The loops that step an engine for a caller (ref/engine/llm_engine.py:
``iter_outputs``, ``stream``, ``generate``): one drive loop (:func:`drive`) that differs
only in which outputs the caller takes and when it stops, and a ``generate`` call's
batch, added all or none (:func:`add_batch`) and dropped on failure (:func:`drop`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from refserve.engine.intake import Prompt
from refserve.engine.outputs import Outputs, RequestOutput
from refserve.engine.samples import SampleBook
from refserve.errors import InvalidArgument, RefserveError
from refserve.model.sampler import SamplingParams


class EngineStalled(RefserveError):
    """Steps keep scheduling nothing while requests are unfinished (a scheduler bug)."""


#: How many passes of a drive loop in a row may produce no output before it raises
#: :class:`EngineStalled` (``LLMEngine.iter_outputs``, ``stream``, ``generate``).
MAX_IDLE_STEPS = 10_000


def drive(
    outputs: Outputs,
    can_step: Callable[[], bool],
    step: Callable[[], list[RequestOutput]],
    wants: Callable[[RequestOutput], bool],
    done: Callable[[], bool],
    what: str,
    max_idle_steps: int = MAX_IDLE_STEPS,
) -> Iterator[RequestOutput]:
    """The one loop that steps an engine for a caller: until ``done()``, yield the held
    outputs the caller ``wants`` or, when none is held, ``step()`` once (if
    ``can_step()``) and yield the wanted outputs it produced. Every other output stays
    held for the engine's ``step``, in order.

    ``max_idle_steps`` passes in a row without a single output (held or produced,
    wanted or not) raise :class:`EngineStalled`: requests are unfinished, yet nothing
    comes out of them.
    """
    idle = 0
    while not done():
        mine = outputs.take(wants)
        produced = bool(mine)
        if not mine and can_step():
            fresh = step()
            produced = bool(fresh)
            mine = [o for o in fresh if wants(o)]
            outputs.hold([o for o in fresh if not wants(o)])
        idle = 0 if produced else idle + 1
        if idle > max_idle_steps:
            raise EngineStalled(f"{what}: {max_idle_steps} steps in a row produced no output")
        yield from mine


class Batching(Protocol):
    """What a ``generate`` call's batch needs of the engine."""

    books: SampleBook
    outputs: Outputs

    def add_request(
        self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str | None = None
    ) -> str: ...

    def abort(self, request_id: str) -> None: ...


def add_batch(
    engine: Batching,
    batch: Sequence[Prompt],
    params: SamplingParams | Sequence[SamplingParams] | None,
) -> list[str]:
    """Add every prompt of a ``generate`` call, or none: a rejected one drops those
    already added (:func:`drop`) and the error is raised."""
    if params is None or isinstance(params, SamplingParams):
        plist: list[SamplingParams | None] = [params] * len(batch)
    else:
        plist = list(params)
        if len(plist) != len(batch):
            raise InvalidArgument(
                f"generate: {len(batch)} prompts but {len(plist)} sampling params"
            )
    ids: list[str] = []
    try:
        for p, sp in zip(batch, plist, strict=True):
            ids.append(engine.add_request(p, sp))
    except BaseException:
        drop(engine, ids)
        raise
    return ids


def drop(engine: Batching, ids: Sequence[str]) -> None:
    """Abort the requests ``ids`` that are still live and drop every output of theirs
    held for the engine's ``step`` (a ``generate`` call that fails takes its own
    requests with it, and only those)."""
    for rid in ids:
        if engine.books.has_request(rid):
            with contextlib.suppress(RefserveError):  # the first error is the one
                engine.abort(rid)
    gone = set(ids)
    engine.outputs.take(lambda o: o.request_id in gone)


def as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (text or token ids) or several, as a list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int):
        return [prompts]  # type: ignore[list-item]
    return list(prompts)  # type: ignore[arg-type]
