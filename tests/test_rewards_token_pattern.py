"""TokenPatternReward: per-sample patterns of different lengths, vectorised, anchored."""

from __future__ import annotations

import pytest
import torch

from tests.test_rewards_math import assert_vectorised, both_paths, encode
from tests.test_rewards_tokenizers import merged_digit_tokenizer, smollm2_tokenizer
from trl_async.rewards import TokenPatternReward, pad_right


@pytest.fixture(params=["qwen", "smollm2"])
def tokenizer(request, qwen_tokenizer):
    return qwen_tokenizer if request.param == "qwen" else smollm2_tokenizer()


def test_anchor_end_span_and_anywhere(tokenizer):
    texts = [
        "so the answer is 72",
        "72 is mentioned first, then the answer is 5",
        "<answer>1234</answer> and 99 after",
        "the final answer is 72 \n",
        "nothing",
    ]
    answers = ["72", "72", "1234", "72", "72"]
    end = TokenPatternReward(tokenizer, anchor="end")
    span = TokenPatternReward(tokenizer, anchor="span")
    anywhere = TokenPatternReward(tokenizer, anchor="anywhere")
    assert both_paths(end, tokenizer, texts, answer=answers) == [1.0, 0.0, 0.0, 1.0, 0.0]
    assert both_paths(span, tokenizer, texts, answer=answers) == [0.0, 0.0, 1.0, 0.0, 0.0]
    assert both_paths(anywhere, tokenizer, texts, answer=answers) == [1.0, 1.0, 1.0, 1.0, 0.0]  # the seed's rule


def test_token_spelling_limit_with_merging_tokenizers():
    """A token pattern is a token spelling: where a tokenizer merges the answer with its neighbours ('er>1' '2'
    '34</'), the spelling differs and nothing matches. That is why numeric answers use MathAnswerReward."""
    tokenizer = merged_digit_tokenizer()
    reward = TokenPatternReward(tokenizer, anchor="anywhere")
    assert both_paths(reward, tokenizer, ["<answer>1234</answer>"], answer=["1234"]) == [0.0]


def test_patterns_of_different_lengths_and_tensor_patterns(qwen_tokenizer):
    reward = TokenPatternReward(qwen_tokenizer, anchor="anywhere", leading_space_variant=False)
    texts = ["a 7 b", "x 1234567 y", "q"]
    ids, mask = pad_right(encode(qwen_tokenizer, texts))
    from_strings = reward.score(ids, mask, answer=["7", "1234567", "q r"])
    pattern = torch.full((3, 7), -1, dtype=torch.long)
    for b, p in enumerate(["7", "1234567", "q r"]):
        tokens = qwen_tokenizer(p, add_special_tokens=False).input_ids
        pattern[b, : len(tokens)] = torch.tensor(tokens)
    from_tensor = reward.score(ids, mask, answer=pattern)
    assert from_strings.tolist() == from_tensor.tolist() == [1.0, 1.0, 0.0]


def test_nothing_after_eos_counts(qwen_tokenizer):
    reward = TokenPatternReward(qwen_tokenizer, anchor="anywhere")
    before = qwen_tokenizer("no", add_special_tokens=False).input_ids
    after = qwen_tokenizer(" 72", add_special_tokens=False).input_ids
    ids = torch.tensor([before + [qwen_tokenizer.eos_token_id] + after])
    assert reward.score(ids, torch.ones_like(ids), answer=["72"]).tolist() == [0.0]


def test_score_is_vectorised_no_host_sync(qwen_tokenizer):
    ids, mask = pad_right(encode(qwen_tokenizer, ["so 72", "<answer>72</answer>"]))
    for anchor in ["end", "span", "anywhere"]:
        reward = TokenPatternReward(qwen_tokenizer, anchor=anchor)
        pattern = reward.pattern_tensor(["72", "72"], ids.device)  # tensorised once, outside the traced call
        assert_vectorised(reward.score, ids, mask, answer=pattern)


def test_patterns_are_tokenised_once_per_string(qwen_tokenizer):
    reward = TokenPatternReward(qwen_tokenizer)
    calls = []
    original = reward.tokenizer

    class Counting:
        def __call__(self, text, **kwargs):
            calls.append(text)
            return original(text, **kwargs)

    reward.tokenizer = Counting()
    ids, mask = pad_right(encode(qwen_tokenizer, ["a", "b", "c", "d"]))
    reward.score(ids, mask, answer=["72", "72", "8", "72"])
    reward.score(ids, mask, answer=["8", "72", "8", "8"])
    assert sorted(calls) == sorted(["72", " 72", "8", " 8"])
