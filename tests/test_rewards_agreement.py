"""Agreement of MathAnswerReward (tensor path, on token ids) with string references, on >= 5,000 completions.

References: math-verify for ``\\boxed{}`` answers (applied from the last ``\\boxed{``: "the final answer", the
policy this reward documents) and a GSM8K-style regex for ``#### N``. Completions are generated from categories
(correct, wrong, malformed, multiple boxed, negative, decimal, comma-separated, text after the answer, truncated,
gaming) and tokenised with the real Qwen2.5 tokenizer and with SmolLM2's. The test prints every disagreement it
allows, grouped by the documented reason, and fails on any disagreement without a documented reason.
"""

from __future__ import annotations

import collections
import random
import re
from dataclasses import dataclass

import pytest
import torch

from tests.test_rewards_tokenizers import smollm2_tokenizer
from trl_async.rewards import MathAnswerReward, pad_right

N_CASES = 5200
CATEGORIES = [
    "correct", "wrong", "malformed", "multiple_boxed", "negative", "decimal", "comma", "text_after", "truncated",
    "gaming",
]  # fmt: skip


@dataclass
class Case:
    text: str
    target: object
    category: str


def _value(rng: random.Random, category: str) -> float | int:
    if category == "negative":
        return -rng.choice([rng.randint(1, 500), round(rng.uniform(0.1, 99), rng.choice([1, 2]))])
    if category == "decimal":
        return round(rng.uniform(0, 500), rng.choice([1, 2]))
    if category == "comma":
        return rng.choice([rng.randint(1000, 99999), rng.randint(100000, 9999999), round(rng.uniform(1000, 9e5), 2)])
    return rng.choice([rng.randint(0, 200), rng.randint(0, 5000), round(rng.uniform(0, 100), 1)])


def _show(rng: random.Random, value) -> str:
    """How a model writes a number inside the box."""
    text = f"{value:,}" if abs(value) >= 1000 and rng.random() < 0.7 else str(value)
    if "," in text and rng.random() < 0.3:
        text = text.replace(",", "{,}")  # LaTeX's thousands separator, as MATH writes it
    style = rng.random()
    if style < 0.12:
        return "\\$" + text if value >= 0 else "-\\$" + text[1:]
    if style < 0.18:
        return f" {text} "
    if style < 0.24:
        units = ["\\text{ dollars}", " \\text{ apples}", "\\ \\text{hours}", "\\mbox{ km}", " \\text{ students}"]
        units += ["\\text{ kilometers}", " \\text{ cupcakes}"]  # unit words longer than 8 characters, one token each
        units += [" \\text{ cm}^2", "\\,\\mathrm{m}^{3}", "^\\circ", "^{\\circ}"]  # squares, cubes, degrees
        return text + rng.choice(units)
    if style < 0.245:  # 0.5% of answers: math-verify reads a decimal or negative x% as x / 100 (documented)
        return text + rng.choice(["\\%", "%"])
    return text


def _target(rng: random.Random, value):
    """How the dataset column holds the answer."""
    text = f"{value:,}" if abs(value) >= 1000 and rng.random() < 0.3 else str(value)
    return rng.choice([text, value, f"She has 3 + 4 = 7 of them.\nSo the total is {text}.\n#### {text}"])


def _prose(rng: random.Random, mention=None) -> str:
    numbers = [rng.randint(1, 90) for _ in range(4)]
    sentences = [
        f"First, {numbers[0]} + {numbers[1]} = {numbers[0] + numbers[1]}.",
        f"Each box holds {numbers[2]} apples, so {numbers[2]} * {numbers[3]} = {numbers[2] * numbers[3]}.",
        "Let's think step by step.",
        f"She spends ${numbers[1]} on food and has {numbers[3]} left.",
        "Now we subtract what was used.",
    ]
    rng.shuffle(sentences)
    text = " ".join(sentences[: rng.randint(1, 5)])
    if mention is not None:
        text += f" Note that {mention} is mentioned here, and {mention} again."
    return text


FINAL = [
    "The answer is \\boxed{{{}}}.",
    "Therefore, the final answer is $\\boxed{{{}}}$.",
    "\\[\n\\boxed{{{}}}\n\\]",
    "**Final Answer**\n\\[ \\boxed{{{}}} \\]",
    "So the total is \\(\\boxed{{{}}}\\).",
    "\\boxed{{{}}}",
]
MALFORMED = [
    "\\boxed{{{}",  # unclosed
    "\\boxed{{}}",  # empty
    "boxed{{{}}}",  # no backslash
    "\\boxed {{{}}}",  # space before the brace (math-verify does not read it either)
    "\\fbox{{{}}}",
    "\\boxed{{{} dollars}}",  # a bare word: not a number
    "\\boxed{{{}, 3}}",  # two numbers
    "\\boxed{{{}.}}",  # trailing dot
    "\\boxed{{x = {}}}",  # an equation: both read the right-hand side
    "\\boxed{{{{{}}}}}",  # doubled braces
    "\\boxed{{{}}} \\boxed{{",  # the last box is unclosed
    "\\boxed{{1,{}0}}",  # commas out of place
]


