"""Liveness on the explored graph: stepping alone finishes every request.

The step graph holds one edge per step outcome (adds, aborts and faults are left out:
the property is about an engine left alone). Along a step-only path every live request's
tokens only grow and the set of live requests only shrinks, so a path can come back to a
state only through steps that sample nothing and finish nothing: a cycle in the step
graph is a livelock (or, as a self-loop, a deadlock), and an acyclic step graph whose
sinks are all quiescent means every path ends with every request finished, within the
longest path's steps. docs/CONFORMANCE.md, "Exhaustive exploration: liveness".
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from dataclasses import dataclass


@dataclass(frozen=True)
class Liveness:
    checked: bool
    """False when the graph was cut (depth, state cap): only its explored part is judged."""
    cycle: tuple[int, ...] = ()
    """A step cycle (node ids, first == last), empty when there is none."""
    longest_drain: int = 0
    """The most steps any state needs to finish everything (acyclic graphs only)."""


def find_cycle(edges: Mapping[int, Set[int]], live: Set[int]) -> tuple[int, ...]:
    """One cycle of the step graph restricted to ``live`` nodes (iterative DFS with
    colours), as node ids with the first repeated at the end; () if it is acyclic."""
    colour: dict[int, int] = {}  # 1: on the stack, 2: done
    for root in sorted(live):
        if root in colour:
            continue
        colour[root] = 1
        stack: list[tuple[int, list[int]]] = [(root, sorted(edges.get(root, ())))]
        while stack:
            node, todo = stack[-1]
            if not todo:
                colour[node] = 2
                stack.pop()
                continue
            nxt = todo.pop()
            if nxt not in live:
                continue
            c = colour.get(nxt)
            if c == 1:
                path = [n for n, _ in stack]
                return (*path[path.index(nxt) :], nxt)
            if c is None:
                colour[nxt] = 1
                stack.append((nxt, sorted(edges.get(nxt, ()))))
    return ()


def longest_drain(edges: Mapping[int, Set[int]], live: Set[int]) -> int:
    """The longest step path from a live node to a quiescent one, on an acyclic graph."""
    memo: dict[int, int] = {}
    for root in live:
        stack = [root]
        while stack:
            node = stack[-1]
            if node in memo:
                stack.pop()
                continue
            succ = [n for n in edges.get(node, ()) if n in live and n not in memo]
            if succ:
                stack.extend(succ)
                continue
            memo[node] = 1 + max((memo.get(n, 0) for n in edges.get(node, ())), default=-1)
            stack.pop()
    return max(memo.values(), default=0)


def check_liveness(edges: Mapping[int, Set[int]], live: Set[int], complete: bool) -> Liveness:
    cycle = find_cycle(edges, live)
    if cycle:
        return Liveness(complete, cycle)
    return Liveness(complete, (), longest_drain(edges, live))
