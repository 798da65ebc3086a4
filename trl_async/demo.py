"""The CPU demo: asynchronous GRPO with LoRA on SmolLM2-135M-Instruct, offline, in about eight minutes on 2 cores.

    python -m trl_async.demo [--config recipes/SmolLM2-135M-Instruct/async_grpo/config_cpu_demo.yaml] [--max-steps N]

The task: "What is a + b?" for one-digit a, b, answered in one final ``\\boxed{}``. Two rewards:
``boxed_format`` (1.0 when the completion ends with exactly one ``\\boxed{...}``: earlier probes saw models game
looser checks by printing many boxes) and ``math_answer`` (the tensor-native
:class:`trl_async.rewards.MathAnswerReward`: the boxed number equals a + b). Expect the format reward to climb
within the run; a 135M model cannot add reliably, so correctness stays low, and that is the honest result.
Writes ``reward_curve.png`` and ``rewards.csv`` into the recipe's ``output_dir``.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import time
from pathlib import Path

DEFAULT_RECIPE = (
    Path(__file__).resolve().parent.parent / "recipes/SmolLM2-135M-Instruct/async_grpo/config_cpu_demo.yaml"
)
_FINAL_BOX = re.compile(r"\\boxed\{[^{}]*\}\s*\.?\s*$")


def boxed_format(completions, **kwargs) -> list[float]:
    """1.0 when the completion ends with its only ``\\boxed{...}``."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(t.count("\\boxed") == 1 and _FINAL_BOX.search(t) is not None) for t in texts]


def addition_problems(n: int, max_operand: int, seed: int):
    from datasets import Dataset

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        # With an example of the format, ~11% of the base model's samples (T=1) end with one box, against ~2% for
        # "Reply with the result in \boxed{}.": with 8 samples a step, most steps then carry a learning signal. The
        # example is no possible sum: with \boxed{10} the policy learned to copy it, which paid whenever a + b = 10.
        question = f"What is {a} + {b}? End your reply with the result in \\boxed{{}}, for example \\boxed{{100}}."
        rows.append({"prompt": [{"role": "user", "content": question}], "answer": str(a + b)})
    return Dataset.from_list(rows)


def load_recipe(path: Path) -> dict:
    import yaml

    with open(path) as f:
        recipe = yaml.safe_load(f)
    for section in ("demo", "lora", "training"):
        if section not in recipe:
            raise ValueError(f"Recipe {path} has no `{section}:` section.")
    return recipe


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_RECIPE)
    parser.add_argument("--max-steps", type=int, default=None, help="override training.max_steps")
    parser.add_argument("--output-dir", type=str, default=None, help="override training.output_dir")
    cli = parser.parse_args(argv)
    recipe = load_recipe(cli.config)
    demo, training = recipe["demo"], dict(recipe["training"])
    if cli.max_steps is not None:
        training["max_steps"] = cli.max_steps
    if cli.output_dir is not None:
        training["output_dir"] = cli.output_dir
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRL_TELEMETRY", "0")

    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer
    from trl_async.offline_assets import smollm2_135m_instruct
    from trl_async.rewards import MathAnswerReward

    torch.set_num_threads(int(demo.get("torch_num_threads", 1)))
    model_path = smollm2_135m_instruct() if demo["model"] == "smollm2-135m-instruct" else demo["model"]
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    with torch.no_grad():  # copy memory-mapped weights into RAM: paged-out weights made one forward take 50 s
        for p in model.parameters():
            p.data = p.data.clone()
    dataset = addition_problems(demo["num_problems"], demo["max_operand"], demo["seed"])
    math_answer = MathAnswerReward(tokenizer, answer_column="answer")
    args = AsyncGRPOConfig(**training)
    curve: list[tuple[int, float, float, float]] = []

    class PrintRewards(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "rewards/boxed_format/mean" in logs:
                row = (
                    state.global_step,
                    logs["rewards/boxed_format/mean"],
                    logs.get(f"rewards/{math_answer.__name__}/mean", float("nan")),
                    logs.get("step_time", float("nan")),
                )
                curve.append(row)
                print(
                    f"step {row[0]:3d} | format {row[1]:.2f} | correct {row[2]:.2f} | "
                    f"staleness {logs.get('off_policy/staleness_mean', 0):.1f} | "
                    f"wait {logs.get('timing/trainer_wait_s', 0):.2f}s | step {row[3]:.1f}s",
                    flush=True,
                )

    last_completions: list = []

    def boxed_format_sampled(completions, **kwargs):  # same reward; keeps the latest completions to show at the end
        last_completions[:] = completions
        return boxed_format(completions)

    boxed_format_sampled.__name__ = "boxed_format"
    trainer = AsyncGRPOTrainer(
        model=model,
        reward_funcs=[boxed_format_sampled, math_answer],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=LoraConfig(**recipe["lora"]),
        callbacks=[PrintRewards()],
    )
    start = time.time()
    trainer.train()
    elapsed = time.time() - start
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_curve(curve, out)
    k = max(1, len(curve) // 4)
    first = sum(r[1] for r in curve[:k]) / k
    last = sum(r[1] for r in curve[-k:]) / k
    print(
        f"\nTrained {len(curve)} steps in {elapsed:.0f} s. Format reward: first {k} steps {first:.2f} -> last {k} "
        f"steps {last:.2f}. Correctness stays low: a 135M model cannot add reliably."
    )
    for completion in last_completions[:3]:
        print(
            "  sample completion (last step):",
            repr(completion[-1]["content"] if isinstance(completion, list) else completion),
        )
    print(f"Curve: {out / 'reward_curve.png'}  Adapter: trainer.save_model() / recipes' push_to_hub for the Hub.")


def _write_curve(curve, out: Path) -> None:
    with open(out / "rewards.csv", "w") as f:
        f.write("step,format_reward,correctness_reward,step_time_s\n")
        for row in curve:
            f.write(",".join(f"{v}" for v in row) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps = [r[0] for r in curve]
    ax.plot(steps, [r[1] for r in curve], label="boxed format")
    ax.plot(steps, [r[2] for r in curve], label="correct answer")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean reward")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title("AsyncGRPOTrainer CPU demo (SmolLM2-135M-Instruct, LoRA)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "reward_curve.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
