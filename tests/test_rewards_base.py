"""The TensorReward protocol: custom rewards, weighted sums, names, the literal automaton."""

from __future__ import annotations

import pickle
import random

import pytest
import torch

from tests.test_rewards_math import encode
from tests.test_rewards_tokenizers import merged_digit_tokenizer, smollm2_tokenizer
from trl_async.rewards import (
    FormatReward,
    MathAnswerReward,
    SoftOverlongPunishment,
    TensorReward,
    VocabTables,
    WeightedSum,
    combine,
    pad_right,
    tensor_reward,
)
from trl_async.rewards.literal import find_literal


def test_custom_reward_by_subclass_and_by_decorator(qwen_tokenizer):
    period = qwen_tokenizer(".", add_special_tokens=False).input_ids[0]

    class EndsWithPeriod(TensorReward):
        default_name = "ends_with_period"

        def score(self, completion_ids, completion_mask, **columns):
            keep = self.before_eos(completion_ids, completion_mask)  # (B, L)
            last = keep & (keep.cumsum(1) == keep.sum(1, keepdim=True))  # (B, L) the last kept token
            return ((completion_ids == period) & last).any(1).float()

    @tensor_reward(eos_token_ids=[qwen_tokenizer.eos_token_id])
    def ends_with_period(completion_ids, completion_mask, **columns):
        last = completion_mask & (completion_mask.cumsum(1) == completion_mask.sum(1, keepdim=True))
        return ((completion_ids == period) & last).any(1).float()

    ids = encode(qwen_tokenizer, ["Done.", "Done", "x. y"])
    by_class = EndsWithPeriod(qwen_tokenizer)
    assert by_class(completion_ids=ids) == ends_with_period(completion_ids=ids) == [1.0, 0.0, 0.0]
    assert by_class.__name__ == "ends_with_period" and ends_with_period.__name__ == "ends_with_period"


def test_weighted_sum_and_names(qwen_tokenizer):
    math = MathAnswerReward(qwen_tokenizer)
    fmt = FormatReward(qwen_tokenizer)
    total = combine([math, fmt, SoftOverlongPunishment(8, 4)], weights=[1.0, 0.5, 1.0])
    texts = ["<think>x</think><answer>\\boxed{7}</answer>", "\\boxed{7}", "<think>x</think><answer>8</answer>"]
    ids, mask = pad_right(encode(qwen_tokenizer, texts))
    expected = (
        math.score(ids, mask, answer=["7"] * 3)
        + 0.5 * fmt.score(ids, mask)
        + SoftOverlongPunishment(8, 4).score(ids, mask)
    )
    assert torch.equal(total.score(ids, mask, answer=["7"] * 3), expected)
    assert total.__name__ == "math_answer+format+soft_overlong_punishment"
    assert MathAnswerReward(qwen_tokenizer, name="gsm8k").__name__ == "gsm8k"
    with pytest.raises(ValueError, match="one weight per reward"):
        WeightedSum([math, fmt], [1.0])
    with pytest.raises(TypeError, match="tensor rewards"):
        WeightedSum([math, lambda **kw: [0.0]])


def test_rewards_pickle(qwen_tokenizer):
    reward = MathAnswerReward(qwen_tokenizer)
    clone = pickle.loads(pickle.dumps(reward))
    ids = encode(qwen_tokenizer, ["\\boxed{3}"])
    assert clone(completion_ids=ids, answer=["3"]) == [1.0]


