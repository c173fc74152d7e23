"""Arguments and output helpers shared by the command modules."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

RUN_REF = "run folder, run id (or unique prefix) or Slurm job id"


def add_recipe_args(p: argparse.ArgumentParser, nargs: str | None = None) -> None:
    p.add_argument("recipe", nargs=nargs, help="recipe YAML file" + ("s" if nargs in ("+", "*") else ""))
    add_overrides(p, "override a recipe value (repeatable; the value is read as YAML), "
                     "e.g. --set parallel.tensor_size=4; --set local.SECTION.KEY=VALUE sets a value of the "
                     "recipe's local profile (used when the profile is, checked either way)")
    p.add_argument("--profile", choices=["local"], default=None,
                   help="apply the recipe's local profile (small model and CPU layout)")


def add_overrides(p: argparse.ArgumentParser, help: str) -> None:
    """``--set SECTION.KEY=VALUE``, repeatable, into ``args.overrides`` (what it overrides: ``help``)."""
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE", help=help)


def add_run_ref(p: argparse.ArgumentParser, latest: bool = False) -> None:
    """The run a command acts on, ``args.run`` (resolved by ``registry.resolve_run`` / ``find_run`` with
    ``--runs-dir``); with ``latest`` it may be left out for the latest run."""
    if latest:
        p.add_argument("run", nargs="?", help=f"{RUN_REF}; default the latest")
    else:
        p.add_argument("run", help=RUN_REF)


def add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print machine-readable JSON on stdout")


def add_runs_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runs-dir", default=None, help="runs root (default: $HPC_TOOLS_RUNS_DIR or ./runs)")


def emit_json(data: Any) -> None:
    if sys.stdout is None:  # started with stdout closed (`>&-`): as if the reader had gone
        raise BrokenPipeError("stdout is closed")
    json.dump(data, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


def say(msg: str) -> None:
    """One line for the human on stderr (stdout stays clean for --json)."""
    print(msg, file=sys.stderr, flush=True)
