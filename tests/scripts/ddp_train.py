"""Launched by tests/test_multiprocess.py under `accelerate launch --num_processes 2`: 2 DDP processes on CPU."""

import json
import sys

import torch
from datasets import Dataset

from tests.conftest import make_tiny_qwen2
from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer
from trl_async.offline_assets import qwen2_tokenizer


class Recording(AsyncGRPOTrainer):
    def _compute_loss(self, model, inputs):
        self.seen = getattr(self, "seen", [])
        self.seen.append(
            {
                "step": self.state.global_step,
                "versions": inputs["policy_version"].tolist(),
                "prompts": inputs["prompt_ids"].shape[0],
            }
        )
        return super()._compute_loss(model, inputs)


def reward(completion_ids, label, **kwargs):
    return [float(len(ids) + sum(ids) % 13 + 0 * lab) for ids, lab in zip(completion_ids, label)]


def main(out_path):
    torch.set_num_threads(1)
    tok = qwen2_tokenizer()
    dataset = Dataset.from_dict({"prompt": [f"Item {i}:" for i in range(32)], "label": list(range(32))})
    args = AsyncGRPOConfig(
        output_dir=out_path + ".run", per_device_train_batch_size=4, num_generations=4, max_completion_length=6,
        max_steps=3, learning_rate=1e-2, bf16=False, use_cpu=True, report_to="none", logging_steps=1,
        disable_tqdm=True, save_strategy="no", max_staleness=1, generation_num_threads=1,
    )  # fmt: skip
    trainer = Recording(make_tiny_qwen2(tok), reward, args=args, train_dataset=dataset, processing_class=tok)
    trainer.train()
    rank = trainer.accelerator.process_index
    weights = trainer.accelerator.unwrap_model(trainer.model).model.embed_tokens.weight[:3, :4].tolist()
    with open(f"{out_path}.{rank}.json", "w") as f:
        json.dump({"seen": trainer.seen, "weights": weights, "logs": trainer.state.log_history}, f)


if __name__ == "__main__":
    main(sys.argv[1])
