"""``python -m hpc_tools COMMAND``: one module per command in this package.

A command module defines ``NAME``, ``HELP``, ``ORDER`` (position in --help), ``add_arguments(parser)`` and
``run(args) -> int``. Modules must not import torch or megatron at import time: --help, validate and render stay light.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import sys
from types import ModuleType

from hpc_tools import __version__
from hpc_tools.errors import RecipeError, UserError
from hpc_tools.recipe.base import printable

EPILOG = """\
Typical use:
  python -m hpc_tools validate recipes/gpt_3d.yaml          check a recipe (all violations at once)
  python -m hpc_tools render recipes/gpt_3d.yaml            write jobs/gpt_3d.sbatch
  python -m hpc_tools submit recipes/gpt_3d.yaml            Slurm if installed, else locally on CPU
  python -m hpc_tools status                                the latest run
Precedence of settings: defaults < recipe < local profile (local runs, --profile local) < --set overrides.
"""


def command_modules() -> list[ModuleType]:
    import hpc_tools.cli as pkg

    mods = [importlib.import_module(f"{pkg.__name__}.{m.name}") for m in pkgutil.iter_modules(pkg.__path__)
            if not m.name.startswith("_")]
    return sorted((m for m in mods if hasattr(m, "NAME")), key=lambda m: (getattr(m, "ORDER", 100), m.NAME))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hpc_tools", description=__doc__.splitlines()[0].split(": ")[0]
                                     and "From a YAML recipe to a finished, analysed training run on Slurm.",
                                     epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"hpc_tools {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for mod in command_modules():
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=getattr(mod, "DESCRIPTION", mod.HELP),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command. Every failure the user can act on is one line on stderr (or a JSON error with --json) and
    exit 2: a UserError, a file-system error on a path the user gave, stdout closed by the reader (`--json | head`)."""
    parser = build_parser()
    args = parser.parse_args(argv)
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
        return _fail(printable(str(exc)), as_json)
    except BrokenPipeError:
        raise
    except OSError as exc:  # a path the user named: unreadable, not a directory, read-only, full disk
        where = f" {printable(str(exc.filename))!r}" if exc.filename else ""
        return _fail(f"{exc.strerror or type(exc).__name__}:{where} (check the path, its permissions and free "
                     "space; nothing else was changed)", as_json)
    except KeyboardInterrupt:
        _say("interrupted")
        return 130


def _fail(message: str, as_json: bool) -> int:
    if as_json:
        print(json.dumps({"ok": False, "errors": [{"message": message}]}, indent=2))
    else:
        _say(f"error: {message}")
    return UserError.exit_code


def _say(line: str) -> None:
    try:
        print(line, file=sys.stderr, flush=True)
    except (BrokenPipeError, ValueError):  # stderr closed too: nothing left to tell
        pass
