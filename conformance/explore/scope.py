"""A scope: the bound an exhaustive exploration covers, as one small named record.

The small-scope hypothesis behind model checkers (most bugs have a small counterexample)
is what makes a bound worth exhausting: a scope fixes the engine's limits, the catalogue
of requests the explorer may add (each at most once, in any order and at any step
boundary) and how many of them one path may add. Everything else (when to add, what to
abort, which sampled token is eos, where the executor fails) is enumerated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from refserve.conformance.adapter import EngineConfig, Feature
from refserve.conformance.workload import EOS, RequestPlan, Workload
from refserve.spec.arith import cdiv
from refserve.values import is_int


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
    transfer_faults: bool = True
    """Each copy in flight at a step completes, stays in flight or fails, each an outcome
    of the step (feature ``transfer_faults``)."""
    transfer_delays: int = 1
    """Steps in a row one copy may stay in flight by the explorer's choice (the bound
    that keeps the outcomes finite)."""

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


# ------------------------------------------------------------------ a user's own scope
class ScopeError(ValueError):
    """A scope given by a user (a JSON file or ``--scope-set``) that cannot be one; the
    message names the field."""


_INT_FIELDS = (
    "block_size",
    "num_blocks",
    "max_num_batched_tokens",
    "max_num_seqs",
    "max_requests",
    "max_depth",
    "max_states",
    "num_speculative_tokens",
)
_BOOL_FIELDS = ("enable_prefix_caching", "faults")
# Short names a user may write for the fields (as the CLI's engine options read).
ALIASES = {"budget": "max_num_batched_tokens", "max_seqs": "max_num_seqs", "blocks": "num_blocks"}
FIELDS = ("name", "catalogue", *_INT_FIELDS, *_BOOL_FIELDS)


def parse_catalogue(text: str) -> tuple[RequestTemplate, ...]:
    """``"2,3,4:3 7,8:1:-1"``: requests separated by spaces or ``;``, each its prompt's
    token ids, ``:`` its max_tokens and optionally ``:`` its priority."""
    out = []
    for entry in text.replace(";", " ").split():
        parts = entry.split(":")
        if len(parts) not in (2, 3):
            raise ScopeError(f"catalogue: {entry!r} is not PROMPT:MAX_TOKENS[:PRIORITY]")
        try:
            prompt = tuple(int(x) for x in parts[0].split(","))
            numbers = [int(x) for x in parts[1:]]
        except ValueError:
            raise ScopeError(f"catalogue: {entry!r} holds a value that is not an integer") from None
        out.append(_template(prompt, *numbers))
    return tuple(out)


def _template(prompt: tuple[int, ...], max_tokens: int, priority: int = 0) -> RequestTemplate:
    try:
        return RequestTemplate(prompt, max_tokens, priority)
    except ValueError as e:
        raise ScopeError(f"catalogue: {e}") from None


def _catalogue(value: Any) -> tuple[RequestTemplate, ...]:
    if isinstance(value, str):
        return parse_catalogue(value)
    if not isinstance(value, list) or not all(isinstance(x, Mapping) for x in value):
        raise ScopeError("catalogue must be a list of {prompt, max_tokens[, priority]} objects")
    out = []
    for i, entry in enumerate(value):
        unknown = set(entry) - {"prompt", "max_tokens", "priority"}
        if unknown:
            raise ScopeError(f"catalogue[{i}]: unknown key(s) {sorted(unknown)}")
        prompt, max_tokens = entry.get("prompt"), entry.get("max_tokens")
        priority = entry.get("priority", 0)
        if not isinstance(prompt, list) or not all(is_int(x) for x in prompt):
            raise ScopeError(f"catalogue[{i}].prompt must be a list of integers")
        if not is_int(max_tokens) or not is_int(priority):
            raise ScopeError(f"catalogue[{i}]: max_tokens and priority must be integers")
        out.append(_template(tuple(prompt), max_tokens, priority))
    return tuple(out)


def _field_value(name: str, value: Any) -> Any:
    """One field's value from JSON or from text, checked for its type."""
    if name == "catalogue":
        return _catalogue(value)
    if name == "name":
        if not isinstance(value, str) or not value.strip():
            raise ScopeError("name must be a non-empty string")
        return value
    if name in _BOOL_FIELDS:
        if isinstance(value, str) and value.lower() in ("true", "on", "1", "false", "off", "0"):
            return value.lower() in ("true", "on", "1")
        if not isinstance(value, bool):
            raise ScopeError(f"{name} must be true or false, got {value!r}")
        return value
    if isinstance(value, str):
        try:
            value = int(value)
        except ValueError:
            raise ScopeError(f"{name} must be an integer, got {value!r}") from None
    if not is_int(value):
        raise ScopeError(f"{name} must be an integer, got {value!r}")
    return value


