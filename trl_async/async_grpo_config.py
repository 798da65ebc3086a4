"""Configuration of :class:`~trl_async.AsyncGRPOTrainer`: every ``GRPOConfig`` field, plus the async ones."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig

GENERATION_BACKENDS = ("hf", "vllm")


@dataclass
class AsyncGRPOConfig(GRPOConfig):
    r"""
    [`~trl.GRPOConfig`] for asynchronous GRPO. Only the fields below are new; everything else is TRL's.

    Parameters:
        max_staleness (`int`, *optional*, defaults to `1`):
            Largest number of optimizer steps between the policy that generated a rollout and the policy trained on
            it. `0` reproduces synchronous on-policy training (the generator waits for the newest weights). Staler
            groups are evicted and counted in `buffer/evicted_stale`, never trained on.
        buffer_capacity (`int` or `None`, *optional*, defaults to `None`):
            Replay buffer size in GRPO groups (prompts). `None` holds `max_staleness + 1` generation batches.
        weight_sync_steps (`int`, *optional*, defaults to `1`):
            Push the trained weights to the generator every this many optimizer steps. Must be
            `<= max_staleness + 1`, otherwise no rollout could ever be fresh enough.
        generation_backend (`str`, *optional*, defaults to `"hf"`):
            `"hf"`: `transformers.generate` on a snapshot of the policy in the worker thread (CPU or GPU, LoRA or full).
            `"vllm"`: a vLLM engine (`vllm_mode="colocate"`: in-process; `"server"`: a `trl vllm-serve` server).
        generation_num_threads (`int` or `None`, *optional*, defaults to `None`):
            CPU only: `torch.set_num_threads` value applied when the generation thread starts. The setting is
            process-wide, and generation and training each use that many threads at the same time, so on C cores use
            C / 2 (1 on a 2-core laptop: 1 + 1 overlaps best). `None` keeps torch's setting.
        generation_timeout_s (`float`, *optional*, defaults to `900.0`):
            Longest time the trainer waits for rollouts before raising a `TimeoutError` (it never hangs).
        worker_shutdown_timeout_s (`float`, *optional*, defaults to `60.0`):
            Longest time `train()` waits for the generation thread to stop when it returns or raises.
        vllm_lora_sync (`str`, *optional*, defaults to `"merged"`):
            `generation_backend="vllm"` with LoRA: `"merged"` pushes `W + delta` into the engine (slower sync, full-speed
            generation); `"adapter"` loads the adapter as a vLLM LoRA request (30-60x faster sync, 2-3x slower
            generation on CPU; `python -m trl_async.benchmarks.vllm_weight_sync`).
        vllm_enforce_eager (`bool` or `None`, *optional*, defaults to `None`):
            Disable vLLM's graph compilation/CUDA graphs. `None`: eager on CPU (a cold compile costs ~40 s), compiled on
            GPU.
    """

    max_staleness: int = field(
        default=1,
        metadata={
            "help": "Largest allowed policy lag (optimizer steps) of a trained rollout. 0 = synchronous on-policy."
        },
    )
    buffer_capacity: int | None = field(
        default=None,
        metadata={"help": "Replay buffer capacity in GRPO groups. None: max_staleness + 1 generation batches."},
    )
    weight_sync_steps: int = field(
        default=1,
        metadata={"help": "Sync weights to the generator every N optimizer steps (N <= max_staleness + 1)."},
    )
    generation_backend: str = field(
        default="hf",
        metadata={"help": "Generation engine of the worker thread.", "choices": list(GENERATION_BACKENDS)},
    )
    generation_num_threads: int | None = field(
        default=None,
        metadata={"help": "CPU: process-wide torch threads once generation runs beside training (use cores / 2)."},
    )
    generation_timeout_s: float = field(
        default=900.0,
        metadata={"help": "Seconds the trainer waits for rollouts before raising TimeoutError."},
    )
    worker_shutdown_timeout_s: float = field(
        default=60.0,
        metadata={"help": "Seconds train() waits for the generation thread to stop."},
    )

    vllm_lora_sync: str = field(
        default="merged",
        metadata={
            "help": "vLLM + LoRA weight sync: 'merged' weights or 'adapter' LoRA requests.",
            "choices": ["merged", "adapter"],
        },
    )
    vllm_enforce_eager: bool | None = field(
        default=None,
        metadata={"help": "vLLM eager mode. None: eager on CPU, compiled on GPU."},
    )

    def __post_init__(self):
        super().__post_init__()
        if self.vllm_lora_sync not in ("merged", "adapter"):
            raise ValueError(f"vllm_lora_sync must be 'merged' or 'adapter', got {self.vllm_lora_sync!r}.")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 (0 = synchronous on-policy), got {self.max_staleness}.")
        if self.weight_sync_steps < 1:
            raise ValueError(f"weight_sync_steps must be >= 1, got {self.weight_sync_steps}.")
        if self.weight_sync_steps > self.max_staleness + 1:
            raise ValueError(
                f"weight_sync_steps={self.weight_sync_steps} with max_staleness={self.max_staleness}: rollouts "
                f"generated between two syncs would be up to {self.weight_sync_steps - 1} steps stale before the "
                "next sync and then be evicted. Set weight_sync_steps <= max_staleness + 1."
            )
        if self.generation_backend not in GENERATION_BACKENDS:
            raise ValueError(
                f"generation_backend must be one of {GENERATION_BACKENDS}, got {self.generation_backend!r}."
            )
        if self.use_vllm:
            raise ValueError(
                "AsyncGRPOConfig generates in its own worker thread: leave use_vllm=False and set "
                "generation_backend='vllm' (with vllm_mode='colocate' or 'server') to generate with vLLM."
            )
        if self.generation_num_threads is not None and self.generation_num_threads < 1:
            raise ValueError(f"generation_num_threads must be >= 1 or None, got {self.generation_num_threads}.")
        if self.generation_timeout_s <= 0 or self.worker_shutdown_timeout_s <= 0:
            raise ValueError("generation_timeout_s and worker_shutdown_timeout_s must be > 0 seconds.")
        local_generation_batch = self.per_device_train_batch_size * self.steps_per_generation
        if local_generation_batch % self.num_generations != 0:
            raise ValueError(
                f"Each process generates whole GRPO groups: per_device_train_batch_size ({self.per_device_train_batch_size})"
                f" x steps_per_generation ({self.steps_per_generation}) = {local_generation_batch} must be divisible "
                f"by num_generations ({self.num_generations})."
            )
        prompts_per_batch = local_generation_batch // self.num_generations
        if self.buffer_capacity is None:
            self.buffer_capacity = (self.max_staleness + 1) * prompts_per_batch
        elif self.buffer_capacity < prompts_per_batch:
            raise ValueError(
                f"buffer_capacity={self.buffer_capacity} groups cannot hold one generation batch "
                f"({prompts_per_batch} groups); raise it to at least {prompts_per_batch}."
            )
