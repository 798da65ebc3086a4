"""Format reward: the completion has the shape ``<think>…</think><answer>…</answer>`` (or other tag pairs).

:class:`FormatReward` pays 1.0 when, before the first EOS, the text is exactly the tag pairs in order, each tag once,
with only whitespace before, between and after the pairs; what is inside a pair is free (it may not contain the
tags). This is the regex ``^\\s*<think>.*?</think>\\s*<answer>.*?</answer>\\s*$`` (DOTALL) with every tag occurring
once; :func:`format_matches` is that string specification, and the tensor path agrees with it exactly (tested).

On token ids: each tag is found with the literal automaton (:mod:`~trl_async.rewards.literal`), so ``<think>``
split as ``'<th' 'ink' '>\\n'`` or ``'<' 'think' '>'`` or merged with the whitespace around it is found all the same.
Character positions come from prefix sums of token lengths, and "only whitespace outside the pairs" is a comparison
of prefix sums of non-whitespace characters. No loop over the batch, no host sync.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

from .base import TensorReward, at_least_one_column
from .literal import find_literal
from .vocab_tables import VocabTables

DEFAULT_TAGS = (("<think>", "</think>"), ("<answer>", "</answer>"))


def format_matches(text: str, tags: Sequence[tuple[str, str]] = DEFAULT_TAGS, opening_in_prompt: bool = False) -> bool:
    """The string specification of :class:`FormatReward` (see the module docstring)."""
    literals = [t for pair in tags for t in pair]
    if any(text.count(t) != (0 if opening_in_prompt and i == 0 else 1) for i, t in enumerate(literals)):
        return False
    pattern = "".join(rf"\s*{re.escape(o)}.*?{re.escape(c)}" for o, c in tags) + r"\s*"
    if opening_in_prompt:
        pattern = ".*?" + pattern.split(re.escape(tags[0][0]), 1)[1]
    return re.fullmatch(pattern, text, re.DOTALL) is not None


class FormatReward(TensorReward):
    """1.0 when the completion is the tag pairs in order with only whitespace around them, else 0.0.

    Args:
        tokenizer: the policy's tokenizer.
        tags: the ``(open, close)`` pairs, in order (default ``<think>…</think>`` then ``<answer>…</answer>``).
        opening_in_prompt: the first opening tag is in the prompt (a chat template that starts the assistant turn
            with ``<think>``): the completion starts inside the first pair and must not repeat that tag.
        eos_token_ids, name: see :class:`~trl_async.rewards.TensorReward`.
    """

    default_name = "format"

    def __init__(
        self,
        tokenizer,
        tags: Sequence[tuple[str, str]] = DEFAULT_TAGS,
        opening_in_prompt: bool = False,
        eos_token_ids: Sequence[int] | None = None,
        name: str | None = None,
    ):
        super().__init__(tokenizer, eos_token_ids, name)
        self.tags = [tuple(pair) for pair in tags]
        if not self.tags or any(len(pair) != 2 or not all(pair) for pair in self.tags):
            raise ValueError(f"tags must be non-empty (open, close) string pairs, got {tags!r}.")
        literals = [t for pair in self.tags for t in pair]
        clashes = [(a, b) for a in literals for b in literals if a != b and a in b]
        if clashes or len(set(literals)) != len(literals):
            raise ValueError(f"Tags must be distinct and none inside another, got {literals} ({clashes}).")
        self.opening_in_prompt = opening_in_prompt
        self.vocab = VocabTables.for_tokenizer(tokenizer)
        self.literals = [self.vocab.literal(t) for t in literals]

    def score(self, completion_ids: torch.Tensor, completion_mask: torch.Tensor, **columns) -> torch.Tensor:
        completion_ids, completion_mask = at_least_one_column(completion_ids, completion_mask)
        keep = self.before_eos(completion_ids, completion_mask)  # (B, L)
        tokens = self.vocab.map_ids(completion_ids, keep)  # (B, L)
        t = self.vocab.on(tokens.device)
        length = VocabTables.take(t.length, tokens).to(torch.int64)  # (B, L)
        nonspace = VocabTables.take(t.nonspace, tokens).to(torch.int64)  # (B, L)
        chars_before = torch.cumsum(length, dim=1) - length  # (B, L) characters before each token
        nonspace_before = torch.cumsum(nonspace, dim=1) - nonspace  # (B, L)
        total_nonspace = nonspace.sum(dim=1)  # (B,)
        positions = torch.arange(tokens.shape[1], device=tokens.device)  # (L,)

        ok = torch.ones(tokens.shape[0], dtype=torch.bool, device=tokens.device)
        previous_end = torch.zeros_like(total_nonspace)  # character position after the previous tag
        previous_nonspace = torch.zeros_like(total_nonspace)  # non-space characters up to there
        for i, literal in enumerate(self.literals):  # a fixed handful of tags
            hits = find_literal(tokens, literal)
            count = hits.count().sum(dim=1)  # (B,)
            index = torch.where(hits.event, positions, 0).amax(dim=1)  # (B,) the token where it ends
            end = chars_before.gather(1, index[:, None])[:, 0] + hits.offset_at(index)  # (B,) char position
            upto = nonspace_before.gather(1, index[:, None])[:, 0] + hits.nonspace_before_at(index)  # (B,)
            if i == 0 and self.opening_in_prompt:
                ok = ok & (count == 0)
                continue
            ok = ok & (count == 1) & (end - literal.n >= previous_end)
            if i % 2 == 0:  # an opening tag: only whitespace since the previous closing tag (or the start)
                ok = ok & (upto - literal.nonspace == previous_nonspace)
            previous_end, previous_nonspace = end, upto
        ok = ok & (total_nonspace == previous_nonspace)  # only whitespace after the last closing tag
        return ok.to(torch.float32)
