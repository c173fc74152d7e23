"""Showing untrusted text on one line (an error message, a script comment): the standard library only, so the CLI's
error path and light commands can use it without importing the recipe schema (pydantic)."""

from __future__ import annotations

import unicodedata


def is_control(ch: str) -> bool:
    """True for characters that would end or corrupt a line: C0/C1 controls, DEL, line/paragraph separators, format
    characters (bidirectional overrides and the like)."""
    return unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp", "Cs")


def printable(text: str) -> str:
    """``text`` safe to put on one line (a script comment, an error message): control characters escaped
    (``\\n``, ``\\x1b``, ``\\u2028``), everything else unchanged."""
    if text.isprintable():
        return text
    return "".join(ch.encode("unicode_escape").decode("ascii") if is_control(ch) or not ch.isprintable() else ch
                   for ch in text)