@pytest.mark.parametrize("which", ["qwen", "smollm2", "merged_digits"])
def test_literal_automaton_equals_str_find(which, qwen_tokenizer):
    tokenizer = {
        "qwen": lambda: qwen_tokenizer,
        "smollm2": smollm2_tokenizer,
        "merged_digits": merged_digit_tokenizer,
    }[which]()
    vocab = VocabTables.for_tokenizer(tokenizer)
    rng = random.Random(which)
    pieces = ["\\boxed{", "\\box", "ed{", "{", "}", "####", "##", "#", " ", "\n", "72", "<think>", "</think>", "<",
              "think", ">", "\\", "$", "answer", "</answer>"]  # fmt: skip
    texts = ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 12))) for _ in range(300)]
    rows = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    ids, mask = pad_right(rows)
    tokens = vocab.map_ids(ids, mask)
    for literal in ["\\boxed{", "####", "<think>", "</answer>"]:
        hits = find_literal(tokens, vocab.literal(literal))
        for b, (text, row) in enumerate(zip(texts, rows)):
            starts = [0]
            for i in row:
                starts.append(starts[-1] + len(vocab.texts[i]))
            assert "".join(vocab.texts[i] for i in row) == text
            want = {}
            at = text.find(literal)
            while at >= 0:  # every occurrence, overlapping ones included: token where it ends -> offset after it
                end = at + len(literal)
                token = max(k for k in range(len(row)) if starts[k] < end)
                want[token] = end - starts[token]
                at = text.find(literal, at + 1)
            got_tokens = hits.event[b, : len(row)].nonzero().flatten().tolist()
            assert sorted(want) == got_tokens, (text, literal)
            if want:
                index = torch.tensor(got_tokens)
                batch_hits = find_literal(tokens[b : b + 1].expand(len(index), -1), vocab.literal(literal))
                assert batch_hits.offset_at(index).tolist() == [want[t] for t in got_tokens], (text, literal)


@pytest.mark.parametrize("which", ["qwen", "smollm2"])
def test_one_pass_last_literal_equals_the_automaton_on_any_token_split(which, qwen_tokenizer):
    """`last_literal` (the packed one-pass search the math reward uses) gives what `find_literal` gives after
    masking, on text split into tokens however a sampler might (single characters, odd merges), with EOS tokens,
    holes in the mask and ids outside the vocabulary."""
    from trl_async.rewards.literal import PackedLiteral, last_literal

    tokenizer = qwen_tokenizer if which == "qwen" else smollm2_tokenizer()
    vocab = VocabTables.for_tokenizer(tokenizer)
    eos = tokenizer.eos_token_id
    rng = random.Random(which)
    pieces = ["\\boxed{", "\\", "b", "o", "x", "e", "d", "{", "bo", "xed", "ed{", "boxed", " \\", "$\\", "{\\", "}",
              "####", "##", "#", " #", "72", " ", "\n", "so"]  # fmt: skip

    def split(literal):  # the literal cut at random points (down to one character per token), parts tokenised alone
        cuts = sorted(rng.sample(range(1, len(literal)), rng.randint(1, len(literal) - 1)))
        return [literal[i:j] for i, j in zip([0] + cuts, cuts + [len(literal)])]

    rows = []
    for _ in range(400):
        row = []
        for _ in range(rng.randint(0, 24)):  # each piece tokenised alone: splits the tokenizer would not choose
            parts = split(rng.choice(["\\boxed{", "####"])) if rng.random() < 0.15 else [rng.choice(pieces)]
            for part in parts:
                row += tokenizer(part, add_special_tokens=False).input_ids
            if rng.random() < 0.04:
                row.append(eos)
            if rng.random() < 0.02:
                row.append(rng.choice([-1, len(vocab.texts) + 7]))
        rows.append(row)
    # rows that end inside a literal (padded on the left), each right before a row that starts by finishing it
    # (padded on the right): no match may run from one row into the next
    width = max(len(r) for r in rows) + 8
    filler = tokenizer("\n", add_special_tokens=False).input_ids
    assert len(filler) == 1
    rows = [r + filler * (width - len(r)) for r in rows]
    for head, tail in [("\\box", "ed{"), ("\\", "boxed{"), ("##", "##"), ("\\bo", "x"), ("x", "ed{")]:
        head_ids = tokenizer("so " + head, add_special_tokens=False).input_ids
        tail_ids = tokenizer(tail + "1", add_special_tokens=False).input_ids
        rows += [filler * (width - len(head_ids)) + head_ids, tail_ids + filler * (width - len(tail_ids))]
    ids, mask = pad_right(rows, pad_id=0)
    mask &= torch.rand(mask.shape, generator=torch.Generator().manual_seed(0)) > 0.05  # holes in the mask
    reward = MathAnswerReward(tokenizer)  # for its EOS handling
    keep = reward.before_eos(ids, mask)
    tokens = vocab.map_ids(ids, keep)
    positions = torch.arange(ids.shape[1])
    is_eos = (ids == eos) & mask
    want_first_eos = torch.where(is_eos.any(dim=1), is_eos.int().argmax(dim=1), ids.shape[1])
    for literal in ["\\boxed{", "####"]:
        tables = vocab.literal(literal)
        hits = find_literal(tokens, tables)
        want_last = torch.where(hits.event, positions, -1).amax(dim=1)
        want_offset = hits.offset_at(want_last.clamp(min=0))
        packed = PackedLiteral(tables, vocab.vocab_size, [eos])
        _, first_eos, last, offset = last_literal(ids, mask, packed, tables.max_chain)
        assert torch.equal(last, want_last), literal
        found = want_last >= 0
        assert torch.equal(offset[found], want_offset[found]), literal
        assert torch.equal(first_eos, want_first_eos), literal
        assert 20 < int(found.sum()) < 380, literal  # both outcomes are exercised


