"""``python -m hpc_tools COMMAND``: one module per command in this package.

A command module defines ``NAME``, ``HELP``, ``ORDER`` (position in --help), ``add_arguments(parser)`` and
``run(args) -> int``. Modules must not import torch or megatron at import time: --help, validate and render stay light.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import sys
from types import ModuleType

from hpc_tools import __version__
from hpc_tools.errors import RecipeError, UserError

EPILOG = """\
Typical use:
  python -m hpc_tools validate recipes/gpt_3d.yaml          check a recipe (all violations at once)
  python -m hpc_tools render recipes/gpt_3d.yaml            write jobs/gpt_3d.sbatch
  python -m hpc_tools submit recipes/gpt_3d.yaml            Slurm when it answers, else locally on CPU
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
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except RecipeError as exc:
        if getattr(args, "json", False):
            print(json.dumps({"ok": False, "errors": [v.as_dict() for v in exc.violations]}, indent=2))
        else:
            for v in exc.violations:
                print(f"error: {exc.source}: {v}", file=sys.stderr)
        return exc.exit_code
    except UserError as exc:
        if getattr(args, "json", False):
            print(json.dumps({"ok": False, "errors": [{"message": str(exc)}]}, indent=2))
        else:
            print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
