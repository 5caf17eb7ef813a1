"""Imports go one way (docs/ARCHITECTURE.md, "Layers").

Every ``import`` in the source tree is read from the syntax tree, the ones inside functions
and under ``TYPE_CHECKING`` included (a lazy import is still a dependency), and checked
against the layer order. ``ref``'s own ``__init__`` is left out: it names the API modules
as strings for lazy loading, which is not an edge a layer sees. The same reading checks
that the layers below the model side (``spec``, ``ref.kv``, ``ref.core``) import no torch:
the scheduler and its step run, and are checked, without a tensor library.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Inside ref/: a module may import its own layer or any lower one. ref.model and ref.sim
# share a rank but are siblings: neither imports the other.
REF_LAYERS: dict[str, int] = {
    "ref.errors": 0,
    "ref.files": 1,
    "ref.kv": 2,
    "ref.core": 3,
    "ref.model": 4,
    "ref.sim": 4,
    "ref.engine": 5,
    "ref.cluster": 6,
    "ref.serve": 7,
    "ref.report": 8,
    "ref.cli": 9,
}
# The top-level packages each may import (besides itself and third-party code).
PACKAGE_MAY_IMPORT: dict[str, set[str]] = {
    "spec": set(),
    "kernels": set(),
    "ref": {"spec", "kernels"},  # conformance only from ref.cli, checked separately
    "conformance": {"spec", "kernels", "ref"},
}
OURS = frozenset(PACKAGE_MAY_IMPORT)
# Below the model side: no tensor library (docs/ARCHITECTURE.md, "Layers": "No torch").
TORCH_FREE = ("spec", "ref/kv", "ref/core")


def _layer(module: str) -> str:
    for name in sorted(REF_LAYERS, key=len, reverse=True):
        if module == name or module.startswith(name + "."):
            return name
    raise AssertionError(f"{module} belongs to no layer: add it to REF_LAYERS")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, *, ours: bool = True) -> list[tuple[int, str]]:
    """(line, absolute module) for every import of one of our packages in ``path``, or
    of any package with ``ours=False``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = _module_name(path).rsplit(".", 1)[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from ref.core import scheduler` imports ref.core.scheduler.
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return [(line, m) for line, m in found if not ours or m.split(".")[0] in OURS]


def _sources() -> list[Path]:
    return sorted(p for pkg in OURS for p in (ROOT / pkg).rglob("*.py"))


def violations(path: Path) -> list[str]:
    """Every import in ``path`` that goes against the layer order."""
    me = _module_name(path)
    top = me.split(".")[0]
    bad = []
    for line, target in _imports(path):
        other = target.split(".")[0]
        where = f"{path.relative_to(ROOT)}:{line} imports {target}"
        if other != top and other not in PACKAGE_MAY_IMPORT[top]:
            if not (top == "ref" and other == "conformance" and _layer(me) == "ref.cli"):
                bad.append(f"{where}: {top} may not import {other}")
            continue
        if top != "ref" or other != "ref" or me == "ref":
            continue
        mine, theirs = _layer(me), _layer(target)
        if REF_LAYERS[theirs] > REF_LAYERS[mine]:
            bad.append(f"{where}: {mine} sits below {theirs}")
        elif REF_LAYERS[theirs] == REF_LAYERS[mine] and theirs != mine:
            bad.append(f"{where}: {mine} and {theirs} are siblings")
    return bad


def test_every_import_follows_the_layer_order() -> None:
    bad = [v for path in _sources() for v in violations(path)]
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def torch_imports(path: Path) -> list[str]:
    """Every import of torch in ``path`` (``import torch.nn``, ``from torch import x``,
    lazy or under ``TYPE_CHECKING`` alike)."""
    return [
        f"{path.relative_to(ROOT)}:{line} imports {target}"
        for line, target in _imports(path, ours=False)
        if target.split(".")[0] == "torch"
    ]


def test_the_layers_below_the_model_import_no_torch() -> None:
    paths = sorted(p for d in TORCH_FREE for p in (ROOT / d).rglob("*.py"))
    assert len(paths) > 30  # the directories are where TORCH_FREE says
    bad = [v for path in paths for v in torch_imports(path)]
    assert not bad, "torch below the model side:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "source",
    [
        "import torch\n",
        "import numpy as np, torch.nn as nn\n",
        "from torch import Tensor\n",
        "def f():\n    from torch.linalg import lstsq\n",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n",
    ],
)
def test_a_torch_import_below_the_model_is_caught(
    source: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "ref" / "core" / "fake.py"
    path.parent.mkdir(parents=True)
    path.write_text(source)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    found = torch_imports(path)
    assert len(found) == 1 and "imports torch" in found[0], found


def test_a_module_named_like_torch_is_not_torch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "spec" / "fake.py"
    path.parent.mkdir(parents=True)
    path.write_text("import torchvision_like\nfrom ref.kv import torch_free\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert torch_imports(path) == []


def test_every_ref_module_has_a_layer() -> None:
    for path in (ROOT / "ref").rglob("*.py"):
        if _module_name(path) != "ref":
            _layer(_module_name(path))


@pytest.mark.parametrize(
    ("module", "source", "complaint"),
    [
        ("ref/core/fake.py", "from ref.sim.trace import load_trace\n", "below ref.sim"),
        ("ref/sim/fake.py", "import ref.model.llama\n", "siblings"),
        ("ref/kv/fake.py", "def f():\n    from ref.core import scheduler\n", "below ref.core"),
        ("ref/engine/fake.py", "from conformance import cli\n", "may not import conformance"),
        ("spec/fake.py", "from ref.kv import BlockPool\n", "spec may not import ref"),
        ("kernels/fake.py", "from ..ref import errors\n", "kernels may not import ref"),
        ("ref/core/fake.py", "from ..report import compare\n", "below ref.report"),
        ("ref/engine/fake.py", "from ref.cluster.router import Router\n", "below ref.cluster"),
        ("ref/cluster/fake.py", "from ref.serve import app\n", "below ref.serve"),
    ],
)
def test_an_upward_import_is_caught(
    module: str, source: str, complaint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checker itself fails on each kind of wrong edge (a planted module)."""
    path = tmp_path / module
    path.parent.mkdir(parents=True)
    path.write_text(source)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    found = violations(path)
    assert len(found) == 1 and complaint in found[0], found


def test_the_cli_may_import_conformance(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ref" / "cli" / "fake.py"
    path.parent.mkdir(parents=True)
    path.write_text("from conformance.cli import main\nfrom ref.report import compare\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert violations(path) == []
