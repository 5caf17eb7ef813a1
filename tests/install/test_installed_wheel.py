"""refserve as a user installs it: the wheel, not editable, in a fresh virtualenv beside
the newest transformers and Hugging Face's ``kernels`` distribution, driven from a
directory outside the checkout (docs/GUIDE.md, "Installing").

Marked ``install``: building the virtualenv takes minutes (torch goes into it), so the
default run deselects it (pyproject's addopts) and ``make test-wheel``, a stage of
``make test``, runs it. torch==2.13.0 is installed first, as the Makefile does for the
project's own venv, so pip takes the CPU wheel and never a CUDA build. A failing check
names the missing file or the clashing distribution (tests/install/wheel_checks.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.install.wheel_checks import (
    clashing_distributions,
    expected_data_files,
    missing_files,
    wheel_import_names,
    wheel_members,
)
from tests.repo.layout import FOLDERS, ROOT

pytestmark = pytest.mark.install

TORCH = "torch==2.13.0"
# The versions from which the clash this layout avoids appeared (transformers then
# requires and imports Hugging Face's `kernels`).
NEWEST = ["transformers>=5.25", "kernels"]
# What the commands below need besides refserve: the Triton interpreter for check-kernel,
# pytest for the plugin.
EXTRA = ["triton", "numpy", "pytest>=8"]
INSTALL_TIMEOUT_S = 900
RUN_TIMEOUT_S = 300


@dataclass(frozen=True)
class Installed:
    """A fresh virtualenv holding the wheel, and a working directory outside the checkout."""

    wheel: Path
    python: Path
    bin: Path
    site_packages: Path
    workdir: Path

    def run(self, *args: str, timeout: float = RUN_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env.update(TRITON_INTERPRET="1", PATH=f"{self.bin}{os.pathsep}{env.get('PATH', '')}")
        return subprocess.run(
            list(args),
            cwd=self.workdir,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )


def _check(proc: subprocess.CompletedProcess[str], what: str) -> str:
    assert proc.returncode == 0, (
        f"{what} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n"
        f"--- stderr\n{proc.stderr[-4000:]}"
    )
    return proc.stdout


def _pip(python: Path, *args: str) -> None:
    cmd = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    _check(proc, " ".join(cmd))


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    base = tmp_path_factory.mktemp("wheel")
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(base / "dist"), "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=INSTALL_TIMEOUT_S,
    )
    _check(build, "pip wheel")
    (wheel,) = (base / "dist").glob("refserve-*.whl")
    venv = base / "venv"
    _check(
        subprocess.run(
            [sys.executable, "-m", "venv", str(venv)], capture_output=True, text=True, timeout=300
        ),
        "python -m venv",
    )
    python = venv / "bin" / "python"
    _pip(python, TORCH)
    _pip(python, f"refserve[conformance] @ {wheel.as_uri()}", *NEWEST, *EXTRA)
    site = _check(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            timeout=60,
        ),
        "purelib",
    ).strip()
    workdir = base / "work"
    workdir.mkdir()
    yield Installed(wheel, python, venv / "bin", Path(site), workdir)


def test_the_wheel_installs_exactly_one_import_name(installed: Installed) -> None:
    names = wheel_import_names(wheel_members(installed.wheel))
    assert names == {"refserve"}, f"the wheel installs these import names: {sorted(names)}"


def test_every_data_file_is_installed(installed: Installed) -> None:
    missing = missing_files(expected_data_files(ROOT, FOLDERS), installed.site_packages)
    assert not missing, f"missing from the installed package: {missing}"


_ENVIRONMENT = """
import importlib.metadata as md, json, kernels, refserve, refserve.kernels, transformers
import transformers.activations  # where transformers imports Hugging Face's kernels
print(json.dumps({
    "providers": md.packages_distributions(),
    "transformers": transformers.__version__,
    "kernels_dist": md.version("kernels"),
    "kernels_file": kernels.__file__,
    "ours": refserve.kernels.__file__,
    "refserve": refserve.__file__,
}))
"""


def test_it_sits_beside_the_newest_transformers_and_hugging_faces_kernels(
    installed: Installed,
) -> None:
    found = json.loads(_check(installed.run(str(installed.python), "-c", _ENVIRONMENT), "env"))
    major, minor = (int(x) for x in found["transformers"].split(".")[:2])
    assert (major, minor) >= (5, 25), found["transformers"]
    clashes = clashing_distributions(["refserve"], found["providers"])
    assert not clashes, f"distributions that install refserve's import name too: {clashes}"
    site = str(installed.site_packages)
    assert found["refserve"].startswith(site), f"refserve imported from {found['refserve']}"
    assert found["kernels_file"].startswith(site + "/kernels/"), found["kernels_file"]
    assert found["ours"].startswith(site + "/refserve/kernels/"), found["ours"]


def test_demo(installed: Installed) -> None:
    out = _check(installed.run("refserve", "demo"), "refserve demo")
    assert "none violated" in out, out


def test_conformance_on_refserves_own_adapter(installed: Installed) -> None:
    adapter = "refserve.conformance.adapters.ref:make"
    out = _check(installed.run("refserve", "conformance", "--adapter", adapter), "conformance")
    assert "scenarios failed (0 findings)" in out and " 0 failed," in out, out


def test_check_kernel_quick(installed: Installed) -> None:
    target = "refserve.kernels:paged_attention"
    out = _check(installed.run("refserve", "check-kernel", target, "--quick"), "check-kernel")
    assert "quick subset" in out and " passed" in out, out


# An engine author's own test file: one test of theirs; the plugin adds the suite's items.
_USERS_TEST = """
from refserve.conformance.adapter import EngineConfig
from refserve.conformance.adapters.ref import make


def test_users_engine_starts_empty():
    engine = make()
    engine.configure(EngineConfig(block_size=4, num_blocks=8, max_num_batched_tokens=16,
                                  max_num_seqs=2))
    assert not engine.has_unfinished()
"""


def test_pytest_plugin_on_a_one_file_test(installed: Installed) -> None:
    (installed.workdir / "test_users_engine.py").write_text(_USERS_TEST, encoding="utf-8")
    proc = installed.run(
        str(installed.python),
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "--refserve-adapter",
        "refserve.conformance.adapters.ref:make",
        "--refserve-examples",
        "3",
        "-k",
        "users_engine or seed001",
        "test_users_engine.py",
    )
    out = _check(proc, "pytest --refserve-adapter")
    last = out.strip().splitlines()[-1]
    assert " passed" in last and "failed" not in last and "error" not in last, out
    passed = int(last.split(" passed")[0].split()[-1])
    assert passed >= 2, out  # the user's own test and at least one conformance scenario
