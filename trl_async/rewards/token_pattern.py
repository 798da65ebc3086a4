"""Token pattern reward: 1.0 when a per-sample token sequence occurs before the first EOS (where it must).

The seed's idea, done right: the seed looped over the batch in Python with ``.item()`` (a host sync per sample) and
paid whenever the pattern's tokens appeared *anywhere*, so a completion listing many numbers was paid. Here:

* all samples at once: the completion is padded by ``K - 1`` tokens and compared with every per-sample pattern
  position by position (``K`` = longest pattern, shorter ones padded with a wildcard), a ``(B, P, L)`` match map;
* anchored: ``anchor="end"`` (default) requires the match to end at the last non-whitespace token before EOS,
  ``anchor="span"`` requires it inside the last ``span`` (default ``<answer>…</answer>``, found with the literal
  automaton however the tags tokenised), ``anchor="anywhere"`` is the seed's rule (gameable; for comparison);
* tokenisation-aware: a string pattern is tokenised once per string (cached), alone and with a leading space, and
  either form matches (``"72"`` and ``" 72"`` tokenise differently in most BPE vocabularies).

Patterns come from a dataset column (default ``answer``): strings, id lists, or an already tensorised ``(B, K)`` or
``(B, P, K)`` long tensor padded with negative ids. For numeric answers prefer
:class:`~trl_async.rewards.MathAnswerReward`, which reads numbers instead of token spellings.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .base import TensorReward, at_least_one_column
from .literal import find_literal
from .vocab_tables import VocabTables

ANCHORS = ("end", "span", "anywhere")


class TokenPatternReward(TensorReward):
    """1.0 when the sample's pattern tokens occur (at the end / inside the answer span / anywhere) before EOS.

    Args:
        tokenizer: the policy's tokenizer (patterns given as strings are tokenised with it once and cached).
        pattern_column: the dataset column with each sample's pattern.
        anchor: ``"end"`` (default), ``"span"`` or ``"anywhere"`` (see the module docstring).
        span: the ``(open, close)`` strings delimiting the answer span for ``anchor="span"``.
        leading_space_variant: also match the pattern tokenised with a leading space.
        eos_token_ids, name: see :class:`~trl_async.rewards.TensorReward`.
    """

    default_name = "token_pattern"

    def __init__(
        self,
        tokenizer,
        pattern_column: str = "answer",
        anchor: str = "end",
        span: tuple[str, str] = ("<answer>", "</answer>"),
        leading_space_variant: bool = True,
        eos_token_ids: Sequence[int] | None = None,
        name: str | None = None,
    ):
        if anchor not in ANCHORS:
            raise ValueError(f"anchor must be one of {ANCHORS}, got {anchor!r}.")
        super().__init__(tokenizer, eos_token_ids, name)
        self.pattern_column = pattern_column
        self.anchor = anchor
        self.leading_space_variant = leading_space_variant
        self.vocab = VocabTables.for_tokenizer(tokenizer)
        self.span = tuple(span)
        self.span_literals = [self.vocab.literal(s) for s in self.span] if anchor == "span" else None
        self._cache: dict[str, list[list[int]]] = {}

    # ---- patterns, host side, once per distinct string ------------------------------------------------------------
    def variants(self, pattern: Any) -> list[list[int]]:
        """The token-id forms of one pattern (cached per string)."""
        if isinstance(pattern, (list, tuple)):
            return [list(pattern)]
        text = str(pattern)
        found = self._cache.get(text)
        if found is None:
            found = [self.tokenizer(text, add_special_tokens=False)["input_ids"]]
            if self.leading_space_variant and not text.startswith(" "):
                spaced = self.tokenizer(" " + text, add_special_tokens=False)["input_ids"]
                if spaced != found[0]:
                    found.append(spaced)
            self._cache[text] = found
        return found

    def pattern_tensor(self, patterns: Sequence[Any], device) -> torch.Tensor:
        """Patterns -> ``(B, P, K)`` long tensor, padded with -1 (an empty pattern never matches)."""
        forms = [self.variants(p) for p in patterns]
        width = max((len(ids) for f in forms for ids in f), default=1) or 1
        depth = max(len(f) for f in forms)
        out = torch.full((len(forms), depth, width), -1, dtype=torch.long)  # (B, P, K)
        for b, f in enumerate(forms):
            for p, ids in enumerate(f):
                out[b, p, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
        return out.to(device)

    # ---- the tensor path ------------------------------------------------------------------------------------------
    def score(self, completion_ids: torch.Tensor, completion_mask: torch.Tensor, **columns: Any) -> torch.Tensor:
        if self.pattern_column not in columns:
            raise KeyError(f"{self.__name__} needs the column {self.pattern_column!r}; got {sorted(columns)}.")
        pattern = columns[self.pattern_column]
        if not isinstance(pattern, torch.Tensor):
            pattern = self.pattern_tensor(pattern, completion_ids.device)
        pattern = pattern.to(completion_ids.device)
        if pattern.dim() == 2:
            pattern = pattern[:, None, :]  # (B, 1, K)
        return self.matches(completion_ids, completion_mask, pattern).to(torch.float32)

    def matches(self, completion_ids, completion_mask, pattern: torch.Tensor) -> torch.Tensor:
        """Whether any form of each sample's pattern occurs where the anchor requires. # (B, P, K) -> (B,) bool"""
        completion_ids, completion_mask = at_least_one_column(completion_ids, completion_mask)
        keep = self.before_eos(completion_ids, completion_mask)  # (B, L)
        batch, length = completion_ids.shape
        width = pattern.shape[-1]
        tokens = torch.where(keep, completion_ids, -2)  # (B, L) -2 equals no pattern id and no padding
        padded = torch.nn.functional.pad(tokens, (0, width), value=-2)  # (B, L + K)
        pattern_len = (pattern >= 0).sum(dim=-1)  # (B, P)
        match = (pattern_len > 0)[:, :, None].expand(batch, pattern.shape[1], length)  # (B, P, L) start positions
        for k in range(width):  # K is a shape, not data: compare the k-th pattern token with the k-th next token
            token_k = padded[:, None, k : k + length]  # (B, 1, L)
            want = pattern[:, :, k, None]  # (B, P, 1)
            match = match & ((token_k == want) | (want < 0))
        positions = torch.arange(length, device=completion_ids.device)  # (L,)
        start = positions  # match at l covers tokens l .. l + len - 1
        end = start + pattern_len[:, :, None] - 1  # (B, P, L) last token of the match
        if self.anchor == "end":
            t = self.vocab.on(completion_ids.device)
            visible = VocabTables.take(t.nonspace, self.vocab.map_ids(completion_ids, keep)) > 0  # (B, L)
            last_visible = torch.where(visible, positions, -1).amax(dim=1)  # (B,)
            match = match & (end == last_visible[:, None, None])
        elif self.anchor == "span":
            lo, hi = self._span_chars(completion_ids, keep)  # (B,), (B,) character bounds of the answer span
            t = self.vocab.on(completion_ids.device)
            tok_len = VocabTables.take(t.length, self.vocab.map_ids(completion_ids, keep)).to(torch.int64)
            chars_before = torch.nn.functional.pad(torch.cumsum(tok_len, dim=1), (1, width))  # (B, L + K + 1)
            first_char = chars_before[:, :length]  # (B, L)
            after_last = chars_before.gather(1, (end + 1).clamp(min=0).flatten(1)).view(end.shape)  # (B, P, L)
            match = match & (first_char[:, None, :] >= lo[:, None, None]) & (after_last <= hi[:, None, None])
        return match.any(dim=2).any(dim=1)

    def _span_chars(self, completion_ids, keep):
        """Character bounds ``[lo, hi)`` of the last answer span (``lo > hi`` when there is none)."""
        tokens = self.vocab.map_ids(completion_ids, keep)  # (B, L)
        t = self.vocab.on(tokens.device)
        tok_len = VocabTables.take(t.length, tokens).to(torch.int64)
        chars_before = torch.cumsum(tok_len, dim=1) - tok_len  # (B, L)
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        opened = find_literal(tokens, self.span_literals[0])
        closed = find_literal(tokens, self.span_literals[1])
        open_at = torch.where(opened.event, positions, -1).amax(dim=1)  # (B,)
        has_open = open_at >= 0
        lo = chars_before.gather(1, open_at.clamp(min=0)[:, None])[:, 0] + opened.offset_at(open_at.clamp(min=0))
        # the first closing tag ending at or after the opener's token that starts after the opener's end
        close_end_here = closed.event & (positions >= open_at[:, None])  # (B, L)
        close_at = torch.where(close_end_here, positions, tokens.shape[1]).amin(dim=1)  # (B,)
        has_close = close_at < tokens.shape[1]
        close_idx = close_at.clamp(max=tokens.shape[1] - 1)
        hi = chars_before.gather(1, close_idx[:, None])[:, 0] + closed.offset_at(close_idx) - closed.n
        valid = has_open & has_close & (hi >= lo)
        return torch.where(valid, lo, 1), torch.where(valid, hi, 0)