def make_corpus(n: int, seed: int = 0) -> list[Case]:
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        category = CATEGORIES[i % len(CATEGORIES)]
        value = _value(rng, category)
        target = _target(rng, value)
        wrong = value + rng.choice([1, -1, 2, 10, -10]) if rng.random() < 0.8 else round(value * 1.5, 1)
        boxed = value if category != "wrong" else wrong
        final = rng.choice(FINAL).format(_show(rng, boxed))
        text = _prose(rng) + "\n" + final
        if category == "malformed":
            text = _prose(rng) + "\n" + rng.choice(MALFORMED).format(value)
        elif category == "multiple_boxed":
            first, last = rng.sample([value, value, wrong], 2)
            text = _prose(rng) + f" Maybe \\boxed{{{first}}}?\n" + rng.choice(FINAL).format(_show(rng, last))
        elif category == "text_after":
            text += rng.choice([f"\n\nI hope this helps! {wrong} is wrong.", " (Check: 7 + 8 = 15.)", "\n#### 3"])
        elif category == "gaming":
            text = _prose(rng, mention=value) + "\n" + rng.choice(FINAL).format(_show(rng, wrong))
        cases.append(Case(text, target, category))
    return cases


def make_hash_corpus(n: int, seed: int = 1) -> list[Case]:
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        category = CATEGORIES[i % len(CATEGORIES)]
        value = _value(rng, category)
        wrong = value + rng.choice([1, -1, 3])
        shown = f"{value:,}" if abs(value) >= 1000 and rng.random() < 0.5 else str(value)
        line = rng.choice(["#### {}", "####{}", "#### ${}", "#### {}.", "#### {} apples"])
        text = _prose(rng) + "\n" + line.format(shown if category != "wrong" else wrong)
        if category == "malformed":
            text = (
                _prose(rng)
                + "\n"
                + rng.choice(["### {}", "#### The answer is {}", "####", "# # # # {}"]).format(shown)
            )
        elif category == "multiple_boxed":
            text = _prose(rng) + f"\n#### {wrong}\nWait.\n#### {shown}"
        elif category == "text_after":
            text += rng.choice(["\nDone.", f"\nNot {wrong}.", " because 2 + 2 = 4"])
        elif category == "gaming":
            text = _prose(rng, mention=shown) + f"\n#### {wrong}"
        cases.append(Case(text, _target(rng, value), category))
    return cases


def make_notation_corpus(n: int, seed: int = 2) -> list[Case]:
    """Correct answers in notations this reward does not read (documented): fractions, a number inside \\text{}."""
    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        p, q = rng.choice([(1, 2), (3, 4), (1, 4), (2, 5), (7, 8), (9, 2)])
        kind = rng.choice(["frac", "dfrac", "text"])
        if kind == "text":
            value = rng.randint(1, 500)
            box = f"\\text{{{value}}}"
        else:
            value = p / q
            box = f"\\{kind}{{{p}}}{{{q}}}"
        cases.append(Case(_prose(rng) + f"\nThe answer is \\boxed{{{box}}}.", str(value), "notation"))
    return cases


# ---- references ---------------------------------------------------------------------------------------------------


def gold_string(target) -> str:
    text = str(target)
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    return text.strip().replace(",", "")


class MathVerifyReference:
    """math-verify on the text from the last ``\\boxed{`` (0 when there is none), cached per (text, target)."""

    def __init__(self):
        from math_verify import LatexExtractionConfig, parse, verify

        self.parse, self.verify = parse, verify
        self.config = [LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False)]
        self.cache: dict = {}

    def __call__(self, text: str, target) -> float:
        key = (text, str(target))
        if key not in self.cache:
            start = text.rfind("\\boxed{")
            if start < 0:
                self.cache[key] = 0.0
            else:
                pred = self.parse(text[start:], extraction_config=self.config, parsing_timeout=None)
                gold = self.parse(gold_string(target), parsing_timeout=None)
                self.cache[key] = float(bool(pred) and self.verify(gold, pred, timeout_seconds=None))
        return self.cache[key]


_HASH = re.compile(r"####\s*\$?\s*(-?)\s*\$?\s*([0-9][0-9,]*(?:\.[0-9]+)?)")


def hash_reference(text: str, target) -> float:
    """GSM8K's convention: the number after the last ``####`` (commas dropped), compared as a float."""
    start = text.rfind("####")
    match = _HASH.match(text, start) if start >= 0 else None
    if not match:
        return 0.0
    return float(float(match.group(1) + match.group(2).replace(",", "")) == float(gold_string(target)))


