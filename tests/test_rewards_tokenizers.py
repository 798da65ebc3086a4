"""Tokenizers the reward tests run on, and what makes each one a different test.

* Qwen2.5 (``qwen_tokenizer`` fixture, conftest): one digit per token, ``' \\\\'`` ``'boxed'`` ``'{'``.
* SmolLM2: a different byte-level BPE, also one digit per token, ``'box'`` ``'ed'``.
* A byte-level BPE trained here on a small synthetic corpus full of numbers, *without* a pre-tokenizer split, so its
  tokens merge digits (``'250'``) and digits with punctuation (``'{1'``, ``'0}.'``, ``',000'``): the adversarial case
  for reading numbers from tokens.
"""

from __future__ import annotations

import functools
import random

import pytest


@functools.cache
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from trl_async.offline_assets import smollm2_135m_instruct

    return AutoTokenizer.from_pretrained(smollm2_135m_instruct())


def _number_corpus(n_lines: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = "the answer is so total cost each she he has dollars apples hours we get final therefore".split()
    lines = []
    for _ in range(n_lines):
        value = rng.choice([rng.randint(0, 300), rng.randint(0, 99999), round(rng.uniform(-50, 50), 2)])
        shown = f"{value:,}" if rng.random() < 0.5 else str(value)
        prose = " ".join(rng.choice(words) for _ in range(rng.randint(2, 8)))
        lines.append(
            rng.choice(
                [
                    f"{prose} {shown}. The answer is \\boxed{{{shown}}}.",
                    f"{prose} $\\boxed{{\\${shown}}}$",
                    f"{prose} = {shown}\n#### {shown}",
                    f"<think>{prose} {rng.randint(0, 999)}</think> <answer>{shown}</answer>",
                ]
            )
        )
    return lines


@functools.cache
def merged_digit_tokenizer():
    """A byte-level BPE (3,000 tokens, at most 6 characters each) whose tokens merge digits and punctuation."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=3000,
        min_frequency=2,
        max_token_length=6,
        special_tokens=["<eos>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_number_corpus(4000), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<pad>")


def test_smollm2_is_a_different_tokenizer_that_also_splits_digits(qwen_tokenizer):
    smol = smollm2_tokenizer()
    text = "so \\boxed{1,250}"
    qwen_pieces = [qwen_tokenizer.decode([i]) for i in qwen_tokenizer(text, add_special_tokens=False).input_ids]
    smol_pieces = [smol.decode([i]) for i in smol(text, add_special_tokens=False).input_ids]
    assert qwen_pieces != smol_pieces  # 'boxed' vs 'box' 'ed'
    assert "2" in smol_pieces and "250" not in smol_pieces  # one digit per token: hence the merged tokenizer


def test_merged_digit_tokenizer_merges_digits_and_punctuation():
    tok = merged_digit_tokenizer()
    vocab = [tok.decode([i]) for i in range(len(tok))]
    multi_digit = [t for t in vocab if sum(c.isdigit() for c in t) >= 2]
    digit_and_punct = [t for t in vocab if any(c.isdigit() for c in t) and any(c in "{},.$" for c in t)]
    assert len(multi_digit) > 50 and len(digit_and_punct) > 20
    pieces = [tok.decode([i]) for i in tok("The answer is \\boxed{1,250}.", add_special_tokens=False).input_ids]
    assert any(sum(c.isdigit() for c in p) >= 2 for p in pieces), pieces


@pytest.fixture(scope="session")
def smol_tokenizer():
    return smollm2_tokenizer()
