"""MathAnswerReward on hand-written completions, through both paths, on three different tokenizers."""

from __future__ import annotations

import random

import pytest
import torch

from tests.test_rewards_tokenizers import merged_digit_tokenizer, smollm2_tokenizer
from trl_async.rewards import MathAnswerReward, final_answer, native, pad_right, target_value

TOKENIZERS = ["qwen", "smollm2", "merged_digits"]


@pytest.fixture(params=TOKENIZERS)
def tokenizer(request, qwen_tokenizer):
    return {"qwen": lambda: qwen_tokenizer, "smollm2": smollm2_tokenizer, "merged_digits": merged_digit_tokenizer}[
        request.param
    ]()


@pytest.fixture(params=["compiled", "torch_ops"])
def cpu_kernel(request):
    """The boxed read on CPU: through the compiled kernel (the default where a C compiler exists) or torch ops."""
    if request.param == "compiled" and native.compiler() is None:
        pytest.skip("no C compiler on this machine ($CC / cc): the kernel cannot be built (CI has gcc)")
    return request.param == "compiled"


def encode(tokenizer, texts, eos=True):
    """Completion ids as TRL hands them to reward functions: EOS appended when the completion finished."""
    return [
        tokenizer(t, add_special_tokens=False).input_ids + ([tokenizer.eos_token_id] if eos else []) for t in texts
    ]


def both_paths(reward, tokenizer, texts, **columns):
    """Run the TRL signature and the tensor path; assert they agree and return the rewards."""
    ids = encode(tokenizer, texts)
    via_trl = reward(prompts=["p"] * len(texts), completions=texts, completion_ids=ids, **columns)
    padded, mask = pad_right(ids, pad_id=tokenizer.pad_token_id)
    via_tensor = reward.score(padded, mask, **columns)
    assert via_tensor.shape == (len(texts),) and via_tensor.dtype == torch.float32
    assert via_trl == via_tensor.tolist()
    return via_trl


BOXED_CASES = [  # (completion, target, reward)
    ("Janet has 16 - 3 - 4 = 9 eggs, 9 * 2 = 18. The answer is \\boxed{18}.", "18", 1.0),
    ("So she pays $\\boxed{\\$1,000}$ in total.", "1000", 1.0),
    ("\\[\n\\boxed{1,234,567.25}\n\\]", "1,234,567.25", 1.0),
    ("The temperature drops to \\boxed{-3.5} degrees.", "-3.5", 1.0),
    ("\\boxed{- \\$5}", "-5", 1.0),
    ("\\boxed{ 72 }", 72, 1.0),
    ("\\boxed{72 \\text{ dollars}}", "72", 1.0),
    ("\\boxed{50\\%}", "50", 1.0),
    ("\\boxed{.5}", "0.5", 1.0),
    ("\\boxed{0.50}", "0.5", 1.0),
    ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72", 0.0),  # no box
    ("I think \\boxed{71}, wait, no: \\boxed{72}", "72", 1.0),  # the last box counts
    ("\\boxed{72} hmm, actually \\boxed{71}", "72", 0.0),
    ("\\boxed{72} and then more text 73 74", "72", 1.0),  # text after the answer
    ("The answer is \\boxed{7", "7", 0.0),  # truncated: unclosed box
    ("\\boxed{}", "0", 0.0),
    ("boxed{72}", "72", 0.0),
    ("\\boxed {72}", "72", 0.0),  # as math-verify: no space before the brace
    ("\\boxed{72, 73}", "72", 0.0),
    ("\\boxed{7 2}", "72", 0.0),
    ("\\boxed{1,0000}", "10000", 0.0),
    ("\\boxed{72.}", "72", 0.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 0.0),  # fractions are not read
    ("\\boxed{x = 72}", "72", 1.0),  # an equation: its right-hand side (as math-verify)
    ("\\boxed{{72}}", "72", 1.0),  # grouping braces
    ("\\boxed{x = y = 72}", "72", 0.0),
    ("\\boxed{\\text{72}}", "72", 0.0),  # a number inside \text is not read
    ("\\boxed{seventy-two}", "72", 0.0),
    ("\\boxed{72 \\text{ or 73}}", "72", 0.0),  # a digit in the unit text
    # unit words longer than the tables keep of a token (" students" is one 9-character token in Qwen2.5)
    ("\\boxed{12 \\text{ students}}", "12", 1.0),
    ("There are \\boxed{18\\text{ kilometers}} left.", "18", 1.0),
    ("\\boxed{3 \\text{ centimeters} 4}", "3", 0.0),  # a digit after the long word
    # LaTeX's thousands separator, as the MATH dataset writes it
    ("\\boxed{10{,}000}", "10000", 1.0),
    ("\\boxed{-1{,}234{,}567.5}", "-1234567.5", 1.0),
    ("\\boxed{1{,}000,000}", "1000000", 1.0),
    ("\\boxed{1234{,}567}", "1234567", 0.0),  # not every three digits
    ("\\boxed{1{,}00}", "100", 0.0),
    ("\\boxed{1{}}", "1", 1.0),  # a brace pair after the number is ignorable, as before
    # degrees start unit text
    ("The angle is \\boxed{45^\\circ}.", "45", 1.0),
    ("\\boxed{-5^{\\circ} \\text{C}}", "-5", 1.0),
    ("\\boxed{2^3}", "8", 0.0),  # a power is not read
    ("\\boxed{90^\\circ 5}", "90", 0.0),
    # a square or a cube in the unit text
    ("\\boxed{48 \\text{ cm}^2}", "48", 1.0),
    ("\\boxed{8\\,\\mathrm{m}^{3}}", "8", 1.0),
    ("\\boxed{8 \\text{ m}^{4}}", "8", 0.0),
    ("\\boxed{8 \\text{ m}^{23}}", "8", 0.0),
    ("\\boxed{5 \\text{ km-h}}", "5", 1.0),  # a '-' in the unit text is no sign
]


