"""Constrained decoding without a grammar engine: text that must follow a sequence of segments.

A forced tool call (`tool_choice: "required"` or a named function) is a fixed opening, a function
name out of a set, a fixed middle, a JSON object (the arguments) and a fixed closing. `TextConstraint`
checks a reply's text against such a sequence from its start, character by character, and says
whether it is still a valid prefix, whether it is complete, and which text is the only way on
(`forced`: what the decode loop feeds without sampling). The decode loop (engine.run_generation)
masks candidate tokens whose text would make the prefix invalid and stops when the text is complete.

Why re-check the whole text for every candidate rather than keep an incremental automaton: the
text is a decode of the reply's tokens, and a token that completes a multi-byte character changes
the decode of the one before it (a trailing U+FFFD becomes the character); re-checking from the
start is always right, and a tool call is a few hundred characters. The JSON check is of syntax
only (any object), not of the function's parameter schema.
"""

from __future__ import annotations

from dataclasses import dataclass

# A model under a constraint can loop on whitespace between JSON tokens (a known failure of guided
# decoding); longer runs than any sane pretty-printing are refused, so it must write JSON instead.
MAX_WHITESPACE_RUN = 32
# Nesting deeper than this in tool arguments is refused (bounds the checker's stack).
MAX_JSON_DEPTH = 32

_WS = " \t\n\r"
_ESCAPES = '"\\/bfnrtu'
_HEX = "0123456789abcdefABCDEF"
_LITERALS = {"t": "true", "f": "false", "n": "null"}


@dataclass(frozen=True)
class Literal:
    """Text that must appear exactly."""

    text: str


@dataclass(frozen=True)
class OneOf:
    """One of these strings; none may be a prefix of another (end each with a delimiter)."""

    options: tuple[str, ...]

    def __post_init__(self):
        if not self.options or any(a != b and b.startswith(a) for a in self.options for b in self.options):
            raise ValueError(f"OneOf options must be non-empty and prefix-free: {self.options}")


@dataclass(frozen=True)
class JsonObject:
    """One JSON object (syntax only), optionally after whitespace."""


Segment = Literal | OneOf | JsonObject


@dataclass(frozen=True)
class Check:
    ok: bool  # the text is a prefix of some text the constraint accepts
    complete: bool = False  # the text is a whole accepted text
    forced: str = ""  # the only way the text can go on (empty: a choice is the model's)


class TextConstraint:
    def __init__(self, segments: list[Segment] | tuple[Segment, ...]):
        self.segments = tuple(segments)

    def check(self, text: str) -> Check:
        pos = 0
        for k, seg in enumerate(self.segments):
            rest = text[pos:]
            if isinstance(seg, Literal):
                if rest.startswith(seg.text):
                    pos += len(seg.text)
                    continue
                if seg.text.startswith(rest):
                    return Check(True, forced=seg.text[len(rest) :] + self._forced_after(k))
                return Check(False)
            if isinstance(seg, OneOf):
                whole = next((o for o in seg.options if rest.startswith(o)), None)
                if whole is not None:
                    pos += len(whole)
                    continue
                tails = [o[len(rest) :] for o in seg.options if o.startswith(rest)]
                if not tails:
                    return Check(False)
                forced = _common_prefix(tails)
                return Check(True, forced=forced + self._forced_after(k) if len(tails) == 1 else forced)
            ok, end = json_object_prefix(text, pos)
            if not ok:
                return Check(False)
            if end is None:
                return Check(True)
            pos = end
        return Check(pos == len(text), complete=pos == len(text))

    def _forced_after(self, k: int) -> str:
        """The text forced from the start of segment k + 1 on, once segment k is sure to be whole."""
        forced = ""
        for seg in self.segments[k + 1 :]:
            if isinstance(seg, Literal):
                forced += seg.text
            elif isinstance(seg, OneOf) and len(seg.options) == 1:
                forced += seg.options[0]
            else:
                return forced + (_common_prefix(list(seg.options)) if isinstance(seg, OneOf) else "")
        return forced


def _common_prefix(strings: list[str]) -> str:
    first, last = min(strings), max(strings)
    n = 0
    while n < len(first) and first[n] == last[n]:
        n += 1
    return first[:n]


