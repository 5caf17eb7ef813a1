"""One migration driver: only ``refserve.engine.migration.migrate`` orders a move.

What makes a sequence of calls a migration driver is where it lets the source go: the
release must come after the destination's ack, and the driver is the one place that
orders the two. So in ref/ a source is released (``x.release_request(...)``) only inside
``migrate``, or inside a method that is itself a ``release_request`` (a replica or an
end passing the call on to what it wraps); and the scheduler-level release
(``transit.release``) only inside such an end or the engine's ``release``. The engine,
the cluster, the served cluster, the simulator and the CLI all call ``migrate`` with
their own ends. conformance/ is not checked: its harness drives another engine's
migration phases one by one, on purpose, to test them.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ("ref/engine/migration.py", "migrate")
PASS_ON = frozenset({"release_request"})
SCHEDULER_RELEASE = frozenset({"release_request", "release"})


def releases(tree: ast.AST, path: str) -> Iterator[tuple[int, str]]:
    """(line, what) for each release in ``tree`` that is not the driver's or a
    pass-on (module doc)."""

    def visit(node: ast.AST, fn: str | None) -> Iterator[tuple[int, str]]:
        for child in ast.iter_child_nodes(node):
            inner = fn
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inner = child.name
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute):
                name = child.func.attr
                target = child.func.value
                if name == "release_request" and fn not in PASS_ON and (path, fn) != DRIVER:
                    yield child.lineno, f"{ast.unparse(child.func)}() in {fn}()"
                if (
                    name == "release"
                    and isinstance(target, ast.Name)
                    and target.id == "transit"
                    and fn not in SCHEDULER_RELEASE
                ):
                    yield child.lineno, f"transit.release() in {fn}()"
            yield from visit(child, inner)

    yield from visit(tree, None)


def test_only_the_driver_releases_a_source() -> None:
    found = []
    for f in sorted((ROOT / "ref").rglob("*.py")):
        rel = f.relative_to(ROOT).as_posix()
        for line, what in releases(ast.parse(f.read_text(), rel), rel):
            found.append(f"{rel}:{line}: {what}")
    assert not found, "a second migration driver (use refserve.engine.migration.migrate):\n" + (
        "\n".join(found)
    )


def test_a_hand_written_move_is_caught() -> None:
    """A planted second driver, as the served cluster had one: export, import on the
    other side, release here."""
    planted = ast.parse(
        "def _move(a, b, rid):\n"
        "    ticket = a.replica.export_request(rid)\n"
        "    b.replica.import_request(ticket)\n"
        "    a.replica.release_request(rid)\n"
        "def land(sched, rid):\n"
        "    transit.release(sched, rid)\n"
    )
    found = list(releases(planted, "ref/serve/cluster_loop.py"))
    assert [line for line, _ in found] == [4, 6], found
    driver = ast.parse("def migrate(src, dst, rid):\n    src.release_request(rid)\n")
    assert not list(releases(driver, DRIVER[0]))
    assert list(releases(driver, "ref/cluster/sim.py"))  # the name alone is not enough
