r"""Math answer reward: read the *final* answer from token ids, parse it as a number on the tensor, compare.

:class:`MathAnswerReward` pays 1.0 when the completion's final answer equals the target number, else 0.0:

* ``answer_format="boxed"`` (default): the content of the **last** ``\boxed{...}`` before the first EOS. The content
  must be one number, optionally with ``$``/``\$``, whitespace and LaTeX spacing (``\,``, ``\;``, ``\!``) around it:
  ``\boxed{-3.5}``, ``\boxed{\$1,000}``, ``$\boxed{72}$``, ``\boxed{{72}}``; an optional ``x =`` before it, an
  optional ``%`` and optional unit text after it, from a text group or degrees on, without digits but for squares
  and cubes (``\boxed{18 \text{ dollars}}``, ``\boxed{45^\circ}``, ``\boxed{12 \text{ cm}^2}``). Anything else
  (``\frac``, a number inside ``\text{}``, letters, a second number) is not a number: reward 0. An unclosed last box
  (truncation) is 0, as is one whose closing brace is nested 16 braces deep or more.
* ``answer_format="hash"``: the number right after the **last** ``####`` (GSM8K's convention), optionally preceded
  by whitespace, ``$`` and a sign; it ends at the first character that is not a digit, ``,`` or ``.``, and trailing
  ``.``/``,`` are punctuation (``#### 72.`` reads 72). Text after it is ignored; text between ``####`` and the
  number (``#### The answer is 72``) is not an answer.
* ``answer_format="last_number"``: the last run of ``[0-9.,]`` holding a digit (leading commas and trailing ``.``/``,``
  dropped), negative when an immediately preceding ``-`` (``$`` allowed between) does not follow a letter or digit.

A number is ``[+-]? int? (. digits)?`` with at least one digit, at most 18 digits, and either no commas or commas
every three digits of the integer part (``1,234,567.25``; in a box also written ``1{,}234{,}567.25``, as MATH does);
``1,0000``, ``12,34``, ``5.``, ``1.2.3`` are not numbers.
It is compared with the target as float64 with ``rel_tol``/``abs_tol`` (default: exact up to 1e-9 relative).

The string functions :func:`final_answer` and :func:`parse_number` are the executable specification: the tensor path
agrees with them exactly (tested), and with math-verify / GSM8K's regex on >= 99.5% of a 5,000-completion corpus.

How the tensor path works (no decode, no per-sample loop, no host sync):

1. Map ids after the first EOS (or outside the mask) to the null token; find the last ``\boxed{`` / ``####`` with the
   literal automaton (:mod:`~trl_async.rewards.literal`), which sees the text however the tokenizer split it. For
   openers of at most 8 characters this is one pass over the raw ids (:func:`~trl_async.rewards.literal.last_literal`:
   one packed table lookup per token with the EOS flag folded in, byte-wide automaton steps, integer reductions).
2. A box: read ``max_answer_tokens`` tokens from there with :mod:`~trl_async.rewards.boxed_tokens`, which knows
   every token of the vocabulary whole (its element of the content grammar's monoid, its brace depth change, digits,
   dot and sign), so nothing is expanded to characters: find the closing brace from running depths, compose the
   grammar in ``log2 W`` rounds of table lookups, compute the value with place values: ``mantissa = sum v * 10^rank``
   over the tokens' digit values (int64, exact), ``value = mantissa / 10^fraction_digits`` (one correctly rounded
   float64 division, the same value Python's ``float()`` gives the target string).
3. ``####`` and the last number: gather a window of ``max_answer_tokens`` tokens, expand each to its character codes
   with the vocabulary tables (:mod:`~trl_async.rewards.vocab_tables`), so multi-digit tokens (``"250"``) and merged
   punctuation (``' {-'``, ``'}.'``) read like text, compact the characters to the left, and read the run with prefix
   sums and masked reductions (character classes from one per-code bit table, ``_Chars``), values as above. On CPU
   these windows are dispatch-bound, so all of this is written in few ops.

On CPU tensors the boxed read (1 and 2) and the comparison with the target run as one C call instead
(:mod:`~trl_async.rewards.native`, ``last_box.c``, compiled on first use where a C compiler exists): the same
tables, the same results (tested), 4-9x faster at B=256, L=512 in the benchmark (median ~5x), because ~150 torch
ops cost mostly dispatch there.
``cpu_kernel=False`` (or ``TRL_ASYNC_NATIVE=0``) keeps the torch-op path; other devices always use it.
"""

