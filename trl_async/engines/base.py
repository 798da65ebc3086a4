"""The seam between the generation worker and whatever produces tokens.

An engine is driven from exactly one thread, the :class:`~trl_async.generation_worker.GenerationWorker`'s, except
:meth:`GenerationEngine.stage_weights`, which the trainer calls on the main thread to capture the weights to sync.

Contract (every engine, tested in ``tests/test_engines.py`` and the vLLM tier):

* :meth:`generate` gets ``P`` tokenised prompts and returns ``P * num_generations`` completions, prompt-major
  (completions ``i * G ... i * G + G - 1`` belong to prompt ``i``). Each completion is the list of sampled token ids
  up to and including the first EOS, or ``max_completion_length`` ids when truncated; no padding.
* ``logprobs[k][t]`` is the **behaviour log-prob** of ``completion_ids[k][t]``: the log-softmax of the *processed*
  logits it was sampled from (after temperature, top-k, top-p, min-p, repetition penalty). Same lengths as the ids.
* :meth:`stage_weights` (main thread) copies what must be synced out of the training model and returns an opaque
  update; :meth:`load_weights` (worker thread, between two ``generate`` calls) makes the engine generate with it.
  After ``load_weights`` returns, every later ``generate`` uses the new weights (the worker then bumps the
  ``policy_version`` it tags rollouts with).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@dataclass
class EngineOutput:
    """What :meth:`GenerationEngine.generate` returns (``P * G`` rows, prompt-major, ragged lists)."""

    completion_ids: list[list[int]]
    logprobs: list[list[float]]


@runtime_checkable
class GenerationEngine(Protocol):
    def generate(self, prompt_ids: list[list[int]], num_generations: int) -> EngineOutput: ...

    def stage_weights(self, model: Any) -> Any: ...

    def load_weights(self, update: Any) -> None: ...

    def close(self) -> None: ...
