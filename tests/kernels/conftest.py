"""Setup for the kernel tests (docs/ARCHITECTURE.md, "Kernels", "Verification practice").

Triton has no CPU backend: without a CUDA device the kernels run in Triton's interpreter
on CPU tensors. ``@triton.jit`` reads ``TRITON_INTERPRET`` when a kernel module is
imported, so it is set here, before any test module imports ``refserve.kernels.attention`` (or
touches ``refserve.kernels.paged_attention``); ``test_interpreter_mode_is_on`` proves it took.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
