"""Where the Triton kernels can run, decided once for the whole package.

Triton has no CPU backend. With ``TRITON_INTERPRET=1`` in the environment *when a kernel
module is imported* (``@triton.jit`` reads it at decoration time), kernels become
``InterpretedFunction`` objects that run on CPU tensors through numpy; docs/ARCHITECTURE.md
("Kernels") records that this is how the CPU tests run. Without it, a CPU tensor reaching a
compiled kernel fails deep inside Triton, so the entry points check first and raise a
:class:`~refserve.kernels.validation.KernelInputError` that says what to do.
"""

from __future__ import annotations

import torch

from refserve.kernels.validation import KernelInputError


def is_interpreted(jitted: object) -> bool:
    """True when ``jitted`` (a ``@triton.jit`` function) was built in interpreter mode."""
    return type(jitted).__name__ == "InterpretedFunction"


def require_runnable(jitted: object, device: torch.device, function: str, argument: str) -> None:
    """Raise unless ``jitted`` can run on ``device`` (CUDA, or CPU through the interpreter)."""
    if device.type == "cuda" or is_interpreted(jitted):
        return
    raise KernelInputError(
        function,
        argument,
        f"is on {device}; Triton kernels run on CUDA tensors, or on CPU tensors only when "
        "TRITON_INTERPRET=1 is set before the kernels module is imported",
    )


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= ``n`` (>= 1); tile extents in Triton must be powers of two."""
    return 1 << max(n - 1, 0).bit_length()