@pytest.mark.parametrize("text,target,expected", BOXED_CASES)
def test_boxed_cases_both_paths(tokenizer, cpu_kernel, text, target, expected):
    reward = MathAnswerReward(tokenizer, cpu_kernel=cpu_kernel)
    assert both_paths(reward, tokenizer, [text], answer=[target]) == [expected]
    assert final_answer(text) == (target_value(target) if expected else final_answer(text))


def test_gaming_right_number_mentioned_but_wrong_box_gets_zero(tokenizer, cpu_kernel):
    reward = MathAnswerReward(tokenizer, cpu_kernel=cpu_kernel)
    texts = [
        "72 72 72 72. The answer is 72, definitely 72. \\boxed{5}",
        "\\boxed{72} is what a cheater writes first; my final answer: \\boxed{70}",
        "72\n#### 72\n\\boxed{0}",
        "I won't box it: 72",
    ]
    assert both_paths(reward, tokenizer, texts, answer=["72"] * 4) == [0.0, 0.0, 0.0, 0.0]


def test_only_text_before_the_first_eos_is_read(tokenizer, cpu_kernel):
    reward = MathAnswerReward(tokenizer, cpu_kernel=cpu_kernel)
    eos = tokenizer.eos_token_id
    first = tokenizer("\\boxed{5}", add_special_tokens=False).input_ids
    after = tokenizer(" \\boxed{72}", add_special_tokens=False).input_ids
    ids = torch.tensor([first + [eos] + after])  # the mask covers everything: EOS must cut
    assert reward.score(ids, torch.ones_like(ids), answer=["72"]).tolist() == [0.0]
    assert reward.score(ids, torch.ones_like(ids), answer=["5"]).tolist() == [1.0]


def test_hash_format(tokenizer):
    reward = MathAnswerReward(tokenizer, answer_format="hash")
    cases = [
        ("48 / 2 = 24 clips in May.\n#### 72", 1.0),
        ("#### 72.", 1.0),
        ("####72 apples", 1.0),
        ("#### $72", 1.0),
        ("#### 72,000", 0.0),
        ("#### 7 2", 0.0),
        ("#### The answer is 72", 0.0),
        ("#### 71\nno wait\n#### 72", 1.0),
        ("#### 72\n#### 71", 0.0),
        ("72", 0.0),
    ]
    texts, expected = zip(*cases)
    assert both_paths(reward, tokenizer, list(texts), answer=["72"] * len(texts)) == list(expected)


def test_last_number_format(tokenizer):
    reward = MathAnswerReward(tokenizer, answer_format="last_number")
    cases = [
        ("3 + 4 = 7", "7", 1.0),
        ("it costs -$12.50.", "-12.5", 1.0),
        ("x-5", "5", 1.0),  # a minus after a letter is not a sign
        ("the total is 1,234,567 apples", "1234567", 1.0),
        ("7 then 8", "7", 0.0),
        ("no numbers", "0", 0.0),
    ]
    texts, targets, expected = zip(*cases)
    assert both_paths(reward, tokenizer, list(texts), answer=list(targets)) == list(expected)


