"""The token-level box reader on vocabularies made from random splits of text: the opener ending inside a token, the
closing brace inside a token at any depth, tokens of any length; against the string specification."""

from __future__ import annotations

import random

import torch

from tests.test_boxed_automaton import contents
from trl_async.rewards import VocabTables, final_answer, native
from trl_async.rewards.boxed_tokens import MAX_DEPTH, BoxedTokenReader
from trl_async.rewards.literal import PackedLiteral, last_literal
from trl_async.rewards.native import LastBoxKernel

PROSE = ["So ", "72 ", "\\boxed{5} ", "{", "}", "$", "x", "\\", "box", "ed", " the answer: ", "\n"]


def split(text: str, rng: random.Random, longest: int) -> list[str]:
    """``text`` cut at random places into pieces of 1 to ``longest`` characters."""
    pieces, i = [], 0
    while i < len(text):
        n = rng.randint(1, longest)
        pieces.append(text[i : i + n])
        i += n
    return pieces


def read_all(texts: list[list[str]], window: int = 24) -> list[float | None]:
    """Tokenise each text (a list of pieces) with a vocabulary made of all the pieces, find the last opener with the
    one-pass automaton, read the box: what MathAnswerReward does, on this vocabulary (with torch ops, and with the
    compiled kernel where a C compiler exists, which must agree)."""
    vocab = sorted({p for pieces in texts for p in pieces})
    index = {p: i for i, p in enumerate(vocab)}
    tables = VocabTables(vocab)
    opener = tables.literal("\\boxed{")
    reader = BoxedTokenReader(tables)
    length = max(len(p) for p in texts)
    ids = torch.zeros((len(texts), length), dtype=torch.long)  # (B, L)
    mask = torch.zeros((len(texts), length), dtype=torch.bool)
    for b, pieces in enumerate(texts):
        ids[b, : len(pieces)] = torch.tensor([index[p] for p in pieces])
        mask[b, : len(pieces)] = True
    packed = PackedLiteral(opener, len(vocab), eos_token_ids=[])
    key, first_eos, last, offset = last_literal(ids, mask, packed, opener.max_chain)
    value, ok = reader.read(key, last.clamp(min=0), offset, first_eos, window)
    found = ok & (last >= 0)
    if native.compiler() is not None:  # the compiled kernel reads the same tables: the same answers
        kernel_value, kernel_found = LastBoxKernel(packed, reader, window).read(ids, mask)
        assert torch.equal(kernel_found, found) and torch.equal(kernel_value, torch.where(found, value, 0.0))
    return [v if k else None for v, k in zip(value.tolist(), found.tolist())]


def test_random_token_splits_read_as_the_specification():
    rng = random.Random(0)
    texts = [rng.choice(PROSE) + "\\boxed{" + c + rng.choice(["", " ", ".", "\\boxed{"]) for c in contents(3000, 1)]
    split_texts = [split(t, rng, longest=rng.choice([3, 8, 20])) for t in texts]
    got = read_all(split_texts, window=80)  # every box here closes within 80 tokens
    want = [final_answer(t) for t in texts]
    mismatches = [(t, g, w) for t, g, w in zip(texts, got, want) if g != w]
    assert not mismatches, mismatches[:5]
    assert 500 < sum(w is not None for w in want) < len(texts) - 500


def test_long_tokens_are_read_whole():
    """Unit words, digit runs and closing braces inside tokens far longer than the character tables' 8 slots."""
    texts = [
        ["\\boxed{", "12", " \\text{ kilometers per hour on the highway}}", " ok"],
        ["\\boxed{1234567890123", "45}"],  # 15 digits in one token
        ["\\boxed{18 \\text{ students and 2 teachers}}"],  # a digit in the unit text, inside one token
        ["The answer is $\\boxed{-3.25}$.", " Done"],  # the whole answer in one token
    ]
    assert read_all(texts) == [12.0, 123456789012345.0, None, -3.25]


def test_closing_brace_depths_and_the_depth_limit():
    inner = MAX_DEPTH - 1
    texts = [
        ["\\boxed{", "{", "72", "}}"],  # the box closes in "}}" entered at depth 1
        ["\\boxed{", "{{", "7", "}}}."],  # entered at depth 2
        ["\\boxed{", "{1", "}7}"],  # entered at depth 1, the content is "{1}7": two numbers, not read
        ["\\boxed{" + "{" * inner, "8", "}" * (inner + 1)],  # the deepest nesting read
        ["\\boxed{" + "{" * (inner + 1), "9", "}" * (inner + 2)],  # one deeper: not read (documented)
    ]
    assert final_answer("".join(texts[-1])) == 9.0
    assert read_all(texts) == [72.0, 7.0, None, 8.0, None]


def test_a_box_that_does_not_close_within_the_window_is_not_read():
    texts = [["\\boxed{", *"1234", "}"]]
    assert read_all(texts, window=6) == [1234.0]  # the opener's token, 4 digits, "}": 6 tokens
    assert read_all(texts, window=5) == [None]
