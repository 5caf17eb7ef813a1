"""The import names refserve installs are its own (docs/GUIDE.md, "Installing").

Our Triton kernels live in the top-level package `kernels/`, and Hugging Face ships a
distribution of the same import name that transformers >= 5.25 requires and imports
whenever it is installed. With both present one hides the other: `import transformers`
then fails inside our package. pyproject holds transformers below 5.25; this test names
the culprit when an environment brings the other `kernels` anyway.
"""

from __future__ import annotations

import importlib.metadata

import pytest

OUR_PACKAGES = ("ref", "spec", "kernels", "conformance")


def foreign_providers(name: str, mapping: dict[str, list[str]]) -> list[str]:
    """The distributions other than refserve that install the import name `name`."""
    return sorted({dist for dist in mapping.get(name, []) if dist.lower() != "refserve"})


def test_no_other_distribution_installs_our_import_names() -> None:
    mapping = importlib.metadata.packages_distributions()
    clashes = {name: foreign_providers(name, mapping) for name in OUR_PACKAGES}
    clashes = {name: dists for name, dists in clashes.items() if dists}
    assert not clashes, (
        f"import names installed by refserve and by other distributions: {clashes}; "
        "transformers >= 5.25 brings Hugging Face's `kernels` (see docs/GUIDE.md, "
        "'Installing'): install transformers < 5.25 in a virtualenv of refserve's own"
    )


def test_the_clash_check_names_a_foreign_kernels_distribution() -> None:
    mapping = {"kernels": ["refserve", "kernels"], "ref": ["refserve"]}
    assert foreign_providers("kernels", mapping) == ["kernels"]
    assert foreign_providers("ref", mapping) == []
    assert foreign_providers("spec", mapping) == []


@pytest.mark.parametrize("module", ["transformers.activations", "transformers.models.llama"])
def test_transformers_imports_beside_our_kernels_package(module: str) -> None:
    # transformers.activations is where >= 5.25 imports Hugging Face's `kernels`.
    importlib.import_module(module)
