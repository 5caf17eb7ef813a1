"""No class over 450 lines in ``ref/``, ``spec/``, ``kernels/`` or ``conformance/``.

A class that long holds several responsibilities; it is split by responsibility into
collaborators that each own their state (docs/ARCHITECTURE.md, "Claims the tests check").
Lines are the class statement's span in the file, docstring and comments included: what a
reader has to hold to follow the class.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_CLASS_LINES = 450
CHECKED = ("ref", "spec", "kernels", "conformance")


def long_classes(source: str, max_lines: int = MAX_CLASS_LINES) -> list[tuple[str, int]]:
    """(name, lines) of every class in ``source`` longer than ``max_lines``, nested ones too."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            assert node.end_lineno is not None
            lines = node.end_lineno - node.lineno + 1
            if lines > max_lines:
                out.append((node.name, lines))
    return out


def test_no_class_is_longer_than_the_limit() -> None:
    found = [
        f"{path.relative_to(ROOT)}: class {name} has {lines} lines"
        for folder in CHECKED
        for path in sorted((ROOT / folder).rglob("*.py"))
        for name, lines in long_classes(path.read_text(encoding="utf-8"))
    ]
    assert not found, (
        f"classes over {MAX_CLASS_LINES} lines: split by responsibility\n" + "\n".join(found)
    )


def test_the_measure_sees_a_long_class_and_a_nested_one() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_CLASS_LINES))
    long = f"class Long:\n{body}\n"
    assert long_classes(long) == [("Long", MAX_CLASS_LINES + 1)]
    nested = "class Outer:\n" + "\n".join("    " + line for line in long.splitlines())
    assert [name for name, _ in long_classes(nested)] == ["Outer", "Long"]
    assert long_classes("class Short:\n    x = 1\n") == []