def test_every_reward_scores_a_batch_of_empty_completions(qwen_tokenizer):
    """A batch whose completions are all empty (TRL path: empty id lists; tensor path: a (B, 0) batch) scores like
    any other batch instead of failing on an empty dimension."""
    from trl_async.rewards import TargetLengthReward, TokenPatternReward

    rewards = [
        MathAnswerReward(qwen_tokenizer),
        MathAnswerReward(qwen_tokenizer, answer_format="hash"),
        MathAnswerReward(qwen_tokenizer, answer_format="last_number"),
        FormatReward(qwen_tokenizer),
        TokenPatternReward(qwen_tokenizer),
        SoftOverlongPunishment(8, 4),
        TargetLengthReward(5),
    ]
    columns = {"answer": ["1", "2"], "pattern": ["72", "1"]}
    for reward in rewards:
        via_trl = reward(prompts=["p", "q"], completions=["", ""], completion_ids=[[], []], **columns)
        via_tensor = reward.score(torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, 0, dtype=torch.bool), **columns)
        assert via_trl == via_tensor.tolist() and len(via_trl) == 2, reward
        if isinstance(reward, (MathAnswerReward, FormatReward, TokenPatternReward)):
            assert via_trl == [0.0, 0.0], reward


def test_positions_made_while_tracing_are_not_cached():
    """A reward first called on fake tensors (shape checks, tracing) must not leave fake positions in the cache for
    the real calls after it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from trl_async.rewards.positions import Positions

    n = 4099  # a length no other test uses
    with FakeTensorMode():
        Positions.of(n, torch.device("cpu"), torch.int16)
    real = Positions.of(n, torch.device("cpu"), torch.int16)
    assert type(real.at) is torch.Tensor and real.at[-1].item() == n - 1


def test_long_tokens_keep_a_marker_for_their_hidden_characters():
    """A token longer than the table width keeps C - 1 characters and OVERFLOW for the rest (the #### and last-number
    readers then never read it as a short text); short ones are NUL-padded."""
    from trl_async.rewards.vocab_tables import NUL, OVERFLOW, char_code

    tables = VocabTables([" students", "short"], width=8)
    left, right = tables.on("cpu").chars_left, tables.on("cpu").chars_right
    assert left[0].tolist() == [char_code(c) for c in " studen"] + [OVERFLOW]
    assert right[0].tolist() == [OVERFLOW] + [char_code(c) for c in "tudents"]
    assert left[1].tolist() == [char_code(c) for c in "short"] + [NUL] * 3
    assert right[1].tolist() == [NUL] * 3 + [char_code(c) for c in "short"]
