"""``python -m hpc_tools COMMAND``: one module per command in this package.

A command module defines ``NAME``, ``HELP``, ``ORDER`` (position in --help), ``add_arguments(parser)`` and
``run(args) -> int`` (optionally ``DESCRIPTION``). It is found without being imported: ``NAME``, ``HELP`` and
``ORDER`` are read from the module's source (plain assignments of literals, or sums of them), and only the command
being run is imported. Modules must not import torch, pandas or pydantic at import time: --help, validate and render
stay light. A module whose ``NAME``/``HELP`` are not literals still works; it is imported to read them (slower).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from hpc_tools import __version__
from hpc_tools.errors import RecipeError, UserError
from hpc_tools.recipe.text import printable

EPILOG = """\
Typical use:
  python -m hpc_tools validate recipes/gpt_3d.yaml          check a recipe (all violations at once)
  python -m hpc_tools render recipes/gpt_3d.yaml            write jobs/gpt_3d.sbatch
  python -m hpc_tools submit recipes/gpt_3d.yaml            Slurm if installed, else locally on CPU
  python -m hpc_tools status                                the latest run
  python -m hpc_tools doctor recipes/gpt_3d.yaml            check this machine or cluster for that job
Precedence of settings: defaults < recipe < local profile (local runs, --profile local) < --set overrides.
"""
DESCRIPTION = "From a YAML recipe to a finished, analysed training run on Slurm."
_SPEC_NAMES = ("NAME", "HELP", "ORDER")


class OneLineParser(argparse.ArgumentParser):
    """argparse's refusals as one line on stderr, exit 2 (as every other refusal): no usage block above it; the
    usage stays in --help, which the line names. (Here, not in _common: --help imports no other module.)"""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"error: {self.prog}: {printable(message)} (see `{self.prog} --help`)\n")


@dataclass(frozen=True)
class CommandSpec:
    """What --help shows of one command, and the module that implements it."""

    module: str
    name: str
    help: str
    order: int = 100


def command_specs(folder: Path | None = None, package: str = __name__) -> list[CommandSpec]:
    """Every command module of this package (``_``-prefixed modules are helpers), in --help order, read from the
    sources; nothing is imported unless a module's ``NAME``/``HELP`` are computed at import time. ``folder`` and
    ``package`` name another package of command modules (tests)."""
    specs = []
    for path in sorted((folder or Path(__file__).parent).glob("*.py")):
        if path.name.startswith("_"):
            continue
        module = f"{package}.{path.stem}"
        found = _literal_constants(path)
        if not {"NAME", "HELP"} <= found.keys():
            found = _imported_constants(module)
            if "NAME" not in found:  # a helper module without a command
                continue
        specs.append(CommandSpec(module, str(found["NAME"]), str(found.get("HELP", "")),
                                 int(found.get("ORDER", 100))))
    return sorted(specs, key=lambda s: (s.order, s.name))


def _literal_constants(path: Path) -> dict[str, object]:
    """NAME / HELP / ORDER assigned at the top of ``path`` as literals, sums of literals or earlier such names.
    Only the module's head (before its first ``def``/``class``) is parsed: that is where the contract puts them."""
    import ast
    import re

    text = path.read_text(encoding="utf-8")
    head = re.search(r"^(?:def |async def |class |@)", text, re.MULTILINE)
    try:
        tree = ast.parse(text[:head.start()] if head else text)
    except SyntaxError:
        return {}
    known: dict[str, object] = {}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    value = _evaluate(node.value, known)
                    if value is not None:
                        known[target.id] = value
    return {k: v for k, v in known.items() if k in _SPEC_NAMES}


def _evaluate(node, known: dict[str, object]) -> object | None:
    import ast

    if isinstance(node, ast.Constant) and isinstance(node.value, (str, int)):
        return node.value
    if isinstance(node, ast.Name):
        return known.get(node.id)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _evaluate(node.left, known), _evaluate(node.right, known)
        if isinstance(left, str) and isinstance(right, str) or isinstance(left, int) and isinstance(right, int):
            return left + right
    return None


