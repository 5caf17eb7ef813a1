"""The engine: the model executor driven by the core's transactional step, behind the
``LLMEngine`` API (docs/ARCHITECTURE.md, "Layers")."""

from refserve.engine.llm_engine import LLMEngine

__all__ = ["LLMEngine"]
