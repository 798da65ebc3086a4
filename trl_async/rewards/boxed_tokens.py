r"""Read the content of the last ``\boxed{`` token by token, from tables made once per vocabulary.

:class:`~trl_async.rewards.boxed_automaton.BoxedAutomaton` is a DFA over characters whose strings form a small
monoid. A token's text is a string, so every token has its monoid element, precomputed here with the other facts
the reader needs about its text. The box's content is then read over ``W`` tokens instead of their characters: no
expansion to characters, no compaction, and a ``log2 W`` composition tree.

A *piece* is a row of these tables:

* rows ``0 .. V + 1`` are the key space of :func:`~trl_async.rewards.literal.last_literal` (``clamp(id, -1, V) + 1``:
  row 0 and row ``V + 1`` are the empty null piece, row ``k`` is token ``k - 1``);
* *suffix* pieces: the text of a token that can end the opener, from character ``offset`` on (the content may start
  inside the token: ``'{\\'``, ``'{-'``): row ``suffix_base[key] + offset``;
* *closing* pieces: the text of a piece (token or suffix) up to the brace that closes the box when the piece is
  entered at brace depth ``d`` (``'}.'`` closes at depth 0, ``'}}'`` at 0 or 1): row ``closing_base[piece] + d``.

Per piece: its monoid element, brace depth change and lowest running depth, digit count and value (the digits
concatenated), digits after its first ``.`` (-1000 when it has none), whether a ``-`` comes before its first digit,
all of the text before its first ``^`` (unit exponents, ``cm^2``, come after it), and whether it has a ``^``.

Invariant (tested against :func:`~trl_async.rewards.math_answer.final_answer` on fuzzed text and three
tokenizers): :meth:`BoxedTokenReader.read` gives the value the string specification gives for the text after the
opener, whenever the box closes within the window's ``W`` tokens, at brace depth below :data:`MAX_DEPTH`. Tokens are
read whole, however long.
"""

from __future__ import annotations

import threading
import weakref

import torch

from .boxed_automaton import MAX_DIGITS, BoxedAutomaton, boxed_automaton
from .positions import Positions
from .vocab_tables import VocabTables, char_code

take = VocabTables.take

MAX_DEPTH = 16  # a box whose closing brace comes at a deeper brace nesting is not read
_NO_DOT = -1000  # "digits after the first dot" of a piece without one: below any real count plus the digits after


def _fields(text: str) -> tuple[int, int, int, int, int, int, int]:
    """(brace change, lowest running depth, has a '^', then of the text before its first '^': digit count, digit
    value, digits after the first '.' or _NO_DOT, 1 when a '-' comes before the first digit) of one piece's text.

    In an accepted box every digit before the first '^' is the number's and every one after it a unit's exponent."""
    depth = lowest = 0
    for ch in text:
        depth += (ch == "{") - (ch == "}")
        lowest = min(lowest, depth)
    caret = text.find("^")
    head = text if caret < 0 else text[:caret]
    digits = [ch for ch in head if "0" <= ch <= "9"]
    count = len(digits)
    value = int("".join(digits)) if 0 < count <= MAX_DIGITS else 0
    dot = head.find(".")
    after_dot = sum("0" <= ch <= "9" for ch in head[dot + 1 :]) if dot >= 0 else _NO_DOT
    first_digit = next((i for i, ch in enumerate(head) if "0" <= ch <= "9"), len(head))
    minus = int("-" in head[:first_digit])
    return depth, lowest, int(caret >= 0), min(count, MAX_DIGITS + 1), value, after_dot, minus


def _before_close(text: str, depth: int) -> str | None:
    """The text before the brace that takes the running depth from ``depth`` to -1, or None."""
    for i, ch in enumerate(text):
        depth += (ch == "{") - (ch == "}")
        if depth < 0:
            return text[:i]
    return None


