"""AsyncGRPOTrainer end to end on a tiny random Qwen2 with the real Qwen2.5 tokenizer (offline, CPU)."""

import threading
import time

import pytest
import torch
import trl
from datasets import Dataset
from peft import LoraConfig
from transformers import TrainerCallback

from tests.conftest import make_tiny_qwen2
from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer, GenerationWorkerError

WORKER_NAME = "trl_async-generation-worker"


def config(tmp_path, **overrides):
    values = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        max_steps=3,
        learning_rate=1e-2,
        bf16=False,
        use_cpu=True,
        report_to="none",
        logging_steps=1,
        disable_tqdm=True,
        save_strategy="no",
        max_staleness=1,
    )
    values.update(overrides)
    return AsyncGRPOConfig(**values)


def prompts_dataset(n=16):
    return Dataset.from_dict({"prompt": [f"Item {i}:" for i in range(n)], "label": list(range(n))})


def length_reward(completion_ids, **kwargs):
    """Varies within every group (a random model rarely stops early, so plain length would not)."""
    return [float(len(ids) + sum(ids) % 13) for ids in completion_ids]


class RecordingTrainer(AsyncGRPOTrainer):
    """Records (trainer version, policy versions) of every micro-batch the loss is computed on."""

    def _compute_loss(self, model, inputs):
        self.seen = getattr(self, "seen", [])
        self.seen.append((self.state.global_step, inputs["policy_version"].tolist()))
        return super()._compute_loss(model, inputs)


def assert_no_worker_thread():
    deadline = time.time() + 5
    while WORKER_NAME in [t.name for t in threading.enumerate()] and time.time() < deadline:
        time.sleep(0.05)
    assert WORKER_NAME not in [t.name for t in threading.enumerate()]


def test_is_a_grpo_trainer_subclass():
    assert trl.GRPOTrainer in AsyncGRPOTrainer.__mro__
    assert issubclass(AsyncGRPOConfig, trl.GRPOConfig)


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(max_staleness=-1), "max_staleness"),
        (dict(weight_sync_steps=0), "weight_sync_steps"),
        (dict(max_staleness=1, weight_sync_steps=3), "weight_sync_steps <= max_staleness"),
        (dict(generation_backend="sglang"), "generation_backend"),
        (dict(use_vllm=True), "generation_backend='vllm'"),
        (dict(buffer_capacity=0), "buffer_capacity"),
        (dict(per_device_train_batch_size=6), "divisible by num_generations"),
        (dict(generation_timeout_s=0), "generation_timeout_s"),
    ],
)
def test_bad_config_values_raise_clear_errors(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        config(tmp_path, **overrides)


def test_plain_grpo_config_is_rejected_with_a_fix(tmp_path, qwen_tokenizer, tiny_qwen2):
    args = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, bf16=False)
    with pytest.raises(TypeError, match="AsyncGRPOConfig"):
        AsyncGRPOTrainer(tiny_qwen2, length_reward, args=args, train_dataset=prompts_dataset())


def test_full_finetuning_trains_with_bounded_staleness_and_logs_metrics(tmp_path, qwen_tokenizer, tiny_qwen2):
    before = {n: p.detach().clone() for n, p in tiny_qwen2.named_parameters()}
    trainer = RecordingTrainer(
        tiny_qwen2,
        length_reward,
        args=config(tmp_path, max_steps=4, max_staleness=1),
        train_dataset=prompts_dataset(),
        processing_class=qwen_tokenizer,
    )
    trainer.train()
    assert trainer.state.global_step == 4
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert changed, "training must change the parameters"
    lags = [step - v for step, versions in trainer.seen for v in versions]
    assert max(lags) <= 1 and min(lags) >= 0
    assert max(lags) == 1, "with max_staleness=1 the worker runs one step ahead"
    logs = [h for h in trainer.state.log_history if "loss" in h]
    for key in [
        "buffer/size",
        "buffer/evicted_stale",
        "off_policy/staleness_mean",
        "off_policy/staleness_max",
        "timing/generation_s",
        "timing/trainer_wait_s",
        "reward",
        "rewards/length_reward/mean",
        "completions/mean_length",
        "entropy",
    ]:
        assert all(key in h for h in logs), key
    assert any("timing/weight_sync_s" in h for h in logs)
    assert any("sampling/importance_sampling_ratio/mean" in h for h in logs), "stale batches use TRL's IS correction"
    assert_no_worker_thread()


def test_lora_trains_only_the_adapter(tmp_path, qwen_tokenizer, tiny_qwen2):
    trainer = RecordingTrainer(
        tiny_qwen2,
        length_reward,
        args=config(tmp_path, max_steps=3),
        train_dataset=prompts_dataset(),
        processing_class=qwen_tokenizer,
        peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
    )
    adapter_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert adapter_before and all("lora_" in n for n in adapter_before)
    trainer.train()
    params = dict(trainer.model.named_parameters())
    assert any(not torch.equal(params[n].detach(), p) for n, p in adapter_before.items())
    assert max(s - v for s, vs in trainer.seen for v in vs) <= 1
    assert_no_worker_thread()


