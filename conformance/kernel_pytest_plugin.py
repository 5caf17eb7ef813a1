"""A pytest plugin that runs the kernel grid against your kernel (docs/KERNELS.md, "From
pytest").

Installing refserve registers it (the ``pytest11`` entry point ``refserve_kernels``); from
a source tree that is not installed, add ``-p refserve.conformance.kernel_pytest_plugin``. Then::

    pytest --refserve-kernel mypkg.attention:paged_attention [--refserve-kernel-quick]
           [--refserve-kernel-dtype float16 ...]

Each (case, dtype) of the grid becomes one item, ``refserve_kernel[CASE-DTYPE]``, run in
the pytest process (use ``refserve check-kernel`` for crash isolation). It fails with the
error, tolerance and worst element, and is skipped with the reason when the kernel's
declared capabilities exclude the case (NOT_SUPPORTED) or it needs CUDA. Without
``--refserve-kernel`` nothing is collected, and nothing heavy is imported.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("refserve-kernel", "refserve kernel grid")
    group.addoption(
        "--refserve-kernel",
        default=None,
        metavar="MODULE:FUNCTION",
        help="run refserve's paged-attention kernel grid against this function",
    )
    group.addoption(
        "--refserve-kernel-quick", action="store_true", help="only the quick subset of the grid"
    )
    group.addoption(
        "--refserve-kernel-dtype",
        action="append",
        choices=["float32", "float16", "bfloat16"],
        help="repeatable; default float32 and float16 (+ bfloat16 on CUDA)",
    )


class KernelCaseItem(pytest.Item):
    """One (case, dtype) of the kernel grid as a pytest item."""

    def __init__(self, *, target: str, case: str, dtype: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.target = target
        self.case = case
        self.dtype = dtype

    def runtest(self) -> None:
        import torch

        from refserve.conformance.kernel_grid import CASES, FAIL, PASS, TIMEOUT, run_case
        from refserve.conformance.kernel_grid.worker import load_function

        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        fn = load_function(self.target)
        result = run_case(fn, CASES[self.case], getattr(torch, self.dtype), device)
        if result.status in (FAIL, TIMEOUT):
            detail = json.dumps(result.to_json(), indent=1, default=str)
            pytest.fail(f"{result.error}\n{detail}", pytrace=False)
        if result.status != PASS:
            pytest.skip(f"{result.status}: {result.error}")

    def reportinfo(self) -> tuple[str, int | None, str]:
        return "refserve-kernel", None, f"refserve_kernel[{self.case}-{self.dtype}]"


def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    target = config.getoption("--refserve-kernel")
    if not target:
        return
    import torch

    if not torch.cuda.is_available():
        # Triton runs on CPU tensors only in its interpreter, which must be on before the
        # kernel's module is imported (docs/KERNELS.md).
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from refserve.conformance.kernel_grid import select_cases

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtypes = config.getoption("--refserve-kernel-dtype") or (
        ["float32", "float16", "bfloat16"] if device == "cuda" else ["float32", "float16"]
    )
    quick = bool(config.getoption("--refserve-kernel-quick"))
    for case in select_cases(device, quick=quick):
        for dtype in dtypes:
            items.append(
                KernelCaseItem.from_parent(
                    session,
                    name=f"refserve_kernel[{case.name}-{dtype}]",
                    target=str(target),
                    case=case.name,
                    dtype=dtype,
                )
            )
