"""Per-dtype tolerances for comparing a kernel's output with the dense oracle.

Written down once here and used by every test and by the conformance grid
(``conformance/kernel_grid/``), as docs/ARCHITECTURE.md ("Kernels") asks.

A result passes when ``max |out - ref| <= atol + rtol * max |ref|``. Both sides see the
same rounded inputs (the oracle upcasts them to fp32), so the difference comes from
three places: the kernel's order of fp32 accumulation (online softmax rescaling), the
rounding of the softmax probabilities to the value dtype before the second matmul (as
fused-attention kernels do to use tensor cores), and the final rounding of the output
to its dtype. The grid draws values from N(0, 1), so outputs have magnitude of order 1.

Devices differ (docs/ARCHITECTURE.md, "Kernels"): the interpreter's fp32 dot is exact fp32
while a GPU may use TF32. Our kernel asks for IEEE fp32 dots on fp32 inputs, but a kernel
under test may not, so fp32 on CUDA gets a TF32-sized tolerance. The interpreter's bf16 dot
is broken, so bf16 on CPU is only meaningful for kernels that upcast before ``tl.dot`` (ours
does).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import torch


@dataclass(frozen=True)
class Tolerance:
    """``|out - ref| <= atol + rtol * max|ref|`` over all outputs."""

    atol: float
    rtol: float

    def bound(self, ref_max_abs: float) -> float:
        """The largest allowed max-abs error for a reference whose max |value| is given."""
        return self.atol + self.rtol * ref_max_abs


# fp16: 11-bit significand, unit roundoff 4.9e-4: rounding the output alone costs up to
# ~1e-3 at |out| in [2, 4), plus the probabilities' rounding. bf16: 8 bits, roundoff
# 3.9e-3. Measured in the interpreter over the grid (max |ref| ~ 2-4, so bounds are
# 3-5x these atols): fp32 <= 3e-6, fp16 <= 9.8e-4 (one output ulp).
_ATTENTION: MappingProxyType[tuple[str, torch.dtype], Tolerance] = MappingProxyType(
    {
        ("cpu", torch.float32): Tolerance(atol=1e-5, rtol=1e-5),
        ("cpu", torch.float16): Tolerance(atol=1e-3, rtol=1e-3),
        ("cpu", torch.bfloat16): Tolerance(atol=8e-3, rtol=8e-3),
        # TF32 keeps 10 significand bits: treat an fp32 kernel like an fp16 one on a GPU.
        ("cuda", torch.float32): Tolerance(atol=1e-3, rtol=1e-3),
        ("cuda", torch.float16): Tolerance(atol=1e-3, rtol=1e-3),
        ("cuda", torch.bfloat16): Tolerance(atol=8e-3, rtol=8e-3),
    }
)


def attention_tolerance(dtype: torch.dtype, device: torch.device | str) -> Tolerance:
    """Tolerance for ``paged_attention`` outputs of ``dtype`` computed on ``device``."""
    kind = torch.device(device).type
    key = ("cuda" if kind == "cuda" else "cpu", dtype)
    if key not in _ATTENTION:
        raise KeyError(f"no attention tolerance for dtype {dtype} on {kind}")
    return _ATTENTION[key]
