"""The site file: defaults for any recipe field that a cluster or a user sets once (account, partition, qos, container
image, modules, env, GPU type, ...) instead of in every recipe.

Found at ``$HPC_TOOLS_SITE``, else ``~/.config/hpc_tools/site.yaml``, else there is none (``HPC_TOOLS_SITE=none`` or
an empty value turns a user's file off, e.g. in tests). It has the recipe's sections, partial; it sits between the
schema's defaults and the recipe (``hpc_tools.recipe.load`` merges it). It is read with the recipe's bounded loader
and each field is checked against the schema on its own, so a bad site file is one line naming the file and the
field, whichever recipe is being read.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hpc_tools.errors import RecipeError, UserError
from hpc_tools.recipe.pydantic_errors import violations_from_pydantic
from hpc_tools.recipe.text import printable
from hpc_tools.recipe.yamlfile import MAX_BYTES, decode, parse_yaml

SITE_ENV = "HPC_TOOLS_SITE"
OFF = ("", "none")
# What a site may not set: a recipe's identity and its own grid.
NOT_SITE_KEYS = ("name", "description", "sweep")


def site_path(env: dict[str, str] | None = None) -> Path | None:
    """The site file in use: ``$HPC_TOOLS_SITE`` (which must exist), else ``~/.config/hpc_tools/site.yaml`` when it
    exists, else None."""
    env = os.environ if env is None else env
    if SITE_ENV in env:
        value = env[SITE_ENV]
        if value.strip().lower() in OFF:
            return None
        path = Path(value).expanduser()
        if not path.is_file():
            raise UserError(f"site file {printable(value)} (from ${SITE_ENV}) does not exist or is not a file "
                            f"(fix the path, or unset {SITE_ENV})")
        return path.absolute()
    default = Path(env.get("HOME") or Path.home()) / ".config" / "hpc_tools" / "site.yaml"
    return default if default.is_file() else None


def read_site(env: dict[str, str] | None = None) -> tuple[Path | None, dict[str, Any]]:
    """(site file, its checked mapping); (None, {}) without one. Raises a one-line UserError for a bad file."""

    path = site_path(env)
    if path is None:
        return None, {}
    shown = f"site file {printable(str(path))}"
    try:
        with path.open("rb") as fh:
            data = fh.read(MAX_BYTES + 1)
    except OSError as exc:
        raise UserError(f"{shown} cannot be read: {exc.strerror or exc} (check its permissions)") from None
    text = decode(data, shown)
    if not text.strip():
        return path, {}
    raw = parse_yaml(text, shown)
    check_site(raw, shown)
    return path, raw


def check_site(raw: dict[str, Any], source: str) -> None:
    """Every field of a site mapping checked against its section's schema on its own (required fields may be left
    to the recipe); raises RecipeError (one line naming ``source`` and the field)."""
    from pydantic import BaseModel, ValidationError

    from hpc_tools.errors import Violation
    from hpc_tools.recipe.schema import Recipe

    violations = []
    for key, value in raw.items():
        field = Recipe.model_fields.get(str(key))
        if field is None or key in NOT_SITE_KEYS:
            allowed = [k for k in Recipe.model_fields if k not in NOT_SITE_KEYS]
            violations.append(Violation(printable(str(key))[:80], Ellipsis, "is not a section a site file may set",
                                        f"use one of {', '.join(allowed)}"))
            continue
        if key == "local":  # the local profile: the same sections, checked the same way
            if not isinstance(value, dict):
                violations.append(Violation("local", value, "must be a mapping of recipe sections", "give a mapping"))
                continue
            try:
                check_site(value, source)
            except RecipeError as exc:
                violations += [Violation(f"local.{v.path}", v.value, v.rule, v.fix) for v in exc.violations]
            continue
        model = field.annotation
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            continue
        if not isinstance(value, dict):
            violations.append(Violation(str(key), value, "must be a mapping of fields",
                                        f"give {key}: {{field: value}}"))
            continue
        try:
            model.model_validate(value)
        except ValidationError as exc:
            for err in exc.errors():
                # left to the recipe: required fields, and cross-field checks of a whole section (no location)
                if err["type"] == "missing" or not err["loc"]:
                    continue
                violations += violations_from_pydantic([{**err, "loc": (key, *err["loc"])}], raw)
    if violations:
        raise RecipeError(violations, source)


def site_note(env: dict[str, str] | None = None) -> str:
    """One line naming the site file in use ("" without one), for `render`, `validate` and `status` to print."""
    path = site_path(env)
    return f"site settings: {printable(str(path))}" if path else ""
