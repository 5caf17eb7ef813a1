"""ROLES: the rules of prefill/decode disaggregation (docs/DISAGG.md, "The rules").

A disaggregated cluster gives each replica a role: prefill (``P``), decode (``D``) or both
(``C``). A request is placed on a replica that prefills; after its first token it is
handed off, with its K/V, to a decode replica, through the migration protocol; or, when
the prefill side would miss its TTFT SLO, its prefill is deflected to a decode replica,
which prefills it in chunks its decodes' TBT SLO allows and then decodes it. The rules
these records are checked against, one checker each:

* ``first`` (:func:`check_first_token`): a prefill replica samples no token of a
  request past its first of the turn; it hands the request off. A request whose
  handoff failed (no decode replica took it, the move aborted) is ``kept``: it decodes
  where it is, and the record says so.
* ``deflect`` (:func:`check_deflect`): a decode replica's step computes prompt tokens
  only of requests deflected to it, or K/V it computed before and lost to its own
  preemption (a recompute); and while it decodes, the step's prefill tokens fit the TBT
  bound of its decodes by its cost model: ``b * P <= tbt_slo_ms - (a + c*D + e*K)``.
* ``once`` (:func:`check_once`): a request is handed off at most once a turn, at a token
  boundary (when it has sampled exactly its first token of the turn), from a prefill
  replica to one that decodes, never one that was deflected.

That every request is owned by exactly one replica at every observable point is OWNER
(spec/cluster.py), and that the K/V a decode replica reads is the prefill replica's is
KVCOPY over the handoff's transit: the migration rules, checked beside these.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from refserve.spec.violation import Invariant, Violation, violation

ROLES = Invariant.ROLES


class RoleName(StrEnum):
    PREFILL = "P"
    DECODE = "D"
    COLOCATED = "C"


@dataclass(frozen=True)
class PDRequest:
    """One live request as the roles see it: the replica holding it and that replica's
    role, the tokens that replica sampled for it this turn, whether it was deflected or
    kept (its handoff failed), and ``handoffs``: for each handoff of this turn, the
    tokens of the turn it had sampled then, and the two roles."""

    request_id: str
    replica: str
    role: RoleName
    sampled_here: int
    deflected: bool = False
    kept: bool = False
    handoffs: tuple[Handoff, ...] = ()


@dataclass(frozen=True)
class Handoff:
    """One handoff: from a replica of role ``source`` to one of role ``destination``,
    when the request had sampled ``tokens_of_turn`` tokens of its turn."""

    source: RoleName
    destination: RoleName
    tokens_of_turn: int


@dataclass(frozen=True)
class PDSnapshot:
    requests: tuple[PDRequest, ...]


@dataclass(frozen=True)
class PrefillChunk:
    """Prompt tokens one step computed for one request: ``deflected`` to this replica, or
    a ``recompute`` of K/V this replica had computed and lost to its own preemption."""

    request_id: str
    tokens: int
    deflected: bool
    recompute: bool = False


@dataclass(frozen=True)
class StepCostModel:
    """The replica's cost model ``a + b*P + c*D + e*K`` (ms)."""

    a: float
    b: float
    c: float
    e: float = 0.0


@dataclass(frozen=True)
class DecodeStep:
    """One step of a decode replica: how many requests it decoded, the K/V positions they
    read, the prompt tokens it computed per request, its cost model and TBT SLO (None:
    the replica has none, so only the first half of rule ``deflect`` applies)."""

    replica: str
    num_decodes: int
    kv_read: int
    chunks: tuple[PrefillChunk, ...]
    cost: StepCostModel
    tbt_slo_ms: float | None


def tbt_bound_tokens(step: DecodeStep) -> int | None:
    """The most prefill tokens the step may take beside its decodes (None: no decodes,
    or a replica without a TBT SLO, ``tbt_slo_ms`` None: no bound)."""
    if step.num_decodes == 0 or step.tbt_slo_ms is None:
        return None
    c = step.cost
    spare = step.tbt_slo_ms - (c.a + c.c * step.num_decodes + c.e * step.kv_read)
    if c.b == 0:
        return None if spare >= 0 else 0
    return max(0, int(spare // c.b))


def check_first_token(snap: PDSnapshot) -> list[Violation]:
    """Rule ``first`` (module doc)."""
    out: list[Violation] = []
    for r in snap.requests:
        if r.role is RoleName.PREFILL and not r.kept and r.sampled_here > 1:
            out.append(
                violation(
                    ROLES,
                    f"request {r.request_id}",
                    f"prefill replica {r.replica} sampled past the first token (rule first)",
                    "at most 1 token this turn",
                    f"{r.sampled_here} tokens",
                )
            )
    return out


def check_deflect(step: DecodeStep) -> list[Violation]:
    """Rule ``deflect`` (module doc)."""
    out: list[Violation] = []
    for ch in step.chunks:
        if ch.tokens > 0 and not ch.deflected and not ch.recompute:
            out.append(
                violation(
                    ROLES,
                    f"request {ch.request_id}",
                    f"decode replica {step.replica} prefilled a request not deflected to it "
                    "(rule deflect)",
                    "no prompt tokens",
                    f"{ch.tokens} tokens",
                )
            )
    bound = tbt_bound_tokens(step)
    total = sum(ch.tokens for ch in step.chunks)
    if bound is not None and total > bound:
        out.append(
            violation(
                ROLES,
                "step",
                f"decode replica {step.replica}: prefill tokens beside {step.num_decodes} "
                f"decodes exceed their TBT bound of {step.tbt_slo_ms:g} ms (rule deflect)",
                f"at most {bound} tokens",
                f"{total} tokens",
            )
        )
    return out


def check_once(snap: PDSnapshot) -> list[Violation]:
    """Rule ``once`` (module doc)."""
    out: list[Violation] = []
    for r in snap.requests:
        who = f"request {r.request_id}"
        if len(r.handoffs) > 1:
            out.append(
                violation(
                    ROLES,
                    who,
                    "handed off more than once this turn (rule once)",
                    "at most 1 handoff",
                    f"{len(r.handoffs)} handoffs",
                )
            )
        if r.handoffs and r.deflected:
            out.append(
                violation(ROLES, who, "a deflected request was handed off (rule once)", 0, 1)
            )
        for h in r.handoffs:
            if h.tokens_of_turn != 1:
                out.append(
                    violation(
                        ROLES,
                        who,
                        "handed off at another point than its first token (rule once)",
                        "1 token of the turn",
                        h.tokens_of_turn,
                    )
                )
            if h.source is not RoleName.PREFILL or h.destination is RoleName.PREFILL:
                out.append(
                    violation(
                        ROLES,
                        who,
                        "handed off between the wrong roles (rule once)",
                        "P to D or C",
                        f"{h.source.value} to {h.destination.value}",
                    )
                )
    return out


def check_roles(snap: PDSnapshot) -> list[Violation]:
    """The snapshot rules, ``first`` and ``once``."""
    return check_first_token(snap) + check_once(snap)
