"""The box-content automaton against the string specification, on character codes (no tokenizer in between)."""

from __future__ import annotations

import random

import pytest
import torch

from trl_async.rewards import final_answer
from trl_async.rewards.boxed_automaton import CLASSES, BoxedAutomaton, boxed_automaton
from trl_async.rewards.vocab_tables import HIDDEN_TEXT, NUL, OVERFLOW, char_code

WIDTH = 64

PIECES = [
    "72", "-3", "+4", "1,000", "1,0000", "12,345.67", "0.5", ".5", "5.", "007", "1,23", "9" * 19, ",", ".", "-", "+",
    " ", "\n", "$", "%", "{", "}", "\\$", "\\%", "\\,", "\\;", "\\!", "\\:", "\\ ", "\\\\", "\\{", ";", "!",
    "x", "X", "y", "=", " = ", "x = ", "é", "*", "(", "\\text{", "\\textrm{", "\\textbf{", "\\mbox{", "\\mathrm{",
    "\\textit{", "\\tex", "\\frac{1}{2}", "\\m", " dollars", "abc", "{,}", "1{,}000", "{,", "{", "{}",
    "^", "^\\circ", "^{\\circ}", "^2", "^{\\cir", "\\circ", "^\\text{",
]  # fmt: skip
AFTER = ["}", "}.", " }", "}$", "}}", "} 73", "", "} \\, 9"]  # the reward finds the last opener itself


def codes_of(texts: list[str]) -> torch.Tensor:
    rows = [[char_code(c) for c in t][:WIDTH] for t in texts]
    return torch.tensor([r + [NUL] * (WIDTH - len(r)) for r in rows], dtype=torch.int8)  # (B, N)


def contents(n: int, seed: int) -> list[str]:
    """Half well-formed answers (prefix, sign, number, spacing, unit), each piece sometimes replaced by a random one,
    half random pieces; then what follows the box."""
    rng = random.Random(seed)
    parts = [
        ["", "x = ", "X=", "\\$", " ", "{"],
        ["", "-", "+", "- ", "-\\$"],
        ["72", "1,000", "12,345.67", "0.5", ".5", "007", "1234567.25", "3", "1,000,000", "1{,}000", "1{,}234.5"],
        ["", " ", "\\,", "\\%", "%", "$", "}", "\\;"],
        ["", "\\text{ dollars}", "\\textrm{kg}", "\\mbox{m}", "\\mathrm{cm}", "\\textbf{ apples}", "^\\circ", "^{\\circ}F"],
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
    value, ok = boxed_automaton().read(codes_of(texts))
    got = [v if k else None for v, k in zip(value.tolist(), ok.tolist())]
    want = [final_answer("\\boxed{" + t) for t in texts]
    mismatches = [(t, g, w) for t, g, w in zip(texts, got, want) if g != w]
    assert not mismatches, mismatches[:5]
    assert 1000 < sum(w is not None for w in want) < len(texts) - 1000  # both outcomes, often


@pytest.mark.parametrize("where", ["sign", "number", "after", "unit"])
def test_an_overflowing_token_inside_the_box_is_never_read(where):
    """OVERFLOW stands for characters of a long token the tables do not keep: they could be digits."""
    text = {"sign": "-@72}", "number": "72@}", "after": "72 \\,@}", "unit": "72 \\text{ @}}"}[where]
    codes = codes_of([text.replace("@", " ")])
    codes[0, text.index("@")] = OVERFLOW
    assert final_answer("\\boxed{" + text.replace("@", " ")) is not None
    assert not boxed_automaton().read(codes)[1].item()


@pytest.mark.parametrize("where", ["sign", "number", "after", "unit"])
def test_hidden_text_is_read_only_as_unit_text(where):
    """HIDDEN_TEXT stands for hidden characters that hold no digit and no brace (a long unit word): unit text may
    hold them; anywhere else they are not a number's part, so the box is not read (as for OVERFLOW)."""
    text = {"sign": "-@72}", "number": "72@}", "after": "72 \\,@}", "unit": "72 \\text{ @}}"}[where]
    codes = codes_of([text.replace("@", " ")])
    codes[0, text.index("@")] = HIDDEN_TEXT
    value, ok = boxed_automaton().read(codes)
    assert ok.item() == (where == "unit")
    assert value.item() == 72.0 or where != "unit"


def test_overflow_after_the_closing_brace_is_ignored():
    codes = codes_of(["72} @"])
    codes[0, 4] = OVERFLOW
    value, ok = boxed_automaton().read(codes)
    assert ok.item() and value.item() == 72.0


def test_the_monoid_is_closed_associative_and_small():
    automaton = BoxedAutomaton()
    f = automaton.n_functions
    compose = automaton.compose.view(f, f).long()
    gen = torch.Generator().manual_seed(0)
    a, b, c = (torch.randint(0, f, (5000,), generator=gen) for _ in range(3))
    assert torch.equal(compose[compose[a, b], c], compose[a, compose[b, c]])
    identity = torch.arange(f)
    assert torch.equal(compose[automaton.identity], identity) and torch.equal(compose[:, automaton.identity], identity)
    assert f < 2000 and automaton.n_classes == len(CLASSES)  # the composition table stays a few MB
