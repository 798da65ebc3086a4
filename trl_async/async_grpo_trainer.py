"""``AsyncGRPOTrainer``: ``trl.GRPOTrainer`` with generation moved to a background thread.

Data flow: dataset -> prompt stream -> :class:`GenerationWorker` (engine: HF snapshot or vLLM, behaviour log-probs)
-> :class:`VersionedReplayBuffer` (whole groups, ``policy_version``) -> ``_prepare_inputs`` -> TRL's stock scoring
(reward_funcs, reward_weights, scale_rewards, advantages) and loss -> optimizer step -> weight sync (version + 1).

What changes relative to ``GRPOTrainer`` (narrow overrides of its seams, nothing copied):

* ``_prepare_inputs``: at each generation boundary, takes a generation batch of groups from the buffer instead of
  generating; syncs weights to the worker every ``weight_sync_steps`` optimizer steps.
* ``_tokenize_prompts`` / ``_generate_single_turn``: while scoring buffered rollouts, return their prompt ids,
  completion ids and behaviour log-probs, so TRL's ``_generate_and_score_completions`` runs unchanged.
* ``use_vllm`` (read-only here): TRL gates its importance-sampling correction (``old_per_token_logps`` +
  ``vllm_importance_sampling_mode`` truncate/mask at token/sequence level) on this flag. It is ``True`` exactly while
  a batch of stale (or non-HF) rollouts is scored or trained on, so that machinery corrects for staleness here too.
  Fresh rollouts from the exact HF engine skip it, which reproduces the synchronous trainer at ``max_staleness=0``.
* ``_calculate_rewards``: rewards with a tensor path (:class:`trl_async.rewards.TensorReward`) are scored on the
  padded completion-id tensor, without decoding; other rewards go through TRL's path. NaN rewards raise.

Staleness of a group = trainer ``global_step`` when the group leaves the buffer minus its ``policy_version``.
Reuse inside one generation batch (``steps_per_generation``, ``num_iterations``) is TRL's own and is corrected by
its PPO ratio against ``old_per_token_logps``, as in the stock trainer.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Iterator
from typing import Any

import torch
from accelerate.utils import gather
from datasets import IterableDataset
from trl import GRPOTrainer
from trl.trainer.utils import RepeatSampler, is_async_callable

from .async_grpo_config import AsyncGRPOConfig
from .engines import create_engine
from .generation_worker import GenerationWorker
from .replay_buffer import BufferClosed, RolloutGroup, VersionedReplayBuffer, staleness


class AsyncGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` whose completions come from a background generation thread (see the module docstring).

    Same constructor as ``GRPOTrainer``; ``args`` must be an :class:`AsyncGRPOConfig`. Not supported (clear error):
    ``tools``, ``rollout_func``, ``environment_factory`` and iterable datasets.
    """

    _tag_names = ["trl", "grpo", "trl_async", "async-grpo"]
    _config_class = AsyncGRPOConfig  # subclasses that need a richer config override this

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: AsyncGRPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        tools=None,
        rollout_func=None,
        environment_factory=None,
    ):
        config_class, trainer_name = self._config_class, type(self).__name__
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = config_class(f"{str(name).split('/')[-1]}-{trainer_name.removesuffix('Trainer')}")
        if not isinstance(args, config_class):
            raise TypeError(
                f"{trainer_name} needs an {config_class.__name__}, got {type(args).__name__}. Build it with the same "
                f"arguments: {config_class.__name__}(**your_config.to_dict()) keeps every other setting."
            )
        unsupported = {"tools": tools, "rollout_func": rollout_func, "environment_factory": environment_factory}
        for name, value in unsupported.items():
            if value is not None:
                raise NotImplementedError(
                    f"AsyncGRPOTrainer does not support `{name}` yet (multi-turn rollouts would have to run in the "
                    "generation thread). Use trl.GRPOTrainer for it."
                )
        if isinstance(train_dataset, IterableDataset):
            raise NotImplementedError(
                "AsyncGRPOTrainer needs an indexable `datasets.Dataset` (the generation thread samples prompts "
                "ahead of the trainer). Materialise the stream, e.g. `Dataset.from_list(list(stream.take(n)))`."
            )
        self._behaviour_is_active = False  # see `use_vllm`
        self._scoring_groups: list[RolloutGroup] | None = None
        self._worker: GenerationWorker | None = None
        self._buffer: VersionedReplayBuffer | None = None
        self._engine = None
        self._synced_version: int | None = None
        super().__init__(
            model=model,
            reward_funcs=reward_funcs,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            reward_processing_classes=reward_processing_classes,
            callbacks=callbacks,
            optimizers=optimizers,
            quantization_config=quantization_config,
            peft_config=peft_config,
        )
        self.reward_funcs = [_reject_nan_rewards(f, n) for f, n in zip(self.reward_funcs, self.reward_func_names)]

    # ---- TRL's importance-sampling gate -------------------------------------------------------------------------
    @property
    def use_vllm(self) -> bool:
        """True while scoring/training a batch whose behaviour log-probs differ from the current policy's."""
        return self._behaviour_is_active

    @use_vllm.setter
    def use_vllm(self, value: bool) -> None:
        if value:  # GRPOTrainer.__init__ assigns args.use_vllm, which AsyncGRPOConfig keeps False
            raise ValueError("AsyncGRPOTrainer drives vLLM itself: set generation_backend='vllm', not use_vllm.")

    # ---- lifecycle ------------------------------------------------------------------------------------------------
    def train(self, *args, **kwargs):
        try:
            return super().train(*args, **kwargs)
        finally:
            self._stop_worker()

    def _start_worker(self) -> None:
        args = self.args
        prompts_per_call = args.per_device_train_batch_size * args.steps_per_generation // self.num_generations
        self._buffer = VersionedReplayBuffer(capacity=args.buffer_capacity, max_staleness=args.max_staleness)
        self._engine = create_engine(self)
        start_version = self.state.global_step
        self._synced_version = start_version
        generate_every = args.steps_per_generation * self.num_iterations
        grad_accum = args.gradient_accumulation_steps

        def planned_version(call_index: int) -> int:  # optimizer step at which call `call_index` is trained on
            return start_version + (call_index * generate_every) // grad_accum

        self._worker = GenerationWorker(
            engine=self._engine,
            prompt_rows=self._prompt_rows(prompts_per_call),
            tokenize=self._tokenize_for_worker,
            buffer=self._buffer,
            num_generations=self.num_generations,
            planned_version=planned_version,
            max_staleness=args.max_staleness,
            initial_version=start_version,
            num_threads=args.generation_num_threads,
        )
        if args.max_staleness > 0:
            self._worker.start()  # at max_staleness=0 the trainer calls `generate_inline` instead (no overlap possible)

    def _stop_worker(self) -> None:
        worker, self._worker = self._worker, None
        if worker is not None:
            if self._engine is not None and hasattr(self._engine, "cancel"):
                self._engine.cancel.set()
            worker.stop(timeout=self.args.worker_shutdown_timeout_s)
        if self._engine is not None:
            self._engine.close()
            self._engine = None

    def _prompt_rows(self, prompts_per_call: int) -> Iterator[list[dict[str, Any]]]:
        """This process's share of each generation batch of prompts, epoch after epoch (same order as TRL's sampler)."""
        sampler = RepeatSampler(
            data_source=self.train_dataset,
            mini_repeat_count=1,
            batch_size=self.args.generation_batch_size // self.num_generations,
            repeat_count=1,
            shuffle=self.shuffle_dataset,
            seed=self.args.seed,
        )
        start = self.accelerator.process_index * prompts_per_call
        while True:
            indices = list(sampler)
            if not indices:
                raise ValueError(
                    f"The training dataset ({len(self.train_dataset)} rows) is smaller than one generation batch "
                    f"({self.args.generation_batch_size // self.num_generations} prompts)."
                )
            chunk = self.args.generation_batch_size // self.num_generations
            for offset in range(0, len(indices), chunk):
                mine = indices[offset + start : offset + start + prompts_per_call]
                yield [self.train_dataset[i] for i in mine]

    def _tokenize_for_worker(self, prompts: list[Any]) -> list[list[int]]:
        prompt_ids, images, _ = GRPOTrainer._tokenize_prompts(self, prompts)
        if images is not None:
            raise NotImplementedError("AsyncGRPOTrainer does not support image prompts yet.")
        return [list(ids) for ids in prompt_ids]

    # ---- the buffer seam ----------------------------------------------------------------------------------------
    def _prepare_inputs(self, generation_batch):
        if not self.model.training:
            return super()._prepare_inputs(generation_batch)  # evaluation generates synchronously, as in TRL
        if self._worker is None:
            self._start_worker()
        self._sync_weights_if_due()
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            generation_batch = self._take_rollouts()
        return super()._prepare_inputs(generation_batch)

    def _sync_weights_if_due(self) -> None:
        version = self.state.global_step
        if version == self._synced_version or version % self.args.weight_sync_steps != 0:
            return
        start = time.perf_counter()
        update = self._engine.stage_weights(self.accelerator.unwrap_model(self.model))
        self._worker.push_weights(update, version)
        self._synced_version = version
        self._metrics["train"]["timing/weight_sync_s"].append(time.perf_counter() - start)

    def _take_rollouts(self) -> list[dict[str, Any]]:
        args = self.args
        num_groups = args.per_device_train_batch_size * args.steps_per_generation // self.num_generations
        trainer_version = self.state.global_step
        start = time.perf_counter()
        if args.max_staleness == 0:
            self._worker.generate_inline()
        try:
            groups = self._buffer.get(
                num_groups, trainer_version, timeout=args.generation_timeout_s, on_wait=self._worker.raise_if_failed
            )
        except BufferClosed:
            self._worker.raise_if_failed()
            raise
        wait_s = time.perf_counter() - start
        self._worker.raise_if_failed()
        lags = [staleness(trainer_version, g.policy_version) for g in groups]
        calls = {g.batch_index: g.generation_s for g in groups}
        metrics = self._metrics["train"]
        metrics["timing/trainer_wait_s"].append(wait_s)
        metrics["timing/generation_s"].append(sum(calls.values()) / len(calls))
        if self._worker.last_weight_load_s:
            metrics["timing/weight_load_s"].append(self._worker.last_weight_load_s)
        metrics["buffer/size"].append(float(len(self._buffer)))
        metrics["buffer/evicted_stale"].append(float(self._buffer.evicted_stale))
        metrics["off_policy/staleness_mean"].append(sum(lags) / len(lags))
        metrics["off_policy/staleness_max"].append(float(max(lags)))
        self._scoring_groups = groups
        # Decided over all processes: TRL gathers inside the IS branch, so every rank must take the same branch.
        needs_correction = max(lags) > 0 or not getattr(self._engine, "exact_behaviour_logps", False)
        flag = torch.tensor([float(needs_correction)], device=self.accelerator.device)
        self._behaviour_is_active = bool(gather(flag).max() > 0)
        return [group.row for group in groups for _ in range(self.num_generations)]

    def _tokenize_prompts(self, prompts: list):
        if self._scoring_groups is None:
            return super()._tokenize_prompts(prompts)
        return [g.prompt_ids for g in self._scoring_groups for _ in range(self.num_generations)], None, {}

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if self._scoring_groups is None:
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images=has_tool_images
            )
        completion_ids = [ids for g in self._scoring_groups for ids in g.completion_ids]
        logprobs = [lps for g in self._scoring_groups for lps in g.logprobs]
        return completion_ids, logprobs

    def _generate_and_score_completions(self, inputs):
        groups = self._scoring_groups
        if groups is None:
            return super()._generate_and_score_completions(inputs)
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            self._scoring_groups = None
        versions = [g.policy_version for g in groups for _ in range(self.num_generations)]
        output["policy_version"] = torch.tensor(versions, dtype=torch.long, device=self.accelerator.device)  # (B,)
        if not self._behaviour_is_active:
            output.pop("sampling_per_token_logps", None)  # fresh + exact: behaviour == current policy
        elif not self.args.vllm_importance_sampling_correction and "old_per_token_logps" not in output:
            # No IS correction requested: clip the PPO ratio against the behaviour policy itself.
            output["old_per_token_logps"] = output["sampling_per_token_logps"]
        self._behaviour_is_active = False
        return output

    def _compute_loss(self, model, inputs):
        self._behaviour_is_active = self.model.training and "importance_sampling_ratio" in inputs
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._behaviour_is_active = False

    # ---- tensor-native rewards ------------------------------------------------------------------------------------
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        from .rewards.base import TensorReward, pad_right

        tensor_idx = [i for i, f in enumerate(self.reward_funcs) if isinstance(f, TensorReward)]
        if not tensor_idx:
            return super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        other_idx = [i for i in range(len(self.reward_funcs)) if i not in tensor_idx]
        device = self.accelerator.device
        columns = {k: [x[k] for x in inputs] for k in inputs[0] if k not in ("prompt", "completion", "completion_ids")}
        completion_ids, completion_mask = (
            t.to(device) for t in pad_right(completion_ids_list, self._tokenizer.pad_token_id)
        )
        local = torch.zeros(len(prompts), len(self.reward_funcs), device=device)  # (B, num_funcs)
        for i in tensor_idx:
            scores = self.reward_funcs[i].score(completion_ids, completion_mask, **columns)  # (B,)
            local[:, i] = scores.to(device=device, dtype=local.dtype)
        _raise_on_nan_tensor(local[:, tensor_idx], [self.reward_func_names[i] for i in tensor_idx])
        rewards = gather(local)  # (B_global, num_funcs)
        if other_idx:
            saved = self.reward_funcs, self.reward_processing_classes, self.reward_func_names
            try:
                self.reward_funcs = [saved[0][i] for i in other_idx]
                self.reward_processing_classes = [saved[1][i] for i in other_idx]
                self.reward_func_names = [saved[2][i] for i in other_idx]
                rewards[:, other_idx] = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
            finally:
                self.reward_funcs, self.reward_processing_classes, self.reward_func_names = saved
        return rewards