from __future__ import annotations

import functools
import logging
import math
import re
from collections.abc import Sequence
from typing import Any

import torch

from .base import TensorReward, at_least_one_column, column_tensor
from .boxed_automaton import MAX_DIGITS, UNIT_COMMANDS
from .boxed_tokens import boxed_token_reader
from .literal import PackedLiteral, find_literal, last_literal
from .native import LastBoxKernel, NativeUnavailable
from .positions import Positions
from .vocab_tables import (
    BACKSLASH,
    COMMA,
    DIGIT,
    DOLLAR,
    DOT,
    LETTER,
    LOWER,
    MINUS,
    NUL,
    OVERFLOW,
    PERCENT,
    PLUS,
    SPACE,
    SPACING,
    VocabTables,
)

take = VocabTables.take
logger = logging.getLogger(__name__)

ANSWER_FORMATS = ("boxed", "hash", "last_number")

# ---- the string specification -----------------------------------------------------------------------------------

_NUMBER = re.compile(r"[+-]?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]*)(?:\.[0-9]+)?")
_IGNORABLE = r"(?:\s|[$%]|\\[$%,;!:\s])"  # whitespace, $, %, their escapes, LaTeX spacing
_IN_BOX = r"(?:\s|[${}%]|\\[$%,;!:\s])"  # inside a box, LaTeX grouping braces are ignorable too
_BOXED_CONTENT = re.compile(rf"(?:{_IN_BOX}*[A-Za-z]{_IN_BOX}*=)?{_IN_BOX}*([+-]?){_IN_BOX}*([0-9.,]*){_IN_BOX}*")
_BARE_TARGET = re.compile(rf"{_IGNORABLE}*([+-]?){_IGNORABLE}*([0-9.,]*){_IGNORABLE}*")
_HASH_CONTENT = re.compile(rf"{_IGNORABLE}*(?:([+-]){_IGNORABLE}*)?([0-9.,]+)")
_RUN = re.compile(r"[0-9.,]+")
_SQUARE_OR_CUBE = re.compile(r"\^(?:[23]|\{[23]\})")


def parse_number(body: str, negative: bool = False) -> float | None:
    """The value of ``body`` under the number grammar (module docstring), or None."""
    digits = sum(c.isascii() and c.isdigit() for c in body)
    if not body or digits == 0 or digits > MAX_DIGITS or not _NUMBER.fullmatch(body):
        return None
    value = float(body.replace(",", ""))
    return -value if negative else value


