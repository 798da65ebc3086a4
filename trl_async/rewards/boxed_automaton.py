r"""The grammar of a ``\boxed{...}``'s content as a finite automaton, and its transition monoid.

The grammar of a box's content (see :mod:`~trl_async.rewards.math_answer`) is regular once the matching closing
brace is known: ignorables (whitespace, ``$``, ``%``, braces, ``\$ \% \, \; \! \: \<space>``), an optional ``x =``,
an optional sign, one number ``[0-9]{1,3}(,[0-9]{3})+|[0-9]*`` (a comma may be written ``{,}``, LaTeX's thousands
separator) with an optional ``.[0-9]+``, ignorables, and optional unit text from a text group (``\text{...}``
etc.) or degrees (``^\circ``) on, without digits but for squares and cubes (``^2``, ``^{3}``). :class:`BoxedAutomaton`
is that grammar as a DFA over a few character classes.

Evaluating a DFA character by character is a sequential loop. Instead every string is identified with the function
it induces on the states (``f[s]`` = the state reached from ``s``), and these functions form a small monoid (about
1,750 elements for this DFA, found by closure at construction). Concatenation is then one lookup in a ``(F, F)``
composition table: :mod:`~trl_async.rewards.boxed_tokens` gives every token its element once, and reduces a window
of tokens in ``log2 W`` rounds of "pair neighbours, look up", each one op over the batch.

Invariants: the empty string (and NUL) is the identity; a string is accepted from ``start`` iff the string
specification (:func:`~trl_async.rewards.math_answer.final_answer`, ``"boxed"``) reads a number from that box content
(tested through the token reader, on a one-character-per-token vocabulary and on real tokenizers).
"""

from __future__ import annotations

import torch

from .vocab_tables import (
    BACKSLASH,
    CARET,
    COMMA,
    DIGIT,
    DOLLAR,
    DOT,
    EQUALS,
    LBRACE,
    LOWER,
    MINUS,
    NUL,
    PERCENT,
    PLUS,
    RBRACE,
    SPACE,
    SPACING,
    UPPER,
    char_code,
)

# what starts the unit text after the number: a text group, or degrees
UNIT_COMMANDS = ("\\text{", "\\textrm{", "\\textbf{", "\\mbox{", "\\mathrm{", "^\\circ", "^{\\circ}")
MAX_DIGITS = 18  # int64 mantissa stays exact

# ---- character classes --------------------------------------------------------------------------------------------
_UNIT_LETTERS = sorted({ch for command in UNIT_COMMANDS for ch in command if ch.isalpha()})
CLASSES = (
    ["nul", "space", "dollar", "percent", "lbrace", "rbrace", "backslash", "spacing", "equals", "plus", "minus"]
    + ["caret", "dot", "comma", "ascii_letter", "other"]
    + [f"letter_{ch}" for ch in _UNIT_LETTERS]
    + [f"digit{d}" for d in range(10)]
)
_CLASS = {name: i for i, name in enumerate(CLASSES)}


def _class_of_code(code: int) -> int:
    """The automaton's class of one character code (:mod:`~trl_async.rewards.vocab_tables`)."""
    single = {
        NUL: "nul", SPACE: "space", DOLLAR: "dollar", PERCENT: "percent", LBRACE: "lbrace", RBRACE: "rbrace",
        BACKSLASH: "backslash", SPACING: "spacing", EQUALS: "equals", PLUS: "plus", MINUS: "minus", DOT: "dot",
        COMMA: "comma", CARET: "caret",
    }  # fmt: skip
    if code in single:
        return _CLASS[single[code]]
    if DIGIT <= code < DIGIT + 10:
        return _CLASS[f"digit{code - DIGIT}"]
    for ch in _UNIT_LETTERS:
        if code == char_code(ch):
            return _CLASS[f"letter_{ch}"]
    if LOWER <= code < LOWER + 26 or UPPER <= code < UPPER + 26:
        return _CLASS["ascii_letter"]
    return _CLASS["other"]  # other punctuation, non-ASCII letters


