"""Arguments and output helpers shared by the command modules."""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from typing import Any, Callable

RUN_REF = "run folder, run id (or unique prefix) or Slurm job id"
LARGEST = 2**31 - 1  # a count, step or rank beyond it is a typo (and Triton's INT32 inputs end there)


# --- argument types shared by every command ---------------------------------------------------------------------------
# argparse calls these on the text given; an ArgumentTypeError is its one-line refusal (exit 2) naming the option, so
# a bad number is refused before a command reads a file, writes one or starts anything.

def whole_number(low: int = 0, high: int = LARGEST, what: str = "a count") -> Callable[[str], int]:
    """An argparse type: a whole number from ``low`` to ``high`` (``what`` it counts, for the message)."""
    span = f"{low:,} to {high:,}"

    def parse(text: str) -> int:
        found = re.fullmatch(r"\s*([+-]?)([0-9]+)\s*", text)
        if not found:
            raise argparse.ArgumentTypeError(f"{_shown(text)} is not a whole number (give {what}: {span})")
        # int() of 4,300+ digits is a ValueError of its own; 40 digits is beyond any bound here
        sign, digits = found.groups()
        value = int(sign + digits) if len(digits) <= 40 else (-1 if sign == "-" else 1) * 10**40
        if value < low:
            raise argparse.ArgumentTypeError(f"{_shown(text)} is below {low} (give {what}: {span})")
        if value > high:
            raise argparse.ArgumentTypeError(f"{_shown(text)} is above {high:,} (give {what}: {span})")
        return value
    parse.__name__ = f"whole number {span}"  # argparse names the type in its messages
    return parse


def real_number(low: float = 0.0, high: float = math.inf, what: str = "a number", above: bool = False,
                ) -> Callable[[str], float]:
    """An argparse type: a finite number from ``low`` (excluded with ``above``) to ``high`` -- never nan or inf,
    whatever the bounds (`nan < 0` is False: a check of the bound alone lets it through)."""
    span = (f"above {low:g}" if above else f"{low:g} or more") + ("" if high == math.inf else f" and at most {high:g}")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{_shown(text)} is not a number (give {what}: {span})") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{_shown(text)} is not a finite number (give {what}: {span})")
        if value < low or (above and value == low) or value > high:
            raise argparse.ArgumentTypeError(f"{_shown(text)} is out of range (give {what}: {span})")
        return value
    parse.__name__ = f"number {span}"
    return parse


def _shown(text: str) -> str:
    from hpc_tools.recipe.text import printable

    return repr(printable(text)[:60])


COUNT = whole_number(1, what="a count")
"""1 or more (to ``LARGEST``): a number of things to make or show (batch sizes, examples, requests)."""
STEP = whole_number(0, what="a step")
"""0 or more (to ``LARGEST``): a step, iteration or rank."""
PORT = whole_number(0, 65535, what="a TCP port (0: any free one)")
SECONDS = real_number(0.0, what="seconds", above=True)
"""A finite time above 0."""


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
