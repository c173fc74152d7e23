"""The words that describe the structure are checked against it: a package docstring that lists its modules lists all
of them, and the floors drawn in docs/architecture.md are the floors import-linter enforces (setup.cfg's ``layers``
contract), room for room, in the same order.
"""

from __future__ import annotations

import ast
import configparser
import re

import pytest

from tests.helpers import REPO

PACKAGES = ("hpc_tools", "profiling")
NAMED = re.compile(r"``([A-Za-z_][A-Za-z0-9_]*)``")


def package_inits() -> list:
    return sorted(p for root in PACKAGES for p in (REPO / root).rglob("__init__.py") if "__pycache__" not in p.parts)


def children(init) -> set[str]:
    """The package's own modules and sub-packages (not ``__init__``/``__main__``)."""
    folder = init.parent
    names = {p.stem for p in folder.glob("*.py") if not p.stem.startswith("__")}
    names |= {p.name for p in folder.iterdir() if (p / "__init__.py").is_file()}
    return names


def missing_from_docstring(init) -> set[str]:
    """The children a listing docstring leaves out; empty when the docstring names none of them (no listing)."""
    doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
    named = set(NAMED.findall(doc))
    kids = children(init)
    return set() if not named & kids else kids - named


@pytest.mark.parametrize("init", package_inits(), ids=lambda p: str(p.parent.relative_to(REPO)))
def test_a_package_docstring_that_lists_modules_lists_all_of_them(init):
    missing = missing_from_docstring(init)
    assert not missing, f"{init.relative_to(REPO)}: the docstring names some of its modules but not {sorted(missing)}"


def test_the_listing_check_sees_a_missing_module(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text("")
    (pkg / "b.py").write_text("")
    (pkg / "__init__.py").write_text('"""Modules: ``a``."""\n')
    assert missing_from_docstring(pkg / "__init__.py") == {"b"}
    (pkg / "__init__.py").write_text('"""Nothing listed here."""\n')
    assert missing_from_docstring(pkg / "__init__.py") == set()


def contract_floors() -> list[list[str]]:
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    floors = []
    for line in config["importlinter:contract:layers"]["layers"].strip().splitlines():
        rooms = [r.strip().removeprefix("hpc_tools.") for r in line.split("|")]
        if rooms != ["__main__"]:  # the entry point above the commands
            floors.append(sorted(rooms))
    return floors


def documented_floors(text: str) -> list[list[str]]:
    """The first column of the fenced block under ``## Floors``: one floor a line, rooms split by ``|``."""
    section = text.split("## Floors", 1)[1]
    block = section.split("```", 2)[1]
    floors = []
    for line in block.strip("\n").splitlines():
        head = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
        floors.append(sorted(r.strip() for r in head.split("|")))
    return floors


def test_the_documented_floors_are_the_contracts_floors():
    documented = documented_floors((REPO / "docs" / "architecture.md").read_text(encoding="utf-8"))
    assert documented == contract_floors(), (
        "docs/architecture.md's floors differ from setup.cfg's layers contract:\n"
        f"  docs:     {documented}\n  contract: {contract_floors()}")


def test_the_floors_check_sees_a_missing_room():
    text = "## Floors\n\n```\n cli                 the commands\n analysis | sweep    post-run\n```\n"
    assert documented_floors(text) == [["cli"], ["analysis", "sweep"]]
