"""The executor's output for one step, checked against the plan before anything commits
(docs/ARCHITECTURE.md, "One step", stage 4: validate).

Every sampling entry of the plan must get a non-negative int token, and every request
that verifies drafts an accepted count from 0 to its draft count; anything else raises
:class:`BadExecutorOutput` naming the first request at fault, with nothing changed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from refserve.core.plan import StepPlan
from refserve.errors import RefserveError

Ints = npt.NDArray[np.int64]


class BadExecutorOutput(RefserveError):
    """The executor's output does not match the plan (a sampled token is missing, ...)."""


class ArrayLike(Protocol):
    """Another library's array (a torch tensor): numpy reads it through ``__array__``, so
    the core takes one without importing that library (docs/ARCHITECTURE.md, "Layers")."""

    def __array__(self) -> npt.NDArray[Any]: ...


Sampled = Mapping[str, int] | npt.NDArray[np.integer[Any]] | ArrayLike
"""The executor's sampled tokens: by request id, or in the plan's sampling order."""
_ARRAY_TYPES = (np.ndarray,)


def _host_array(sampled: object) -> object:
    """``sampled`` as a numpy array if it is or reads as one, else as given (for the
    caller to refuse, naming its type). A CPU tensor reads through ``__array__`` without
    a copy; one on a device refuses that (TypeError) and is read through ``tolist``."""
    if isinstance(sampled, np.ndarray) or not hasattr(sampled, "__array__"):
        return sampled
    try:
        return np.asarray(sampled)
    except (TypeError, RuntimeError):
        tolist = getattr(sampled, "tolist", None)
        if not callable(tolist):
            return sampled
        listed = tolist()
        # An empty list reads as float64: keep it an int array (it names no token).
        return np.asarray(listed) if listed else np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class SplitTokens:
    """The sampled tokens of a step, checked: ``bulk`` for the bulk decode rows (in plan
    order), ``rest`` by request id for the plan's other sampling entries."""

    bulk: Ints
    rest: Mapping[str, int]


def _sampling_ids(plan: StepPlan, start: int) -> list[str]:
    return [
        rid for rid, smp in zip(plan.request_ids[start:], plan.samples[start:], strict=True) if smp
    ]


def _checked_array(plan: StepPlan, tokens: list[object], ids: Sequence[str]) -> Ints:
    """``tokens`` (one per id) as an int64 array, or :class:`BadExecutorOutput` naming
    the first request whose token is not an int in ``[0, 2**63)`` (bool excluded)."""
    if set(map(type, tokens)) <= {int}:
        try:
            array = np.array(tokens, dtype=np.int64)
        except OverflowError:
            array = None  # one of them is 2**63 or more: named below
        if array is not None and (not len(array) or array.min() >= 0):
            return array
    for rid, token in zip(ids, tokens, strict=True):
        if type(token) is not int or not 0 <= token < 2**63:
            limit = " below 2**63" if type(token) is int and token >= 2**63 else ""
            raise BadExecutorOutput(
                f"step {plan.step_index}: executor gave {token!r} as the sampled token of "
                f"request {rid!r}; expected a non-negative int{limit}"
            )
    raise AssertionError("unreachable: a refused list has a bad token")


def checked_accepted(plan: StepPlan, accepted: Mapping[str, int] | None) -> Mapping[str, int]:
    """``accepted``: for each request of the plan that verifies drafts, how many were
    accepted, an int from 0 to its draft count; :class:`BadExecutorOutput` names the
    first request without one, with another, or that verified none."""
    given = accepted or {}
    for rid in given:
        if rid not in plan.drafts:
            raise BadExecutorOutput(
                f"step {plan.step_index}: executor gave an accepted count for request "
                f"{rid!r}, which verified no drafts"
            )
    for rid, drafts in plan.drafts.items():
        a = given.get(rid)
        if type(a) is not int or not 0 <= a <= len(drafts):
            raise BadExecutorOutput(
                f"step {plan.step_index}: executor gave {a!r} as the accepted count of "
                f"request {rid!r}; expected an int from 0 to its {len(drafts)} drafts"
            )
    return given


def split_output(plan: StepPlan, sampled: Sampled) -> SplitTokens:
    """The sampled tokens checked (non-negative ints, one per sampling entry) and
    split: an array for the bulk decodes, a mapping for the other entries."""
    rows = plan.decode_rows
    num_bulk = 0 if rows is None else len(rows.slots)
    # Arrays first: isinstance against the Mapping ABC is slow for a tensor.
    if not isinstance(sampled, _ARRAY_TYPES) and isinstance(sampled, Mapping):
        bulk_ids = plan.request_ids[:num_bulk]
        bulk = _checked_array(plan, list(map(sampled.get, bulk_ids)), bulk_ids)
        rest_ids = _sampling_ids(plan, num_bulk)
        rest = {rid: sampled.get(rid) for rid in rest_ids}
        _checked_array(plan, list(rest.values()), rest_ids)
        return SplitTokens(bulk, rest)  # type: ignore[arg-type]
    values = _host_array(sampled)
    count = plan.samples.count(True)
    if (
        not isinstance(values, np.ndarray)
        or values.ndim != 1
        or values.dtype.kind not in "iu"
        or len(values) != count
    ):
        given = (
            f"a {values.dtype} array of shape {values.shape}"
            if isinstance(values, np.ndarray)
            else f"a {type(sampled).__name__}"
        )
        raise BadExecutorOutput(
            f"step {plan.step_index}: executor gave {given} as the sampled tokens; "
            f"expected a 1-D int array of {count}, one per sampling request in plan "
            "order, or a mapping by request id"
        )
    ids = (
        plan.request_ids
        if count == len(plan.samples)
        else (plan.request_ids[:num_bulk] + tuple(_sampling_ids(plan, num_bulk)))
    )
    checked = values.astype(np.int64)  # a uint64 past int64 wraps negative: refused
    if len(checked) and checked.min() < 0:
        bad = int(np.flatnonzero(checked < 0)[0])
        raise BadExecutorOutput(
            f"step {plan.step_index}: executor gave {values[bad].item()!r} as the sampled "
            f"token of request {ids[bad]!r}; expected a non-negative int below 2**63"
        )
    if num_bulk == count:  # bulk decodes only: the usual step
        return SplitTokens(checked, {})
    return SplitTokens(
        checked[:num_bulk], dict(zip(ids[num_bulk:], checked[num_bulk:].tolist(), strict=True))
    )


def validate_output(
    plan: StepPlan, sampled: Sampled, accepted: Mapping[str, int] | None = None
) -> None:
    """Raise :class:`BadExecutorOutput` unless every sampling request got a token and
    every verification an accepted count."""
    split_output(plan, sampled)
    checked_accepted(plan, accepted)
