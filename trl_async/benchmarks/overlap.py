"""Overlap benchmark: stock ``trl.GRPOTrainer`` vs ``AsyncGRPOTrainer`` on the same model, data, seed and steps.

    python -m trl_async.benchmarks.overlap [--models tiny smollm2] [--steps 8] [--repeats 3]

For each model, the configurations run alternately (repeat 1 of each, then repeat 2, ...; this machine is noisy,
so only side-by-side ratios mean something) and the table reports medians over repeats of the per-step medians
(the first two steps are warm-up and dropped):

* ``G`` generation seconds per step, ``T`` the rest of the step (scoring forward, loss, backward, optimizer),
  ``step`` wall seconds per optimizer step.
* ``stock@1`` and ``stock@N``: ``trl.GRPOTrainer`` with 1 and with all N torch threads (the best synchronous
  configuration on a CPU). ``async 1+1``: ``AsyncGRPOTrainer`` with 1 generation thread and 1 training thread,
  ``max_staleness=1``, with TRL's importance-sampling correction on stale batches (one extra no-grad forward per
  generation batch for the proximal log-probs, as stock TRL pays with vLLM). ``async 1+1 noIS``: the same with
  ``vllm_importance_sampling_correction=False`` (PPO clip against the behaviour log-probs, no extra forward), which
  isolates the cost of the orchestration itself. ``async s=0``: ``AsyncGRPOTrainer`` at ``max_staleness=0``
  (synchronous, generation inline on the training thread), all threads.
* **overlap efficiency** = ``max(G@1, T@1) / step(async 1+1)``, with ``G@1``/``T@1`` from ``stock@1`` (the ideal
  for that thread split is the slower of the two phases); 100% = perfect overlap.
* with ``--modes "stock+vllm" "async+vllm"`` (needs vLLM: ``.venv-vllm/bin/python -m trl_async.benchmarks.overlap``):
  ``trl.GRPOTrainer(use_vllm=True, vllm_mode="colocate")`` against ``AsyncGRPOTrainer(generation_backend="vllm")``,
  ``max_staleness=1``. On a CPU, TRL 1.16's colocate weight sync fails (``'Parameter' object has no attribute
  'weight_loader'``), so the stock run syncs through the same in-place reload our engine uses; on a GPU it runs as is.
  ``G`` for stock+vllm is TRL's own vLLM generate call.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_TELEMETRY", "0")

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402


class _StepClock(TrainerCallback):
    def __init__(self):
        self.stamps: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs):
        if not self.stamps:
            self.stamps.append(time.perf_counter())

    def on_step_end(self, args, state, control, **kwargs):
        self.stamps.append(time.perf_counter())


def _timed_stock_trainer():
    import trl

    class TimedGRPOTrainer(trl.GRPOTrainer):
        """Stock trainer + a stopwatch around generation (benchmark only)."""

        generation_s: list[float]

        def _generate_single_turn(self, *args, **kwargs):
            start = time.perf_counter()
            try:
                return super()._generate_single_turn(*args, **kwargs)
            finally:
                self.generation_s.append(time.perf_counter() - start)

    return TimedGRPOTrainer


def _patch_trl_colocate_sync_on_cpu() -> None:
    if torch.cuda.is_available():
        return
    from trl.generation.vllm_generation import VLLMGeneration

    from trl_async.engines.vllm_engine import load_named_weights

    VLLMGeneration.sync_weights = lambda self: load_named_weights(self.llm, self._iter_named_params())


def _build(model_name: str, num_threads: int):
    """Fresh model, tokenizer, dataset, reward and trainer settings for one run (same seed every time)."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    if model_name == "tiny":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        from trl_async.offline_assets import qwen2_tokenizer

        tokenizer = qwen2_tokenizer()
        config = Qwen2Config(
            vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
        from trl_async.offline_assets import cache_dir

        folder = cache_dir() / "bench-tiny-qwen2-h128"  # a folder on disk: vLLM engines load from a path
        if not (folder / "config.json").exists():
            Qwen2ForCausalLM(config).save_pretrained(folder)
            tokenizer.save_pretrained(folder)
        model, peft_config = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), None
        settings = dict(per_device_train_batch_size=8, num_generations=8, max_completion_length=32, learning_rate=1e-4)
    else:
        from trl_async.offline_assets import smollm2_135m_instruct

        path = smollm2_135m_instruct()
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                p.data = p.data.clone()  # out of the memory map
        peft_config = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
        settings = dict(per_device_train_batch_size=8, num_generations=8, max_completion_length=48, learning_rate=5e-4)
    prompts = [
        [{"role": "user", "content": f"What is {i % 10} + {i // 10 % 10}? Answer in \\boxed{{}}."}] for i in range(200)
    ]
    dataset = Dataset.from_dict({"prompt": prompts})

    def reward(completion_ids, **kwargs):
        return [float(len(ids) % 7) for ids in completion_ids]

    common = dict(
        **settings, bf16=False, use_cpu=not torch.cuda.is_available(), report_to="none", logging_steps=1, save_strategy="no",
        disable_tqdm=True, gradient_checkpointing=False, beta=0.0, lr_scheduler_type="constant", seed=0,
        temperature=1.0,
    )  # fmt: skip
    return model, tokenizer, dataset, reward, peft_config, common


