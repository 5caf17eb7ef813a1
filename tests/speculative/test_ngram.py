"""Prompt-lookup drafts (ref/model/proposers.py): the longest earlier suffix, its latest
occurrence, at most k tokens, nothing without a match, typed errors for bad settings."""

from __future__ import annotations

import pytest

from refserve.errors import InvalidArgument
from refserve.model.proposers import NgramProposer


def test_the_tokens_after_an_earlier_occurrence_of_the_suffix_are_the_draft() -> None:
    assert NgramProposer(2).propose([1, 2, 3, 4, 1, 2]) == (3, 4)


def test_the_longest_matching_suffix_wins_over_a_later_shorter_one() -> None:
    # [1, 2] occurred at 0 (then 7, 5); [2] alone occurred later at 4 (then 8).
    assert NgramProposer(2, max_n=3).propose([1, 2, 7, 5, 2, 8, 1, 2]) == (7, 5)
    assert NgramProposer(2, max_n=1).propose([1, 2, 7, 5, 2, 8, 1, 2]) == (8, 1)


def test_the_latest_occurrence_wins() -> None:
    assert NgramProposer(2, max_n=1).propose([1, 5, 1, 6, 1]) == (6, 1)


def test_a_draft_near_the_end_is_shorter_and_a_run_drafts_itself() -> None:
    assert NgramProposer(4).propose([9, 8, 7, 9, 8]) == (7, 9, 8)
    assert NgramProposer(3).propose([3, 3, 3]) == (3,)


def test_no_match_or_no_room_drafts_nothing() -> None:
    p = NgramProposer(3)
    assert p.propose([]) == ()
    assert p.propose([5]) == ()
    assert p.propose([1, 2, 3, 4]) == ()
    assert NgramProposer(3, min_n=2).propose([1, 2, 3, 2]) == ()  # only a 1-gram repeats


def test_limit_caps_the_draft() -> None:
    p = NgramProposer(3)
    assert p.propose([1, 2, 3, 4, 1], limit=2) == (2, 3)
    assert p.propose([1, 2, 3, 4, 1], limit=0) == ()


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"num_speculative_tokens": 0}, "num_speculative_tokens must be an int >= 1"),
        ({"num_speculative_tokens": True}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 2, "min_n": 0}, "min_n must be an int >= 1"),
        ({"num_speculative_tokens": 2, "max_n": 1.5}, "max_n must be an int"),
        ({"num_speculative_tokens": 2, "min_n": 3, "max_n": 2}, "max_n .2. is below min_n .3."),
    ],
)
def test_bad_settings_are_typed_errors_naming_them(kwargs: dict[str, object], named: str) -> None:
    with pytest.raises(InvalidArgument, match=named):
        NgramProposer(**kwargs)  # type: ignore[arg-type]