def _raise_on_nan_tensor(values: torch.Tensor, names: list[str]) -> None:
    bad = torch.isnan(values).any(dim=0)
    if bad.any():
        culprits = [n for n, b in zip(names, bad.tolist()) if b]
        raise ValueError(f"Reward function(s) {culprits} returned NaN. Return a number, or None for 'not applicable'.")


def _check_rewards(name: str, values: list) -> list:
    for i, v in enumerate(values):
        if v is not None and isinstance(v, (float, int)) and math.isnan(v):
            raise ValueError(
                f"Reward function '{name}' returned NaN for completion {i}. Return a number, or None when the "
                "reward does not apply to that completion (TRL then ignores it)."
            )
    return values


def _reject_nan_rewards(func, name: str):
    """Wrap a Python reward function so that a NaN reward (a bug, unlike None = 'not applicable') raises."""
    from .rewards.base import TensorReward

    if isinstance(func, (torch.nn.Module, TensorReward)):
        return func
    if is_async_callable(func):

        @functools.wraps(func)
        async def checked_async(*args, **kwargs):
            return _check_rewards(name, await func(*args, **kwargs))

        return checked_async

    @functools.wraps(func)
    def checked(*args, **kwargs):
        return _check_rewards(name, func(*args, **kwargs))

    return checked
