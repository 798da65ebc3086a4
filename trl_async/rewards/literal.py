"""Find a literal string (``\\boxed{``, ``####``, ``</think>``) in token ids, however the tokenizer split it.

The same text tokenises differently by context: Qwen2.5 writes ``\\boxed{`` as ``' \\'``, ``'boxed'``, ``'{'`` but
``$\\boxed{\\$`` as ``'$\\'``, ``'boxed'``, ``'{\\'``; SmolLM2 splits ``'box'``, ``'ed'``; ``<think>`` may end in
``'>\\n'``. So matching one token sequence is not enough. :class:`LiteralTables` classifies every token of the
vocabulary once against the literal ``S`` (length ``n``):

* ``full_after[t]``: ``S`` occurs inside token ``t``; the character offset just after its last occurrence (else 0).
* ``pre[t]``: bit ``k`` set when the text of ``t`` ends with ``S[:k]`` (``0 < k < n``): a match may start here.
* ``mid[t]``: bit ``j`` set when the text of ``t`` *is* ``S[j:j+len(t)]`` and the match continues after it.
* ``post[t]``: bit ``j`` set when the text of ``t`` starts with ``S[j:]``: a match that consumed ``S[:j]`` ends here.

:func:`find_literal` then runs the automaton over the whole batch at once: the set of partial-match states at each
token boundary is a bitmask, and a chain of ``mid`` tokens is at most ``max_chain`` long (found from the vocabulary),
so the recurrence is unrolled that many times. No loop over the batch or the sequence, no host sync.

Invariant (tested against ``str.find`` on decoded text): ``event[b, t]`` is True iff an occurrence of ``S`` in the
concatenated text ends inside token ``t``, and ``offset_at`` is the character offset within token ``t`` just
after the last such occurrence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .positions import Positions


def _nonspace(text: str) -> int:
    return sum(not c.isspace() for c in text)


class LiteralTables:
    """How every token of a vocabulary relates to one literal (see the module docstring)."""

    def __init__(self, texts: list[str], literal: str):
        n = len(literal)
        if n == 0 or n > 62:
            raise ValueError(f"The literal must have 1 to 62 characters, got {literal!r}.")
        self.literal = literal
        self.n = n
        rows = len(texts) + 1  # + the null token
        full_after = [0] * rows
        full_count = [0] * rows
        full_nonspace = [0] * rows
        pre = [0] * rows
        mid = [0] * rows
        post = [0] * rows
        alphabet = set(literal)
        for i, text in enumerate(texts):
            if alphabet.isdisjoint(text):
                continue  # shares no character with the literal: takes no part in any match
            if literal in text:
                full_after[i] = text.rfind(literal) + n
                full_count[i] = text.count(literal)
                full_nonspace[i] = _nonspace(text[: full_after[i]])
            for k in range(1, n):
                if text.endswith(literal[:k]):
                    pre[i] |= 1 << k
            for j in range(1, n - 1):
                if j + len(text) < n and literal.startswith(text, j):
                    mid[i] |= 1 << j
            for j in range(1, n):
                if text.startswith(literal[j:]):
                    post[i] |= 1 << j
        bits = torch.int16 if n <= 14 else torch.int32 if n <= 30 else torch.int64  # state bitmasks need n bits
        self.full_after = torch.tensor(full_after, dtype=torch.int32)  # (V+1,)
        self.full_count = torch.tensor(full_count, dtype=torch.int32)  # (V+1,)
        self.full_nonspace = torch.tensor(full_nonspace, dtype=torch.int32)  # (V+1,) non-space chars up to there
        # non-space characters of S[j:], what a match ending in a token after consuming S[:j] adds to it
        self.suffix_nonspace = torch.tensor([_nonspace(literal[j:]) for j in range(n + 1)], dtype=torch.int64)
        self.nonspace = _nonspace(literal)
        self.pre = torch.tensor(pre, dtype=bits)  # (V+1,)
        self.mid = torch.tensor(mid, dtype=bits)  # (V+1,)
        self.post = torch.tensor(post, dtype=bits)  # (V+1,)
        # Shift amounts for `mid` tokens (all shorter than n); clamped so that no shift reaches the word size.
        word = torch.iinfo(bits).bits - 1
        self.length = torch.tensor([min(len(t), word) for t in texts] + [0], dtype=bits)  # (V+1,)
        self.max_chain = self._longest_mid_chain(texts, literal, mid)
        cpu = _LiteralOnDevice(*(getattr(self, f) for f in self._NAMES))
        self._on: dict[torch.device, _LiteralOnDevice] = {torch.device("cpu"): cpu}

    @staticmethod
    def _longest_mid_chain(texts: list[str], literal: str, mid: list[int]) -> int:
        """Most ``mid`` tokens one match can pass through (longest path over states ``1 .. n-1``)."""
        n = len(literal)
        by_state: dict[int, set[int]] = {}
        for i, bits in enumerate(mid[:-1]):
            if bits:
                for j in range(1, n - 1):
                    if (bits >> j) & 1:
                        by_state.setdefault(j, set()).add(len(texts[i]))
        longest = [0] * (n + 1)
        for j in range(n - 1, 0, -1):
            longest[j] = max((1 + longest[j + s] for s in by_state.get(j, ()) if j + s < n), default=0)
        return max(longest)

    _NAMES = ("full_after", "full_count", "full_nonspace", "pre", "mid", "post", "length", "suffix_nonspace")

    def on(self, device: torch.device) -> _LiteralOnDevice:
        """The tables on ``device`` (the CPU ones are the originals; others copied once and cached)."""
        found = self._on.get(device)
        if found is None:
            found = _LiteralOnDevice(*(getattr(self, f).to(device) for f in self._NAMES))
            self._on[device] = found
        return found


@dataclass
class _LiteralOnDevice:
    full_after: torch.Tensor
    full_count: torch.Tensor
    full_nonspace: torch.Tensor
    pre: torch.Tensor
    mid: torch.Tensor
    post: torch.Tensor
    length: torch.Tensor
    suffix_nonspace: torch.Tensor


@dataclass
class LiteralHits:
    """Where a literal ends, per token (``(B, L)`` tensors); details are read only where asked."""

    n: int  # the literal's length
    event: torch.Tensor  # bool: an occurrence ends inside this token
    ends: torch.Tensor  # int bitmask: bit j = an occurrence that had consumed S[:j] before this token ends here
    tokens: torch.Tensor  # the (mapped) token ids searched
    tables: _LiteralOnDevice

    def _at(self, index: torch.Tensor):
        token = self.tokens.gather(1, index[:, None])[:, 0]  # (B,)
        ends = self.ends.gather(1, index[:, None])[:, 0].to(torch.int64)  # (B,)
        lowest = ends & -ends  # the smallest j ends latest in the token
        j_min = torch.log2(lowest.clamp(min=1).to(torch.float64)).to(torch.int64)  # exact for powers of two
        full = self.tables.full_after.index_select(0, token).to(torch.int64)  # (B,) 0: no occurrence inside
        return token, ends != 0, j_min, full

    def offset_at(self, index: torch.Tensor) -> torch.Tensor:
        """Character offset, within token ``index[b]``, just after the last occurrence ending there. # (B,)"""
        _, has_post, j_min, full = self._at(index)
        return torch.where(full > 0, full, torch.where(has_post, self.n - j_min, 0))

    def nonspace_before_at(self, index: torch.Tensor) -> torch.Tensor:
        """Non-whitespace characters of token ``index[b]`` before that offset. # (B,)"""
        token, has_post, j_min, full = self._at(index)
        inside = self.tables.full_nonspace.index_select(0, token).to(torch.int64)
        suffix = self.tables.suffix_nonspace.index_select(0, j_min.clamp(0, self.n))
        return torch.where(full > 0, inside, torch.where(has_post, suffix, 0))

    def count(self) -> torch.Tensor:
        """Occurrences ending in each token. # (B, L) int64"""
        full_count = self.tables.full_count.index_select(0, self.tokens.reshape(-1)).view(self.tokens.shape)
        return full_count.to(torch.int64) + (self.ends != 0).to(torch.int64)