def final_answer(text: str, answer_format: str = "boxed") -> float | None:
    """The final answer of a completion's text as a number, or None: what the tensor path computes, on strings."""
    if answer_format == "boxed":
        start = text.rfind("\\boxed{")
        if start < 0:
            return None
        rest = text[start + len("\\boxed{") :]
        depth, close = 0, -1
        for i, ch in enumerate(rest):  # the matching closing brace
            depth += (ch == "{") - (ch == "}")
            if depth < 0:
                close = i
                break
        if close < 0:
            return None
        content = rest[:close].replace("{,}", ",")  # LaTeX's thousands separator (10{,}000)
        unit = min((i for i in (content.find(c) for c in UNIT_COMMANDS) if i >= 0), default=len(content))
        content, unit_text = content[:unit], content[unit:]
        if any("0" <= c <= "9" for c in _SQUARE_OR_CUBE.sub("", unit_text)):  # cm^2 and m^{3} are units
            return None
        match = _BOXED_CONTENT.fullmatch(content)
        return parse_number(match.group(2), match.group(1) == "-") if match else None
    if answer_format == "hash":
        start = text.rfind("####")
        if start < 0:
            return None
        match = _HASH_CONTENT.match(text, start + 4)
        if not match:
            return None
        return parse_number(match.group(2).rstrip(".,"), match.group(1) == "-")
    if answer_format == "last_number":
        runs = [m for m in _RUN.finditer(text) if any("0" <= c <= "9" for c in m.group())]
        if not runs:
            return None
        run = runs[-1].group()
        body = run[: max(i for i, c in enumerate(run) if "0" <= c <= "9") + 1].lstrip(",")
        begin = runs[-1].start() + len(run) - len(run.lstrip(","))  # where the body starts
        before = re.sub(r"\\?\$$", "", text[:begin])
        negative = before.endswith("-") and not (len(before) > 1 and (before[-2].isalpha() or before[-2].isdigit()))
        return parse_number(body, negative)
    raise ValueError(f"answer_format must be one of {ANSWER_FORMATS}, got {answer_format!r}.")


@functools.lru_cache(maxsize=65536)
def target_value(target: Any) -> float:
    """A dataset target as a float (NaN when it has none): a number, ``"1,000"``, ``"-3.5"``, a GSM8K solution
    ending ``#### 72``, or a solution with a ``\\boxed{}`` answer."""
    if isinstance(target, (int, float)) and not isinstance(target, bool):
        return float(target)
    text = str(target)
    if "####" in text:
        value = final_answer(text, "hash")
    elif "\\boxed{" in text:
        value = final_answer(text, "boxed")
    else:
        match = _BARE_TARGET.fullmatch(text.strip())
        value = parse_number(match.group(2), match.group(1) == "-") if match else None
    return math.nan if value is None else value


# ---- the tensor path ----------------------------------------------------------------------------------------------


