"""The import map of docs/ARCHITECTURE.md ("Who imports whom") is the sources' real
package-level import graph.

The map is parsed from the document's ``text`` block under that heading; the graph is
read from the syntax tree of every module of ours (lazy imports and those under
``TYPE_CHECKING`` included, relative ones resolved), an edge per pair of packages. The test
fails on an edge the map names that no source has, and on an edge a source has that the
map does not name; each message says which file makes the edge, so the map is fixed in
the same change that adds or drops one.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.repo import layout

ROOT = layout.ROOT
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
HEADING = "### Who imports whom"
# The package root's __init__ names the API modules as strings for lazy loading: not an
# edge (the map says so); everything else under the four folders is read.
ROOT_PACKAGE = "refserve"
Graph = dict[str, dict[str, list[str]]]  # package -> package it imports -> the files


def package_of(module: str) -> str:
    """The map's node a module belongs to: ``refserve.core.scheduler`` -> ``refserve.core``,
    ``refserve.errors`` -> itself."""
    return ".".join(module.split(".")[:2])


def imported_modules(path: Path, module: str) -> list[str]:
    """Every module of ours ``path`` (the module ``module``) imports, anywhere in it."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = parts[: len(parts) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from refserve import errors` imports refserve.errors.
            found += [f"{base}.{a.name}" for a in node.names] if base == ROOT_PACKAGE else [base]
    return [m for m in found if m.split(".")[0] == ROOT_PACKAGE and m != ROOT_PACKAGE]


def import_graph(root: Path = ROOT) -> Graph:
    """The package-level graph of the sources under ``root``: each edge with the files
    that make it."""
    graph: Graph = {}
    for folder in layout.FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            module = layout.module_name(path.relative_to(root).as_posix())
            if module == ROOT_PACKAGE:
                continue
            me = package_of(module)
            graph.setdefault(me, {})
            for target in imported_modules(path, module):
                other = package_of(target)
                if other != me:
                    graph[me].setdefault(other, []).append(path.relative_to(root).as_posix())
    return graph


def parse_map(text: str) -> dict[str, set[str]]:
    """The map in the ``text`` block under :data:`HEADING`: each entry
    ``<package> imports <a>, <b>, ...`` (or ``imports nothing of ours``), its list
    continued on indented lines."""
    after = text.split(HEADING, 1)[1]
    block = re.search(r"```text\n(.*?)```", after, re.DOTALL)
    assert block is not None, f"no text block under {HEADING!r}"
    entries: list[str] = []
    for line in block.group(1).splitlines():
        if line.startswith(ROOT_PACKAGE + "."):
            entries.append(line)
        elif line.strip():
            assert line.startswith(" ") and entries, f"not an entry nor its continuation: {line!r}"
            entries[-1] += " " + line.strip()
    out: dict[str, set[str]] = {}
    for entry in entries:
        m = re.fullmatch(r"(\S+)\s+imports\s+(.*)", entry)
        assert m is not None, f"an entry is '<package> imports <packages>': {entry!r}"
        package, rest = m.group(1), m.group(2).strip()
        assert package not in out, f"{package} has two entries"
        names = [] if rest == "nothing of ours" else [n.strip() for n in rest.split(",")]
        out[package] = set(names)
    return out


def differences(claimed: dict[str, set[str]], graph: Graph) -> list[str]:
    """What the map and the graph disagree on, one line each."""
    bad = [f"{p} has no entry in the map" for p in sorted(set(graph) - set(claimed))]
    bad += [f"{p} is in the map but has no source" for p in sorted(set(claimed) - set(graph))]
    for p in sorted(set(claimed) & set(graph)):
        real = graph[p]
        for q in sorted(set(real) - claimed[p]):
            bad.append(f"{p} imports {q}, the map omits it ({', '.join(sorted(set(real[q])))})")
        for q in sorted(claimed[p] - set(real)):
            bad.append(f"the map says {p} imports {q}; no source of it does")
    return bad


