"""Shared fixtures: offline, CPU, tiny real models with the real Qwen2.5 tokenizer."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRL_TELEMETRY", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))


@pytest.fixture(scope="session")
def qwen_tokenizer():
    """The real Qwen2.5 tokenizer, built offline from the vocabulary `dashscope` ships."""
    from trl_async.offline_assets import qwen2_tokenizer

    return qwen2_tokenizer()


def make_tiny_qwen2(tokenizer, seed: int = 0, hidden_size: int = 64, num_layers: int = 2):
    """A random Qwen2 causal LM over the full Qwen2.5 vocabulary (~20M params, mostly the embedding)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


@pytest.fixture
def tiny_qwen2(qwen_tokenizer):
    return make_tiny_qwen2(qwen_tokenizer)