# ---- the automaton ------------------------------------------------------------------------------------------------
_ZONES = ("start", "letter", "equals", "sign", "after")  # before / around the number; each has a "\" twin
_BODY = ("g1", "g2", "g3", "gn", "k0", "k1", "k2", "k3", "dot0", "frac")  # inside the number
_BODY_ACCEPTS = {"g1", "g2", "g3", "gn", "k3", "frac"}  # a complete number: 1-3 / 4+ digits, full groups, fraction
_IGNORABLE = {"space", "dollar", "percent", "lbrace", "rbrace"}
_ESCAPABLE = {"dollar", "percent", "comma", "spacing", "space"}  # \$ \% \, \; \! \: \<space>
_DIGIT_STEP = {"g1": "g2", "g2": "g3", "g3": "gn", "gn": "gn", "k0": "k1", "k1": "k2", "k2": "k3", "k3": "reject",
               "dot0": "frac", "frac": "frac"}  # fmt: skip
_UNIT_PREFIXES = {c[:i] for c in UNIT_COMMANDS for i in range(1, len(c))}  # "\\", "\\t", ..., "^{\\circ"


def _char(name: str) -> str:
    """The character a class stands for in a unit command (a brace, "^", "\\" or a letter), else ""."""
    single = {"lbrace": "{", "rbrace": "}", "caret": "^", "backslash": "\\"}
    return single.get(name, name.removeprefix("letter_") if name.startswith("letter_") else "")


def _step(state: str, cls: str) -> str:
    """One transition of the content DFA (states are readable names)."""
    raw, cls = cls, "digit" if cls.startswith("digit") else "sign" if cls in ("plus", "minus") else cls
    if cls == "nul" or state == "reject":
        return state
    if state == "unit":  # unit text: anything without digits, but for a square or cube (cm^2, m^{3})
        return "unit^" if cls == "caret" else "reject" if cls == "digit" else "unit"
    if state in ("unit^", "unit^{"):
        if raw in ("digit2", "digit3"):
            return "unit" if state == "unit^" else "unit^{d"
        return "unit^{" if state == "unit^" and cls == "lbrace" else _step("unit", raw)
    if state == "unit^{d":
        return "unit" if cls == "rbrace" else "reject"
    if state.startswith("cmd:"):  # spelling a unit command
        spelled = state[4:] + _char(cls)
        if spelled in UNIT_COMMANDS:
            return "unit"
        return "cmd:" + spelled if spelled in _UNIT_PREFIXES and _char(cls) else "reject"
    if state == "nb":  # "{" right after 1-3 digits or a full group: "{,}" is LaTeX's thousands comma, else a brace
        return "nbc" if cls == "comma" else _step("after", cls)
    if state == "nbc":
        return "k0" if cls == "rbrace" else "reject"
    if state.endswith("\\"):  # after a backslash: an escape, or (after the number) a unit command
        zone = state[:-1]
        if cls in _ESCAPABLE:
            return zone
        if zone == "after" and _char(cls).isalpha() and "\\" + _char(cls) in _UNIT_PREFIXES:
            return "cmd:\\" + _char(cls)
        return "reject"
    if state in _BODY:
        accepts = state in _BODY_ACCEPTS
        if cls == "lbrace" and state in ("g1", "g2", "g3", "k3"):
            return "nb"
        if cls == "caret":  # degrees
            return "cmd:^" if accepts else "reject"
        if cls in _IGNORABLE:
            return "after" if accepts else "reject"
        if cls == "backslash":
            return "after\\" if accepts else "reject"
        if cls == "digit":
            return _DIGIT_STEP[state]
        if cls == "comma":
            return "k0" if state in ("g1", "g2", "g3", "k3") else "reject"
        if cls == "dot":
            return "dot0" if state in ("g1", "g2", "g3", "gn", "k3") else "reject"
        return "reject"
    # the zones around the number
    if cls in _IGNORABLE:
        return state
    if cls == "backslash":
        return state + "\\"
    before_number = state in ("start", "equals", "sign")
    if cls == "ascii_letter" or cls.startswith("letter_"):
        return "letter" if state == "start" else "reject"
    if cls == "equals":
        return "equals" if state == "letter" else "reject"
    if cls == "caret":
        return "cmd:^" if state == "after" else "reject"
    if cls == "sign":
        return "sign" if state in ("start", "equals") else "reject"
    if cls == "digit":
        return "g1" if before_number else "reject"
    if cls == "dot":
        return "dot0" if before_number else "reject"
    return "reject"