def test_the_import_map_is_the_real_import_graph() -> None:
    claimed = parse_map(ARCHITECTURE.read_text(encoding="utf-8"))
    graph = import_graph()
    assert {"refserve.core", "refserve.engine", "refserve.conformance"} <= set(graph)
    bad = differences(claimed, graph)
    assert not bad, "docs/ARCHITECTURE.md, 'Who imports whom':\n" + "\n".join(bad)


# Edges the layer order would allow but the design rules out (docs/ARCHITECTURE.md, the
# notes under the map): the engine takes its per-request record from the core, not from
# the simulator; conformance reaches an engine only through an adapter, never the engine
# or the model side directly (conformance-http is handed its reference).
NEVER = (
    ("refserve.engine", "refserve.sim"),
    ("refserve.conformance", "refserve.engine"),
    ("refserve.conformance", "refserve.model"),
)


def test_the_graph_has_none_of_the_ruled_out_edges() -> None:
    graph = import_graph()
    bad = [
        f"{a} imports {b} ({', '.join(sorted(set(graph[a][b])))})"
        for a, b in NEVER
        if b in graph.get(a, {})
    ]
    assert not bad, "ruled-out imports:\n" + "\n".join(bad)


def test_the_engine_loads_no_simulator_at_import_time() -> None:
    """The same rule when the code runs: a fresh interpreter that imports the engine has
    loaded nothing of the simulator (the package __init__ files included); the control,
    the simulator's own driver, does load it."""
    code = "import sys\nimport {}\nprint('\\n'.join(sorted(sys.modules)))"
    loaded = {}
    for module in ("refserve.engine.llm_engine", "refserve.sim.simulator"):
        proc = subprocess.run(
            [sys.executable, "-c", code.format(module)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        loaded[module] = [m for m in proc.stdout.split() if m.startswith("refserve.sim")]
    assert loaded["refserve.engine.llm_engine"] == []
    assert "refserve.sim.simulator" in loaded["refserve.sim.simulator"]


MAP = """### Who imports whom

```text
refserve.errors       imports nothing of ours
refserve.kv           imports refserve.errors,
                      refserve.spec
refserve.spec         imports nothing of ours
```
"""


def _planted(tmp_path: Path, files: dict[str, str]) -> Graph:
    for rel, source in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return import_graph(tmp_path)


def test_the_map_parses_entries_and_their_continuations() -> None:
    assert parse_map(MAP) == {
        "refserve.errors": set(),
        "refserve.kv": {"refserve.errors", "refserve.spec"},
        "refserve.spec": set(),
    }


@pytest.mark.parametrize(
    ("files", "complaint"),
    [
        (  # an edge the map omits, made by a lazy import
            {"ref/kv/pool.py": "def f():\n    from refserve.core import scheduler\n"},
            "refserve.kv imports refserve.core, the map omits it (ref/kv/pool.py)",
        ),
        (  # an edge the map names that no source has
            {"ref/kv/events.py": "from refserve.errors import InvalidArgument\n"},
            "the map says refserve.kv imports refserve.spec; no source of it does",
        ),
        (  # a relative import, resolved
            {"ref/kv/pool.py": "from ..spec import x\nfrom .. import sim\n"},
            "refserve.kv imports refserve.sim, the map omits it",
        ),
        (  # a package the map does not know
            {"ref/sim/run.py": "import os\n"},
            "refserve.sim has no entry in the map",
        ),
    ],
)
def test_the_check_fails_on_a_wrong_map(
    files: dict[str, str], complaint: str, tmp_path: Path
) -> None:
    base = {
        "ref/errors.py": "",
        "spec/arith.py": "",
        "ref/kv/events.py": "from refserve.spec import arith\nfrom refserve import errors\n",
    }
    graph = _planted(tmp_path, {**base, **files})
    bad = differences(parse_map(MAP), graph)
    assert any(complaint in line for line in bad), bad


def test_the_check_passes_on_a_true_map(tmp_path: Path) -> None:
    graph = _planted(
        tmp_path,
        {
            "ref/errors.py": "",
            "spec/arith.py": "from typing import TYPE_CHECKING\n",
            "ref/kv/events.py": "from refserve.spec import arith\nfrom refserve import errors\n",
        },
    )
    assert differences(parse_map(MAP), graph) == []
