"""Token pattern reward: 1.0 when a per-sample token sequence occurs before the first EOS (where it must).

The seed's idea, done right: the seed looped over the batch in Python with ``.item()`` (a host sync per sample) and
paid whenever the pattern's tokens appeared *anywhere*, so a completion listing many numbers was paid. Here:

* all samples at once: the completion is padded by ``K`` tokens and compared with every per-sample pattern
  position by position (``K`` = longest pattern, shorter ones padded), as int32 xor/or arithmetic into a
  ``(B, P, L)`` mismatch map that is 0 where a match starts (``anchor="end"`` gathers the ``K`` tokens before the
  end instead: no scan);
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
from .positions import Positions
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
                plain = found[0]
                # Where the spaced form ends with the plain one (a space token, then the same tokens: numbers in
                # most vocabularies), every match of it is a match of the plain form, at every anchor: skip it.
                if not (plain and spaced[-len(plain) :] == plain):
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
        """Whether any form of each sample's pattern occurs where the anchor requires. # (B, P, K) -> (B,) bool

        Token equality is tested as ``(a ^ b) & care == 0`` on int32: on a CPU, comparisons (bool outputs) and
        ``where`` cost 4-8x an arithmetic op over the same ``(B, L)`` batch."""
        completion_ids, completion_mask = at_least_one_column(completion_ids, completion_mask)
        keep = self.before_eos(completion_ids, completion_mask)  # (B, L)
        tokens = _comparable(completion_ids, keep)  # (B, L) int32 >= 0, NO_TOKEN outside `keep`
        pattern_len = (pattern >= 0).sum(dim=-1)  # (B, P) (padding is at the end)
        want = pattern.clamp(min=0).to(torch.int32)  # (B, P, K)
        care = -(pattern >= 0).to(torch.int32)  # (B, P, K) all bits set on a pattern token, 0 on its padding
        if self.anchor == "end":
            return self._matches_at_end(completion_ids, keep, tokens, want, care, pattern_len)
        mismatch = _mismatch_at_each_start(tokens, want, care)  # (B, P, L) int32 >= 0
        if self.anchor == "anywhere":
            return ((mismatch.amin(dim=2) == 0) & (pattern_len > 0)).any(dim=1)
        length = completion_ids.shape[1]
        match = (mismatch == 0) & (pattern_len > 0)[:, :, None]  # (B, P, L) a match starts at l
        end = torch.arange(length, device=completion_ids.device) + pattern_len[:, :, None] - 1  # (B, P, L) its end
        lo, hi = self._span_chars(completion_ids, keep)  # (B,), (B,) character bounds of the answer span
        t = self.vocab.on(completion_ids.device)
        tok_len = VocabTables.take(t.length, self.vocab.map_ids(completion_ids, keep)).to(torch.int64)
        chars_before = torch.nn.functional.pad(torch.cumsum(tok_len, dim=1), (1, pattern.shape[-1]))  # (B, L + K + 1)
        first_char = chars_before[:, :length]  # (B, L)
        after_last = chars_before.gather(1, (end + 1).clamp(min=0).flatten(1)).view(end.shape)  # (B, P, L)
        match = match & (first_char[:, None, :] >= lo[:, None, None]) & (after_last <= hi[:, None, None])
        return match.any(dim=2).any(dim=1)

    def _matches_at_end(self, completion_ids, keep, tokens, want, care, pattern_len):
        """The match must end at the last token with a non-whitespace character: one gather of ``K`` tokens."""
        length = completion_ids.shape[1]
        t = self.vocab.on(completion_ids.device)
        visible = VocabTables.take(t.nonspace, self.vocab.map_ids(completion_ids, keep)) > 0  # (B, L)
        last_visible = Positions.of(length, completion_ids.device).last(visible).to(torch.int64)  # (B,) -1: none
        start = last_visible[:, None] - pattern_len + 1  # (B, P) where the match would start
        index = start[:, :, None] + torch.arange(want.shape[-1], device=want.device)  # (B, P, K)
        got = tokens.gather(1, index.clamp(0, length - 1).flatten(1)).view(want.shape)  # (B, P, K)
        mismatch = ((got ^ want) & care).amax(dim=2)  # (B, P) 0: every pattern token matches
        return ((mismatch == 0) & (start >= 0) & (pattern_len > 0)).any(dim=1)

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


NO_TOKEN = torch.iinfo(torch.int32).max  # stands for masked tokens; no pattern id equals it


def _comparable(completion_ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Ids as non-negative int32, ``NO_TOKEN`` outside ``keep`` (an id < 0 becomes a value no vocabulary reaches).
    # (B, L) -> (B, L) int32"""
    masked_bits = (keep.to(torch.int32) - 1) & NO_TOKEN  # (B, L) 0 where kept, NO_TOKEN elsewhere
    return (completion_ids.to(torch.int32) | masked_bits) & NO_TOKEN


def _mismatch_at_each_start(tokens: torch.Tensor, want: torch.Tensor, care: torch.Tensor) -> torch.Tensor:
    """OR over k of ``(token[l + k] ^ want[k]) & care[k]``: 0 exactly where form p of the pattern starts at l
    (meaningless for an empty form: test its length).
    # tokens (B, L) int32 >= 0, want / care (B, P, K) int32 -> (B, P, L) int32 >= 0

    A loop over the P forms and K pattern positions (shapes, not data), each step three ops on contiguous
    ``(B, L)`` rows with a per-row scalar (broadcasting the ``P`` axis costs ~3x more per element)."""
    batch, length = tokens.shape
    forms, width = want.shape[1], want.shape[2]
    padded = torch.nn.functional.pad(tokens, (0, width), value=NO_TOKEN)  # (B, L + K)
    rows = []
    for p in range(forms):
        # k = 0 needs no `care`: only an empty form has none there, and callers require a non-empty form.
        row = padded[:, :length] ^ want[:, p, 0, None]  # (B, L)
        for k in range(1, width):
            row |= (padded[:, k : k + length] ^ want[:, p, k, None]) & care[:, p, k, None]
        rows.append(row)
    return rows[0][:, None] if forms == 1 else torch.stack(rows, dim=1)
