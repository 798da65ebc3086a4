"""Slow tier: every loss_type, batch-reuse options, reward kinds, and a learning test on stale data."""

import asyncio

import pytest
import torch
from datasets import Dataset
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

from tests.conftest import make_tiny_qwen2
from tests.test_async_grpo_trainer import (
    RecordingTrainer,
    assert_no_worker_thread,
    config,
    length_reward,
    prompts_dataset,
)
from trl_async import AsyncGRPOTrainer

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"])
def test_every_loss_type_trains_on_stale_data(tmp_path, qwen_tokenizer, loss_type):
    overrides = dict(loss_type=loss_type, max_steps=3, max_staleness=2)
    if loss_type == "luspo":
        overrides["importance_sampling_level"] = "sequence"
    if loss_type == "vespo":
        overrides["vllm_importance_sampling_mode"] = "token_truncate"
    trainer = RecordingTrainer(
        make_tiny_qwen2(qwen_tokenizer),
        length_reward,
        args=config(tmp_path, **overrides),
        train_dataset=prompts_dataset(),
        processing_class=qwen_tokenizer,
    )
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    assert max(s - v for s, vs in trainer.seen for v in vs) <= 2


@pytest.mark.parametrize(
    "overrides",
    [
        dict(gradient_accumulation_steps=2),  # steps_per_generation follows it: one generation per optimizer step
        dict(gradient_accumulation_steps=2, steps_per_generation=4),  # one generation feeds two optimizer steps
        dict(num_iterations=2),  # each generation batch is trained on twice
        dict(num_iterations=2, gradient_accumulation_steps=2, max_staleness=3),
    ],
)
def test_batch_reuse_options(tmp_path, qwen_tokenizer, overrides):
    args = config(tmp_path, max_steps=4, **{"max_staleness": 2, **overrides})
    trainer = RecordingTrainer(
        make_tiny_qwen2(qwen_tokenizer),
        length_reward,
        args=args,
        train_dataset=prompts_dataset(32),
        processing_class=qwen_tokenizer,
    )
    trainer.train()
    assert trainer.state.global_step == 4
    micro_batches = 4 * args.gradient_accumulation_steps
    assert len(trainer.seen) == micro_batches
    assert all(len(vs) == args.per_device_train_batch_size for _, vs in trainer.seen)
    logs = [h for h in trainer.state.log_history if "off_policy/staleness_max" in h]
    assert logs and all(h["off_policy/staleness_max"] <= args.max_staleness for h in logs)


def test_async_and_model_and_weighted_rewards(tmp_path, qwen_tokenizer):
    """An async reward function, a reward model given as a path string, and reward_weights, together."""
    reward_model_dir = tmp_path / "reward_model"
    cfg = Qwen2Config(
        vocab_size=len(qwen_tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_labels=1,
        pad_token_id=qwen_tokenizer.pad_token_id,
    )
    Qwen2ForSequenceClassification(cfg).save_pretrained(reward_model_dir)
    qwen_tokenizer.save_pretrained(reward_model_dir)
    assert AutoTokenizer.from_pretrained(reward_model_dir).pad_token_id == qwen_tokenizer.pad_token_id

    async def async_reward(completion_ids, **kwargs):
        await asyncio.sleep(0)
        return [float(ids[0] % 5) for ids in completion_ids]

    trainer = AsyncGRPOTrainer(
        make_tiny_qwen2(qwen_tokenizer),
        [async_reward, str(reward_model_dir), length_reward],
        args=config(tmp_path / "out", max_steps=2, reward_weights=[1.0, 0.5, 2.0]),
        train_dataset=prompts_dataset(),
        processing_class=qwen_tokenizer,
    )
    trainer.train()
    log = [h for h in trainer.state.log_history if "reward" in h][-1]
    names = [k for k in log if k.startswith("rewards/") and k.endswith("/mean")]
    assert len(names) == 3
    assert_no_worker_thread()


def test_reward_rises_when_training_on_stale_data(tmp_path, qwen_tokenizer):
    """A dense reward a tiny random model can climb: the fraction of sampled tokens in a fixed half of the
    vocabulary (ids whose initial embedding points along a random direction u). Rollouts are up to 2 steps stale.
    The (tied) embedding is frozen, as in adapter training: trained, its 151k rows are each touched only by the few
    samples that drew that token, Adam moves each touched row by ~lr whatever its gradient, and one row could take
    over the policy (entropy 12 -> 0) whether or not its token was rewarded; CI saw the reward end at 0.0 so. Frozen,
    only the shared layers learn: in 9 runs the reward rose by 0.28-0.39 in 40 steps (entropy above 10 in the 4 seen)."""
    model = make_tiny_qwen2(qwen_tokenizer, seed=0)
    u = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    target = (model.get_input_embeddings().weight.detach() @ u) > 0  # (V,)
    model.get_input_embeddings().weight.requires_grad_(False)

    def aligned_fraction(completion_ids, **kwargs):
        return [float(target[torch.tensor(ids)].float().mean()) for ids in completion_ids]

    args = config(
        tmp_path,
        per_device_train_batch_size=16,
        num_generations=8,
        max_completion_length=8,
        max_steps=40,
        learning_rate=0.4,
        lr_scheduler_type="constant",
        max_staleness=2,
        gradient_checkpointing=False,
    )
    dataset = Dataset.from_dict({"prompt": [f"Item {i}:" for i in range(64)]})
    trainer = RecordingTrainer(
        model, aligned_fraction, args=args, train_dataset=dataset, processing_class=qwen_tokenizer
    )
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    lags = [s - v for s, vs in trainer.seen for v in vs]
    print("reward per step:", [round(r, 2) for r in rewards], "staleness:", sorted(set(lags)))
    assert max(lags) == 2, "the test must actually train on 2-step-stale rollouts"
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last > first + 0.2, f"reward did not rise: first steps {first:.2f}, last steps {last:.2f}"
