"""spec/pd.py's rules (ROLES: first, deflect, once): silent on sound records, and each
fails on the corrupted record it exists for, its violation naming the rule."""

from __future__ import annotations

import dataclasses

from refserve.spec.pd import (
    DecodeStep,
    Handoff,
    PDRequest,
    PDSnapshot,
    PrefillChunk,
    RoleName,
    StepCostModel,
    check_deflect,
    check_first_token,
    check_once,
    check_roles,
    tbt_bound_tokens,
)
from refserve.spec.violation import Invariant, Violation

P, D, C = RoleName.PREFILL, RoleName.DECODE, RoleName.COLOCATED
P_TO_D = Handoff(P, D, 1)

#: One request of every kind a disaggregated cluster holds, each as the rules allow it.
SOUND = PDSnapshot(
    (
        PDRequest("fresh", "p0", P, 0),  # placed, no token yet
        PDRequest("first", "p0", P, 1),  # its first token: handed off before P steps again
        PDRequest("kept", "p1", P, 5, kept=True),  # its handoff failed: it decodes on P
        PDRequest("moved", "d0", D, 4, handoffs=(P_TO_D,)),
        PDRequest("to_c", "c0", C, 3, handoffs=(Handoff(P, C, 1),)),
        PDRequest("deflected", "d1", D, 6, deflected=True),
        PDRequest("colocated", "c0", C, 7),
    )
)

# Cost 2 + 1*P + 1*D + 0.25*K: with 2 decodes reading 8 K/V positions and a 12 ms TBT
# SLO, 12 - (2 + 2 + 2) = 6 ms are left, so 6 prefill tokens fit.
COST = StepCostModel(a=2.0, b=1.0, c=1.0, e=0.25)
STEP = DecodeStep(
    "d0",
    num_decodes=2,
    kv_read=8,
    chunks=(
        PrefillChunk("deflected", 4, deflected=True),
        PrefillChunk("moved", 2, deflected=False, recompute=True),  # lost to its preemption
    ),
    cost=COST,
    tbt_slo_ms=12.0,
)


def _with(snap: PDSnapshot, request: PDRequest) -> PDSnapshot:
    """``snap`` with the request of that id replaced."""
    rid = request.request_id
    return PDSnapshot(tuple(request if r.request_id == rid else r for r in snap.requests))


def _only(found: list[Violation], rule: str, subject: str) -> Violation:
    """The one violation found: of ROLES, naming ``rule``, about ``subject``."""
    assert len(found) == 1, found
    (v,) = found
    assert (v.invariant, v.subject) == (Invariant.ROLES, subject), v
    assert f"(rule {rule})" in v.message, v
    return v


def test_sound_records_pass_every_rule() -> None:
    assert check_first_token(SOUND) == []
    assert check_once(SOUND) == []
    assert check_roles(SOUND) == []
    assert check_deflect(STEP) == []
    assert tbt_bound_tokens(STEP) == 6


# ------------------------------------------------------------------ first
def test_first_fails_on_a_prefill_replica_sampling_past_the_first_token() -> None:
    bad = _with(SOUND, PDRequest("first", "p0", P, 2))
    v = _only(check_first_token(bad), "first", "request first")
    assert "p0" in v.message and v.seen == "2 tokens"
    assert check_roles(bad) == check_first_token(bad)


def test_first_allows_a_kept_request_and_a_decode_or_colocated_replica() -> None:
    # The same count of tokens is sound where the request was kept or where it decodes.
    for r in (
        PDRequest("first", "p0", P, 9, kept=True),
        PDRequest("first", "d0", D, 9, handoffs=(P_TO_D,)),
        PDRequest("first", "c0", C, 9),
    ):
        assert check_first_token(_with(SOUND, r)) == [], r


# ------------------------------------------------------------------ deflect
def test_deflect_fails_on_a_decode_replica_prefilling_a_request_not_deflected_to_it() -> None:
    stray = PrefillChunk("moved", 3, deflected=False)
    bad = dataclasses.replace(STEP, num_decodes=0, chunks=(stray,))
    v = _only(check_deflect(bad), "deflect", "request moved")
    assert "d0" in v.message and v.seen == "3 tokens"
    # The same chunk as a recompute of K/V it lost to its own preemption is allowed, and a
    # chunk of no tokens is no prefill.
    assert (
        check_deflect(
            dataclasses.replace(bad, chunks=(dataclasses.replace(stray, recompute=True),))
        )
        == []
    )
    assert (
        check_deflect(dataclasses.replace(bad, chunks=(dataclasses.replace(stray, tokens=0),)))
        == []
    )


