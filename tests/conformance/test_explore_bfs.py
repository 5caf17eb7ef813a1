"""The breadth-first core both explorers share, on a toy graph: a counter that may add
1 or 2, its state the value (so 3 is reached both as 1+2 and 2+1)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import pytest

from refserve.conformance.explore.bfs import BreadthFirst, FirstFound, Unreachable


@dataclass
class _Explored:
    graph: BreadthFirst[int, None, int]
    exhausted: bool


def _explore(max_states: int, max_depth: int, top: int = 4) -> _Explored:
    g: BreadthFirst[int, None, int] = BreadthFirst("copy", max_states, max_depth)
    g.visit(-1, None, (0,), None, 0)

    def expand(nid: int) -> None:
        value = g.sessions[nid]
        for step in (1, 2):
            if value + step <= top:
                g.visit(nid, step, (value + step,), None, value + step)

    return _Explored(g, g.search(expand, lambda: False))


def test_every_state_once_by_a_shortest_path() -> None:
    run = _explore(100, 0)
    g = run.graph
    assert run.exhausted
    assert [n.key for n in g] == [(0,), (1,), (2,), (3,), (4,)]
    assert [n.depth for n in g] == [0, 1, 1, 2, 2]
    assert g.deepest == 2
    four = g.index[(4,)]
    assert g.path(four) == (2, 2)
    assert g.path(four, 1) == (2, 2, 1)
    assert not g.cut and not g.capped
    assert not g.sessions, "a state's session is dropped once it is expanded"


def test_the_depth_limit_cuts_and_the_run_is_not_exhausted() -> None:
    run = _explore(100, 1)
    g = run.graph
    assert not run.exhausted
    assert [n.key for n in g] == [(0,), (1,), (2,)]
    assert g.cut == {1, 2}
    assert not g.capped


def test_the_state_limit_stops_with_the_queue_left_unexpanded() -> None:
    run = _explore(3, 0)
    g = run.graph
    assert not run.exhausted
    assert g.capped
    assert g.cut == {1, 2}


def test_stop_ends_the_search_before_the_next_state() -> None:
    g: BreadthFirst[int, None, int] = BreadthFirst("replay", 100, 0)
    g.visit(-1, None, (0,), None, 0)
    expanded: list[int] = []

    def expand(nid: int) -> None:
        expanded.append(nid)
        g.visit(nid, 1, (len(g),), None, 0)

    assert not g.search(expand, lambda: bool(expanded))
    assert expanded == [0]
    assert list(g.frontier) == [1]
    assert not g.sessions, "replay keeps no session"


def test_an_unknown_strategy_is_refused() -> None:
    with pytest.raises(ValueError, match="strategy must be one of"):
        BreadthFirst("clone", 10, 0)


class _Counter:
    def __init__(self, wrong_at: int | None = None) -> None:
        self.value = 0
        self.dead = False
        self.wrong_at = wrong_at

    def apply(self, step: int) -> list[str]:
        self.value += step
        return ["boom"] if self.value == self.wrong_at else []

    def key(self) -> tuple[int]:
        return (self.value,)


def test_replay_reaches_the_state_again_or_says_why() -> None:
    g = _explore(100, 0).graph
    four = g.index[(4,)]
    g.replay(four, _Counter(), "steps", "counter")
    with pytest.raises(Unreachable) as e:
        g.replay(four, _Counter(wrong_at=2), "steps", "counter")
    assert e.value.finding == "boom"
    late = _Counter()
    late.value = 1
    with pytest.raises(Unreachable, match="same steps on a fresh counter reached a different"):
        g.replay(four, late, "steps", "counter")


def test_the_first_finding_of_each_signature_is_kept() -> None:
    found: FirstFound[str, int] = FirstFound()
    calls: list[int] = []

    def shows(where: int) -> int:
        calls.append(where)
        return where

    for finding, where in (("a", 1), ("b", 2), ("a", 3)):
        found.record(finding, finding, partial(shows, where))
    assert list(found.values()) == [("a", 1), ("b", 2)]
    assert calls == [1, 2], "what shows a finding is made only for a new signature"