def test_max_staleness_zero_matches_the_synchronous_data_flow(tmp_path, qwen_tokenizer):
    """Same prompts in the same order as stock GRPOTrainer, every rollout on-policy, no IS correction."""
    seen_labels = {"sync": [], "async": []}

    def recorder(key):
        def reward(completion_ids, label, **kwargs):
            seen_labels[key].extend(label)
            return [float(len(ids)) for ids in completion_ids]

        reward.__name__ = "length"
        return reward

    common = dict(max_steps=3, max_staleness=0)
    async_args = config(tmp_path / "a", **common)
    sync_args = trl.GRPOConfig(
        output_dir=str(tmp_path / "s"),
        **{
            k: getattr(async_args, k)
            for k in ("per_device_train_batch_size", "num_generations", "max_completion_length")
        },
        **{k: getattr(async_args, k) for k in ("max_steps", "learning_rate", "bf16", "use_cpu", "report_to", "seed")},
        disable_tqdm=True,
        save_strategy="no",
    )
    stock = trl.GRPOTrainer(
        make_tiny_qwen2(qwen_tokenizer),
        recorder("sync"),
        args=sync_args,
        train_dataset=prompts_dataset(),
        processing_class=qwen_tokenizer,
    )
    stock.train()
    ours = RecordingTrainer(
        make_tiny_qwen2(qwen_tokenizer),
        recorder("async"),
        args=async_args,
        train_dataset=prompts_dataset(),
        processing_class=qwen_tokenizer,
    )
    ours.train()
    assert seen_labels["async"] == seen_labels["sync"] and len(seen_labels["sync"]) == 12
    assert all(step == v for step, versions in ours.seen for v in versions)
    logs = [h for h in ours.state.log_history if "loss" in h]
    assert all(h["off_policy/staleness_max"] == 0 for h in logs)
    assert not any("sampling/importance_sampling_ratio/mean" in h for h in logs)
    assert all(h["buffer/evicted_stale"] == 0 for h in logs)


def test_worker_failure_surfaces_in_train_promptly_and_leaves_no_thread(tmp_path, qwen_tokenizer, tiny_qwen2):
    long_prompt = "word " * 600  # longer than the tiny model's 512 positions: the engine raises in the worker
    dataset = Dataset.from_dict({"prompt": [long_prompt] * 8})
    trainer = AsyncGRPOTrainer(
        tiny_qwen2, length_reward, args=config(tmp_path), train_dataset=dataset, processing_class=qwen_tokenizer
    )
    start = time.monotonic()
    with pytest.raises(GenerationWorkerError, match="exceeds the model's 512 positions") as info:
        trainer.train()
    assert time.monotonic() - start < 30
    assert isinstance(info.value.__cause__, ValueError)
    assert_no_worker_thread()


def test_keyboard_interrupt_stops_the_worker(tmp_path, qwen_tokenizer, tiny_qwen2):
    class Interrupt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            raise KeyboardInterrupt

    trainer = AsyncGRPOTrainer(
        tiny_qwen2,
        length_reward,
        args=config(tmp_path, max_staleness=2),
        train_dataset=prompts_dataset(),
        processing_class=qwen_tokenizer,
        callbacks=[Interrupt()],
    )
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert_no_worker_thread()


def test_nan_reward_is_a_clear_error(tmp_path, qwen_tokenizer, tiny_qwen2):
    def nan_reward(completions, **kwargs):
        return [float("nan")] * len(completions)

    trainer = AsyncGRPOTrainer(
        tiny_qwen2, nan_reward, args=config(tmp_path), train_dataset=prompts_dataset(), processing_class=qwen_tokenizer
    )
    with pytest.raises(ValueError, match="'nan_reward' returned NaN"):
        trainer.train()
    assert_no_worker_thread()


def test_wrong_length_reward_is_a_clear_error(tmp_path, qwen_tokenizer, tiny_qwen2):
    def short_reward(completions, **kwargs):
        return [1.0]

    trainer = AsyncGRPOTrainer(
        tiny_qwen2,
        short_reward,
        args=config(tmp_path),
        train_dataset=prompts_dataset(),
        processing_class=qwen_tokenizer,
    )
    with pytest.raises(ValueError, match="returned 1 rewards"):
        trainer.train()
    assert_no_worker_thread()


def test_unsupported_arguments_are_rejected(tmp_path, qwen_tokenizer, tiny_qwen2):
    with pytest.raises(NotImplementedError, match="tools"):
        AsyncGRPOTrainer(
            tiny_qwen2, length_reward, args=config(tmp_path), train_dataset=prompts_dataset(), tools=[len]
        )


def test_without_is_correction_the_ppo_ratio_is_taken_against_the_behaviour_policy(tmp_path, qwen_tokenizer):
    class Capture(AsyncGRPOTrainer):
        def _compute_loss(self, model, inputs):
            self.batches = getattr(self, "batches", []) + [{k: v for k, v in inputs.items()}]
            return super()._compute_loss(model, inputs)

    trainer = Capture(
        make_tiny_qwen2(qwen_tokenizer),
        length_reward,
        args=config(tmp_path, max_steps=3, max_staleness=1, vllm_importance_sampling_correction=False),
        train_dataset=prompts_dataset(),
        processing_class=qwen_tokenizer,
    )
    trainer.train()
    stale = [b for b in trainer.batches if "sampling_per_token_logps" in b]
    assert stale, "steps 1 and 2 train on 1-step-stale rollouts"
    for b in stale:
        assert "importance_sampling_ratio" not in b
        assert torch.equal(b["old_per_token_logps"], b["sampling_per_token_logps"])
