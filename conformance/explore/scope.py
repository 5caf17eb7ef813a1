"""A scope: the bound an exhaustive exploration covers, as one small named record.

The small-scope hypothesis behind model checkers (most bugs have a small counterexample)
is what makes a bound worth exhausting: a scope fixes the engine's limits, the catalogue
of requests the explorer may add (each at most once, in any order and at any step
boundary) and how many of them one path may add. Everything else (when to add, what to
abort, which sampled token is eos, where the executor fails) is enumerated.
"""

from __future__ import annotations

from dataclasses import dataclass

from refserve.conformance.adapter import EngineConfig, Feature
from refserve.conformance.workload import EOS, RequestPlan, Workload


@dataclass(frozen=True)
class RequestTemplate:
    """One catalogue entry: a request the explorer may add once."""

    prompt: tuple[int, ...]
    max_tokens: int
    priority: int = 0

    def __post_init__(self) -> None:
        if not self.prompt or any(not isinstance(t, int) or t < 2 for t in self.prompt):
            raise ValueError(f"prompt must be a non-empty tuple of token ids >= 2: {self.prompt}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclass(frozen=True)
class Scope:
    """The bound of one exploration (docs/CONFORMANCE.md, "Exhaustive exploration").

    ``max_requests`` caps the adds along one path; ``max_depth`` the events along one path
    (0: no cap, the scope is finite anyway: every request's tokens are bounded by its
    ``max_tokens``); ``max_states`` stops a run that grows past it (reported as not
    exhausted, never as a pass of the whole scope).
    """

    name: str
    block_size: int
    num_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    catalogue: tuple[RequestTemplate, ...]
    max_requests: int
    enable_prefix_caching: bool = True
    max_depth: int = 0
    max_states: int = 200_000
    faults: bool = True
    """Try an executor fault (schedule, then rollback) in every state with live requests."""
    num_speculative_tokens: int = 0
    """Drafts proposed to every decoding request each step (feature
    ``speculative_decoding``); each accepted count is an outcome of the step."""

    def __post_init__(self) -> None:
        for field in ("block_size", "num_blocks", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")
        if not self.catalogue:
            raise ValueError("the catalogue must hold at least one request")
        if not 1 <= self.max_requests <= len(self.catalogue):
            raise ValueError(
                f"max_requests must be in 1..{len(self.catalogue)} (the catalogue), "
                f"got {self.max_requests}"
            )
        if self.max_depth < 0 or self.max_states < 1:
            raise ValueError("max_depth must be >= 0 and max_states >= 1")

    def config(self) -> EngineConfig:
        return EngineConfig(
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            enable_prefix_caching=self.enable_prefix_caching,
            eos_token_id=EOS,
            num_speculative_tokens=self.num_speculative_tokens,
        )

    def needs(self) -> frozenset[Feature]:
        """Features an engine must have for the scope (as :meth:`Workload.needs`; aborts,
        faults and priorities are left out of the events of an engine without them)."""
        w = Workload(
            self.config(),
            tuple(
                RequestPlan(f"c{i}", t.prompt, t.max_tokens) for i, t in enumerate(self.catalogue)
            ),
        )
        return w.needs()

    def describe(self) -> str:
        """One line a reader can quote: what every explored state is bounded by."""
        lengths = ",".join(str(len(t.prompt)) for t in self.catalogue)
        outs = ",".join(str(t.max_tokens) for t in self.catalogue)
        return (
            f"up to {self.max_requests} of {len(self.catalogue)} requests (prompt lengths "
            f"{lengths}, max_tokens {outs}), {self.num_blocks} blocks of {self.block_size} "
            f"tokens, budget {self.max_num_batched_tokens}, max {self.max_num_seqs} seqs, "
            f"prefix caching {'on' if self.enable_prefix_caching else 'off'}"
            + (f", {self.num_speculative_tokens} drafts" if self.num_speculative_tokens else "")
        )


# The catalogue: prompts share a leading block (prefix hits) and differ after it; one is
# longer than the budget (chunked prefill); two together outgrow the pool (preemption);
# one outgrows the pool alone (a capacity finish); one is more important (priorities);
# two long prompts cannot be prefilled side by side (the planted livelock's trigger).
_A = RequestTemplate((2, 3, 4), 3)
_B = RequestTemplate((2, 3, 5, 6), 2)
_C = RequestTemplate((7, 8), 1)
_D = RequestTemplate((2, 3, 5, 6, 9, 10, 11), 3, priority=-1)
_E = RequestTemplate((12, 13, 14, 15, 16, 17), 1)
# With drafts, outputs long enough that a decode is proposed two drafts.
_A_SPEC = RequestTemplate((2, 3, 4), 5)
_B_SPEC = RequestTemplate((2, 3, 5, 6), 4)

SCOPES: dict[str, Scope] = {
    "tiny": Scope(
        "tiny",
        block_size=2,
        num_blocks=3,
        max_num_batched_tokens=3,
        max_num_seqs=2,
        catalogue=(_A, _C),
        max_requests=2,
    ),
    "small": Scope(
        "small",
        block_size=2,
        num_blocks=4,
        max_num_batched_tokens=2,
        max_num_seqs=2,
        catalogue=(_A, _B, _C, _D, _E),
        max_requests=3,
    ),
    # The small scope for an engine without chunked prefill: a budget every prompt and
    # its outputs fit whole (a recomputed request included).
    "small-unchunked": Scope(
        "small-unchunked",
        block_size=2,
        num_blocks=4,
        max_num_batched_tokens=10,
        max_num_seqs=2,
        catalogue=(_A, _B, _C, _D, _E),
        max_requests=3,
    ),
    # Speculative decoding: two drafts a step, every accepted count explored.
    "small-spec": Scope(
        "small-spec",
        block_size=2,
        num_blocks=4,
        max_num_batched_tokens=4,
        max_num_seqs=2,
        catalogue=(_A_SPEC, _B_SPEC, _C),
        max_requests=3,
        num_speculative_tokens=2,
    ),
    "medium": Scope(
        "medium",
        block_size=2,
        num_blocks=4,
        max_num_batched_tokens=4,
        max_num_seqs=3,
        catalogue=(_A, _B, _C, _D, _E),
        max_requests=4,
    ),
}
