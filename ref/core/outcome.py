"""What a commit did: one record per request, built once (docs/ARCHITECTURE.md, "One
step", stage 5).

``Scheduler.commit`` returns a :class:`StepOutcome`; the engine turns it into outputs and
the simulator into metrics, and neither re-derives anything from the requests. Every
request the commit changed appears exactly once: the steady decodes of the bulk path
(one token kept, still running) as two parallel columns, since a thousand of them must
not cost a thousand Python objects per step (docs/ARCHITECTURE.md, "The persistent
batch"), and every other request (a prefill chunk, a per-request decode, a verification,
a preemption, a finish) as one :class:`Outcome`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from refserve.core.request import FinishReason

Ints = npt.NDArray[np.int64]


class Outcome(NamedTuple):
    """One request's part of a commit (a named tuple: the per-request path makes one for
    every request it commits, and a named tuple is made in a quarter of a frozen
    dataclass's time, measured at 0.56 against 2.1 us; frozen all the same).

    ``tokens`` are the tokens it kept, in order: none for a prefill chunk that does not
    sample, one for a decode, up to ``num_drafts + 1`` for a verification
    (docs/SPECULATIVE.md: the accepted drafts, then the target's own token, cut at a
    stop). ``finish`` says why it finished in this commit, if it did, and
    ``blocks_freed`` how many device blocks its table gave back then (a shared block stays
    held by its other holders). ``preempted``: it left the running set to wait again, by
    recompute or swap; its blocks were released when the step was planned, inside the
    step's transaction, so it has none to give back here.
    """

    request_id: str
    tokens: tuple[int, ...] = ()
    finish: FinishReason | None = None
    blocks_freed: int = 0
    preempted: bool = False
    num_drafts: int = 0
    num_accepted: int = 0


@dataclass(frozen=True)
class StepOutcome:
    """A commit's outcomes: ``decoded_ids[i]`` kept the one token ``decoded_tokens[i]``
    and runs on (the bulk decodes, in running order); ``outcomes`` are every other
    request the commit changed, each once, in the order the commit changed them
    (preemptions, finishes of the bulk decodes, the plan's other entries, the plan's
    finishes without computing)."""

    decoded_ids: Sequence[str]
    decoded_tokens: Ints
    outcomes: tuple[Outcome, ...]

    def __post_init__(self) -> None:
        assert len(self.decoded_ids) == len(self.decoded_tokens), "parallel columns"

    def last_tokens(self) -> Iterator[tuple[str, int]]:
        """``(request id, the last token it kept)`` for each request that kept any:
        the bulk decodes first, then the others in commit order."""
        yield from zip(self.decoded_ids, self.decoded_tokens.tolist(), strict=True)
        for o in self.outcomes:
            if o.tokens:
                yield o.request_id, o.tokens[-1]

    @cached_property
    def finished(self) -> tuple[str, ...]:
        """The requests that finished, in the order they did."""
        return tuple(o.request_id for o in self.outcomes if o.finish is not None)

    @cached_property
    def preempted(self) -> tuple[str, ...]:
        return tuple(o.request_id for o in self.outcomes if o.preempted)

    @cached_property
    def verified(self) -> Mapping[str, Outcome]:
        """The requests that verified drafts (docs/SPECULATIVE.md), by id."""
        return {o.request_id: o for o in self.outcomes if o.num_drafts}
