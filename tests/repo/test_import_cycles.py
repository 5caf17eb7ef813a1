"""No two modules import each other, directly or round a longer circle
(docs/ARCHITECTURE.md, "Who imports whom"; listed in "Claims the tests check").

Every ``import`` is read from the syntax tree, the ones inside functions and under
``TYPE_CHECKING`` included: a lazy import postpones the circle to the first call, it does
not remove it, and a circle is a pair of modules that cannot be understood (or moved) one
without the other. An import names the module it loads (``from refserve.core import scheduler``
is an edge to ``refserve.core.scheduler``; ``from refserve.cli.args import PROG`` to
``refserve.cli.args``), not the packages above it, which Python loads first but which do not
import back.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping

import pytest

from tests.repo.layout import FOLDERS, ROOT, module_name

PACKAGES = tuple(FOLDERS)


def _imported_names(path: str, source: str) -> list[str]:
    """Every dotted name an import statement in ``source`` loads, made absolute."""
    me = module_name(path)
    package = me if path.endswith("__init__.py") else me.rpartition(".")[0]
    names: list[str] = []
    for node in ast.walk(ast.parse(source, filename=path)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from a.b import c` loads a.b.c when c is a module, else a.b (resolved below).
            names += [f"{base}.{alias.name}" for alias in node.names]
    return names


def import_graph(sources: Mapping[str, str]) -> dict[str, set[str]]:
    """Module -> the modules among ``sources`` it imports; ``sources`` maps a path
    relative to the repository root to the file's text. Imports of modules outside
    ``sources`` (the standard library, third-party code) are left out."""
    modules = {module_name(path) for path in sources}
    graph: dict[str, set[str]] = {}
    for path, source in sources.items():
        me = module_name(path)
        edges: set[str] = set()
        for name in _imported_names(path, source):
            parts = name.split(".")
            # The longest prefix that is a module: `from refserve.cli.args import PROG`.
            target = next(
                (t for i in range(len(parts), 0, -1) if (t := ".".join(parts[:i])) in modules),
                None,
            )
            if target is not None and target != me:
                edges.add(target)
        graph[me] = edges
    return graph


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """Each group of modules that import one another round a circle (the strongly
    connected components with more than one module, Tarjan's algorithm without recursion,
    so a deep import chain cannot overflow the stack), each sorted, sorted by first."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, list[str]]] = [(root, sorted(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, todo = work[-1]
            if todo:
                nxt = todo.pop()
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, sorted(graph.get(nxt, ()))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                group: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return sorted(found)


def _repository_sources() -> dict[str, str]:
    return {
        path.relative_to(ROOT).as_posix(): path.read_text(encoding="utf-8")
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
    }


def test_no_module_imports_itself_round_a_circle() -> None:
    sources = _repository_sources()
    graph = import_graph(sources)
    # The walk saw the package: a broken reader would find no edges and pass.
    assert "refserve.cli.serve" in graph["refserve.cli.main"]
    assert "refserve.cli.config_args" in graph["refserve.cli.serve"]
    found = cycles(graph)
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_cli_commands_import_the_shared_options_not_each_other() -> None:
    graph = import_graph(_repository_sources())
    assert "refserve.cli.main" not in graph["refserve.cli.serve"]


# --------------------------------------------------------------------- the checker fails
@pytest.mark.parametrize(
    ("sources", "circle"),
    [
        (  # the circle this test was written for: one side lazy, in a function
            {
                "ref/cli/main.py": "from refserve.cli.serve import add\n",
                "ref/cli/serve.py": "def add():\n    from refserve.cli.main import config\n",
            },
            ["refserve.cli.main", "refserve.cli.serve"],
        ),
        (  # round three modules, relative and TYPE_CHECKING imports
            {
                "ref/a.py": "from . import b\n",
                "ref/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                "    from refserve.c import X\n",
                "ref/c.py": "import refserve.a\nimport json\n",
            },
            ["refserve.a", "refserve.b", "refserve.c"],
        ),
        (  # through a package's __init__
            {
                "ref/kv/__init__.py": "from refserve.kv.pool import Pool\n",
                "ref/kv/pool.py": "from refserve.kv import helper\n",
            },
            ["refserve.kv", "refserve.kv.pool"],
        ),
    ],
)
def test_a_planted_circle_is_found(sources: dict[str, str], circle: list[str]) -> None:
    assert cycles(import_graph(sources)) == [circle]


def test_a_one_way_chain_is_no_circle() -> None:
    sources = {
        "ref/a.py": "from refserve.b import f\n",
        "ref/b.py": "from refserve import c\nimport os\n",
        "ref/c.py": "from refserve.c import itself\n",  # a module naming itself is no edge
        "spec/d.py": "from . import e\n",  # relative, in a subpackage of its own folder
        "spec/e.py": "",
    }
    graph = import_graph(sources)
    assert graph == {
        "refserve.a": {"refserve.b"},
        "refserve.b": {"refserve.c"},
        "refserve.c": set(),
        "refserve.spec.d": {"refserve.spec.e"},
        "refserve.spec.e": set(),
    }
    assert cycles(graph) == []