def test_targets_bare_gsm8k_and_tensor(qwen_tokenizer):
    assert target_value("72") == 72 and target_value("1,000") == 1000 and target_value("-3.5") == -3.5
    assert target_value("Natalia sold 48/2 = 24 clips.\n#### 72") == 72
    assert target_value(" $1,234.5 ") == 1234.5 and target_value(7) == 7.0
    assert target_value("a cat") != target_value("a cat")  # NaN: never equal, reward 0
    reward = MathAnswerReward(qwen_tokenizer)
    ids, mask = pad_right(encode(qwen_tokenizer, ["\\boxed{72}", "\\boxed{1,000}", "\\boxed{3}"]))
    solutions = ["... #### 72", "so 1000\n#### 1,000", "a cat"]
    from_strings = reward.score(ids, mask, answer=solutions)
    from_tensor = reward.score(ids, mask, answer=torch.tensor([72.0, 1000.0, float("nan")]))
    assert from_strings.tolist() == from_tensor.tolist() == [1.0, 1.0, 0.0]


def test_answer_column_unknown_columns_and_tolerance(qwen_tokenizer):
    ids, mask = pad_right(encode(qwen_tokenizer, ["\\boxed{3.14}"]))
    extra = {"trainer_state": object(), "log_extra": print, "log_metric": print, "prompt_id": [0]}
    reward = MathAnswerReward(qwen_tokenizer, answer_column="solution")
    assert reward.score(ids, mask, solution=["3.14"], **extra).tolist() == [1.0]
    with pytest.raises(KeyError, match="solution"):
        reward.score(ids, mask, answer=["3.14"])
    assert MathAnswerReward(qwen_tokenizer, abs_tol=0.01).score(ids, mask, answer=["3.141"]).tolist() == [1.0]
    assert MathAnswerReward(qwen_tokenizer).score(ids, mask, answer=["3.141"]).tolist() == [0.0]


def test_conversational_completions_without_ids(qwen_tokenizer):
    reward = MathAnswerReward(qwen_tokenizer)
    completions = [[{"role": "assistant", "content": "\\boxed{4}"}], [{"role": "assistant", "content": "4"}]]
    assert reward(prompts=[[], []], completions=completions, answer=["4", "4"]) == [1.0, 0.0]


def test_extract_reads_values(qwen_tokenizer):
    reward = MathAnswerReward(qwen_tokenizer)
    texts = ["\\boxed{-1,234.5}", "\\boxed{x}", "\\boxed{123456789012345678}", "\\boxed{72, 73}"]
    value, found = reward.extract(*pad_right(encode(qwen_tokenizer, texts)))
    assert found.tolist() == [True, False, True, False]
    assert value.tolist() == [-1234.5, 0.0, 123456789012345678.0, 0.0]  # 0 where nothing was found


FUZZ_PROSE = ["so ", "72", " \\boxed{5}", "####", "\n", "-", "$", "x", "}", "{", " 250", "1,000", ". "]
FUZZ_CONTENT = [
    "72", "-3", "1,000", "1,0000", ",", ".", "5", "-", "+", "$", "\\$", "\\,", " ", "abc", "\\frac{1}{2}", "0.5",
    "12,345.67", "250", "%", "\\%", "\\text{", " dollars", "}", "{", "007", "\n", "{,}", "^\\circ", "^", " kilometers",
]  # fmt: skip
FUZZ_AFTER = ["}", "}.", " }", "}$", "", "} 73", "}}", "\n#### 9"]


def fuzz_texts(opener: str, n: int, seed: str) -> list[str]:
    """Prose, the opener, answer-ish content, a closer, more prose: mostly near-misses of a valid answer."""
    rng = random.Random(seed)

    def pick(pool, lo, hi):
        return "".join(rng.choice(pool) for _ in range(rng.randint(lo, hi)))

    return [
        pick(FUZZ_PROSE, 0, 4) + opener + pick(FUZZ_CONTENT, 1, 4) + rng.choice(FUZZ_AFTER) + pick(FUZZ_PROSE, 0, 2)
        for _ in range(n)
    ]


