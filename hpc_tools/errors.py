"""User-facing errors: one line each, naming what is wrong and how to fix it.

The CLI prints them without a traceback and exits with ``UserError.exit_code`` (2).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

_PLAIN = re.compile(r"[\w.,:/@+*-]+")  # shown bare; anything else (spaces, quotes, newlines) is quoted


def show(value: Any) -> str:
    """Render a value the way a user wrote it in YAML (strings unquoted unless empty or odd)."""
    if isinstance(value, str):
        return value if _PLAIN.fullmatch(value) else repr(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):  # items as YAML shows them: [1, true], not Python's [1, True]
        return "[" + ", ".join(repr(v) if isinstance(v, str) and "," in v else show(v) for v in value) + "]"
    return str(value)


@dataclass(frozen=True, slots=True)
class Violation:
    """One broken rule: ``path=value rule (fix)``."""

    path: str
    value: Any
    rule: str
    fix: str

    def __str__(self) -> str:
        where = self.path if self.value is Ellipsis else f"{self.path}={show(self.value)}"
        return f"{where} {self.rule} ({self.fix})"

    def as_dict(self) -> dict[str, str]:
        return {"path": self.path, "value": None if self.value is Ellipsis else show(self.value), "rule": self.rule,
                "fix": self.fix, "message": str(self)}


class UserError(Exception):
    """Bad input from the user; the message is a single line."""

    exit_code = 2


class RecipeError(UserError):
    """A recipe broke one or more rules; ``violations`` lists every one of them."""

    def __init__(self, violations: list[Violation], source: str = "recipe"):
        self.violations = list(violations)
        self.source = source
        first = str(self.violations[0]) if self.violations else "invalid recipe"
        recipe = source if source.endswith((".yaml", ".yml")) else "RECIPE"
        more = (f" (+{len(self.violations) - 1} more; `python -m hpc_tools validate {recipe}` with the same --set "
                "options lists all)") if len(self.violations) > 1 else ""
        super().__init__(f"{source}: {first}{more}")