def reason(text: str) -> str | None:
    """Why this reward may read a completion differently from math-verify (documented in MathAnswerReward)."""
    last = text[text.rfind("\\boxed{") :]
    if re.search(r"[0-9]\\?%", last):
        return "a percent sign: this reward ignores it (50% pays 50); math-verify pays 50% for 50 but not 2.5% for 2.5"
    if "frac{" in last:  # \\frac, \\dfrac
        return "a fraction: math-verify evaluates it, this reward reads plain numbers only"
    if re.match(r"\\boxed\{\\text\{", last):
        return "the number inside \\text{}: math-verify reads it, this reward reads a number then optional units"
    if re.search(r"[0-9](?:,|\{,\})[0-9]{3}.*\^", last):
        return "a thousands comma, then a unit with '^': math-verify does not read `1,268\\,\\mathrm{m}^{3}` as 1268"
    if re.match(r"\\boxed\{-?0(?:\.0+)? [a-z]+\}", last):
        return (
            "zero and a bare word: math-verify reads `0 dollars` as the product 0 * dollars = 0, this reward no number"
        )
    return None


# ---- the measurement ----------------------------------------------------------------------------------------------


def _tokenise(tokenizer, cases, rng):
    """Completion ids; truncated cases are cut at a random token (no EOS), like max_completion_length does."""
    rows, texts = [], []
    for case in cases:
        ids = tokenizer(case.text, add_special_tokens=False).input_ids
        if case.category == "truncated":
            ids = ids[: rng.randint(max(1, len(ids) - 12), len(ids))]
        else:
            ids = ids + [tokenizer.eos_token_id]
        rows.append(ids)
        texts.append(tokenizer.decode([i for i in ids if i != tokenizer.eos_token_id]))
    return rows, texts


def measure(tokenizer, cases, reference, answer_format):
    rows, texts = _tokenise(tokenizer, cases, random.Random(7))
    ids, mask = pad_right(rows, pad_id=tokenizer.pad_token_id)
    reward = MathAnswerReward(tokenizer, answer_format=answer_format)
    ours = reward.score(ids, mask, answer=[c.target for c in cases]).tolist()
    if reward.kernel is not None:  # the compiled kernel scored: torch ops must score the same
        torch_ops = MathAnswerReward(tokenizer, answer_format=answer_format, cpu_kernel=False)
        assert torch_ops.score(ids, mask, answer=[c.target for c in cases]).tolist() == ours
    theirs = [reference(t, c.target) for t, c in zip(texts, cases)]
    disagreements = [(t, c, o, r) for t, c, o, r in zip(texts, cases, ours, theirs) if o != r]
    return ours, theirs, disagreements


def report(name, cases, ours, disagreements, explain):
    agreement = 1 - len(disagreements) / len(cases)
    by_reason = collections.defaultdict(list)
    for text, case, o, r in disagreements:
        by_reason[explain(text)].append((text, case, o, r))
    print(f"\n[{name}] {len(cases)} completions, agreement {agreement:.2%}, ours paid {sum(ours):.0f}")
    for why, items in by_reason.items():
        print(f"  {len(items)} allowed disagreement(s) -- {why}:")
        for text, case, o, r in items[:3]:
            print(f"    ours={o} reference={r} target={case.target!r} ...{text[-60:]!r}")
    return agreement, by_reason


@pytest.fixture(scope="module")
def mv_reference():
    pytest.importorskip("math_verify")
    return MathVerifyReference()


@pytest.mark.parametrize("which", ["qwen", "smollm2"])
def test_boxed_agrees_with_math_verify(which, qwen_tokenizer, mv_reference):
    tokenizer = qwen_tokenizer if which == "qwen" else smollm2_tokenizer()
    cases = make_corpus(N_CASES)
    ours, theirs, disagreements = measure(tokenizer, cases, mv_reference, "boxed")
    agreement, by_reason = report(f"boxed vs math-verify, {which}", cases, ours, disagreements, reason)
    assert None not in by_reason, by_reason.get(None, [])[:5]  # every disagreement has a documented reason
    assert agreement >= 0.995
    assert 0.15 < sum(ours) / len(ours) < 0.7  # the corpus pays and withholds


@pytest.mark.parametrize("which", ["qwen", "smollm2"])
def test_hash_agrees_with_gsm8k_regex(which, qwen_tokenizer):
    tokenizer = qwen_tokenizer if which == "qwen" else smollm2_tokenizer()
    cases = make_hash_corpus(N_CASES)
    ours, theirs, disagreements = measure(tokenizer, cases, hash_reference, "hash")
    agreement, by_reason = report(f"#### vs regex, {which}", cases, ours, disagreements, lambda text: None)
    assert agreement >= 0.995
    assert 0.15 < sum(ours) / len(ours) < 0.7


def test_notation_disagreements_are_the_documented_ones(qwen_tokenizer, mv_reference):
    cases = make_notation_corpus(300)
    ours, theirs, disagreements = measure(qwen_tokenizer, cases, mv_reference, "boxed")
    agreement, by_reason = report(
        "notation (not read by design) vs math-verify, qwen", cases, ours, disagreements, reason
    )
    assert sum(ours) == 0 and sum(theirs) == len(cases)  # math-verify reads them all, this reward none
    assert None not in by_reason


def test_corpus_covers_every_category():
    cases = make_corpus(N_CASES)
    counts = collections.Counter(c.category for c in cases)
    assert set(counts) == set(CATEGORIES) and min(counts.values()) >= 500
    assert len(cases) >= 5000 and torch.tensor([1]).sum() == 1