class BoxedTokenReader:
    """The piece tables of one vocabulary for the ``\\boxed{`` opener (see the module docstring)."""

    def __init__(self, vocab_tables: VocabTables):
        texts, opener, automaton = vocab_tables.texts, vocab_tables.literal("\\boxed{"), boxed_automaton()
        vocab = len(texts)
        pieces: list[str] = ["", *texts, ""]  # the key space
        suffix_base = [0] * (vocab + 2)
        ends = ((opener.full_after[:vocab] > 0) | (opener.post[:vocab] != 0)).nonzero().flatten().tolist()
        for token in ends:  # tokens the opener can end in: their text from every offset on
            suffix_base[token + 1] = len(pieces) - 1  # + offset (>= 1)
            text = texts[token]
            pieces += [text[offset:] for offset in range(1, len(text) + 1)]
        closing_base = [0] * len(pieces)
        closers = []
        for row, text in enumerate(pieces):  # pieces that can close the box: their text up to it, per entry depth
            if "}" in text:
                prefixes = [_before_close(text, d) for d in range(MAX_DEPTH)]
                prefixes = prefixes[: next((d for d, p in enumerate(prefixes) if p is None), MAX_DEPTH)]
                closing_base[row] = len(pieces) + len(closers)
                closers += prefixes
        pieces += closers
        closing_base += [0] * len(closers)
        fields = torch.tensor([_fields(text) for text in pieces], dtype=torch.int64)  # (R, 7)
        self.n_pieces = len(pieces)
        self.suffix_base = torch.tensor(suffix_base, dtype=torch.int32)  # (V+2,)
        self.closing_base = torch.tensor(closing_base, dtype=torch.int32)  # (R,)
        self.function = self._functions(pieces, automaton)  # (R,) int32 monoid element of the text
        self.depth_change = fields[:, 0].to(torch.int32)  # (R,)
        self.lowest = fields[:, 1].to(torch.int32)  # (R,) <= 0
        self.caret = fields[:, 2].to(torch.int32)  # (R,) 1: the text has a '^'
        self.n_digits = fields[:, 3].to(torch.int32)  # (R,) before the first '^', capped at MAX_DIGITS + 1
        self.digit_value = fields[:, 4].contiguous()  # (R,) int64
        self.after_dot = fields[:, 5].to(torch.int32)  # (R,) digits after the first '.', -1000 without one
        self.minus_first = fields[:, 6].to(torch.int32)  # (R,) 1: a '-' before the first digit
        self.pow10 = torch.tensor([10**k for k in range(MAX_DIGITS + 1)], dtype=torch.int64)  # place values
        self.pow10f = self.pow10.to(torch.float64)
        self.automaton = automaton
        self._on: dict[torch.device, tuple] = {}

    @staticmethod
    def _functions(pieces: list[str], automaton: BoxedAutomaton) -> torch.Tensor:
        """The monoid element of every piece's text, folded one character column at a time over all pieces."""
        compose = automaton.compose.to(torch.int64)
        n = automaton.n_functions
        # Every character's class at once: code points of all texts joined, through a table over the code points used.
        joined = "".join(pieces)
        points = torch.frombuffer(bytearray(joined.encode("utf-32-le", "surrogatepass")), dtype=torch.int32).long()
        code_of_point = torch.zeros(int(points.max()) + 1 if len(joined) else 1, dtype=torch.int64)
        for ch in set(joined):
            code_of_point[ord(ch)] = char_code(ch)
        classes = automaton.code_class.to(torch.int64).index_select(0, code_of_point.index_select(0, points))
        identity = torch.tensor([automaton.identity])  # a padding slot after the last character
        generators = torch.cat([automaton.generator.to(torch.int64).index_select(0, classes), identity])  # (N + 1,)
        nul = len(generators) - 1
        lengths = torch.tensor([len(p) for p in pieces])  # (R,)
        starts = lengths.cumsum(0) - lengths  # (R,) where each text begins in `joined`
        order = torch.argsort(lengths)  # chunks of similar lengths
        out = torch.full((len(pieces),), automaton.identity, dtype=torch.int64)
        for lo in range(0, len(pieces), 8192):
            rows = order[lo : lo + 8192]  # (P,)
            f = torch.full((len(rows),), automaton.identity, dtype=torch.int64)
            for column in range(int(lengths[rows[-1]])):
                inside = column < lengths[rows]  # (P,)
                at = torch.where(inside, starts[rows] + column, nul)  # (P,) the character, or padding
                f = compose.index_select(0, f * n + generators.index_select(0, at))
            out[rows] = f
        return out.to(torch.int32)

    def on(self, device: torch.device) -> tuple:
        found = self._on.get(device)
        if found is None:
            names = ("suffix_base", "closing_base", "function", "depth_change", "lowest", "caret", "n_digits")
            names += ("digit_value", "after_dot", "minus_first", "pow10", "pow10f")
            found = self._on[device] = tuple(getattr(self, n).to(device) for n in names)
        return found

    def read(self, keys: torch.Tensor, start: torch.Tensor, offset: torch.Tensor, end: torch.Tensor, window: int):
        """The box whose opener ends in token ``start`` (B,) of ``keys`` (B, L), its content from character ``offset``
        (B,) of that token on, reading at most ``window`` tokens from there and none from ``end`` (B,) on.
        -> ``(value (B,) float64, ok (B,) bool)``"""
        length = keys.shape[1]
        index = start[:, None] + Positions.of(window, keys.device, torch.int64).at[1:]  # (B, W-1) the tokens after
        following = keys.gather(1, index.clamp(max=length - 1)) * (index < end[:, None])  # (B, W-1) null past end
        first = keys.gather(1, start[:, None])[:, 0]  # (B,) the opener's last token
        (suffix_base, closing_base, function, depth_change, lowest, caret, n_digits, digit_value, after_dot,
         minus_first, pow10, pow10f) = self.on(first.device)  # fmt: skip
        compose, accepts = self.automaton.on(first.device)
        pos = Positions.of(window, first.device)
        head = take(suffix_base, first) + offset.to(torch.int32)  # (B,) the content's part of the opener's token
        piece = torch.cat([head.clamp_(0, self.n_pieces - 1)[:, None], following.to(torch.int32)], dim=1)  # (B, W)
        # Where the box closes: the first piece whose lowest running depth, from its entry depth, goes below zero.
        change = take(depth_change, piece)  # (B, W)
        entry = change.cumsum(dim=1, dtype=torch.int32) - change  # (B, W) depth before each piece
        below = (entry + take(lowest, piece)) >> 31  # (B, W) -1 where the running depth goes below zero, else 0
        closing = window - (below & pos.rev).amax(dim=1)  # (B,) the first such piece, W when none
        at = closing.clamp(max=window - 1).long()[:, None]  # (B, 1)
        depth = entry.gather(1, at)[:, 0]  # (B,)
        closer = take(closing_base, piece.gather(1, at)[:, 0]) + depth.clamp(max=MAX_DEPTH - 1)  # (B,)
        closer = closer.clamp_(max=self.n_pieces - 1)  # (where the box does not close here: any row, not read)
        piece = (piece * pos.lt(closing)).scatter_(1, at, closer[:, None])  # (B, W) content only
        # The grammar: compose the pieces' functions in log2(W) rounds.
        f = take(function, piece)  # (B, W)
        n = self.automaton.n_functions
        while f.shape[1] > 1:
            if f.shape[1] % 2:
                f = torch.nn.functional.pad(f, (0, 1), value=self.automaton.identity)
            f = take(compose, torch.add(f[:, 1::2], f[:, 0::2], alpha=n))  # (B, M/2) left * F + right
        ok = take(accepts, f[:, 0]) & (closing < window) & (depth < MAX_DEPTH)
        # The value: the content's digits up to its first '^' are the number's (the grammar allows no others).
        carets = take(caret, piece)  # (B, W)
        digits = piece * (carets.cumsum(dim=1, dtype=torch.int32) <= carets)  # (B, W) null after the first '^' piece
        count = take(n_digits, digits)  # (B, W)
        seen = count.cumsum(dim=1, dtype=torch.int32)  # (B, W) digits up to each piece's end
        total = seen[:, -1]  # (B,)
        after = total[:, None] - seen  # (B, W) digits after each piece
        place = take(pow10, after.clamp(max=MAX_DIGITS))  # (B, W) int64
        mantissa = (take(digit_value, digits) * place).sum(dim=1)  # (B,) exact
        fraction = (take(after_dot, digits) + after).amax(dim=1).clamp_(0, MAX_DIGITS)  # (B,) after the first dot
        value = mantissa.to(torch.float64) / take(pow10f, fraction)
        negative = (take(minus_first, digits) - (seen - count)).amax(dim=1) > 0  # a '-' with no digit before it
        value = torch.where(negative, -value, value)
        return value, ok & (total <= MAX_DIGITS)


_READERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def boxed_token_reader(vocab_tables: VocabTables) -> BoxedTokenReader:
    """The reader of one vocabulary (built on first use, ~0.6 s for a 152k vocabulary, then cached)."""
    with _LOCK:
        found = _READERS.get(vocab_tables)
        if found is None:
            found = _READERS[vocab_tables] = BoxedTokenReader(vocab_tables)
        return found