def _imported_constants(module: str) -> dict[str, object]:
    import importlib

    mod = importlib.import_module(module)
    return {k: getattr(mod, k) for k in _SPEC_NAMES if hasattr(mod, k)}


def selected_command(argv: list[str], names: set[str]) -> str | None:
    """The command ``argv`` runs: its first word that is not an option (the top level has only -h and --version)."""
    for word in argv:
        if word == "--":
            continue
        if not word.startswith("-"):
            return word if word in names else None
    return None


def build_parser(only: str | None = None, *, lazy: bool = False,
                 specs: list[CommandSpec] | None = None) -> argparse.ArgumentParser:
    """The argument parser. ``lazy``: only the command ``only`` gets its full arguments (its module imported); the
    others are listed for --help and ``invalid choice`` messages. Not lazy: every command is built in full."""
    import importlib

    parser = OneLineParser(prog="python -m hpc_tools", description=DESCRIPTION, epilog=EPILOG,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"hpc_tools {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for spec in specs or command_specs():
        if lazy and spec.name != only:
            sub.add_parser(spec.name, help=spec.help)
            continue
        mod = importlib.import_module(spec.module)
        p = sub.add_parser(spec.name, help=spec.help, description=getattr(mod, "DESCRIPTION", spec.help),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command. Every failure the user can act on is one line on stderr (or a JSON error with --json) and
    exit 2: a UserError, a file-system error on a path the user gave, stdout closed by the reader (`--json | head`)."""
    argv = sys.argv[1:] if argv is None else [*argv]  # not list(): the `list` command module shadows it here
    specs = command_specs()
    parser = build_parser(selected_command(argv, {s.name for s in specs}), lazy=True, specs=specs)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse's one-line refusal (OneLineParser) is a status like any other refusal's
        if exc.code in (0, None):  # --help, --version
            raise
        return exc.code if isinstance(exc.code, int) else UserError.exit_code
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return _run(args)
    except BrokenPipeError:
        # The reader of stdout went away (`| head -1`): stop quietly, and point stdout at /dev/null so the
        # interpreter's final flush does not print a second traceback.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (AttributeError, OSError, ValueError):  # stdout was never open (`>&-`): nothing to flush
            pass
        _say("error: stdout was closed before all the output was written (the reader of the pipe exited)")
        return UserError.exit_code


def _run(args: argparse.Namespace) -> int:
    as_json = getattr(args, "json", False)
    try:
        return int(args._run(args) or 0)
    except RecipeError as exc:
        if as_json:
            print(json.dumps({"ok": False, "errors": [v.as_dict() for v in exc.violations]}, indent=2))
        else:
            for v in exc.violations:
                _say(f"error: {printable(exc.source)}: {printable(str(v))}")
        return exc.exit_code
    except UserError as exc:
        return _fail(printable(str(exc)), as_json, exc.exit_code)
    except BrokenPipeError:
        raise
    except OSError as exc:  # a path the user named: unreadable, not a directory, read-only, full disk
        where = f" {printable(str(exc.filename))!r}" if exc.filename else ""
        return _fail(f"{exc.strerror or type(exc).__name__}:{where} (check the path, its permissions and free "
                     "space; nothing else was changed)", as_json)
    except KeyboardInterrupt:
        _say("interrupted")
        return 130


def _fail(message: str, as_json: bool, exit_code: int = UserError.exit_code) -> int:
    if as_json:
        print(json.dumps({"ok": False, "errors": [{"message": message}]}, indent=2))
    else:
        _say(f"error: {message}")
    return exit_code


def _say(line: str) -> None:
    try:
        print(line, file=sys.stderr, flush=True)
    except (BrokenPipeError, ValueError):  # stderr closed too: nothing left to tell
        pass