def _checked_fields(fields: Mapping[str, Any]) -> dict[str, Any]:
    """Each of a user's fields under its own name, its value checked."""
    out = {}
    for key, value in fields.items():
        name = ALIASES.get(key, key)
        if name not in FIELDS:
            raise ScopeError(f"unknown scope field {key!r} (fields: {', '.join(FIELDS)})")
        out[name] = _field_value(name, value)
    return out


def user_scope(fields: Mapping[str, Any], base: Scope | None = None) -> Scope:
    """A scope from a user's fields (a JSON object, or ``--scope-set`` pairs as text),
    over ``base`` when given (its other fields are kept): every field is checked, and
    an unknown or wrong one raises :class:`ScopeError` naming it."""
    values: dict[str, Any] = {} if base is None else dataclasses.asdict(base)
    if base is not None:
        values["catalogue"] = base.catalogue
    values.update(_checked_fields(fields))
    if base is not None and fields and "name" not in fields:
        values["name"] = f"{base.name}+user"
    if base is not None and "catalogue" in fields and "max_requests" not in fields:
        # The base's bound, as far as the new catalogue allows.
        values["max_requests"] = min(values["max_requests"], len(values["catalogue"]))
    missing = [f for f in ("catalogue", *_INT_FIELDS[:4]) if f not in values]
    if missing:
        raise ScopeError(f"the scope lacks {', '.join(missing)} (and names no base scope)")
    values.setdefault("name", "user")
    values.setdefault("max_requests", min(3, len(values["catalogue"]) or 1))
    try:
        return Scope(**values)
    except ValueError as e:
        raise ScopeError(str(e)) from None


# --------------------------------------------------------------- the boundary sweep
MAX_SWEEP_POINTS = 400
"""The most points one sweep explores: each is a whole exploration, so a catalogue of
many lengths would otherwise make a sweep that never ends."""


@dataclass(frozen=True)
class Boundaries:
    """Where a scope's catalogue sits on the edge of its limits: each budget and pool
    size one below, at and one above what one of its requests needs."""

    budgets: tuple[int, ...]
    pools: tuple[int, ...]


def sequence_need(t: RequestTemplate) -> int:
    """The most tokens one step must hold for ``t`` when prompts are not chunked: a
    recompute after a preemption, its prompt and every output but the last."""
    return len(t.prompt) + t.max_tokens - 1


def block_needs(t: RequestTemplate, block_size: int) -> tuple[int, int]:
    """The blocks ``t`` holds at its longest: its K/V (prompt and every output but the
    last), and that plus the slot an engine reserving one ahead takes."""
    longest = len(t.prompt) + t.max_tokens
    return cdiv(longest - 1, block_size), cdiv(longest, block_size)


def _around(needs: set[int]) -> tuple[int, ...]:
    return tuple(sorted({n + d for n in needs for d in (-1, 0, 1) if n + d >= 1}))


def boundaries(scope: Scope) -> Boundaries:
    budgets = {sequence_need(t) for t in scope.catalogue}
    pools = {n for t in scope.catalogue for n in block_needs(t, scope.block_size)}
    return Boundaries(_around(budgets), _around(pools))


def sweep(scope: Scope, *, chunked: bool = True) -> tuple[Scope, ...]:
    """``scope`` at every (budget, pool size) of :func:`boundaries`, budgets outer.

    For an engine that cannot chunk a prompt (``chunked=False``) a budget below some
    requests' whole sequence would make the point unsupported; there the point keeps the
    catalogue's requests that fit it (and no point is made where none does), so the
    boundary of every request is reached, not only the longest one's."""
    edges = boundaries(scope)
    points = len(edges.budgets) * len(edges.pools)
    if points > MAX_SWEEP_POINTS:
        raise ScopeError(
            f"the sweep would explore {points} points ({len(edges.budgets)} budgets x "
            f"{len(edges.pools)} pool sizes), more than {MAX_SWEEP_POINTS}: give a catalogue "
            "of fewer lengths"
        )
    out = []
    for b in edges.budgets:
        fits = (
            scope.catalogue
            if chunked
            else tuple(t for t in scope.catalogue if sequence_need(t) <= b)
        )
        if not fits:
            continue
        kept = "" if len(fits) == len(scope.catalogue) else f",{len(fits)} requests"
        for n in edges.pools:
            out.append(
                dataclasses.replace(
                    scope,
                    name=f"{scope.name}@budget={b},blocks={n}{kept}",
                    max_num_batched_tokens=b,
                    num_blocks=n,
                    catalogue=fits,
                    max_requests=min(scope.max_requests, len(fits)),
                )
            )
    return tuple(out)
