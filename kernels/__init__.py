"""Triton kernels for paged KV caches and the dense PyTorch oracle they are checked against.

docs/ARCHITECTURE.md ("Kernels") fixes the public API:

- :func:`paged_attention` (``refserve.kernels.attention``): unified causal paged attention;
- :func:`write_kv` (``refserve.kernels.kv_write``): write this step's K/V into cache slots;
- :func:`copy_blocks` (``refserve.kernels.copy``): copy-on-write and swap of whole blocks;
- ``refserve.kernels.oracle``: the same three operations in plain PyTorch (the reference);
- ``refserve.kernels.validation`` (:class:`KernelInputError`) and ``refserve.kernels.tolerances``.

The Triton entry points are imported lazily, on first attribute access, so that
``import refserve.kernels.oracle`` (and the conformance suite, which depends only on the oracle)
works without triton installed. On a machine without CUDA, set ``TRITON_INTERPRET=1``
before first touching a Triton entry point to run them on CPU tensors.
"""

from __future__ import annotations

import importlib
from types import MappingProxyType
from typing import TYPE_CHECKING

from refserve.kernels.validation import KernelInputError

if TYPE_CHECKING:
    from refserve.kernels.attention import paged_attention as paged_attention
    from refserve.kernels.copy import copy_blocks as copy_blocks
    from refserve.kernels.kv_write import write_kv as write_kv

__all__ = ["KernelInputError", "copy_blocks", "paged_attention", "write_kv"]

# Public name -> module defining it. Module names differ from the function names so a
# submodule import never shadows the function of the same name on the package.
_LAZY = MappingProxyType(
    {
        "paged_attention": "refserve.kernels.attention",
        "write_kv": "refserve.kernels.kv_write",
        "copy_blocks": "refserve.kernels.copy",
    }
)


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kernels' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