def test_deflect_fails_on_prefill_tokens_past_the_tbt_bound_beside_decodes() -> None:
    # 4 + 3 = 7 tokens where 6 fit.
    over = dataclasses.replace(
        STEP, chunks=(PrefillChunk("deflected", 4, True), PrefillChunk("other", 3, True))
    )
    v = _only(check_deflect(over), "deflect", "step")
    assert (v.expected, v.seen) == ("at most 6 tokens", "7 tokens")
    assert "2 decodes" in v.message and "12 ms" in v.message
    # Exactly at the bound is within it.
    at = dataclasses.replace(
        STEP, chunks=(PrefillChunk("deflected", 4, True), PrefillChunk("other", 2, True))
    )
    assert check_deflect(at) == []


def test_deflect_reports_both_halves_of_the_rule_at_once() -> None:
    both = dataclasses.replace(STEP, chunks=(PrefillChunk("stray", 9, deflected=False),))
    found = check_deflect(both)
    assert [v.subject for v in found] == ["request stray", "step"]
    assert all("(rule deflect)" in v.message for v in found)


def test_deflect_without_decodes_has_no_tbt_bound() -> None:
    alone = dataclasses.replace(STEP, num_decodes=0, kv_read=0)
    assert tbt_bound_tokens(alone) is None
    huge = dataclasses.replace(alone, chunks=(PrefillChunk("deflected", 10_000, True),))
    assert check_deflect(huge) == []


def test_tbt_bound_tokens_edges() -> None:
    # Decodes alone over the SLO: no prefill token fits (never a negative bound).
    late = dataclasses.replace(STEP, tbt_slo_ms=5.0)
    assert tbt_bound_tokens(late) == 0
    (v,) = check_deflect(dataclasses.replace(late, chunks=(PrefillChunk("deflected", 1, True),)))
    assert v.expected == "at most 0 tokens"
    # A fraction of a token's cost left rounds down.
    assert tbt_bound_tokens(dataclasses.replace(STEP, tbt_slo_ms=12.75)) == 6
    # b == 0: prefill tokens cost nothing, so no bound while the decodes fit, and none
    # at all once they alone miss the SLO.
    free = dataclasses.replace(STEP, cost=dataclasses.replace(COST, b=0.0))
    assert tbt_bound_tokens(free) is None
    assert check_deflect(dataclasses.replace(free, chunks=(PrefillChunk("x", 10_000, True),))) == []
    free_late = dataclasses.replace(free, tbt_slo_ms=5.0)
    assert tbt_bound_tokens(free_late) == 0
    exact = dataclasses.replace(free, tbt_slo_ms=6.0)  # the decodes take exactly the SLO
    assert tbt_bound_tokens(exact) is None


# ------------------------------------------------------------------ once
def test_once_fails_on_a_second_handoff_in_a_turn() -> None:
    bad = _with(SOUND, PDRequest("moved", "d1", D, 0, handoffs=(P_TO_D, P_TO_D)))
    v = _only(check_once(bad), "once", "request moved")
    assert (v.expected, v.seen) == ("at most 1 handoff", "2 handoffs")
    assert check_roles(bad) == check_once(bad)


def test_once_fails_on_a_handoff_not_at_the_first_token() -> None:
    for tokens in (0, 2):
        bad = _with(SOUND, PDRequest("moved", "d0", D, 1, handoffs=(Handoff(P, D, tokens),)))
        v = _only(check_once(bad), "once", "request moved")
        assert "first token" in v.message and v.seen == str(tokens)


def test_once_fails_on_a_handoff_between_the_wrong_roles() -> None:
    for src, dst in ((D, D), (C, D), (P, P)):
        bad = _with(SOUND, PDRequest("moved", "d0", dst, 1, handoffs=(Handoff(src, dst, 1),)))
        v = _only(check_once(bad), "once", "request moved")
        assert v.seen == f"{src.value} to {dst.value}"


def test_once_fails_on_a_deflected_request_handed_off() -> None:
    bad = _with(SOUND, PDRequest("deflected", "d0", D, 3, deflected=True, handoffs=(P_TO_D,)))
    v = _only(check_once(bad), "once", "request deflected")
    assert "deflected" in v.message


def test_once_reports_every_broken_part_of_a_bad_handoff() -> None:
    # Twice, the second from a decode replica after two tokens: three violations.
    bad = _with(SOUND, PDRequest("moved", "d1", D, 0, handoffs=(P_TO_D, Handoff(D, D, 2))))
    found = check_once(bad)
    assert len(found) == 3 and all("(rule once)" in v.message for v in found)
