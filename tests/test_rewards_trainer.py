"""The rewards inside stock trl.GRPOTrainer (TRL signature) and inside AsyncGRPOTrainer (tensor path)."""

from __future__ import annotations

import pytest
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from tests.conftest import make_tiny_qwen2
from trl_async.rewards import FormatReward, MathAnswerReward, SoftOverlongPunishment, TensorReward

ARGS = dict(
    per_device_train_batch_size=4,
    num_generations=4,
    max_completion_length=8,
    max_steps=1,
    bf16=False,
    use_cpu=True,
    report_to="none",
    logging_steps=1,
    disable_tqdm=True,
    save_strategy="no",
)


def gsm8k_like(n=8):
    return Dataset.from_dict(
        {
            "prompt": [f"What is {i} + {i}? Put the answer in \\boxed{{}}." for i in range(n)],
            "answer": [f"{i} + {i} = {2 * i}\n#### {2 * i}" for i in range(n)],
        }
    )


class Spy(TensorReward):
    """Counts which path the trainer takes through a reward."""

    def __init__(self, reward):
        super().__init__(name=reward.__name__)
        self.reward, self.calls, self.scores = reward, 0, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.reward(*args, **kwargs)

    def score(self, *args, **kwargs):
        self.scores += 1
        return self.reward.score(*args, **kwargs)


def rewards(tokenizer):
    return [MathAnswerReward(tokenizer), FormatReward(tokenizer), SoftOverlongPunishment(8, 4)]


def logged(trainer):
    keys = set().union(*(entry.keys() for entry in trainer.state.log_history))
    return {k for k in keys if k.startswith("rewards/")}


def test_inside_stock_grpo_trainer(tmp_path, qwen_tokenizer):
    funcs = [Spy(r) for r in rewards(qwen_tokenizer)]
    args = GRPOConfig(output_dir=str(tmp_path), reward_weights=[1.0, 0.5, 1.0], **ARGS)
    trainer = GRPOTrainer(
        make_tiny_qwen2(qwen_tokenizer), funcs, args=args, train_dataset=gsm8k_like(), processing_class=qwen_tokenizer
    )
    trainer.train()
    names = logged(trainer)
    for name in ["math_answer", "format", "soft_overlong_punishment"]:
        assert f"rewards/{name}/mean" in names
    assert all(f.calls >= 1 and f.scores == 0 for f in funcs)  # stock TRL uses the TRL signature


def test_inside_async_grpo_trainer(tmp_path, qwen_tokenizer):
    async_trainer = pytest.importorskip("trl_async.async_grpo_trainer")
    from trl_async import AsyncGRPOConfig

    funcs = [Spy(r) for r in rewards(qwen_tokenizer)]
    args = AsyncGRPOConfig(output_dir=str(tmp_path), reward_weights=[1.0, 0.5, 1.0], **ARGS)
    trainer = async_trainer.AsyncGRPOTrainer(
        make_tiny_qwen2(qwen_tokenizer), funcs, args=args, train_dataset=gsm8k_like(), processing_class=qwen_tokenizer
    )
    trainer.train()
    names = logged(trainer)
    for name in ["math_answer", "format", "soft_overlong_punishment"]:
        assert f"rewards/{name}/mean" in names
    assert all(f.scores >= 1 and f.calls == 0 for f in funcs), [(f.scores, f.calls) for f in funcs]  # tensor path
