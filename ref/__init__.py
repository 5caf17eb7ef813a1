"""refserve: a reference LLM serving engine (layers: docs/ARCHITECTURE.md, "Layers").

``ref.LLMEngine`` and ``ref.SamplingParams`` are the engine API (``ref/engine/llm_engine.py``,
``ref/model/sampler.py``); they are imported on first use so the scheduler and simulator do not
pay for the model code.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ref.engine.llm_engine import LLMEngine as LLMEngine
    from ref.model.sampler import SamplingParams as SamplingParams

__all__ = ["LLMEngine", "SamplingParams"]
_LAZY = {"LLMEngine": "ref.engine.llm_engine", "SamplingParams": "ref.model.sampler"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ref' has no attribute {name!r}")
