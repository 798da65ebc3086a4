"""trl_async: asynchronous GRPO for Hugging Face TRL.

Swap one import: ``from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer`` (or ``AsyncM2POConfig``,
``AsyncM2POTrainer`` for stale-data correction). Rewards that score token ids without decoding live in
:mod:`trl_async.rewards`.
"""

from importlib import import_module
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_EXPORTS = {
    "AsyncGRPOConfig": "async_grpo_config",
    "AsyncGRPOTrainer": "async_grpo_trainer",
    "AsyncM2POConfig": "async_m2po_config",
    "AsyncM2POTrainer": "async_m2po_trainer",
    "second_moment_mask": "m2po",
    "VersionedReplayBuffer": "replay_buffer",
    "RolloutGroup": "replay_buffer",
    "GenerationWorker": "generation_worker",
    "GenerationWorkerError": "generation_worker",
}

__all__ = [
    "AsyncGRPOConfig",
    "AsyncGRPOTrainer",
    "AsyncM2POConfig",
    "AsyncM2POTrainer",
    "GenerationWorker",
    "GenerationWorkerError",
    "RolloutGroup",
    "VersionedReplayBuffer",
    "rewards",
    "second_moment_mask",
]


def __getattr__(name):  # lazy: `import trl_async` stays cheap and does not import torch/trl until needed
    if name in _EXPORTS:
        return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    if name == "rewards":
        return import_module(".rewards", __name__)
    raise AttributeError(f"module 'trl_async' has no attribute {name!r}")


if TYPE_CHECKING:
    from .async_grpo_config import AsyncGRPOConfig
    from .async_grpo_trainer import AsyncGRPOTrainer
    from .async_m2po_config import AsyncM2POConfig
    from .async_m2po_trainer import AsyncM2POTrainer
    from .generation_worker import GenerationWorker, GenerationWorkerError
    from .m2po import second_moment_mask
    from .replay_buffer import RolloutGroup, VersionedReplayBuffer
