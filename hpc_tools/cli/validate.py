"""validate: check recipes against the schema, the layout rules and the planner's memory fit; write nothing."""

from __future__ import annotations

import argparse

from hpc_tools.cli._common import add_json, add_recipe_args, emit_json
from hpc_tools.errors import RecipeError, UserError
from hpc_tools.recipe.base import printable

NAME = "validate"
ORDER = 10
HELP = "check recipes (schema, layout arithmetic, backend rules, memory fit); report every violation"
DESCRIPTION = HELP + """

Each violation is one line: FIELD=VALUE RULE (FIX). Exit 0 when valid, 2 otherwise.
A recipe with a `local:` profile is checked as written and with the profile applied.

The reference, without a recipe:
  python -m hpc_tools validate --explain parallel.tensor_size   a field: type, default, bounds, doc, rules reading it
  python -m hpc_tools validate --explain parallel               a section: its fields
  python -m hpc_tools validate --explain recipe                 the sections
  python -m hpc_tools validate --explain heads_shape            a cross-field rule: its doc and the fields it reads
  python -m hpc_tools validate --rules                          every cross-field rule"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_recipe_args(p, nargs="*")
    add_json(p)
    p.add_argument("--no-fit", action="store_true", help="skip the planner's memory-fit check")
    p.add_argument("--rules", action="store_true", help="list the layout and backend rules and exit (no recipe needed)")
    p.add_argument("--explain", metavar="NAME", default=None,
                   help="print the reference of a field (parallel.tensor_size), a section (parallel, or recipe for "
                        "all) or a rule (heads_shape) and exit (no recipe needed)")


def check(path: str, overrides: list[str], profile: str | None, fit: bool) -> list[dict]:
    """Violations (as dicts) of one recipe under one profile."""
    from hpc_tools.recipe.load import read_yaml, resolve
    from hpc_tools.submission import fit_violations

    try:
        recipe = resolve(read_yaml(path), overrides, profile, path)
        violations = fit_violations(recipe) if fit else []
    except RecipeError as exc:
        violations = exc.violations
    return [v.as_dict() for v in violations]


def run(args: argparse.Namespace) -> int:
    if args.explain is not None:
        return _explain(args.explain, args.json)
    if args.rules:
        return _rules(args.json)
    if not args.recipe:
        raise UserError("validate needs recipe files (e.g. python -m hpc_tools validate recipes/*.yaml), "
                        "or --explain NAME / --rules")
    from hpc_tools.recipe.load import read_yaml

    results = []
    for path in args.recipe:
        profiles = [args.profile] if args.profile else [None] + (["local"] if _has_local(read_yaml(path)) else [])
        for profile in profiles:
            results.append({"recipe": path, "profile": profile,
                            "errors": check(path, args.overrides, profile, not args.no_fit)})
    ok = all(not r["errors"] for r in results)
    if args.json:
        emit_json({"ok": ok, "results": results})
    else:
        for r in results:
            where = printable(r["recipe"]) + (f" (profile {r['profile']})" if r["profile"] else "")
            if r["errors"]:
                for e in r["errors"]:
                    print(f"error: {where}: {printable(e['message'])}")
            else:
                print(f"ok: {where}")
    if not ok:
        return UserError.exit_code
    return 0


def _explain(name: str, as_json: bool) -> int:
    from hpc_tools.recipe.explain import explain, format_text

    info = explain(name)
    if as_json:
        emit_json(info)
    else:
        print(format_text(info))
    return 0


def _rules(as_json: bool) -> int:
    from hpc_tools.recipe.rules import RULES

    if as_json:
        emit_json([{"name": r.name, "doc": r.doc, "reads": sorted(r.reads)} for r in RULES])
        return 0
    for r in RULES:
        print(f"{r.name}: {r.doc}")
    print("(`python -m hpc_tools validate --explain RULE` shows the fields a rule reads)")
    return 0


def _has_local(raw: dict) -> bool:
    return raw.get("local") is not None