def find_literal(tokens: torch.Tensor, tables: LiteralTables) -> LiteralHits:
    """Occurrences of ``tables.literal`` in ``tokens`` (ids already mapped to ``[0, V]``, null = V). # (B, L)"""
    t = tables.on(tokens.device)
    flat = tokens.reshape(-1)

    def take(table):  # table[tokens], (B, L)
        return table.index_select(0, flat).view(tokens.shape)

    pre, mid, length = take(t.pre), take(t.mid), take(t.length)  # (B, L) each
    state = pre  # partial matches alive at the end of each token
    for _ in range(tables.max_chain):
        before = torch.nn.functional.pad(state[:, :-1], (1, 0))  # (B, L) state at the start of each token
        state = pre | torch.bitwise_left_shift(before & mid, length)
    before = torch.nn.functional.pad(state[:, :-1], (1, 0))  # (B, L)
    ends = before & take(t.post)  # (B, L) bit j: a match that had consumed S[:j] ends in this token
    event = (take(t.full_after) > 0) | (ends != 0)
    return LiteralHits(tables.n, event, ends, tokens, t)


# ---- one pass for "where does the last occurrence before the first EOS end" (short literals) ---------------------


class PackedLiteral:
    """The tables of a literal of at most 8 characters packed into one int32 per token, EOS flag included, for
    :func:`last_literal`: one table lookup over ``(B, L)`` instead of one per field, then byte-wide automaton steps.

    Rows are indexed by ``clamp(id, -1, V) + 1``: row 0 (negative ids) and row ``V + 1`` (ids ``>= V``) are null.
    Byte 0: ``pre``; byte 1: ``mid``; byte 2: ``post``; byte 3: bits 0-3 the length of a ``mid`` token (else 0),
    bit 4 ``full_after > 0``, bit 5 the token is an EOS.
    """

    MAX_N = 8  # bits 1 .. n-1 of the state fit in a byte

    def __init__(self, tables: LiteralTables, vocab_size: int, eos_token_ids):
        if tables.n > self.MAX_N:
            raise ValueError(f"PackedLiteral needs a literal of at most {self.MAX_N} characters, got {tables.n}.")
        self.tables = tables
        self.n = tables.n
        self.vocab_size = vocab_size
        pre, mid, post = (getattr(tables, f)[:vocab_size].to(torch.int64) for f in ("pre", "mid", "post"))
        length = torch.where(mid != 0, tables.length[:vocab_size].to(torch.int64), 0)
        full = (tables.full_after[:vocab_size] > 0).to(torch.int64)
        eos = torch.zeros(vocab_size, dtype=torch.int64)
        for eos_id in eos_token_ids or ():
            eos[eos_id] = 1
        word = pre | (mid << 8) | (post << 16) | (length << 24) | (full << 28) | (eos << 29)
        null = torch.zeros(1, dtype=torch.int64)
        self.code = torch.cat([null, word, null]).to(torch.int32)  # (V+2,)
        full_after = tables.full_after[:vocab_size].to(torch.int64)
        self.full_after = torch.cat([null, full_after, null])  # (V+2,) by key
        # by the byte of match ends in a token (bit j: a match that had consumed S[:j] ends there): the character
        # offset after the latest one, n - (lowest j); 0 when none
        self.crossing_end = torch.tensor([self.n - (e & -e).bit_length() + 1 if e else 0 for e in range(256)])
        self._on: dict[torch.device, tuple[torch.Tensor, ...]] = {
            torch.device("cpu"): (self.code, self.full_after, self.crossing_end)
        }

    def on(self, device: torch.device):
        found = self._on.get(device)
        if found is None:
            found = self._on[device] = (self.code.to(device), self.full_after.to(device), self.crossing_end.to(device))
        return found


