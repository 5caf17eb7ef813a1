"""Which module each source file is: the mapping of folders to the one import name.

pyproject's ``[tool.setuptools.package-dir]`` puts the four folders under ``refserve``:
``ref/`` is the package itself and ``spec/``, ``kernels/`` and ``conformance/`` are its
subpackages (docs/ARCHITECTURE.md, "One import name"). The repository tests that read
sources from their paths (layers, import circles, the rename's leftovers) name modules
through this one reading of that table.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def package_dirs(root: Path = ROOT) -> dict[str, str]:
    """Folder -> the package it is, from pyproject (``{"ref": "refserve", ...}``)."""
    data = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))
    table: dict[str, str] = data["tool"]["setuptools"]["package-dir"]
    return {folder: package for package, folder in table.items()}


FOLDERS = package_dirs()
# The deepest package first: refserve.spec.x is in spec/, not in ref/.
_BY_DEPTH = sorted(FOLDERS.items(), key=lambda item: -len(item[1]))


def module_name(path: str) -> str:
    """``ref/cli/main.py`` -> ``refserve.cli.main``; ``spec/__init__.py`` -> ``refserve.spec``."""
    folder, _, rest = path.removesuffix(".py").partition("/")
    parts = [FOLDERS[folder], *rest.split("/")] if rest else [FOLDERS[folder]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def folder_of(module: str) -> str | None:
    """The folder a module of ours lives in (``refserve.spec.arith`` -> ``spec``,
    ``refserve.core`` -> ``ref``), or None for a module that is not ours."""
    for folder, package in _BY_DEPTH:
        if module == package or module.startswith(package + "."):
            return folder
    return None
