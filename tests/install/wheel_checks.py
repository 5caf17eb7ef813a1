"""What the installed-wheel test checks, as plain functions over file lists and mappings,
so that each check can be shown failing on a planted wheel, file tree or environment
(tests/install/test_wheel_checks.py) without building anything."""

from __future__ import annotations

import zipfile
from collections.abc import Iterable, Mapping
from pathlib import Path

# What refserve's wheel may hold at its top level: the package and its metadata.
DIST_INFO_SUFFIX = ".dist-info"


def wheel_import_names(names: Iterable[str]) -> set[str]:
    """The top-level import names a wheel with these member paths installs (its
    ``*.dist-info`` and ``*.data`` folders are not import names)."""
    tops = {name.split("/", 1)[0] for name in names if name}
    return {
        top.removesuffix(".py")
        for top in tops
        if not top.endswith(DIST_INFO_SUFFIX) and not top.endswith(".data")
    }


def wheel_members(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        return archive.namelist()


def expected_data_files(root: Path, package_dirs: Mapping[str, str]) -> list[str]:
    """The files that are not Python sources and must ship, as installed paths
    (``refserve/sim/traces/seed001.jsonl``): every ``py.typed``, the embedded traces and
    the trained model's checkpoint. ``package_dirs`` maps a folder to its package."""
    wanted: list[str] = []
    for folder, package in package_dirs.items():
        base = package.replace(".", "/")
        wanted.append(f"{base}/py.typed")
        if folder == "ref":
            wanted += [
                f"{base}/{p.relative_to(root / folder).as_posix()}"
                for pattern in (
                    "sim/traces/*.jsonl",
                    "model/tiny/config.json",
                    "model/tiny/model.safetensors",
                )
                for p in sorted((root / folder).glob(pattern))
            ]
    return sorted(wanted)


def missing_files(wanted: Iterable[str], site_packages: Path) -> list[str]:
    """The wanted installed paths that are not files under ``site_packages``."""
    return [name for name in wanted if not (site_packages / name).is_file()]


def clashing_distributions(
    ours: Iterable[str], providers: Mapping[str, list[str]], me: str = "refserve"
) -> dict[str, list[str]]:
    """Import name -> the other distributions that install it too, for each of ``ours``
    that another distribution provides (``providers`` is
    ``importlib.metadata.packages_distributions()`` of the environment)."""
    out: dict[str, list[str]] = {}
    for name in ours:
        others = sorted({d for d in providers.get(name, []) if d.lower() != me})
        if others:
            out[name] = others
    return out
