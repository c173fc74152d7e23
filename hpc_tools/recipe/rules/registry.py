"""The rule registry: ``@rule`` and ``@note`` register a rule, ``check_recipe`` runs every rule and returns every
violation (one line per root cause, ``merged``), ``recipe_notes`` the notes; and the fixes that list the values they
admit (``_try``), which the rules of every section write."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable, Iterator

from hpc_tools.errors import Violation, show
from hpc_tools.layout import ParallelLayout
from hpc_tools.recipe.reads import fields_read
from hpc_tools.recipe.schema import Recipe

RuleFn = Callable[[Recipe, ParallelLayout], Iterator[Violation]]


@dataclass(frozen=True, slots=True)
class Rule:
    name: str
    doc: str
    fn: RuleFn

    @property
    def reads(self) -> frozenset[str]:
        """The recipe fields this rule reads, found in its source (``hpc_tools.recipe.reads``)."""
        return fields_read(self.fn)


RULES: list[Rule] = []


def rule(fn: RuleFn) -> RuleFn:
    RULES.append(Rule(fn.__name__, (fn.__doc__ or "").strip(), fn))
    return fn


# A rule refusing the layout's product (layout_fills_world) also makes what the layout derives from it unsound.
DERIVED = {"layout_fills_world": frozenset({"parallel.data_size"})}


def check_recipe(recipe: Recipe) -> list[Violation]:
    """Every violation, one line per root cause: a line computed from a value an earlier rule refused (a sequence
    length checked against a refused context_size, a batch split by a refused layout: the rule reads that field and
    the line names it) is left out, and the lines refusing one value are one line whose fix is what every rule
    admits (``merged``)."""
    layout = ParallelLayout.from_recipe(recipe)
    kept: list[Violation] = []
    refused: set[str] = set()
    for r in RULES:
        for v in r.fn(recipe, layout):
            if v.path not in refused and _reads(r) & refused and _names_any(v, refused):
                continue
            kept.append(v)
            refused |= {v.path} | DERIVED.get(r.name, frozenset())
    return merged(kept)


def _reads(r: Rule) -> frozenset[str]:
    """The fields the rule reads (``Rule.reads``, from its source); none when its source cannot be read."""
    try:
        return r.reads
    except (OSError, TypeError, SyntaxError):
        return frozenset()


def _names_any(v: Violation, fields: set[str]) -> bool:
    """Whether the line's rule or fix names one of ``fields``: by its path, or by its bare key (``tensor_size``,
    ``data_size``); a key inside another path (``tracking.mlflow.enabled`` for ``tracking.wandb.enabled``) is another
    field."""
    text = f"{v.rule} ({v.fix})"
    return any(re.search(rf"(?<![\w.]){re.escape(f)}(?![\w])", text) or
               re.search(rf"(?<![\w.]){re.escape(f.rsplit('.', 1)[-1])}(?![\w])", text) for f in fields)


def merged(violations: list[Violation]) -> list[Violation]:
    """The lines refusing the same field and value as one line: the rules joined, the fix what every rule admits
    (the intersection of the values their fixes list, ``_Fix``), or each fix once when they list none."""
    groups: dict[tuple[str, str], list[Violation]] = {}
    for v in violations:
        groups.setdefault((v.path, show(v.value)), []).append(v)
    out = []
    for group in groups.values():
        if len(group) == 1:
            out.append(group[0])
            continue
        listed = [v.fix.values for v in group if isinstance(v.fix, _Fix)]
        fixes = [v.fix for v in group if not isinstance(v.fix, _Fix)]
        if listed:
            common = [x for x in listed[0] if all(x in other for other in listed[1:])]
            fixes.insert(0, _try(common) if common else "no value satisfies all of these: change the fields they "
                         "name")
        out.append(Violation(group[0].path, group[0].value, " and ".join(v.rule for v in group),
                             "; ".join(dict.fromkeys(fixes))))
    return out


NOTES: list[Rule] = []
"""Checks of choices that are valid but unusual: each finding is one line on stderr (``note: ...``), exit 0."""


def note(fn: RuleFn) -> RuleFn:
    NOTES.append(Rule(fn.__name__, (fn.__doc__ or "").strip(), fn))
    return fn


def recipe_notes(recipe: Recipe) -> list[str]:
    """The notes of a recipe that passed its rules, as the lines the commands print (``note: FIELD=VALUE ...``)."""
    layout = ParallelLayout.from_recipe(recipe)
    return [f"note: {v}" for n in NOTES for v in n.fn(recipe, layout)]


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` in ascending order, in O(sqrt n) (n can be any bounded recipe value)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


class _Fix(str):
    """A fix that lists the values it admits (``values``), so that the fixes of rules refusing the same value can be
    intersected (``merged``)."""

    values: tuple[int, ...] = ()


def _fix(text: str, values: list[int]) -> _Fix:
    fix = _Fix(text)
    fix.values = tuple(values)
    return fix


def _try(values: list[int], limit: int = 8) -> _Fix:
    shown = ", ".join(str(v) for v in values[:limit])
    return _fix(f"try {shown}{', ...' if len(values) > limit else ''}", values)
