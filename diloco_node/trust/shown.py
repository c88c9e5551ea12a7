"""A peer's text as we show it (the status view, log lines): one safe line, escaped character by
character and bounded, since a label or a config value a peer publishes reaches a terminal.
A leaf: nothing of the package."""

from __future__ import annotations

from typing import Any

TEXT_CHARS = 160  # the most of one server-sent string shown (a multiaddr with its /p2p id is ~100)
CUT = "..."


def _escaped(char: str) -> str:
    """One character as the terminal may see it: printable ones as they are, the rest (control
    characters, ESC, DEL, bidi overrides, line and paragraph separators) as repr writes them, and
    the backslash doubled so an escape shown is never confused with the same text sent."""
    if char == "\\":
        return "\\\\"
    return char if char.isprintable() else repr(char)[1:-1]


def shown(value: Any, limit: int = TEXT_CHARS) -> str:
    """A server-sent value as one safe line: escaped character by character, and cut to at most
    `limit` characters, ending in '...' when cut (an escape is never cut in half)."""
    string = str(value)
    pieces = [_escaped(char) for char in string[:limit + 1]]  # each shows as ≥ 1 character
    if len(string) <= limit and sum(map(len, pieces)) <= limit:
        return "".join(pieces)
    kept, length = [], 0
    for piece in pieces:
        if length + len(piece) > limit - len(CUT):
            break
        kept.append(piece)
        length += len(piece)
    return "".join(kept) + CUT