class MathAnswerReward(TensorReward):
    r"""1.0 when the final answer (last ``\boxed{}``, ``####`` line, or last number) equals the target number.

    Args:
        tokenizer: the policy's tokenizer (vocabulary tables are built once per tokenizer and cached).
        answer_column: dataset column holding the target (a number, ``"1,000"``, or a GSM8K ``... #### 72``).
        answer_format: ``"boxed"`` (default), ``"hash"`` or ``"last_number"`` (see the module docstring).
        rel_tol, abs_tol: the comparison tolerance, ``|value - target| <= abs_tol + rel_tol * |target|``.
        max_answer_tokens: how many tokens are read from the opener's last token on (before the last digit for
            ``last_number``); a box that does not close in them is not read (reward 0).
        max_answer_chars, token_chars: for ``hash`` and ``last_number``, at most this many characters are read, and
            the tables keep this many characters of a token (a longer one is read conservatively: never a number).
            A box reads every token whole.
        eos_token_ids, name: see :class:`~trl_async.rewards.TensorReward`.
        cpu_kernel: for ``"boxed"`` on CPU tensors, read with the compiled kernel (:mod:`~trl_async.rewards.native`):
            ``None`` (default) where it can be built, else torch ops; ``True`` always (raises
            :class:`~trl_async.rewards.native.NativeUnavailable`, saying why, where it cannot be built); ``False``
            never. Both give the same rewards.

    TRL: ``reward(prompts, completions, completion_ids, answer=[...])``; tensor: ``reward.score(ids, mask,
    answer=[...] or (B,) tensor)``. :meth:`extract` returns the parsed answers themselves.
    """

    default_name = "math_answer"

    def __init__(
        self,
        tokenizer,
        answer_column: str = "answer",
        answer_format: str = "boxed",
        rel_tol: float = 1e-9,
        abs_tol: float = 0.0,
        max_answer_tokens: int = 24,
        max_answer_chars: int = 64,
        token_chars: int = 8,
        eos_token_ids: Sequence[int] | None = None,
        name: str | None = None,
        cpu_kernel: bool | None = None,
    ):
        if answer_format not in ANSWER_FORMATS:
            raise ValueError(f"answer_format must be one of {ANSWER_FORMATS}, got {answer_format!r}.")
        if max_answer_tokens < 1 or max_answer_chars < 8:
            raise ValueError(
                f"Need max_answer_tokens >= 1 and max_answer_chars >= 8, got {max_answer_tokens}, {max_answer_chars}."
            )
        super().__init__(tokenizer, eos_token_ids, name)
        self.answer_column = answer_column
        self.answer_format = answer_format
        self.rel_tol = rel_tol
        self.abs_tol = abs_tol
        self.window = max_answer_tokens
        self.max_chars = max_answer_chars
        self.tables = VocabTables.for_tokenizer(tokenizer, token_chars)
        opener = {"boxed": "\\boxed{", "hash": "####", "last_number": None}[answer_format]
        self.opener = self.tables.literal(opener) if opener else None
        eos = self.eos_token_ids or []
        fast = self.opener is not None and self.opener.n <= PackedLiteral.MAX_N
        fast = fast and all(0 <= e < self.tables.vocab_size for e in eos)
        self.packed = PackedLiteral(self.opener, self.tables.vocab_size, eos) if fast else None
        self.reader = boxed_token_reader(self.tables) if answer_format == "boxed" else None
        self.kernel = self._cpu_kernel(cpu_kernel)

    def _cpu_kernel(self, wanted: bool | None) -> LastBoxKernel | None:
        """The compiled CPU kernel of the boxed read, or None (then the torch-op path runs on CPU too)."""
        if wanted is False:
            return None
        if self.answer_format != "boxed":
            reason = f"the compiled kernel reads answer_format='boxed' only, not {self.answer_format!r}."
        elif self.packed is None:
            reason = f"the compiled kernel needs EOS ids inside the vocabulary, got {self.eos_token_ids}."
        else:
            try:
                return LastBoxKernel(self.packed, self.reader, self.window, required=wanted is True)
            except NativeUnavailable as error:
                reason = str(error)
        if wanted:
            raise NativeUnavailable(f"cpu_kernel=True, but {reason}")
        if self.answer_format == "boxed":  # a fallback worth a line in the log; the other formats have no kernel
            logger.info("MathAnswerReward reads on CPU with torch ops (%s)", reason)
        return None

    def _on_kernel(self, completion_ids: torch.Tensor) -> bool:
        return self.kernel is not None and completion_ids.device.type == "cpu"

    def score(self, completion_ids: torch.Tensor, completion_mask: torch.Tensor, **columns: Any) -> torch.Tensor:
        if self.answer_column not in columns:
            raise KeyError(
                f"{self.__name__} needs the target column {self.answer_column!r}; got columns {sorted(columns)}. "
                "Pass `answer_column=` to read another one."
            )
        if self._on_kernel(completion_ids):  # read and compare in one C call
            ids, mask = at_least_one_column(completion_ids, completion_mask)
            target = column_tensor(columns[self.answer_column], ids.device, target_value, ids.shape[0])  # (B,)
            return self.kernel.score(ids, mask, target, self.abs_tol, self.rel_tol)
        value, found = self._read(completion_ids, completion_mask)  # (B,), (B,)
        target = column_tensor(columns[self.answer_column], value.device, target_value, value.shape[0])  # (B,)
        close = (value - target).abs() <= self.abs_tol + self.rel_tol * target.abs()  # NaN target -> False
        return (found & close).to(torch.float32)

    def extract(self, completion_ids: torch.Tensor, completion_mask: torch.Tensor):
        """The final answers: ``(value (B,) float64, found (B,) bool)``; value is 0 where nothing was found."""
        value, found = self._read(completion_ids, completion_mask)
        return torch.where(found, value, 0.0), found

    def _read(self, completion_ids: torch.Tensor, completion_mask: torch.Tensor):
        """:meth:`extract`, but value is unspecified where nothing was found."""
        completion_ids, completion_mask = at_least_one_column(completion_ids, completion_mask)
        if self._on_kernel(completion_ids):
            return self.kernel.read(completion_ids, completion_mask)
        if self.packed is not None:
            return self._extract_packed(completion_ids, completion_mask.bool())
        keep = self.before_eos(completion_ids, completion_mask)  # (B, L)
        tokens = self.tables.map_ids(completion_ids, keep)  # (B, L), null after EOS
        n_valid = keep.sum(dim=1)  # (B,)
        if self.answer_format == "last_number":
            return self._last_number(tokens)
        hits = find_literal(tokens, self.opener)
        positions = torch.arange(tokens.shape[1], device=tokens.device)  # (L,)
        last = torch.where(hits.event, positions, -1).amax(dim=1)  # (B,) token where the last opener ends
        has_opener = last >= 0
        start = last.clamp(min=0)
        offset = hits.offset_at(start)  # (B,) characters of that token before the content
        if self.answer_format == "boxed":
            keys = tokens + 1  # (B, L) the reader's key space (null V -> V + 1)
            value, ok = self.reader.read(keys, start, offset, torch.full_like(start, keys.shape[1]), self.window)
        else:
            codes, complete = self._window_after(tokens, start, offset)  # (B, N)
            value, ok = _read_hash(codes, text_ends_in_window=complete & (start + self.window >= n_valid))
        return value, has_opener & ok

    def _extract_packed(self, ids: torch.Tensor, mask: torch.Tensor):
        """:meth:`extract` for ``boxed`` / ``hash`` in one pass over the raw ids (:func:`last_literal`)."""
        key, first_eos, last, offset = last_literal(ids, mask, self.packed, self.opener.max_chain)
        length = ids.shape[1]
        start = last.clamp(min=0)
        if self.answer_format == "boxed":
            value, ok = self.reader.read(key, start, offset, first_eos, self.window)
            return value, (last >= 0) & ok
        index = start[:, None] + torch.arange(self.window, device=ids.device)  # (B, W)
        clamped = index.clamp(max=length - 1)
        token = key.gather(1, clamped) - 1  # (B, W) in [-1, V], -1 outside the mask
        inside = (index < first_eos[:, None]) & (token >= 0)  # (B, W)
        window = torch.where(inside, token, self.tables.null_id)  # (B, W) V = null
        codes, complete = self._window_codes(window, offset)
        positions = torch.arange(length, device=ids.device)
        n_valid = (mask & (positions < first_eos[:, None])).sum(dim=1)
        value, ok = _read_hash(codes, text_ends_in_window=complete & (start + self.window >= n_valid))
        return value, (last >= 0) & ok

    # ---- windows of character codes ------------------------------------------------------------------------------
    def _window_after(self, tokens, start, offset):
        """Codes of the text from character ``offset`` of token ``start`` on: ``window`` tokens, at most
        ``max_chars`` characters. -> (B, N) int8 codes, (B,) bool: no character was cut off."""
        index = start[:, None] + torch.arange(self.window, device=tokens.device)  # (B, W)
        inside = index < tokens.shape[1]
        window = torch.where(inside, tokens.gather(1, index.clamp(max=tokens.shape[1] - 1)), self.tables.null_id)
        return self._window_codes(window, offset)

    def _window_codes(self, window, offset):
        """Codes of ``window`` (B, W) token ids from character ``offset`` of the first one on."""
        t = self.tables.on(window.device)
        width = self.tables.width
        first = take(t.chars_right, window[:, 0])  # (B, C) right-aligned: slot s is character len - C + s
        length = take(t.length, window[:, 0]).to(torch.int64)  # (B,)
        slots = torch.arange(width, device=window.device)  # (C,)
        first = torch.where(slots >= (offset - length + width)[:, None], first, NUL)
        rest = take(t.chars_left, window[:, 1:]).flatten(1)  # (B, (W-1)*C)
        return _compact(torch.cat([first, rest], dim=1), self.max_chars, from_right=False)

    def _last_number(self, tokens):
        t = self.tables.on(tokens.device)
        positions = torch.arange(tokens.shape[1], device=tokens.device)  # (L,)
        has_digit = take(t.digits, tokens) > 0  # (B, L)
        last = torch.where(has_digit, positions, -1).amax(dim=1)  # (B,) last token holding a digit
        found = last >= 0
        first_index = last - self.window + 1  # (B,) may be negative: the window then starts before the text
        index = first_index[:, None] + torch.arange(self.window, device=tokens.device)  # (B, W)
        window = torch.where(index >= 0, tokens.gather(1, index.clamp(min=0)), self.tables.null_id)  # (B, W)
        body = take(t.chars_right, window[:, :-1]).flatten(1)  # (B, (W-1)*C) tails of earlier tokens
        tail = take(t.chars_left, window[:, -1])  # (B, C) head of the last digit token
        codes, complete = _compact(torch.cat([body, tail], dim=1), self.max_chars, from_right=True)
        value, ok = _read_last_number(codes, text_starts_in_window=complete & (first_index <= 0))
        return value, found & ok & take(t.digits_visible, window[:, -1])