def json_object_prefix(text: str, start: int = 0) -> tuple[bool, int | None]:
    """Whether `text[start:]` begins like one JSON object (after optional whitespace): (False, None)
    at the first character that no JSON object can have there; (True, end) when the object closes at
    `end` (text after it is not looked at); (True, None) when all of it is a valid unfinished prefix."""
    stack: list[str] = []  # open containers: "{" or "["
    # what comes next: "value", "key_or_end" (after "{"), "key" (after "," in an object), "colon",
    # "after" (a value ended inside a container), "value_or_end" (after "["), "string", "number", "literal"
    mode = "value"
    in_key = False  # the string being read is an object key
    escape = 0  # 0: none; 1: after a backslash; 2..5: hex digits of \\uXXXX still to read (5 - escape + 1)
    number = ""  # the number read so far
    literal = ""  # the rest of true/false/null still to read
    ws_run = 0
    i = start
    while i < len(text):
        c = text[i]
        if mode == "string":
            if escape == 1:
                if c not in _ESCAPES:
                    return False, None
                escape = 2 if c == "u" else 0
            elif escape >= 2:
                if c not in _HEX:
                    return False, None
                escape = 0 if escape == 5 else escape + 1
            elif c == "\\":
                escape = 1
            elif c == '"':
                mode = "colon" if in_key else "after"
            elif ord(c) < 0x20:  # control characters must be escaped in JSON strings
                return False, None
            i += 1
            continue
        if mode == "number":
            if c in "0123456789+-.eE" and _number_prefix(number + c):
                number += c
                i += 1
                continue
            if not _number_complete(number):
                return False, None
            mode = "after"  # the character is looked at again below
        if mode == "literal":
            if c != literal[0]:
                return False, None
            literal = literal[1:]
            mode = "literal" if literal else "after"
            i += 1
            continue
        if mode == "after" and not stack:
            return True, i  # the top-level object closed just before this character
        if c in _WS:
            ws_run += 1
            if ws_run > MAX_WHITESPACE_RUN:
                return False, None
            i += 1
            continue
        ws_run = 0
        if mode in ("value", "value_or_end"):
            if mode == "value_or_end" and c == "]":
                stack.pop()
                mode = "after"
            elif not stack and c != "{":
                return False, None  # the top level is an object
            elif c in "{[":
                if len(stack) >= MAX_JSON_DEPTH:
                    return False, None
                stack.append(c)
                mode = "key_or_end" if c == "{" else "value_or_end"
            elif c == '"':
                mode, in_key = "string", False
            elif c in "-0123456789":
                mode, number = "number", c
            elif c in _LITERALS:
                mode, literal = "literal", _LITERALS[c][1:]
            else:
                return False, None
        elif mode in ("key_or_end", "key"):
            if mode == "key_or_end" and c == "}":
                stack.pop()
                mode = "after"
            elif c == '"':
                mode, in_key = "string", True
            else:
                return False, None
        elif mode == "colon":
            if c != ":":
                return False, None
            mode = "value"
        elif mode == "after":
            if c == ",":
                mode = "key" if stack[-1] == "{" else "value"
            elif c == ("}" if stack[-1] == "{" else "]"):
                stack.pop()
                mode = "after"
            else:
                return False, None
        i += 1
    if mode == "after" and not stack:
        return True, i
    return True, None


def _number_prefix(s: str) -> bool:
    """Whether `s` can still grow into a JSON number."""
    i = 1 if s.startswith("-") else 0
    if i == len(s):
        return True
    if s[i] == "0":
        i += 1
        if i < len(s) and s[i].isdigit():
            return False  # no leading zeros
    elif s[i].isdigit():
        while i < len(s) and s[i].isdigit():
            i += 1
    else:
        return False
    if i < len(s) and s[i] == ".":
        i += 1
        if i < len(s) and not s[i].isdigit():
            return False
        while i < len(s) and s[i].isdigit():
            i += 1
    if i < len(s) and s[i] in "eE":
        i += 1
        if i < len(s) and s[i] in "+-":
            i += 1
        if i < len(s) and not s[i].isdigit():
            return False
        while i < len(s) and s[i].isdigit():
            i += 1
    return i == len(s)


def _number_complete(s: str) -> bool:
    return _number_prefix(s) and s[-1].isdigit()
