"""Per-tokenizer lookup tables over the vocabulary, built once by decoding every token once.

Rewards never decode a completion. Instead each token id indexes small tables that say what its text contains: how
many characters, how many non-whitespace characters, and a fixed-width *character code* row used to read numbers
(digit values, sign, decimal point, comma, ``$``, backslash, braces, whitespace, letters, anything else).

Invariants:

* Row ``V = len(tokenizer)`` is the *null token*: empty text, all codes :data:`NUL`. Ids outside ``[0, V)``
  (a model's padded embedding rows) and positions a reward must ignore are mapped to it.
* ``chars_left[t]`` holds the codes of the first ``C`` characters of token ``t``'s text, ``chars_right[t]`` those of
  the last ``C`` characters, right-aligned. A text longer than ``C`` keeps ``C - 1`` characters and puts
  :data:`OVERFLOW` in the slot standing for the hidden ones, so a reader never mistakes a cut text for a short one.
  (The ``#### N`` and last-number readers use these rows; the box reader, :mod:`~trl_async.rewards.boxed_tokens`,
  reads every token whole.)
* A digit ``d`` (ASCII ``0``-``9`` only) is coded ``DIGIT + d``, an ASCII lowercase letter ``LOWER + i`` (so LaTeX
  commands can be spelled), an uppercase one ``UPPER + i``; other letters are :data:`LETTER`; every other code is
  below :data:`DIGIT`.
* Tables are plain CPU tensors, copied once per device (:meth:`VocabTables.on`) and cached; building them for a
  152k vocabulary takes 1-2 s, and happens once per (tokenizer, ``C``) per process.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch

# Character codes (int8). Digits are DIGIT + value so one gather yields both the class and the value.
(NUL, SPACE, COMMA, DOT, MINUS, PLUS, DOLLAR, BACKSLASH, LBRACE, RBRACE, SPACING, LETTER, OTHER, OVERFLOW, PERCENT,
 EQUALS, CARET) = range(17)  # fmt: skip
DIGIT = 32  # DIGIT + d for the ASCII digit d
LOWER = 64  # LOWER + i for the i-th ASCII lowercase letter (to spell LaTeX commands)
UPPER = 96  # UPPER + i for the i-th ASCII uppercase letter; other letters are LETTER
_SINGLE = {
    ",": COMMA, ".": DOT, "-": MINUS, "+": PLUS, "$": DOLLAR, "\\": BACKSLASH, "{": LBRACE, "}": RBRACE, "%": PERCENT, "=": EQUALS,
    "^": CARET,
}  # fmt: skip
_SPACING = set(";!:")  # `\;`, `\!`, `\:` are LaTeX spacing commands (as is `\,`)


def char_code(ch: str) -> int:
    """The code of one character (see the module docstring)."""
    if "0" <= ch <= "9":
        return DIGIT + ord(ch) - ord("0")
    if "a" <= ch <= "z":
        return LOWER + ord(ch) - ord("a")
    if "A" <= ch <= "Z":
        return UPPER + ord(ch) - ord("A")
    if ch in _SINGLE:
        return _SINGLE[ch]
    if ch.isspace():
        return SPACE
    if ch in _SPACING:
        return SPACING
    if ch.isalpha() or ch.isdigit():  # letters and non-ASCII digits: never part of a number
        return LETTER
    return OTHER


def token_texts(tokenizer) -> list[str]:
    """The text of every token id ``0 .. len(tokenizer) - 1``, decoded once, special tokens included.

    SentencePiece tokenizers drop a word-initial ``▁`` when one token is decoded alone; it is restored as a space so
    that ``"1 2"`` and ``"12"`` stay different.
    """
    vocab_size = len(tokenizer)
    ids = list(range(vocab_size))
    texts = tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    pieces = tokenizer.convert_ids_to_tokens(ids)
    return [
        " " + text if isinstance(piece, str) and piece.startswith("▁") and not text.startswith(" ") else text
        for text, piece in zip(texts, pieces)
    ]


@dataclass
class _DeviceTables:
    length: torch.Tensor  # (V+1,) int32  characters in the token's text
    nonspace: torch.Tensor  # (V+1,) int32  non-whitespace characters
    digits: torch.Tensor  # (V+1,) int32  ASCII digits
    chars_left: torch.Tensor  # (V+1, C) int8  codes of the first C characters
    chars_right: torch.Tensor  # (V+1, C) int8  codes of the last C characters, right-aligned
    digits_visible: torch.Tensor  # (V+1,) bool  every digit of the text is inside chars_left


class VocabTables:
    """Lookup tables for one tokenizer (see the module docstring). Get one with :meth:`for_tokenizer`."""

    def __init__(self, texts: list[str], width: int = 8):
        if width < 2:
            raise ValueError(f"width must be >= 2 characters, got {width}.")
        self.texts = texts
        self.vocab_size = len(texts)
        self.null_id = self.vocab_size
        self.width = width
        rows = len(texts) + 1
        left_rows, right_rows, digit_counts, visible_rows, nonspace_counts = [], [], [], [], []
        known: dict[str, int] = {}  # char -> code, filled as characters are met
        for text in texts + [""]:
            codes = [known[c] if c in known else known.setdefault(c, char_code(c)) for c in text]
            n_digits = sum(DIGIT <= code < DIGIT + 10 for code in codes)
            digit_counts.append(n_digits)
            nonspace_counts.append(len(codes) - codes.count(SPACE))
            if len(codes) <= width:
                pad = [NUL] * (width - len(codes))
                left_rows.append(codes + pad)
                right_rows.append(pad + codes)
                visible_rows.append(True)
            else:
                left_rows.append(codes[: width - 1] + [OVERFLOW])
                right_rows.append([OVERFLOW] + codes[len(codes) - width + 1 :])
                visible_rows.append(sum(DIGIT <= code < DIGIT + 10 for code in codes[: width - 1]) == n_digits)
        length = torch.tensor([len(t) for t in texts] + [0], dtype=torch.int32)
        nonspace = torch.tensor(nonspace_counts, dtype=torch.int32)
        digits = torch.tensor(digit_counts, dtype=torch.int32)
        left = torch.tensor(left_rows, dtype=torch.int8)
        right = torch.tensor(right_rows, dtype=torch.int8)
        visible = torch.tensor(visible_rows, dtype=torch.bool)
        assert left.shape == (rows, width)
        self._cpu = _DeviceTables(length, nonspace, digits, left, right, visible)
        self._on: dict[torch.device, _DeviceTables] = {torch.device("cpu"): self._cpu}
        self._literals: dict[str, object] = {}

    def on(self, device: torch.device | str) -> _DeviceTables:
        """The tables on ``device`` (copied on first use, then cached)."""
        device = torch.device(device)
        if device.type != "cpu" and device.index is None:
            device = torch.device(device.type, torch.empty(0, device=device).device.index)
        tables = self._on.get(device)
        if tables is None:
            cpu = self._cpu
            tables = _DeviceTables(*(getattr(cpu, f).to(device) for f in cpu.__dataclass_fields__))
            self._on[device] = tables
        return tables

    def literal(self, text: str):
        """The :class:`~trl_async.rewards.literal.LiteralTables` that find ``text`` across token boundaries."""
        from .literal import LiteralTables

        found = self._literals.get(text)
        if found is None:
            found = self._literals[text] = LiteralTables(self.texts, text)
        return found

    @staticmethod
    def take(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``table[ids]`` for a ``(V+1, ...)`` table (``index_select``: several times faster than fancy indexing)."""
        return table.index_select(0, ids.reshape(-1)).view(*ids.shape, *table.shape[1:])

    def map_ids(self, completion_ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """Ids with positions outside ``keep`` and ids outside the vocabulary replaced by the null token. # (B, L)"""
        in_vocab = (completion_ids >= 0) & (completion_ids < self.vocab_size)
        return torch.where(keep & in_vocab, completion_ids, self.null_id)

    _cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    _lock = threading.Lock()

    @classmethod
    def for_tokenizer(cls, tokenizer, width: int = 8) -> VocabTables:
        """The cached tables of ``tokenizer`` (built on first use: one decode per token id)."""
        with cls._lock:
            per_width = cls._cache.setdefault(tokenizer, {})
            tables = per_width.get(width)
            if tables is None:
                texts = per_width["texts"] if "texts" in per_width else token_texts(tokenizer)
                per_width["texts"] = texts
                tables = per_width[width] = cls(texts, width)
            return tables