# ---- character-level readers: (B, N) int8 codes, compacted (characters, then NUL padding) -------------------------


def _compact(codes: torch.Tensor, keep: int, from_right: bool):
    """Drop the NUL slots of each row, keeping order; keep the first (or, ``from_right``, the last) ``keep``
    characters. -> (B, keep) codes (NUL-padded at the end, or at the start ``from_right``), (B,) bool: none cut."""
    if not from_right:  # codes are >= 0 and NUL == 0: a scatter-max lets each character win over the NULs after it
        seen = codes.bool().cumsum(dim=1)  # (B, N) characters up to here
        target = (seen - 1).clamp_(0, keep)  # keep = the discard slot
        out = torch.zeros((codes.shape[0], keep + 1), dtype=codes.dtype, device=codes.device)
        return out.scatter_reduce_(1, target, codes, "amax")[:, :keep], seen[:, -1] <= keep
    present = codes != NUL  # (B, N)
    behind = present.flip(1).cumsum(dim=1).flip(1)  # characters from here to the end, this one included
    target = keep - behind
    target = torch.where(present & (target >= 0) & (target < keep), target, keep)  # keep = the discard slot
    out = torch.full((codes.shape[0], keep + 1), NUL, dtype=codes.dtype, device=codes.device)
    return out.scatter_(1, target, codes)[:, :keep], present.sum(dim=1) <= keep


