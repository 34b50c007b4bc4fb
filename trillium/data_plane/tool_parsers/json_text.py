"""Reading JSON text that may still be growing: where values end, an object's members.

Pure string scanning, no parsing of numbers: enough for a stream to know
where a tool call's `name` and `arguments` values lie while the model is
still writing them. Every function takes the full text and a start index and
answers None for "not written yet" rather than raising; text that can never
become JSON raises ValueError.
"""

from __future__ import annotations

import json

import attrs

_WS = " \t\n\r"
_SCALAR_END = ",}] \t\n\r"


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def partial_tag_overlap(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (text to hold back)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def string_end(text: str, start: int) -> int | None:
    """End (exclusive) of the JSON string opening at text[start] == '"'."""
    i = start + 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return None


def value_end(text: str, start: int) -> int | None:
    """End (exclusive) of the JSON value starting at text[start]; None while it is incomplete."""
    c = text[start]
    if c == '"':
        return string_end(text, start)
    if c in "{[":
        depth = 0
        i = start
        while i < len(text):
            ch = text[i]
            if ch == '"':
                end = string_end(text, i)
                if end is None:
                    return None
                i = end
                continue
            if ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    i = start
    while i < len(text) and text[i] not in _SCALAR_END:
        i += 1
    # NOTE: a scalar at the very end of the text may still grow (12 -> 123).
    return i if i < len(text) else None


@attrs.frozen
class Member:
    key: str
    start: int  # of the value
    end: int | None  # of the value; None while incomplete


def object_members(text: str, start: int) -> tuple[list[Member], int | None]:
    """The members of the object opening at text[start] == '{' as far as they are written,
    and the object's end (exclusive; None while open)."""
    members: list[Member] = []
    i = skip_ws(text, start + 1)
    while i < len(text):
        c = text[i]
        if c == "}":
            return members, i + 1
        if c == ",":
            i = skip_ws(text, i + 1)
            continue
        if c != '"':
            raise ValueError(f"expected a key at {i}")
        key_end = string_end(text, i)
        if key_end is None:
            return members, None
        key = json.loads(text[i:key_end])
        i = skip_ws(text, key_end)
        if i >= len(text):
            return members, None
        if text[i] != ":":
            raise ValueError(f"expected ':' at {i}")
        i = skip_ws(text, i + 1)
        if i >= len(text):
            return members, None
        end = value_end(text, i)
        members.append(Member(key, i, end))
        if end is None:
            return members, None
        i = skip_ws(text, end)
    return members, None


__all__ = ["Member", "object_members", "partial_tag_overlap", "skip_ws", "string_end", "value_end"]
