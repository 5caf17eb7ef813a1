"""No module reads or writes another object's private members.

``x._name`` is an access to a private member when ``_name`` is a private name defined in
this repository (a method, an attribute assigned on ``self``/``cls``, a class-level or
module-level name) and ``x`` is neither ``self``, ``cls`` nor ``super()``, and the access is
not inside a class that defines ``_name`` itself (a class may read the same member of
another of its instances). ``from refserve.x import _name`` across modules is one too.
What one module needs of another is given a public, typed name instead; there is no
allow-list of accesses.

Two things are not refserve's private members and are left out, each for a stated reason:
- namedtuple's ``_replace``, ``_asdict``, ``_fields``, ``_make``, ``_field_defaults`` are its
  public API (the underscore only keeps them clear of field names);
- ``conformance/corpus/patches/`` re-applies bugs that third-party engines shipped, by
  putting back the engine's own private method as it was: the members it reaches are the
  engine's, never refserve's, and a patch cannot do its job without them.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECKED = ("ref", "spec", "kernels", "conformance")
THIRD_PARTY_PATCHES = "conformance/corpus/patches"
NAMEDTUPLE_API = frozenset({"_replace", "_asdict", "_fields", "_make", "_field_defaults"})


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def defined_names(tree: ast.AST) -> set[str]:
    """Private names a tree defines: functions, classes, stores on self/cls, assignments."""
    out: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
            if isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"):
                out.add(n.attr)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            out.add(n.id)
    return {name for name in out if _private(name)}


def _own(node: ast.Attribute) -> bool:
    v = node.value
    if isinstance(v, ast.Name) and v.id in ("self", "cls"):
        return True
    return isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super"


def crossings(tree: ast.AST, ours: set[str]) -> Iterator[tuple[int, str]]:
    """(line, text) of each access in ``tree`` to a private member of ours it does not own."""

    def visit(node: ast.AST, owned: frozenset[str]) -> Iterator[tuple[int, str]]:
        for child in ast.iter_child_nodes(node):
            inner = owned | defined_names(child) if isinstance(child, ast.ClassDef) else owned
            if (
                isinstance(child, ast.Attribute)
                and child.attr in ours
                and child.attr not in NAMEDTUPLE_API
                and not _own(child)
                and child.attr not in inner
            ):
                yield child.lineno, ast.unparse(child)
            if isinstance(child, ast.ImportFrom) and (child.module or "").startswith("refserve"):
                for alias in child.names:
                    if alias.name in ours:
                        yield child.lineno, f"from {child.module} import {alias.name}"
            yield from visit(child, inner)

    yield from visit(tree, frozenset())


def _sources() -> dict[str, ast.AST]:
    return {
        str(p.relative_to(ROOT)): ast.parse(p.read_text(encoding="utf-8"))
        for folder in CHECKED
        for p in sorted((ROOT / folder).rglob("*.py"))
    }


def test_no_module_reaches_into_another_objects_private_members() -> None:
    trees = _sources()
    ours = set().union(*(defined_names(t) for t in trees.values()))
    found = [
        f"{path}:{line}: {text}"
        for path, tree in trees.items()
        if not path.startswith(THIRD_PARTY_PATCHES)
        for line, text in crossings(tree, ours)
    ]
    assert not found, "private members reached from outside their class:\n" + "\n".join(found)


def test_the_rule_sees_a_crossing_and_passes_own_access() -> None:
    source = (
        "class A:\n"
        "    def __init__(self):\n"
        "        self._n = 0\n"
        "    def same(self, other):\n"
        "        return self._n + other._n + super()._n\n"
        "def outside(a):\n"
        "    return a._n + a._replace()\n"
        "from refserve.x import _helper\n"
    )
    tree = ast.parse(source)
    ours = defined_names(tree) | {"_helper", "_replace"}
    assert list(crossings(tree, ours)) == [(7, "a._n"), (8, "from refserve.x import _helper")]