_PRE_AND_FLAGS = 0xFF0000FF - 2**32  # int32 mask keeping bytes 0 (pre) and 3 (flags)


def last_literal(ids: torch.Tensor, mask: torch.Tensor, packed: PackedLiteral, max_chain: int):
    """Where the last occurrence of the literal before the first EOS ends, in one pass over raw ids.

    Same answer as mapping ids outside ``mask`` / the vocabulary / after the first EOS to the null token, running
    :func:`find_literal` and taking the last event. -> ``key`` (B, L) int32 (``clamp(id, -1, V) + 1``, 0 outside
    ``mask``: 0 and ``V + 1`` are null), ``first_eos`` (B,) int64 (L when none), ``last`` (B,) int64 token where it
    ends (-1: none), ``offset`` (B,) int64 characters of that token before the text after the occurrence.

    Written for the CPU's per-op costs: the (B, L) work is ~40 ops of byte-wide or int16 arithmetic on contiguous
    tensors; comparisons and ``where`` (bool outputs), ``argmax`` and int64 arithmetic are several times slower there.
    """
    code_table, full_after, crossing_end = packed.on(ids.device)
    batch, length = ids.shape
    # (B, L) the row: clamp(id, -1, V) + 1 (clamped before narrowing: an id >= 2**31 must not wrap into the
    # vocabulary), in a new contiguous buffer (never the caller's ids), 0 outside the mask
    key = ids.clamp(-1, packed.vocab_size).to(torch.int32, memory_format=torch.contiguous_format)
    key.add_(1).mul_(mask)
    code = code_table.index_select(0, key.view(-1))  # (B*L,) int32, null outside the mask
    # The rows run on one flat sequence: a row's first token continues no match from the row before (no mid, no post).
    code.view(batch, length)[:, 0] &= _PRE_AND_FLAGS
    pre = code.to(torch.uint8)  # the byte fields, each (B*L,) contiguous
    mid = (code >> 8).to(torch.uint8)
    post = (code >> 16).to(torch.uint8)
    flags = (code >> 24).to(torch.uint8)
    shift = flags & 15
    state = torch.empty(batch * length + 1, dtype=torch.uint8, device=ids.device)  # state[i]: before token i
    state[0] = 0
    state[1:] = pre  # partial matches alive after each token (bit k: S[:k] consumed)
    step = torch.empty_like(pre)
    for _ in range(max_chain):  # a chain of `mid` tokens advances one token per round
        torch.bitwise_and(state[:-1], mid, out=step)
        torch.bitwise_or(step.bitwise_left_shift_(shift), pre, out=state[1:])
    ends = (state[:-1] & post).view(batch, length)  # bit j: a match that had consumed S[:j] ends in this token
    event = (ends | (flags & 16).view(batch, length)).clamp_(max=1)  # (B, L) 0/1
    eos = (flags >> 5).view(batch, length)  # (B, L) 0/1
    small = torch.int16 if length < 2**14 else torch.int32  # position arithmetic in the narrowest type
    axis = Positions.of(length, ids.device, small)
    positions, from_end = axis.plus1, axis.rev  # (L,) position + 1, L - position
    first_eos = length - (eos * from_end).amax(dim=1)  # (B,) L when there is no EOS
    before_eos = (positions - (first_eos + 1)[:, None]) >> (torch.iinfo(small).bits - 1)  # -1 before the EOS, else 0
    last = ((event * positions) & before_eos).amax(dim=1).to(torch.int64) - 1  # (B,) -1: none
    at = last.clamp(min=0)[:, None]
    crossing = crossing_end.index_select(0, ends.gather(1, at)[:, 0].to(torch.int64))  # (B,) a match from before
    full = full_after.index_select(0, key.gather(1, at)[:, 0])  # (B,) 0: no occurrence inside the token
    # An occurrence wholly inside the token ends after n characters of it, one that began before within n - 1.
    offset = torch.maximum(full, crossing)
    return key, first_eos.to(torch.int64), last, offset
