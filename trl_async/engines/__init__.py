"""Generation engines behind the worker thread: ``"hf"`` (transformers) and ``"vllm"``."""

from __future__ import annotations

from .base import EngineOutput, GenerationEngine


def create_engine(trainer) -> GenerationEngine:
    """Build the engine named by ``trainer.args.generation_backend`` (called on the main thread)."""
    backend = trainer.args.generation_backend
    if backend == "hf":
        from .hf_engine import HFGenerationEngine

        return HFGenerationEngine.from_trainer(trainer)
    if backend == "vllm":
        from .vllm_engine import VLLMEngine

        return VLLMEngine.from_trainer(trainer)
    raise ValueError(f"Unknown generation_backend {backend!r}; expected 'hf' or 'vllm'.")


__all__ = ["EngineOutput", "GenerationEngine", "create_engine"]