@pytest.mark.parametrize("one_pass", [True, False], ids=["one_pass", "general"])
@pytest.mark.parametrize("answer_format", ["boxed", "hash", "last_number"])
def test_tensor_path_equals_string_specification_on_fuzzed_text(tokenizer, answer_format, one_pass):
    opener = {"boxed": "\\boxed{", "hash": "#### ", "last_number": " "}[answer_format]
    texts = fuzz_texts(opener, 600, answer_format)
    # an EOS id outside the tokenizer's vocabulary (a padded embedding row) takes the general path
    eos = [tokenizer.eos_token_id] + ([] if one_pass else [len(tokenizer) + 7])
    reward = MathAnswerReward(tokenizer, answer_format=answer_format, eos_token_ids=eos, cpu_kernel=False)
    assert (reward.packed is not None) == (one_pass and answer_format != "last_number")
    ids, mask = pad_right(encode(tokenizer, texts))
    value, found = reward.extract(ids, mask)
    got = [v if f else None for v, f in zip(value.tolist(), found.tolist())]
    want = [final_answer(t, answer_format) for t in texts]
    mismatches = [(t, g, w) for t, g, w in zip(texts, got, want) if g != w]
    assert not mismatches, mismatches[:5]
    assert 100 < sum(w is not None for w in want) < 550  # the fuzz reaches both outcomes


def assert_vectorised(score, *tensors, **columns):
    """``score`` has no host sync and no data-dependent Python, checked two ways:

    * on fake tensors (no data): ``.item()``, ``.tolist()``, ``bool(tensor)`` raise ``DataDependentOutputException``;
    * ``torch.compile(score, backend="eager", fullgraph=True)`` traces it in one graph (a Python branch on a tensor
      value breaks the graph) and gives the eager result.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = [mode.from_tensor(t) for t in tensors]
        fake_columns = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in columns.items()}
        out = score(*fake, **fake_columns)
        assert out.shape == (tensors[0].shape[0],)
    eager = score(*tensors, **columns)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(score, backend="eager", fullgraph=True)(*tensors, **columns), eager)
    return eager


def test_score_is_vectorised_no_host_sync(qwen_tokenizer):
    ids, mask = pad_right(encode(qwen_tokenizer, ["\\boxed{72}", "#### 72", "so 72"]))
    target = torch.tensor([72.0, 72.0, 72.0], dtype=torch.float64)
    for answer_format in ["boxed", "hash", "last_number"]:
        reward = MathAnswerReward(qwen_tokenizer, answer_format=answer_format)
        assert_vectorised(reward.score, ids, mask, answer=target)


@pytest.mark.parametrize("body", ["ids.sum().item()", "ids.tolist()", "1.0 if ids.sum() > 0 else 0.0"])
def test_the_vectorisation_check_catches_host_syncs(body):
    """The check is not vacuous: the seed's per-sample `.item()` and Python branching fail it."""
    namespace = {"torch": torch}
    exec(
        f"def score(ids, mask):\n    value = {body}\n    return torch.zeros(ids.shape[0]) + 0 * ids.sum(1)", namespace
    )
    ids = torch.ones(2, 3, dtype=torch.long)
    with pytest.raises(Exception):  # noqa: B017 (fake-tensor and dynamo errors have several types)
        assert_vectorised(namespace["score"], ids, ids)


@pytest.mark.parametrize("answer_format", ["boxed", "hash", "last_number"])
def test_score_leaves_its_inputs_alone_whatever_their_dtype_and_layout(qwen_tokenizer, answer_format):
    """int32 ids (which `.to(torch.int32)` would return as they are) are not written to; a transposed-contiguous
    batch (a view of a (L, B) buffer) reads like a contiguous one."""
    reward = MathAnswerReward(qwen_tokenizer, answer_format=answer_format, cpu_kernel=False)
    texts = ["\\boxed{72}", "#### 72", "so 72", "\\boxed{7}"]
    ids, mask = pad_right(encode(qwen_tokenizer, texts))
    want = reward.score(ids, mask, answer=["72"] * 4)
    ids32 = ids.to(torch.int32)
    before = ids32.clone()
    assert torch.equal(reward.score(ids32, mask, answer=["72"] * 4), want)
    assert torch.equal(ids32, before)
    transposed_ids, transposed_mask = ids.t().contiguous().t(), mask.t().contiguous().t()
    assert not transposed_ids.is_contiguous()
    assert torch.equal(reward.score(transposed_ids, transposed_mask, answer=["72"] * 4), want)
