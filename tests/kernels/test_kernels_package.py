"""Package shape (docs/ARCHITECTURE.md, "Layers"): the oracle and grid import without triton."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_WITHOUT_TRITON = """
import sys
sys.modules["triton"] = None  # any `import triton` now raises ImportError
import refserve.kernels, refserve.kernels.oracle, refserve.kernels.tolerances
import refserve.kernels.validation
import refserve.conformance.kernel_grid
assert "triton" not in [m.split(".")[0] for m in sys.modules if sys.modules[m] is not None]
try:
    refserve.kernels.paged_attention
except ImportError:
    print("lazy-ok")
"""


def test_oracle_and_grid_import_without_triton() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _WITHOUT_TRITON],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "lazy-ok"


def test_lazy_exports_are_the_functions_even_after_submodule_imports() -> None:
    import refserve.kernels.attention
    import refserve.kernels.copy
    import refserve.kernels.kv_write
    from refserve import kernels

    assert kernels.paged_attention is refserve.kernels.attention.paged_attention
    assert kernels.write_kv is refserve.kernels.kv_write.write_kv
    assert kernels.copy_blocks is refserve.kernels.copy.copy_blocks
    assert {"paged_attention", "write_kv", "copy_blocks"} <= set(dir(kernels))
    try:
        kernels.no_such_name  # noqa: B018
    except AttributeError as exc:
        assert "no_such_name" in str(exc)
    else:
        raise AssertionError("expected AttributeError")
