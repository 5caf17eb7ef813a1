"""Helpers shared by the kernel tests (imported by name: tests/kernels is on sys.path).

``conftest.py`` has already set ``TRITON_INTERPRET=1`` when there is no CUDA device.
"""

from __future__ import annotations

import pytest
import torch

from refserve.kernels.tolerances import attention_tolerance

HAS_CUDA = torch.cuda.is_available()

#: Device the Triton kernels run on in this session: CUDA, or CPU via the interpreter.
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")

#: Marker for checks that need a real GPU (compiled kernels, GPU memory, two devices).
needs_cuda = pytest.mark.skipif(
    not HAS_CUDA, reason="needs a CUDA device (compiled Triton, GPU memory or two devices)"
)

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def assert_attention_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """``out`` matches the oracle's ``ref`` within the tolerance for its dtype and device."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert bool(torch.isfinite(out).all()), "non-finite output"
    tol = attention_tolerance(out.dtype, out.device)
    err = float((out.float() - ref.float()).abs().max()) if out.numel() else 0.0
    bound = tol.bound(float(ref.float().abs().max()) if ref.numel() else 0.0)
    assert err <= bound, f"max abs error {err:.3e} > tolerance {bound:.3e}"