def run(model_name: str, mode: str, steps: int, all_threads: int) -> dict[str, float]:
    import trl

    from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer

    threads = {"stock@N": all_threads, "async s=0": all_threads}.get(mode, 1)
    torch.set_num_threads(threads)
    model, tokenizer, dataset, reward, peft_config, common = _build(model_name, threads)
    clock = _StepClock()
    with tempfile.TemporaryDirectory() as out:
        vllm = dict(vllm_gpu_memory_utilization=0.3, vllm_max_model_length=512)
        if mode == "stock+vllm":
            _patch_trl_colocate_sync_on_cpu()
            trainer = _timed_stock_trainer()(
                model, reward, args=trl.GRPOConfig(output_dir=out, max_steps=steps, use_vllm=True,
                                                   vllm_mode="colocate", **vllm, **common),
                train_dataset=dataset, processing_class=tokenizer, peft_config=peft_config, callbacks=[clock],
            )  # fmt: skip
            trainer.generation_s = []
        elif mode == "async+vllm":
            trainer = AsyncGRPOTrainer(
                model, reward, args=AsyncGRPOConfig(output_dir=out, max_steps=steps, generation_backend="vllm",
                                                    vllm_mode="colocate", max_staleness=1, **vllm, **common),
                train_dataset=dataset, processing_class=tokenizer, peft_config=peft_config, callbacks=[clock],
            )  # fmt: skip
        elif mode.startswith("stock"):
            trainer = _timed_stock_trainer()(
                model, reward, args=trl.GRPOConfig(output_dir=out, max_steps=steps, **common),
                train_dataset=dataset, processing_class=tokenizer, peft_config=peft_config, callbacks=[clock],
            )  # fmt: skip
            trainer.generation_s = []
        else:
            split = dict(generation_num_threads=1) if not torch.cuda.is_available() else {}
            if mode == "async s=0":
                extra = dict(max_staleness=0)
            else:  # "async 1+1" (TRL's IS correction on stale batches) or "async 1+1 noIS" (clip vs behaviour)
                extra = dict(max_staleness=1, vllm_importance_sampling_correction=not mode.endswith("noIS"), **split)
            trainer = AsyncGRPOTrainer(
                model, reward, args=AsyncGRPOConfig(output_dir=out, max_steps=steps, **common, **extra),
                train_dataset=dataset, processing_class=tokenizer, peft_config=peft_config, callbacks=[clock],
            )  # fmt: skip
        trainer.train()
    step_times = [b - a for a, b in zip(clock.stamps, clock.stamps[1:])][2:]
    logs = [h for h in trainer.state.log_history if "step_time" in h][2:]
    if mode.startswith("stock"):
        gen = trainer.generation_s[2 : 2 + len(step_times)]
        wait = [0.0] * len(gen)
    else:
        gen = [h["timing/generation_s"] for h in logs]
        wait = [h["timing/trainer_wait_s"] for h in logs]
    step = statistics.median(step_times)
    g = statistics.median(gen)
    t = step - g if mode.startswith("stock") else step - statistics.median(wait)
    return {"G": g, "T": t, "step": step}


def _run_in_subprocess(model_name: str, mode: str, steps: int) -> dict[str, float]:
    """Each run gets a fresh process: torch's thread count is process-wide, and a vLLM engine keeps its memory."""
    cmd = [sys.executable, "-m", "trl_async.benchmarks.overlap", "--single", model_name, mode, "--steps", str(steps)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{model_name} / {mode} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "smollm2"], choices=["tiny", "smollm2"])
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run (2 warm-up steps dropped)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=["stock@1", "stock@N", "async 1+1", "async s=0"])
    parser.add_argument("--single", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    cli = parser.parse_args(argv)
    all_threads = os.cpu_count() or 1
    if cli.single:  # one run in this (fresh) process; the parent reads the JSON line
        print("RESULT " + json.dumps(run(cli.single[0], cli.single[1], cli.steps, all_threads)), flush=True)
        return
    print(
        f"# overlap benchmark: {platform.processor() or platform.machine()}, {all_threads} CPU threads, "
        f"torch {torch.__version__}, {'GPU ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'}"
    )
    print(f"# command: python -m trl_async.benchmarks.overlap {' '.join(sys.argv[1:])}".rstrip())
    for model_name in cli.models:
        results: dict[str, list[dict[str, float]]] = {m: [] for m in cli.modes}
        for repeat in range(cli.repeats):
            for mode in cli.modes:
                results[mode].append(_run_in_subprocess(model_name, mode, cli.steps))
                r = results[mode][-1]
                print(f"  [{model_name} repeat {repeat + 1}] {mode:10s} G={r['G']:.2f}s T={r['T']:.2f}s step={r['step']:.2f}s",
                      file=sys.stderr, flush=True)  # fmt: skip
        med = {m: {k: statistics.median(r[k] for r in rs) for k in ("G", "T", "step")} for m, rs in results.items()}
        print(f"\n## {model_name}: median of {cli.repeats} runs x {cli.steps - 2} measured steps\n")
        print("| configuration | G (s) | T (s) | step (s) | step vs stock@N |")
        print("|---|---:|---:|---:|---:|")
        best = med.get("stock@N", {}).get("step")
        for mode, m in med.items():
            ratio = f"{m['step'] / best:.2f}x" if best else "-"
            print(f"| {mode} | {m['G']:.2f} | {m['T']:.2f} | {m['step']:.2f} | {ratio} |")
        for async_mode in ("async 1+1", "async 1+1 noIS"):
            if "stock@1" in med and async_mode in med:
                ideal = max(med["stock@1"]["G"], med["stock@1"]["T"])
                print(f"\noverlap efficiency ({async_mode}): ideal max(G@1, T@1) = {ideal:.2f} s, async step = "
                      f"{med[async_mode]['step']:.2f} s -> {100 * ideal / med[async_mode]['step']:.0f}%")  # fmt: skip


if __name__ == "__main__":
    main()
