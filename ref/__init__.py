"""refserve: a reference LLM serving engine (layers: docs/ARCHITECTURE.md, "Layers").

``refserve.LLMEngine`` and ``refserve.SamplingParams`` are the engine API
(``ref/engine/llm_engine.py``,
``ref/model/sampler.py``); they are imported on first use so the scheduler and simulator do not
pay for the model code.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from refserve.engine.llm_engine import LLMEngine as LLMEngine
    from refserve.model.sampler import SamplingParams as SamplingParams

__all__ = ["LLMEngine", "SamplingParams"]
_LAZY = {"LLMEngine": "refserve.engine.llm_engine", "SamplingParams": "refserve.model.sampler"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ref' has no attribute {name!r}")