def _is_digit(codes: torch.Tensor) -> torch.Tensor:
    return (codes >= DIGIT) & (codes < DIGIT + 10)


def _any(x: torch.Tensor) -> torch.Tensor:
    """``x.any(dim=1)`` for a (B, N) bool tensor (a sum is several times faster on CPU). # (B,)"""
    return x.sum(dim=1, dtype=torch.int32) > 0


# Character classes: bit k of a per-code int32 table (one lookup per window, then an `&` per class used).
_ESCAPABLE, _PLAIN, _BACKSLASH, _DIGIT, _BODY_CHAR, _SIGN, _MINUS, _DOT, _COMMA = range(9)


def _class_rows() -> list[int]:
    rows = []
    for c in range(128):
        digit = DIGIT <= c < DIGIT + 10
        flags = [
            c in (DOLLAR, COMMA, SPACING, SPACE, PERCENT),  # \$ \, \; \! \: \<space> \%
            c in (SPACE, DOLLAR, PERCENT),
            c == BACKSLASH,
            digit,
            digit or c in (COMMA, DOT),
            c in (MINUS, PLUS),
            c == MINUS,
            c == DOT,
            c == COMMA,
        ]  # fmt: skip
        rows.append(sum(1 << k for k, flag in enumerate(flags) if flag))
    return rows


