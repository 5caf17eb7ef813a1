"""spec/mlfq.py's rules: silent on a sound snapshot, and each fails on the corrupted state
it exists for."""

from __future__ import annotations

import dataclasses

from refserve.spec.mlfq import (
    NO_THRASH,
    QUEUES,
    STARVATION,
    DisplacedRecord,
    MlfqSnapshot,
    QueuedRecord,
    RunningRecord,
    check_mlfq,
    check_no_thrash,
    check_queues,
    check_starvation,
)
from refserve.spec.violation import Invariant

SOUND = MlfqSnapshot(
    step_index=40,
    starvation_steps=10,
    num_queues=3,
    runnable=("a", "b", "c", "d"),
    running=(RunningRecord("a", 0), RunningRecord("b", 2)),
    # c waited long but is at level 0 (promoted); d waited less than the bound.
    queued=(QueuedRecord("c", 0, 25), QueuedRecord("d", 2, 9)),
    displaced=(DisplacedRecord("e", "seat", "c", 8.0, 8.0),),
)


def test_a_sound_snapshot_passes_every_rule() -> None:
    assert check_mlfq(SOUND) == []


def test_starvation_fails_on_a_request_left_below_level_0_past_the_bound() -> None:
    snap = dataclasses.replace(SOUND, queued=(QueuedRecord("c", 0, 25), QueuedRecord("d", 2, 10)))
    (v,) = check_starvation(snap)
    assert (v.invariant, v.rule, v.subject) == (Invariant.PROGRESS, STARVATION, "request d")
    assert "10" in v.seen


def test_no_thrash_fails_on_a_request_displaced_inside_its_protection() -> None:
    snap = dataclasses.replace(SOUND, displaced=(DisplacedRecord("e", "blocks", "c", 3.0, 8.0),))
    (v,) = check_no_thrash(snap)
    assert (v.invariant, v.rule, v.subject) == (Invariant.ORDER, NO_THRASH, "request e")


def test_conservation_fails_on_a_request_lost_twice_placed_unknown_or_off_the_levels() -> None:
    lost = dataclasses.replace(SOUND, queued=(QueuedRecord("c", 0, 25),))
    assert [(v.rule, v.subject) for v in check_queues(lost)] == [(QUEUES, "request d")]
    twice = dataclasses.replace(SOUND, running=(*SOUND.running, RunningRecord("c", 0)))
    assert [(v.rule, v.subject, v.seen) for v in check_queues(twice)] == [
        (QUEUES, "request c", "2")
    ]
    stranger = dataclasses.replace(SOUND, running=(*SOUND.running, RunningRecord("z", 1)))
    assert [(v.rule, v.subject) for v in check_queues(stranger)] == [(QUEUES, "request z")]
    off = dataclasses.replace(SOUND, running=(RunningRecord("a", 3), RunningRecord("b", 2)))
    assert [(v.rule, v.subject) for v in check_queues(off)] == [(QUEUES, "request a")]
