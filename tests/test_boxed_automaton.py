"""The box-content grammar against the string specification, on a vocabulary of single characters: one token per
character, so tokenisation plays no part (the real tokenizers are in test_rewards_math / test_rewards_agreement)."""

from __future__ import annotations

import functools
import random

import torch

from trl_async.rewards import VocabTables, final_answer
from trl_async.rewards.boxed_automaton import CLASSES, BoxedAutomaton, _step
from trl_async.rewards.boxed_tokens import BoxedTokenReader

WIDTH = 64

PIECES = [
    "72", "-3", "+4", "1,000", "1,0000", "12,345.67", "0.5", ".5", "5.", "007", "1,23", "9" * 19, ",", ".", "-", "+",
    " ", "\n", "$", "%", "{", "}", "\\$", "\\%", "\\,", "\\;", "\\!", "\\:", "\\ ", "\\\\", "\\{", ";", "!",
    "x", "X", "y", "=", " = ", "x = ", "é", "*", "(", "\\text{", "\\textrm{", "\\textbf{", "\\mbox{", "\\mathrm{",
    "\\textit{", "\\tex", "\\frac{1}{2}", "\\m", " dollars", "abc", "{,}", "1{,}000", "{,", "{", "{}",
    "^", "^\\circ", "^{\\circ}", "^2", "^{\\cir", "\\circ", "^\\text{", "^3", "^{2}", "^{3}", "^{2", "^4", "^{",
]  # fmt: skip
AFTER = ["}", "}.", " }", "}$", "}}", "} 73", "", "} \\, 9"]  # the reward finds the last opener itself


CHARACTERS = [chr(c) for c in range(32, 127)] + ["\n", "é"]  # the vocabulary: one token per character


@functools.lru_cache(maxsize=1)
def character_reader() -> BoxedTokenReader:
    return BoxedTokenReader(VocabTables(CHARACTERS))


def read(contents: list[str]) -> list[float | None]:
    """What the reader reads from ``\\boxed{`` + each content, one character per token."""
    opener = CHARACTERS.index("{") + 1  # the opener's last token (key = token id + 1; 0 is null)
    rows = [[opener] + [CHARACTERS.index(c) + 1 for c in text] for text in contents]
    keys = torch.zeros((len(rows), max(map(len, rows))), dtype=torch.int32)  # (B, L)
    for b, row in enumerate(rows):
        keys[b, : len(row)] = torch.tensor(row)
    zero, one, end = (torch.full((len(rows),), v) for v in (0, 1, keys.shape[1]))
    value, ok = character_reader().read(keys, start=zero, offset=one, end=end, window=keys.shape[1])
    return [v if k else None for v, k in zip(value.tolist(), ok.tolist())]


def contents(n: int, seed: int) -> list[str]:
    """Half well-formed answers (prefix, sign, number, spacing, unit), each piece sometimes replaced by a random one,
    half random pieces; then what follows the box."""
    rng = random.Random(seed)
    parts = [
        ["", "x = ", "X=", "\\$", " ", "{"],
        ["", "-", "+", "- ", "-\\$"],
        ["72", "1,000", "12,345.67", "0.5", ".5", "007", "1234567.25", "3", "1,000,000", "1{,}000", "1{,}234.5"],
        ["", " ", "\\,", "\\%", "%", "$", "}", "\\;"],
        ["", "\\text{ dollars}", "\\textrm{kg}", "\\mbox{m}", "\\mathrm{cm}", "\\textbf{ apples}", "^\\circ", "^{\\circ}F", "\\text{ cm}^2", "\\mathrm{m}^{3}"],
    ]  # fmt: skip
    texts = []
    for _ in range(n):
        if rng.random() < 0.5:
            content = "".join(rng.choice(PIECES) if rng.random() < 0.12 else rng.choice(p) for p in parts)
        else:
            content = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 5)))
        texts.append(content + rng.choice(AFTER))
    return texts


def test_reads_what_the_string_specification_reads():
    texts = [t for t in contents(6000, 0) if len(t) <= WIDTH]
    texts += ["72}", "- \\$5}", "x = 72}", "x=-1,234.5}", "{{72}}}", "72 \\text{ dollars}}", "72\\textrm{kg}}",
              "50\\%}", ".5}", "\\$1,000}", "x = y = 72}", "72 \\text{ or 73}}", "7 2}", "72", "}", "\\,72\\;}"]  # fmt: skip
    got = read(texts)
    want = [final_answer("\\boxed{" + t) for t in texts]
    mismatches = [(t, g, w) for t, g, w in zip(texts, got, want) if g != w]
    assert not mismatches, mismatches[:5]
    assert 1000 < sum(w is not None for w in want) < len(texts) - 1000  # both outcomes, often


def test_a_window_that_ends_before_the_closing_brace_is_not_read():
    assert read(["72"]) == [None]  # the box does not close in the text read
    assert read(["72} 5"]) == [72.0]  # what follows the closing brace is not read


def test_the_monoid_composes_the_functions_and_is_associative_and_small():
    automaton = BoxedAutomaton()
    f = automaton.n_functions
    compose = automaton.compose.view(f, f).long()
    gen = torch.Generator().manual_seed(0)
    a, b, c = (torch.randint(0, f, (5000,), generator=gen) for _ in range(3))
    assert torch.equal(compose[compose[a, b], c], compose[a, compose[b, c]])
    identity = torch.arange(f)
    assert torch.equal(compose[automaton.identity], identity) and torch.equal(compose[:, automaton.identity], identity)
    assert f < 2000 and automaton.n_classes == len(CLASSES)  # the composition table stays under 16 MB
    # compose[a, b] is the function "a, then b" (states s -> b[a[s]]), and each generator is its class's step
    functions = automaton.functions.long()  # (F, S)
    assert torch.equal(functions[compose[a, b]], functions[b].gather(1, functions[a]))
    states = automaton.states
    steps = [[states.index(_step(state, name)) for state in states] for name in CLASSES]  # (K, S) one character
    assert functions[automaton.generator.long()].tolist() == steps