class BoxedAutomaton:
    """The content DFA and its transition monoid (built once per process in ~0.3 s; the composition table is 12 MB)."""

    def __init__(self):
        commands = ["cmd:" + p for p in sorted(_UNIT_PREFIXES) if p != "\\"]  # "\" alone is the zones' twin
        states = [*_ZONES, *(z + "\\" for z in _ZONES), *_BODY, *commands]
        states += ["nb", "nbc", "unit", "unit^", "unit^{", "unit^{d", "reject"]  # nb, nbc: "{", "{," in a number
        index = {s: i for i, s in enumerate(states)}
        n_states = len(states)
        generators = [[index[_step(s, c)] for s in states] for c in CLASSES]  # (K, S) one character of each class
        functions, right, parent, via = self._closure(generators, n_states)
        self.n_functions = len(functions)
        # compose[a, b]: the function of "a's string, then b's string". Column 0 (the identity) is every a; a string
        # b found as parent(b) + one character of class via(b) has compose[a, b] = right[compose[a, parent(b)], via(b)],
        # so columns are filled one closure level at a time, parents first.
        right_t = torch.tensor(right)  # (F, K)
        parent_t, via_t = torch.tensor(parent), torch.tensor(via)  # (F,)
        depth = [0] * self.n_functions
        for b in range(1, self.n_functions):
            depth[b] = depth[parent[b]] + 1
        compose = torch.empty((self.n_functions, self.n_functions), dtype=torch.int64)  # (F, F)
        compose[:, 0] = torch.arange(self.n_functions)
        by_depth = torch.tensor(depth)
        for d in range(1, max(depth) + 1):
            columns = (by_depth == d).nonzero().flatten()  # (M,) strings one character longer than their parents
            compose[:, columns] = right_t[compose[:, parent_t[columns]], via_t[columns]]
        accepting = {index[s] for s in (*_BODY_ACCEPTS, "after", "nb", "unit", "unit^", "unit^{")}
        start = index["start"]
        self.n_classes = len(CLASSES)
        self.compose = compose.to(torch.int32).reshape(-1)  # (F*F,) flat: a * F + b (int32: indexes directly)
        self.accepts = torch.tensor([f[start] in accepting for f in functions])  # (F,) from "start"
        self.states = states  # (S,) names
        self.functions = torch.tensor(functions, dtype=torch.int16)  # (F, S) the state each function maps each to
        self.identity = 0
        self.generator = right_t[0].to(torch.int32)  # (K,) the function of one character of each class
        code_table = [_class_of_code(c) for c in range(128)]
        self.code_class = torch.tensor(code_table, dtype=torch.int32)  # (128,) code -> class
        self._on: dict[torch.device, tuple] = {}

    @staticmethod
    def _closure(generators: list[list[int]], n_states: int):
        """Every function a string induces, breadth first from the identity (row 0): ``functions`` (F tuples of S
        states), ``right[f][k]`` = the function of f's string then one character of class k, and for each function
        but the identity the ``parent`` it was first reached from and the class ``via`` which."""
        functions = [tuple(range(n_states))]
        seen = {functions[0]: 0}
        right, parent, via = [], [-1], [-1]
        for f in functions:  # grows while it is walked: the breadth-first frontier
            row = []
            for k, g in enumerate(generators):
                h = tuple(g[s] for s in f)
                j = seen.get(h)
                if j is None:
                    j = seen[h] = len(functions)
                    functions.append(h)
                    parent.append(seen[f])
                    via.append(k)
                row.append(j)
            right.append(row)
        return functions, right, parent, via

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(compose, accepts)`` on ``device`` (copied once, then cached)."""
        found = self._on.get(device)
        if found is None:
            found = self._on[device] = (self.compose.to(device), self.accepts.to(device))
        return found


_AUTOMATON: BoxedAutomaton | None = None


def boxed_automaton() -> BoxedAutomaton:
    """The process-wide automaton (built on first use)."""
    global _AUTOMATON
    if _AUTOMATON is None:
        _AUTOMATON = BoxedAutomaton()
    return _AUTOMATON
