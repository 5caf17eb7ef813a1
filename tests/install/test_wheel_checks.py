"""The installed-wheel test's checks fail on planted faults (tests/install/wheel_checks.py):
a second import name, a missing data file, a clashing distribution."""

from __future__ import annotations

import zipfile
from pathlib import Path

from tests.install.wheel_checks import (
    clashing_distributions,
    expected_data_files,
    missing_files,
    wheel_import_names,
    wheel_members,
)
from tests.repo.layout import FOLDERS, ROOT


def test_one_import_name_passes_and_a_second_is_named(tmp_path: Path) -> None:
    ours = ["refserve/__init__.py", "refserve/spec/arith.py", "refserve-0.1.0.dist-info/RECORD"]
    assert wheel_import_names(ours) == {"refserve"}
    planted = [*ours, "kernels/__init__.py", "helper.py", "refserve-0.1.0.data/scripts/x"]
    assert wheel_import_names(planted) == {"refserve", "kernels", "helper"}
    wheel = tmp_path / "refserve-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name in planted:
            archive.writestr(name, "")
    assert wheel_import_names(wheel_members(wheel)) == {"refserve", "kernels", "helper"}


def test_the_data_files_are_found_and_a_missing_one_is_named(tmp_path: Path) -> None:
    wanted = expected_data_files(ROOT, FOLDERS)
    assert "refserve/sim/traces/seed001.jsonl" in wanted
    assert "refserve/model/tiny/model.safetensors" in wanted
    assert "refserve/spec/py.typed" in wanted
    for name in wanted:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    assert missing_files(wanted, tmp_path) == []
    (tmp_path / "refserve/sim/traces/seed001.jsonl").unlink()
    assert missing_files(wanted, tmp_path) == ["refserve/sim/traces/seed001.jsonl"]


def test_a_clashing_distribution_is_named() -> None:
    providers = {"refserve": ["refserve"], "kernels": ["kernels"], "spec": ["spec-tools"]}
    assert clashing_distributions(["refserve"], providers) == {}
    planted = {**providers, "refserve": ["refserve", "refserve-vendored"]}
    assert clashing_distributions(["refserve"], planted) == {"refserve": ["refserve-vendored"]}
    # Had the wheel still installed `kernels`, Hugging Face's distribution is the clash.
    assert clashing_distributions(
        ["refserve", "kernels"], {"kernels": ["kernels", "refserve"]}
    ) == {"kernels": ["kernels"]}
