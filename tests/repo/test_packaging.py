"""refserve installs one import name, `refserve`, and no other distribution provides it.

The four folders of the repository are mapped under that name by pyproject's
``[tool.setuptools.package-dir]`` (docs/ARCHITECTURE.md, "One import name"), and its
packages are listed by hand: these tests keep the list equal to the folders, so a new
subpackage cannot silently drop out of the wheel. The generic names the folders have
(``kernels`` above all: Hugging Face ships a distribution of that import name, which
transformers >= 5.25 requires) are never installed. tests/install/ builds and installs the
wheel itself.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.repo.layout import FOLDERS, ROOT, module_name

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
# Folders of data inside a package, listed as packages so that their files ship.
DATA_PACKAGES = {"refserve.sim.traces"}


def source_packages(root: Path = ROOT) -> set[str]:
    """Every package of the four folders: each folder holding an ``__init__.py``."""
    return {
        module_name(init.relative_to(root).as_posix())
        for folder in FOLDERS
        for init in (root / folder).rglob("__init__.py")
        if "__pycache__" not in init.parts
    }


def listing_gaps(listed: set[str], found: set[str]) -> list[str]:
    """What is wrong with pyproject's package list, one line per package."""
    return [f"{p}: a package on disk, not in pyproject's packages" for p in sorted(found - listed)]


def test_every_package_on_disk_is_in_the_wheels_list() -> None:
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    found = source_packages()
    assert "refserve.conformance.adapters" in found  # the walk saw the nested packages
    assert not listing_gaps(listed, found)
    assert listed - found == DATA_PACKAGES, "listed packages with no folder or __init__.py"
    for data in DATA_PACKAGES:
        assert PYPROJECT["tool"]["setuptools"]["package-data"][data], data


def test_a_package_missing_from_the_list_is_named(tmp_path: Path) -> None:
    (tmp_path / "conformance" / "newpkg").mkdir(parents=True)
    (tmp_path / "conformance" / "__init__.py").write_text("")
    (tmp_path / "conformance" / "newpkg" / "__init__.py").write_text("")
    found = source_packages(tmp_path)
    assert found == {"refserve.conformance", "refserve.conformance.newpkg"}
    gaps = listing_gaps({"refserve.conformance"}, found)
    assert gaps == ["refserve.conformance.newpkg: a package on disk, not in pyproject's packages"]


def test_the_four_folders_map_under_one_import_name() -> None:
    table = PYPROJECT["tool"]["setuptools"]["package-dir"]
    assert {name.split(".")[0] for name in table} == {"refserve"}
    assert set(table.values()) == {"ref", "spec", "kernels", "conformance"}


def foreign_providers(name: str, mapping: dict[str, list[str]]) -> list[str]:
    """The distributions other than refserve that install the import name `name`."""
    return sorted({dist for dist in mapping.get(name, []) if dist.lower() != "refserve"})


def test_no_other_distribution_installs_our_import_name() -> None:
    mapping = importlib.metadata.packages_distributions()
    assert "refserve" in mapping.get("refserve", []), "refserve is not installed"
    assert foreign_providers("refserve", mapping) == []
    # And refserve installs no other import name (an editable install's finder aside).
    ours = sorted(n for n, dists in mapping.items() if "refserve" in dists)
    assert [n for n in ours if not n.startswith("__editable__")] == ["refserve"], ours


def test_the_clash_check_names_a_foreign_distribution() -> None:
    mapping = {"refserve": ["refserve", "refserve-fork"], "kernels": ["kernels"]}
    assert foreign_providers("refserve", mapping) == ["refserve-fork"]
    assert foreign_providers("kernels", {"kernels": ["refserve"]}) == []


def upper_bounds(requirements: list[str], names: set[str]) -> list[str]:
    """The requirements on ``names`` that cap the version (``<``, ``<=``, ``==``, ``~=``)."""
    capped = []
    for text in requirements:
        req = Requirement(text)
        if req.name.lower() in names and any(
            s.operator in ("<", "<=", "==", "~=", "===") for s in req.specifier
        ):
            capped.append(text)
    return capped


def test_torch_and_transformers_have_no_upper_bound() -> None:
    project = PYPROJECT["project"]
    every = [*project["dependencies"]]
    for extra in project["optional-dependencies"].values():
        every += extra
    assert any(Requirement(r).name == "transformers" for r in every)  # the walk saw them
    assert upper_bounds(every, {"torch", "transformers"}) == []


def test_the_bound_check_catches_a_cap() -> None:
    reqs = ["torch>=2.4,<=2.14.1", "transformers>=4.48,<5.25", "numpy<3", "transformers~=5.0"]
    assert upper_bounds(reqs, {"torch", "transformers"}) == [reqs[0], reqs[1], reqs[3]]


@pytest.mark.parametrize("module", ["transformers.activations", "transformers.models.llama"])
def test_transformers_imports_beside_refserve(module: str) -> None:
    # transformers.activations is where >= 5.25 imports Hugging Face's `kernels`: with our
    # kernels under refserve.kernels, the two no longer meet.
    importlib.import_module(module)
    import refserve.kernels

    assert Path(refserve.kernels.__file__).parent.name == "kernels"
