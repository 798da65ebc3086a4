"""FormatReward: the tag shape on token ids, however the tags tokenise next to whitespace."""

from __future__ import annotations

import random

import pytest

from tests.test_rewards_math import assert_vectorised, both_paths, encode
from tests.test_rewards_tokenizers import merged_digit_tokenizer, smollm2_tokenizer
from trl_async.rewards import FormatReward, format_matches, pad_right


@pytest.fixture(params=["qwen", "smollm2", "merged_digits"])
def tokenizer(request, qwen_tokenizer):
    return {"qwen": lambda: qwen_tokenizer, "smollm2": smollm2_tokenizer, "merged_digits": merged_digit_tokenizer}[
        request.param
    ]()


CASES = [
    ("<think>\nsome reasoning\n</think>\n<answer>\n72\n</answer>", 1.0),
    ("<think>a</think><answer>b</answer>", 1.0),
    ("  <think> a </think>\n\n<answer> b </answer>\n", 1.0),
    ("<think></think><answer></answer>", 1.0),
    ("<think>a</think> <answer>b</answer> trailing text", 0.0),
    ("preamble <think>a</think><answer>b</answer>", 0.0),
    ("<think>a</think> between <answer>b</answer>", 0.0),
    ("<answer>b</answer><think>a</think>", 0.0),
    ("<think>a<think>b</think><answer>c</answer>", 0.0),
    ("<think>a</think><answer>b</answer><answer>c</answer>", 0.0),
    ("<think>a</think><answer>b", 0.0),
    ("<think>a</think>", 0.0),
    ("no tags at all", 0.0),
]


@pytest.mark.parametrize("text,expected", CASES)
def test_format_cases_both_paths(tokenizer, text, expected):
    assert format_matches(text) == bool(expected)
    assert both_paths(FormatReward(tokenizer), tokenizer, [text]) == [expected]


def test_custom_tags_and_opening_in_prompt(qwen_tokenizer):
    reward = FormatReward(qwen_tokenizer, tags=[("<reasoning>", "</reasoning>")])
    assert both_paths(reward, qwen_tokenizer, ["<reasoning>x</reasoning>", "<think>x</think>"]) == [1.0, 0.0]
    prefilled = FormatReward(qwen_tokenizer, opening_in_prompt=True)
    texts = ["reasoning\n</think>\n<answer>7</answer>", "<think>r</think><answer>7</answer>"]
    assert both_paths(prefilled, qwen_tokenizer, texts) == [1.0, 0.0]
    assert [format_matches(t, opening_in_prompt=True) for t in texts] == [True, False]
    with pytest.raises(ValueError, match="distinct"):
        FormatReward(qwen_tokenizer, tags=[("<a>", "<a>")])


def test_tensor_path_equals_string_specification_on_fuzzed_text(tokenizer):
    rng = random.Random(0)
    pieces = ["<think>", "</think>", "<answer>", "</answer>", " ", "\n", "\n\n", "x", "72", "<", ">", "think", "/"]
    texts = ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 9))) for _ in range(1500)]
    shaped = [f"{rng.choice(['', ' ', chr(10)])}<think>{rng.choice(pieces)}</think>{rng.choice(['', ' ', chr(10)])}"
              f"<answer>{rng.choice(pieces)}</answer>{rng.choice(['', chr(10), ' x'])}" for _ in range(500)]  # fmt: skip
    texts += shaped
    ids, mask = pad_right(encode(tokenizer, texts))
    got = FormatReward(tokenizer).score(ids, mask).tolist()
    want = [float(format_matches(t)) for t in texts]
    mismatches = [(t, g, w) for t, g, w in zip(texts, got, want) if g != w]
    assert not mismatches, mismatches[:5]
    assert 100 < sum(want) < len(texts) - 100


def test_format_is_vectorised_no_host_sync(qwen_tokenizer):
    ids, mask = pad_right(encode(qwen_tokenizer, ["<think>a</think><answer>b</answer>", "x"]))
    assert assert_vectorised(FormatReward(qwen_tokenizer).score, ids, mask).tolist() == [1.0, 0.0]