class _Chars:
    """The class bits of a (B, N) window of codes, padded by two NUL characters on the left and one on the right so
    that the neighbours' classes are views."""

    def __init__(self, codes: torch.Tensor):
        self.n = codes.shape[1]
        padded = torch.nn.functional.pad(codes, (2, 1), value=NUL)  # (B, N + 3)
        table = _constant(codes.device, "classes")
        bits = table.index_select(0, padded.reshape(-1).to(torch.int64)).view(padded.shape)  # (B, N + 3)
        powers = _constant(codes.device, "class_bits")[:, None, None]  # (K, 1, 1) 1 << k
        self.classes = (bits & powers).bool()  # (K, B, N + 3): every class at once

    def __call__(self, k: int, shift: int = 0) -> torch.Tensor:
        """Class ``k`` of the character at ``i - shift`` (False out of range). # (B, N) bool"""
        return self.classes[k, :, 2 - shift : 2 - shift + self.n]


def _classes(chars: _Chars):
    """Per character: ignorable (whitespace, ``$``, ``%`` and their escapes, LaTeX spacing), body, sign."""
    spacing = chars(_ESCAPABLE)
    backslash = chars(_BACKSLASH)
    escaped = chars(_BACKSLASH, 1) & spacing & ~chars(_BACKSLASH, 2)
    ignorable = chars(_PLAIN) | (backslash & chars(_ESCAPABLE, -1)) | escaped
    is_digit = chars(_DIGIT)
    body = chars(_BODY_CHAR) & ~ignorable
    return ignorable, body, chars(_SIGN), is_digit


_POW10_INT = [10**k for k in range(MAX_DIGITS + 1)]


def _make_constants() -> dict[str, torch.Tensor]:
    return {
        "pow10": torch.tensor(_POW10_INT, dtype=torch.int64),
        "pow10f": torch.tensor(_POW10_INT, dtype=torch.float64),
        "classes": torch.tensor(_class_rows(), dtype=torch.int32),
        "class_bits": torch.tensor([1 << k for k in range(_COMMA + 1)], dtype=torch.int32),
    }


_CONSTANTS: dict = {(torch.device("cpu"), k): v for k, v in _make_constants().items()}


def _constant(device: torch.device, name: str) -> torch.Tensor:
    """Small constant tables (made on CPU at import, copied once per other device)."""
    key = (device, name)
    found = _CONSTANTS.get(key)
    if found is None:
        found = _CONSTANTS[key] = _CONSTANTS[(torch.device("cpu"), name)].to(device)
    return found


def _number(codes, body, is_digit, negative, pos: Positions, chars: _Chars):
    """Validate the number grammar on a contiguous ``body`` span and compute its value. -> (B,) float64, (B,) bool"""
    n = codes.shape[1]
    first = pos.first(body)  # (B,)
    last = pos.last(body)  # (B,)
    contiguous = body.sum(dim=1, dtype=torch.int32) == last - first + 1
    first_code = codes.gather(1, first.clamp(max=n - 1).long()[:, None])[:, 0]
    last_code = codes.gather(1, last.clamp(min=0).long()[:, None])[:, 0]
    dots = body & chars(_DOT)
    commas = body & chars(_COMMA)
    digits = body & is_digit
    dot = pos.first(dots)  # (B,) n when there is no dot
    int_end = torch.minimum(dot, last + 1)  # (B,)
    int_part = body & pos.lt(int_end)
    has_comma = _any(commas)[:, None]
    comma_slot = ((int_end[:, None] - pos.at) & 3) == 0  # (int_end - i) % 4 == 0, also below 0
    grouped = ~_any(int_part & (commas ^ (has_comma & comma_slot)))
    n_digits = digits.sum(dim=1, dtype=torch.int32)
    after_dot = ~pos.lt(dot + 1)
    ok = (
        contiguous
        & (dots.sum(dim=1, dtype=torch.int32) <= 1)
        & ~_any(commas & after_dot)
        & grouped
        & (first_code != COMMA)
        & _is_digit(last_code)
        & (n_digits >= 1)
        & (n_digits <= MAX_DIGITS)
    )
    rank = (n_digits[:, None] - digits.cumsum(dim=1, dtype=torch.int32)).clamp_(0, MAX_DIGITS)  # (B, N) to the right
    pow10 = _constant(codes.device, "pow10")
    place = pow10.index_select(0, rank.view(-1)).view(rank.shape)  # (B, N) int64
    mantissa = (((codes - DIGIT) * digits) * place).sum(dim=1)  # (B,) int64, exact
    fraction = (digits & after_dot).sum(dim=1, dtype=torch.int32).clamp_(max=MAX_DIGITS).long()  # (B,)
    value = mantissa.to(torch.float64) / _constant(codes.device, "pow10f").index_select(0, fraction)
    return torch.where(negative, -value, value), ok


