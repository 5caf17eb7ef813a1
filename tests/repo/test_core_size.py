"""README's "How big is the spine" is measured, and the spine stays small.

The table names each part of the spine (the reference loop a newcomer reads end to end,
docs/ARCHITECTURE.md, "The core and what attaches to it"), the modules it is, their
lines and source lines (radon's SLOC: without blank lines, comments and docstrings, the
measure the size of ``ref/kv`` + ``ref/core`` was first quoted in) and the target, then
the whole spine. This test measures the modules, requires the README's figures to be
exactly the measured ones (so they cannot drift from the code), each part's source lines
and the whole's to stay within their targets, and the parts to be exactly the spine
``tests/repo/test_layers.py`` holds to its rule (on the KV side, the pool's parts).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from radon.raw import analyze

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


@dataclass(frozen=True)
class Part:
    name: str
    modules: tuple[str, ...]
    target: int  # source lines


def _core(*names: str) -> tuple[str, ...]:
    return tuple(f"ref/core/{n}.py" for n in names)


PARTS = (
    Part("request and settings", _core("__init__", "request", "config", "cost"), 440),
    Part("the rules", _core("capacity", "prefill", "policy", "waiting"), 490),
    Part("planning", _core("hooks", "step_build", "plan", "planner"), 460),
    Part("scheduler loop", _core("loop", "batch"), 560),
    Part(
        "transactional step",
        _core("inputs", "executor", "executor_output", "outcome", "engine_core"),
        520,
    ),
    Part(
        "allocator and prefix index",
        tuple(f"ref/kv/{n}.py" for n in ("allocator", "free_queue", "prefix_index", "journal")),
        550,
    ),
    Part("block pool", tuple(f"ref/kv/{n}.py" for n in ("tables", "pool")), 470),
)
WHOLE = Part("whole spine", tuple(m for p in PARTS for m in p.modules), 3_400)


@dataclass(frozen=True)
class Size:
    lines: int
    source_lines: int


def measure(part: Part) -> Size:
    stats = [analyze((ROOT / m).read_text(encoding="utf-8")) for m in part.modules]
    return Size(sum(s.loc for s in stats), sum(s.sloc for s in stats))


def readme_rows() -> dict[str, tuple[str, ...]]:
    text = README.read_text(encoding="utf-8").split("## How big is the spine", 1)[1]
    table = text.split("\n## ", 1)[0]
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0] not in {"part", ""} and not cells[0].startswith("-"):
            rows[cells[0]] = tuple(cells[1:])
    return rows


def expected_row(part: Part) -> tuple[str, ...]:
    size = measure(part)
    listed = ", ".join(f"`{m}`" for m in part.modules)
    modules = "every module above" if part is WHOLE else listed
    return (modules, f"{size.lines:,}", f"{size.source_lines:,}", f"{part.target:,}")


def test_readme_gives_the_measured_sizes() -> None:
    rows = readme_rows()
    assert set(rows) == {p.name for p in (*PARTS, WHOLE)}, "README's table names other parts"
    for part in (*PARTS, WHOLE):
        assert rows[part.name] == expected_row(part), (
            f"README, 'How big is the spine', {part.name}: write | {part.name} | "
            + " | ".join(expected_row(part))
            + " |"
        )


def test_each_part_is_within_its_target() -> None:
    over = [
        f"{p.name}: {measure(p).source_lines} source lines > {p.target}"
        for p in (*PARTS, WHOLE)
        if measure(p).source_lines > p.target
    ]
    assert not over, over


def test_the_measure_counts_code_not_docstrings() -> None:
    source = '"""A module docstring\nover two lines."""\n\n# a comment\nx = 1\n'
    stats = analyze(source)
    assert (stats.loc, stats.sloc) == (5, 1)
    header = r"\| part \| modules \| lines \| source lines \| target \|"
    assert re.search(header, README.read_text(encoding="utf-8"))


def test_the_parts_are_the_spine() -> None:
    """The table measures what the layer test calls spine, no more and no less."""
    from tests.repo.test_layers import KV_SPINE, SPINE

    # The packages' __init__ files only gather names; the pool's cache events are the
    # prefix index's output records.
    measured = set(WHOLE.modules)
    spine = set(SPINE) | set(KV_SPINE)
    assert measured - spine == set()
    assert spine - measured <= {"ref/kv/__init__.py", "ref/kv/events.py"}
