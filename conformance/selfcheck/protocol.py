"""What the self-check walks through: one small engine, ONE request, the protocol's
expected state of it (:class:`ExpectedState`), and the result a walk yields."""

from __future__ import annotations

from dataclasses import dataclass

from refserve.conformance.adapter import (
    ENGINE_ADAPTER_METHODS,
    EngineConfig,
    NotSupported,
    RequestSpec,
    StepReport,
)
from refserve.conformance.guard import AdapterCallError
from refserve.spec.snapshot import (
    ScheduledRequest,
)

CONFIG = EngineConfig(
    block_size=4,
    num_blocks=16,
    max_num_batched_tokens=16,
    max_num_seqs=4,
    enable_prefix_caching=True,
    eos_token_id=1,
)
"""The self-check's engine: small, and roomy enough that one request never has to wait,
be chunked or be preempted (every engine should accept it)."""


REQUEST = RequestSpec(
    request_id="A", prompt_token_ids=(11, 12, 13, 14, 15, 16), max_tokens=3, eos_token_id=1
)
"""The one request: a 6-token prompt (one full block and half of another at block size
4) and three outputs, so a table grows, a block fills and the request finishes by
length. The sampled tokens are 2, 3, 4, ... (never the eos id 1)."""


MAX_STEPS = 20
"""Steps after which a request that has not finished is a PROGRESS problem."""


PROTOCOL_METHODS = ENGINE_ADAPTER_METHODS


@dataclass(frozen=True)
class SelfCheckResult:
    """What the self-check found: ``ok`` when nothing is wrong; ``lines`` the report."""

    ok: bool
    lines: tuple[str, ...]
    built: bool = True
    """False when the factory could not build an adapter (exit status 2)."""

    @property
    def exit_code(self) -> int:
        """0 when ok, 1 when something is wrong, 2 when the adapter could not be built."""
        if not self.built:
            return 2
        return 0 if self.ok else 1

    def render(self) -> str:
        return "\n".join(self.lines)


class WalkStopped(Exception):
    """Nothing sensible can follow (a call failed, or the step left broken state)."""


@dataclass
class ExpectedState:
    """What the protocol says A's state is (the self-check's own oracle, never read back
    from the adapter, so one wrong snapshot does not shift every later expectation)."""

    tokens: list[int]
    computed: int = 0
    outputs: int = 0
    finished: bool = False
    next_token: int = 2


def span_text(xs: tuple[int, ...] | list[int]) -> str:
    if not xs:
        return "()"
    if len(xs) > 2 and list(xs) == list(range(xs[0], xs[0] + len(xs))):
        return f"{xs[0]}..{xs[-1]}"
    return ", ".join(str(x) for x in xs)


def tuple_text(xs: tuple[int, ...] | list[int]) -> str:
    return "(" + ", ".join(str(x) for x in xs) + ("," if len(xs) == 1 else "") + ")"


def entry_of(rep: StepReport) -> ScheduledRequest | None:
    """The request's entry in a validated report (each id is there at most once)."""
    for s in rep.scheduled:
        if s.request_id == REQUEST.request_id:
            return s
    return None


def hint(e: AdapterCallError, what: str) -> str:
    """Why a failed call matters, in the terms an adapter author acts on."""
    cause = e.__cause__
    if e.timed_out:
        return (
            ": a call that never returns would stall the suite; it stops a call after "
            "--call-timeout seconds"
        )
    if isinstance(cause, NotImplementedError):
        return " (a method still to be written: the template's TODO)"
    if isinstance(cause, NotSupported):
        if what.startswith("configure"):
            return (
                ": the self-check's configuration is small and ordinary (no chunking, no "
                "preemption needed); every engine should accept it"
            )
        return (
            ": NotSupported answers a configuration or an optional feature (abort, "
            "rollback); this call must work"
        )
    return ""