def _read_hash(codes: torch.Tensor, text_ends_in_window: torch.Tensor):
    """Codes start right after ``####``: ignorables and one sign, then a run of ``[0-9.,]`` (trailing ``.,`` cut)."""
    chars = _Chars(codes)
    ignorable, body, sign, is_digit = _classes(chars)
    n = codes.shape[1]
    pos = Positions.of(n, codes.device)
    positions = pos.at
    first = pos.first(body)  # (B,) run start
    before = positions < first[:, None]
    prefix_ok = ~_any(before & ~(ignorable | sign)) & ((before & sign).sum(dim=1) <= 1)
    negative = _any(before & chars(_MINUS))
    end = pos.first(~body & (positions > first[:, None]))  # (B,) first after the run
    stop = codes.gather(1, end.clamp(max=n - 1).long()[:, None])[:, 0]
    seen_end = (end < n) & ((stop != NUL) | text_ends_in_window) & (stop != OVERFLOW)
    in_run = (positions >= first[:, None]) & (positions < end[:, None])
    last_digit = pos.last(in_run & is_digit)
    number = in_run & (positions <= last_digit[:, None])
    value, ok = _number(codes, number, is_digit, negative, pos, chars)
    return value, ok & prefix_ok & seen_end & (first < n)


def _read_last_number(codes: torch.Tensor, text_starts_in_window: torch.Tensor):
    """Codes (right-aligned) end with the last digit token: the last ``[0-9.,]`` run holding a digit, and an
    optional ``-`` before it."""
    n = codes.shape[1]
    chars = _Chars(codes)
    pos = Positions.of(n, codes.device)
    positions = pos.at
    is_digit = chars(_DIGIT)
    runnable = chars(_BODY_CHAR)
    last_digit = pos.last(is_digit)  # (B,)
    breaks = ~runnable & (positions < last_digit[:, None])
    run_start = pos.last(breaks) + 1  # (B,)
    body_start = pos.first((positions >= run_start[:, None]) & ~chars(_COMMA))
    body = (positions >= body_start[:, None]) & (positions <= last_digit[:, None])

    def at(k):  # code at body_start - k (NUL before the window)
        i = body_start - k
        return torch.where(i >= 0, codes.gather(1, i.clamp(min=0).long()[:, None])[:, 0], NUL)

    # "-5", "-$5", "-\$5": the minus, then what stands before it must not be a letter or a digit.
    before = torch.stack([at(1), at(2), at(3), at(4)], dim=1)  # (B, 4)
    dollar = (before[:, 0] == DOLLAR).to(torch.int64) * (1 + (before[:, 1] == BACKSLASH).to(torch.int64))  # 0-2
    minus = before.gather(1, dollar[:, None])[:, 0] == MINUS
    before_minus = before.gather(1, (dollar + 1)[:, None])[:, 0]
    negative = minus & ~(_is_digit(before_minus) | (before_minus == LETTER) | (before_minus >= LOWER))
    # The run (and what decides its sign) must be inside the window unless the text starts there.
    first_char = pos.first(codes != NUL)  # (B,) codes are right-aligned
    seen_start = text_starts_in_window | ((run_start - first_char >= 5) & (before[:, 0] != OVERFLOW))
    value, ok = _number(codes, body, is_digit, negative, pos, chars)
    return value, ok & seen_start & (last_digit >= 0)
