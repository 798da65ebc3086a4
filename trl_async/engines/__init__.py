"""Generation engines behind the worker thread: ``"hf"`` (transformers) and ``"vllm"``."""

from .base import EngineOutput, GenerationEngine

__all__ = ["EngineOutput", "GenerationEngine"]
