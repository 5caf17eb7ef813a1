"""refserve's engine: request state machine, paged KV pool, scheduler, executors, CLI.

``ref.LLMEngine`` and ``ref.SamplingParams`` are the engine API (``ref/engine.py``,
``ref/sampler.py``); they are imported on first use so the scheduler and simulator do not
pay for the model code.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ref.engine import LLMEngine as LLMEngine
    from ref.sampler import SamplingParams as SamplingParams

__all__ = ["LLMEngine", "SamplingParams"]
_LAZY = {"LLMEngine": "ref.engine", "SamplingParams": "ref.sampler"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ref' has no attribute {name!r}")
