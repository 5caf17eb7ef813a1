"""No file of the repository names a module by a folder instead of by ``refserve``.

The folders ``ref/``, ``spec/``, ``kernels/`` and ``conformance/`` are installed as
``refserve``, ``refserve.spec``, ``refserve.kernels`` and ``refserve.conformance``
(tests/repo/layout.py). A leftover ``from spec.arith import ...`` would still import in a
checkout (the folder is there) and fail for every user of the wheel, and a leftover
``conformance.adapters.ref:make`` in a doc is a command that does not run. Two readings
find them: the syntax tree of every Python file (imports inside functions included), and a
text search of every tracked file for a dotted name that starts with a folder and goes on
with a module that folder really has.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

from tests.repo.layout import FOLDERS, ROOT


def folder_imports(source: str, filename: str = "<source>") -> list[str]:
    """Every absolute import in ``source`` whose first name is one of the folders."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in FOLDERS]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found += [node.module] if node.module.split(".")[0] in FOLDERS else []
    return found


def _children(folder: Path) -> set[str]:
    """The modules and subpackages directly in ``folder``."""
    return {
        p.stem
        for p in folder.iterdir()
        if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()
    }


def leftover_pattern(root: Path = ROOT) -> re.Pattern[str]:
    """A dotted name that starts with a folder and goes on with one of its modules
    (``spec.arith``, ``ref.core``), not preceded by a name, a dot or a path separator
    (``refserve.spec.arith`` and ``ref/core/`` are fine); or ``kernels:`` as an entry point."""
    alternatives = [
        rf"{folder}\.(?:{'|'.join(sorted(_children(root / folder)))})\b" for folder in FOLDERS
    ]
    return re.compile(r"(?<![\w./-])(?:" + "|".join(alternatives) + r"|kernels:\w)")


def tracked_text_files() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60
    ).stdout.decode()
    paths = [ROOT / name for name in out.split("\0") if name]
    this = Path(__file__).resolve()  # its planted examples are leftovers on purpose
    skip = (".safetensors", ".png")
    return [p for p in paths if p.is_file() and p.suffix not in skip and p.resolve() != this]


def test_no_python_file_imports_a_folder_by_its_name() -> None:
    files = [p for p in tracked_text_files() if p.suffix == ".py"]
    assert len(files) > 200  # the walk saw the repository
    bad = [
        f"{path.relative_to(ROOT)}: import {name}"
        for path in files
        for name in folder_imports(path.read_text(encoding="utf-8"), str(path))
    ]
    assert not bad, "imports that name a folder, not refserve:\n" + "\n".join(bad)


def test_no_tracked_file_names_a_module_by_its_folder() -> None:
    pattern = leftover_pattern()
    bad = []
    for path in tracked_text_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if match := pattern.search(line):
                bad.append(f"{path.relative_to(ROOT)}:{number}: {match.group(0)!r} in {line!r}")
    assert not bad, "names that miss the refserve prefix:\n" + "\n".join(bad[:50])


@pytest.mark.parametrize(
    "source",
    [
        "import spec.checks\n",
        "from kernels import paged_attention\n",
        "def f():\n    from ref.core.scheduler import Scheduler\n",
        "import json, conformance.adapters.ref as a\n",
    ],
)
def test_a_folder_import_is_caught(source: str) -> None:
    assert len(folder_imports(source)) == 1


def test_imports_under_the_one_name_pass() -> None:
    source = "import refserve.spec.checks\nfrom refserve import kernels\nfrom . import ref\n"
    assert folder_imports(source) == []


@pytest.mark.parametrize(
    ("line", "caught"),
    [
        ("python -m ref.model.train_tiny", True),
        ("refserve conformance --adapter conformance.adapters.ref:make", True),
        ("refserve check-kernel kernels:paged_attention", True),
        ("`spec.arith` holds the contracts", True),
        ("python -m refserve.model.train_tiny", False),
        ("--adapter refserve.conformance.adapters.ref:make", False),
        ("the file ref/core/scheduler.py", False),
        ("ref.shape and spec.temperature are attributes", False),
        ("See the spec. Then the kernels.", False),
    ],
)
def test_the_text_search_tells_a_leftover_from_prose(line: str, caught: bool) -> None:
    assert bool(leftover_pattern().search(line)) is caught
