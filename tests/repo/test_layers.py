"""Imports go one way (docs/ARCHITECTURE.md, "Layers").

Every ``import`` in the source tree is read from the syntax tree, the ones inside functions
and under ``TYPE_CHECKING`` included (a lazy import is still a dependency), and checked
against the layer order. The package's own ``__init__`` (``ref/__init__.py``) is left out:
it names the API modules as strings for lazy loading, which is not an edge a layer sees.
The same reading checks that the layers below the model side (``refserve.spec``,
``refserve.kv``, ``refserve.core``) import no torch: the scheduler and its step run, and
are checked, without a tensor library. Modules are named as installed (``refserve.*``,
tests/repo/layout.py); the rules are stated per folder. Last, the rules hold at import
time: a fresh interpreter that imports one layer has loaded nothing above it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.repo import layout

ROOT = layout.ROOT

# Inside ref/: a module may import its own layer or any lower one. refserve.model and
# refserve.sim share a rank but are siblings: neither imports the other.
REF_LAYERS: dict[str, int] = {
    "refserve.errors": 0,
    "refserve.values": 0,
    "refserve.files": 1,
    "refserve.kv": 2,
    "refserve.core": 3,
    "refserve.model": 4,
    "refserve.sim": 4,
    "refserve.engine": 5,
    "refserve.cluster": 6,
    "refserve.serve": 7,
    "refserve.report": 8,
    "refserve.cli": 9,
}
# The folders whose modules each folder's may import (besides its own and third-party code).
PACKAGE_MAY_IMPORT: dict[str, set[str]] = {
    "spec": set(),
    "kernels": set(),
    "ref": {"spec", "kernels"},  # conformance only from refserve.cli, checked separately
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
    return layout.module_name(path.relative_to(ROOT).as_posix())


def _folder(module: str) -> str | None:
    return layout.folder_of(module)


def _imports(path: Path, *, ours: bool = True) -> list[tuple[int, str]]:
    """(line, absolute module) for every import of one of our packages in ``path``, or
    of any package with ``ours=False``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from refserve.core import scheduler` imports refserve.core.scheduler.
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return [(line, m) for line, m in found if not ours or _folder(m) in OURS]


def _sources() -> list[Path]:
    return sorted(p for pkg in OURS for p in (ROOT / pkg).rglob("*.py"))


def violations(path: Path) -> list[str]:
    """Every import in ``path`` that goes against the layer order."""
    me = _module_name(path)
    top = _folder(me)
    assert top is not None, me
    bad = []
    for line, target in _imports(path):
        other = _folder(target)
        assert other is not None, target
        where = f"{path.relative_to(ROOT)}:{line} imports {target}"
        if other != top and other not in PACKAGE_MAY_IMPORT[top]:
            if not (top == "ref" and other == "conformance" and _layer(me) == "refserve.cli"):
                bad.append(f"{where}: {top} may not import {other}")
            continue
        if top != "ref" or other != "ref" or me == "refserve":
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
    path.write_text("import torchvision_like\nfrom refserve.kv import torch_free\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert torch_imports(path) == []


def test_every_ref_module_has_a_layer() -> None:
    for path in (ROOT / "ref").rglob("*.py"):
        if _module_name(path) != "refserve":
            _layer(_module_name(path))


@pytest.mark.parametrize(
    ("module", "source", "complaint"),
    [
        ("ref/core/fake.py", "from refserve.sim.trace import load_trace\n", "below refserve.sim"),
        ("ref/sim/fake.py", "import refserve.model.llama\n", "siblings"),
        (
            "ref/kv/fake.py",
            "def f():\n    from refserve.core import scheduler\n",
            "below refserve.core",
        ),
        (
            "ref/engine/fake.py",
            "from refserve.conformance import cli\n",
            "may not import conformance",
        ),
        ("spec/fake.py", "from refserve.kv import BlockPool\n", "spec may not import ref"),
        ("kernels/fake.py", "from .. import errors\n", "kernels may not import ref"),
        ("ref/core/fake.py", "from ..report import compare\n", "below refserve.report"),
        (
            "ref/engine/fake.py",
            "from refserve.cluster.router import Router\n",
            "below refserve.cluster",
        ),
        ("ref/cluster/fake.py", "from refserve.serve import app\n", "below refserve.serve"),
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
    path.write_text(
        "from refserve.conformance.cli import main\nfrom refserve.report import compare\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert violations(path) == []


# ------------------------------------------------------------------ at import time
# What a fresh interpreter has loaded of ours after importing one layer: the source reading
# above sees every import statement, this sees what the package's __init__ files really pull
# in (a lazy attribute that is touched, an eager re-export), under the installed names.
IMPORT_TIME_RULES = [
    # (what is imported, prefixes of ours that must not be loaded, prefixes allowed anyway)
    ("refserve.spec", ("refserve",), ("refserve.spec",)),
    ("refserve.kernels.oracle", ("refserve",), ("refserve.kernels",)),
    ("refserve.kv", ("refserve.core", "refserve.engine", "refserve.conformance"), ()),
    (
        "refserve.core.engine_core",
        ("refserve.model", "refserve.engine", "refserve.conformance"),
        (),
    ),
    ("refserve.engine", ("refserve.conformance", "refserve.cluster", "refserve.serve"), ()),
    ("refserve.engine.llm_engine", ("refserve.conformance", "refserve.cli"), ()),
]


def loaded_modules(statement: str) -> list[str]:
    """The modules of ours loaded after ``statement`` in a fresh interpreter."""
    code = f"import sys\n{statement}\nprint('\\n'.join(sorted(sys.modules)))"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return [m for m in proc.stdout.split() if m == "refserve" or m.startswith("refserve.")]


def _under(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def forbidden(loaded: list[str], banned: tuple[str, ...], allowed: tuple[str, ...]) -> list[str]:
    """The modules in ``loaded`` under a banned prefix and under no allowed one. The package
    root ``refserve`` itself, which Python loads before any of its subpackages, is allowed."""
    return [m for m in loaded if m != "refserve" and _under(m, banned) and not _under(m, allowed)]


@pytest.mark.parametrize(("module", "banned", "allowed"), IMPORT_TIME_RULES)
def test_importing_a_layer_loads_nothing_above_it(
    module: str, banned: tuple[str, ...], allowed: tuple[str, ...]
) -> None:
    loaded = loaded_modules(f"import {module}")
    assert module in loaded  # the reading saw the import itself
    bad = forbidden(loaded, banned, allowed)
    assert not bad, f"importing {module} loaded {bad}"


def test_the_import_time_check_fails_on_a_loaded_upper_layer() -> None:
    loaded = loaded_modules("import refserve.spec\nimport refserve.core.scheduler")
    assert "refserve.core.scheduler" in forbidden(loaded, ("refserve",), ("refserve.spec",))
    assert forbidden(["refserve", "refserve.spec.arith"], ("refserve",), ("refserve.spec",)) == []


# The spine (docs/ARCHITECTURE.md, "The core and what attaches to it"): the reference loop
# a newcomer reads end to end. No spine module imports an attachment; each attachment
# plugs in at a named point of ref/core/hooks.py and can be deleted with its tests and
# its lines in ref/core/scheduler.py, the composition, without touching the spine.
SPINE = tuple(
    f"ref/core/{m}.py"
    for m in (
        "__init__",
        "request",
        "config",
        "cost",
        "capacity",
        "prefill",
        "policy",
        "waiting",
        "plan",
        "step_build",
        "hooks",
        "planner",
        "loop",
        "batch",
        "inputs",
        "executor",
        "executor_output",
        "outcome",
        "engine_core",
    )
)
ATTACHMENTS = tuple(
    f"ref/core/{m}.py"
    for m in (
        "scheduler",  # the composition: the loop with every attachment plugged in
        "suspend",
        "swap",
        "speculation",
        "forks",
        "bulk",
        "transit",
        "migration_cost",
        "mlfq",
        "mlfq_settings",
    )
)
# Neither spine nor attachment: records other layers share that no scheduler code uses
# (the per-request latencies the engine reports and the simulator aggregates). The spine
# may not import them either.
BESIDE = tuple(f"ref/core/{m}.py" for m in ("request_metrics",))
# The pool's spine (allocator, free queue, prefix index with its cache events, journal,
# block tables, the pool joining them) and its attachments: the bulk decode step, fork,
# truncation of rejected drafts, and the host pool for swaps.
KV_SPINE = tuple(
    f"ref/kv/{m}.py"
    for m in (
        "__init__",
        "allocator",
        "free_queue",
        "prefix_index",
        "events",
        "journal",
        "tables",
        "pool",
    )
)
KV_ATTACHMENTS = tuple(
    f"ref/kv/{m}.py" for m in ("decode_runs", "forks", "truncation", "host_pool", "groups")
)
# Two edges the rule allows, with their reason: the configuration validates every setting
# in one place, the swap's (preemption mode, swap cost, tool-wait retention) and the
# multi-level queue's included, and those setting types live with their attachment.
SETTINGS_EDGES = frozenset(
    {
        ("refserve.core.config", "refserve.core.swap"),
        ("refserve.core.config", "refserve.core.mlfq_settings"),
    }
)


def spine_violations(root: Path, spine: tuple[str, ...], attachments: tuple[str, ...]) -> list[str]:
    """Every import of an attachment module by a spine module."""
    attached = {layout.module_name(m) for m in attachments}
    bad = []
    for rel in spine:
        path = root / rel
        me = layout.module_name(rel)
        for line, target in _imports(path):
            # `from a.b import c` reads as a.b.c: c may be a name or a module.
            hit = next((m for m in attached if target == m or target.startswith(m + ".")), None)
            if hit is not None and (me, hit) not in SETTINGS_EDGES:
                bad.append(f"{rel}:{line} imports the attachment {hit}")
    return bad


def test_the_spine_imports_no_attachment() -> None:
    # The kv package's __init__ gathers the pool's names, attachments included, for its
    # callers: it is the package's front door, read by no spine module directly.
    kv_spine = tuple(m for m in KV_SPINE if not m.endswith("__init__.py"))
    bad = spine_violations(ROOT, SPINE + kv_spine, ATTACHMENTS + BESIDE + KV_ATTACHMENTS)
    assert not bad, "the spine imports an attachment:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    ("folder", "spine", "others"),
    [("core", SPINE, ATTACHMENTS + BESIDE), ("kv", KV_SPINE, KV_ATTACHMENTS)],
)
def test_every_module_is_spine_or_attachment(
    folder: str, spine: tuple[str, ...], others: tuple[str, ...]
) -> None:
    found = {p.relative_to(ROOT).as_posix() for p in (ROOT / "ref" / folder).glob("*.py")}
    assert not set(spine) & set(others)
    assert found == set(spine) | set(others), (
        f"classify each ref/{folder} module as spine or attachment: "
        f"{sorted(found ^ (set(spine) | set(others)))}"
    )


def test_a_spine_import_of_an_attachment_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rule itself fails on a planted edge (a spine module importing an attachment)."""
    planted = tmp_path / "ref" / "core" / "loop.py"
    planted.parent.mkdir(parents=True)
    planted.write_text("from refserve.core.speculation import Proposals\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    found = spine_violations(tmp_path, ("ref/core/loop.py",), ATTACHMENTS)
    assert found == ["ref/core/loop.py:1 imports the attachment refserve.core.speculation"]
