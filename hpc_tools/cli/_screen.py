"""Fitting the human output of ``plan``, ``status``, ``list`` and ``analyze`` to the terminal: long lines wrap at
word boundaries, tables drop their least important columns (``--json`` always carries everything).

The width is ``$COLUMNS`` when set (``COLUMNS=80 hpc-tools status``), else the terminal's; output into a pipe or a
file is not wrapped (``PIPE_WIDTH``: a reader's ``grep`` finds whole lines) unless ``$COLUMNS`` asks for it.
"""

from __future__ import annotations

import os
import shutil
import textwrap
from collections.abc import Callable, Sequence

PIPE_WIDTH = 100_000  # no wrapping
MIN_WIDTH = 40  # narrower asks are read as this: a table needs room for its first columns


def width() -> int:
    """The columns the output may use."""
    env = os.environ.get("COLUMNS", "").strip()
    if env.isdigit() and int(env) > 0:
        return max(int(env), MIN_WIDTH)
    if os.isatty(1):
        return max(shutil.get_terminal_size((PIPE_WIDTH, 24)).columns, MIN_WIDTH)
    return PIPE_WIDTH


def wrap(line: str, cols: int | None = None, indent: int | None = None) -> list[str]:
    """One logical line as screen lines of at most ``cols``; continuation lines are indented under the value of a
    ``key  value`` line (``indent``: its column, default the end of the first word's padding, at most 12)."""
    cols = cols or width()
    if len(line) <= cols:
        return [line]
    if indent is None:
        head = len(line) - len(line.lstrip(" "))
        word = line.lstrip(" ").split(" ", 1)[0]
        rest = line[head + len(word):]
        indent = head + len(word) + len(rest) - len(rest.lstrip(" "))
        indent = indent if indent <= 12 else 4
    return textwrap.wrap(line, cols, subsequent_indent=" " * indent, break_long_words=True,
                         break_on_hyphens=False) or [""]


def echo(text: str = "", cols: int | None = None) -> None:
    """Print ``text`` (one or more lines), each line wrapped to the width."""
    cols = cols or width()
    for line in text.split("\n"):
        print("\n".join(wrap(line, cols)))


def fit_columns(columns: Sequence[str], widths: dict[str, int], cols: int | None = None, keep: int = 1,
                sep: int = 2, priority: Sequence[str] | None = None) -> list[str]:
    """The columns to show in ``cols``, in ``columns`` order: the first ``keep`` always, then as many of the rest as
    fit with their ``widths`` and ``sep`` spaces between, tried in ``priority`` order (default: ``columns``)."""
    cols = cols or width()
    shown = list(columns[:keep])
    used = sum(widths[c] for c in shown) + sep * (len(shown) - 1)
    for c in [*(priority or ()), *columns]:
        if c in shown or c not in columns:
            continue
        if used + sep + widths[c] <= cols:
            shown.append(c)
            used += sep + widths[c]
    return [c for c in columns if c in shown]


def table(rows: Sequence[dict], columns: Sequence[str], cols: int | None = None, keep: int = 1,
          fmt: Callable[[str, object], str] = lambda c, v: "" if v is None else str(v),
          headers: dict[str, str] | None = None, last_wraps: bool = False,
          priority: Sequence[str] | None = None) -> list[str]:
    """A plain text table of ``rows`` in ``cols``: columns that do not fit are left out, the least important first
    (``priority``: most important first; default the display order ``columns``), and a note names them. A column
    empty on every row is left out. ``last_wraps``: the last column of ``columns`` takes the width left and wraps
    (e.g. a reason) instead of being dropped for its length."""
    cols = cols or width()
    headers = headers or {}
    text = [{c: fmt(c, r.get(c)) for c in columns} for r in rows]
    wraps = columns[-1] if last_wraps and columns and any(t[columns[-1]] for t in text) else None
    columns = [c for i, c in enumerate(columns) if i < keep or any(t[c] for t in text)]
    widths = {c: max([len(headers.get(c, c))] + [len(t[c]) for t in text]) for c in columns}
    if wraps:
        widths[wraps] = min(widths[wraps], max(12, len(headers.get(wraps, wraps))))
    shown = fit_columns(columns, widths, cols, keep, priority=priority)
    out = []
    before = sum(widths[c] + 2 for c in shown[:-1])
    last = shown[-1]
    room = max(cols - before, widths[last])
    for cells in [{c: headers.get(c, c) for c in shown}] + [{c: t[c] for c in shown} for t in text]:
        head = "  ".join(cells[c].ljust(widths[c]) for c in shown[:-1])
        tail = cells[last]
        pieces = textwrap.wrap(tail, room) if last == wraps and len(tail) > room else [tail]
        for i, piece in enumerate(pieces or [""]):
            lead = head if i == 0 else " " * len(head)
            out.append((lead + ("  " if shown[:-1] else "") + piece).rstrip())
    dropped = [headers.get(c, c) for c in columns if c not in shown]
    if dropped:
        out += wrap(f"({', '.join(dropped)} left out to fit {cols} columns; --json has every field)", cols, 1)
    return out
