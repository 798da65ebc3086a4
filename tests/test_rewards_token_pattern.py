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


def reference_matches(reward, ids, mask, pattern, eos_id):
    """The rule in plain Python, one sample at a time: the text is the masked ids before the first masked EOS (a
    hole in the mask breaks a match); a pattern form (its ids before the -1 padding) must occur anywhere, or end at
    the last token with a non-whitespace character."""
    nonspace = reward.vocab.on("cpu").nonspace
    out = []
    for row, keep, forms in zip(ids.tolist(), mask.tolist(), pattern.tolist()):
        text = []
        for token, k in zip(row, keep):
            if k and token == eos_id:
                break
            text.append(token if k else None)
        visible = [i for i, t in enumerate(text) if t is not None and 0 <= t < len(nonspace) - 1 and nonspace[t] > 0]
        hit = False
        for form in forms:
            form = form[: form.index(-1)] if -1 in form else form
            starts = [s for s in range(len(text) - len(form) + 1) if form and text[s : s + len(form)] == form]
            if reward.anchor == "end":
                starts = [s for s in starts if visible and s + len(form) - 1 == visible[-1]]
            hit = hit or bool(starts)
        out.append(float(hit))
    return out


@pytest.mark.parametrize("anchor", ["anywhere", "end"])
def test_matching_agrees_with_a_plain_python_reference(qwen_tokenizer, anchor):
    """Random batches over a 6-token alphabet (so patterns do occur), with spaces, EOS, holes in the mask, ids
    outside the vocabulary, and 1-3 pattern forms of 0-5 tokens padded with -1."""
    gen = torch.Generator().manual_seed(0)
    eos = qwen_tokenizer.eos_token_id
    alphabet = torch.tensor(qwen_tokenizer("a b7", add_special_tokens=False).input_ids + [220, eos])  # 220: " "
    reward = TokenPatternReward(qwen_tokenizer, anchor=anchor)
    hits = 0
    for trial in range(40):
        batch, length, forms, width = 16, int(torch.randint(1, 12, (1,), generator=gen)), 1 + trial % 3, 5
        ids = alphabet[torch.randint(0, len(alphabet), (batch, length), generator=gen)]
        ids[torch.rand(batch, length, generator=gen) < 0.03] = -100
        mask = (torch.arange(length) < torch.randint(0, length + 1, (batch, 1), generator=gen)).long()
        mask[torch.rand(batch, length, generator=gen) < 0.05] = 0
        pattern = alphabet[:-1][torch.randint(0, len(alphabet) - 1, (batch, forms, width), generator=gen)]
        sizes = torch.randint(0, width + 1, (batch, forms, 1), generator=gen)
        pattern = torch.where(torch.arange(width) < sizes, pattern, -1)
        got = reward.score(ids, mask, answer=pattern).tolist()
        assert got == reference_matches(reward, ids, mask, pattern, eos), (ids, mask, pattern)
        hits += sum(got)
    assert 20 < hits < 600  # both outcomes are exercised (of 640 samples)


def test_a_spaced_form_ending_with_the_plain_one_is_not_kept(qwen_tokenizer):
    """' 72' tokenises as ' ' + '7' '2': every match of it is a match of '72', so it is dropped (one form to scan);
    ' Paris' is one token unlike 'Paris', so both forms stay."""
    reward = TokenPatternReward(qwen_tokenizer)
    assert reward.variants("72") == [qwen_tokenizer("72", add_special_tokens=False).input_ids]
    assert len(reward.variants("Paris")) == 2
