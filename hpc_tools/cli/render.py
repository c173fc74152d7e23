"""render: write the sbatch script of a recipe into jobs/ (or check that jobs/ is up to date)."""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from pathlib import Path

from hpc_tools.cli._common import add_json, add_recipe_args, emit_json, say
from hpc_tools.errors import UserError
from hpc_tools.recipe.base import printable

NAME = "render"
ORDER = 20
HELP = "render a recipe into jobs/<recipe>.sbatch (a complete script for plain `sbatch`)"
DESCRIPTION = HELP + """

  python -m hpc_tools render recipes/gpt_3d.yaml       write jobs/gpt_3d.sbatch
  python -m hpc_tools render --all                      regenerate jobs/ from every recipes/*.yaml
  python -m hpc_tools render --all --check              exit 1 (with a diff) if jobs/ drifted from recipes/

Defaults from a site file ($HPC_TOOLS_SITE, else ~/.config/hpc_tools/site.yaml) apply under each recipe
(docs/site-config.md); jobs/ in the repository is rendered without one (HPC_TOOLS_SITE=none)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_recipe_args(p, nargs="?")  # optional with --all
    p.add_argument("--all", action="store_true", help="every recipes/*.yaml into jobs/")
    p.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 on drift")
    p.add_argument("-o", "--output", default=None, help="output file (default jobs/<recipe>.sbatch); - for stdout")
    p.add_argument("--recipes-dir", default="recipes", help=argparse.SUPPRESS)
    p.add_argument("--jobs-dir", default="jobs", help=argparse.SUPPRESS)
    add_json(p)


def run(args: argparse.Namespace) -> int:
    from hpc_tools.recipe.load import load_recipe
    from hpc_tools.recipe.rules import recipe_notes
    from hpc_tools.recipe.site import site_note
    from hpc_tools.render.sbatch import job_script_path, render_sbatch
    from profiling.files import atomic_write  # the owner (registry re-exports it): no run-state imports here

    if args.all == bool(args.recipe):
        raise UserError("render needs a recipe file or --all (not both)")
    paths = sorted(Path(args.recipes_dir).glob("*.yaml")) if args.all else [Path(args.recipe)]
    if not paths:
        raise UserError(f"no recipes in {args.recipes_dir}/ (run from the repository root)")
    rendered = []
    for path in paths:  # render all first: nothing is written if any recipe is invalid
        recipe = load_recipe(path, args.overrides, args.profile)
        out = Path(args.output) if args.output and args.output != "-" else job_script_path(path, args.jobs_dir)
        rendered.append((path, out, render_sbatch(recipe, path.as_posix()), recipe_notes(recipe)))
    note = site_note()  # the site file's defaults went into every script: say which file
    if note and not args.json:
        say(note)
    if not args.json:
        for line in dict.fromkeys(n for _, _, _, notes in rendered for n in notes):
            say(line)  # valid but unusual choices (recipe/rules NOTES)
    if not args.check and args.output != "-":
        for _, out, _, _ in rendered:
            _check_output(out)
    drift = []
    for path, out, text, _ in rendered:
        if args.output == "-":
            sys.stdout.write(text)
        elif args.check:
            old = out.read_text() if out.exists() else ""
            if old != text:
                drift.append(str(out))
                sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), text.splitlines(True), str(out),
                                                           f"rendered from {path}"))
        else:
            atomic_write(out, text)
            say(f"wrote {printable(str(out))}")
    if args.json:
        emit_json({"ok": not drift, "scripts": [str(o) for _, o, _, _ in rendered], "drift": drift})
    if drift:
        say(f"{len(drift)} script(s) drifted from their recipes; regenerate with: python -m hpc_tools render --all")
        return 1
    return 0


def _check_output(out: Path) -> None:
    """Refuse, before anything is written, an output that cannot be written: its folder missing or not a folder,
    the output itself a folder, or not writable."""
    shown, folder = printable(str(out)), out.parent
    if out.is_dir():
        raise UserError(f"output {shown} is a directory (give a file name, e.g. {shown}/job.sbatch)")
    if not folder.is_dir():
        what = "is not a directory" if folder.exists() else "does not exist"
        raise UserError(f"output {shown}: the folder {printable(str(folder))} {what} (create it or choose another)")
    if not os.access(folder, os.W_OK | os.X_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise UserError(f"output {shown} is not writable (choose another place)")
