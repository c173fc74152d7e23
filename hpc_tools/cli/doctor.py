"""doctor: check what a job needs on this machine or cluster; a table of pass/warn/fail with the fix for each."""

from __future__ import annotations

import argparse

from hpc_tools.cli._common import add_json, add_recipe_args, add_runs_dir, emit_json

NAME = "doctor"
ORDER = 90
HELP = "check this machine or cluster for a job: Python, packages, CUDA/NCCL, Slurm, partition, container, runs folder"
DESCRIPTION = HELP + """

Each check is one row: PASS, WARN, FAIL or SKIP, with the fix under anything that did not pass. Exit 0 when
nothing failed, 1 otherwise. With a RECIPE, the job it describes is checked as `submit` would send it: its files,
its partition (nodes, GPUs and CPUs per node, time limit) on the live cluster and its container runtime.
Packages are compared with the pins in environment/ (a different version is a warning). Slurm is asked once, with
a 3 s timeout. torch is imported for the CUDA / driver / NCCL rows (a few seconds; --no-torch skips them)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_recipe_args(p, nargs="?")
    add_runs_dir(p)
    add_json(p)
    p.add_argument("--no-torch", action="store_true", help="skip the CUDA / driver / NCCL rows (no torch import)")


def run(args: argparse.Namespace) -> int:
    from hpc_tools.doctor import Check, as_json, format_table, run_doctor

    recipe, executor, problems = None, "local", []
    if args.recipe:
        recipe, executor, problems = _resolve(args)
    rows = run_doctor(recipe, executor, args.runs_dir, with_torch=not args.no_torch)
    if problems:
        rows.insert(0, Check("recipe", "fail", f"{args.recipe}: {problems[0]}" +
                             (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""),
                             f"python -m hpc_tools validate {args.recipe} lists them all"))
    elif recipe is not None:
        rows.insert(0, Check("recipe", "pass", f"{args.recipe} is valid; checked as a {executor} job"))
    if args.json:
        emit_json(as_json(rows))
    else:
        print(format_table(rows))
    return 1 if any(r.status == "fail" for r in rows) else 0


def _resolve(args: argparse.Namespace):
    """(recipe or None, executor, violations as text): the recipe as `submit` would resolve it (the local profile
    when no Slurm is installed), without its world checks (the doctor's rows show those)."""
    from hpc_tools.errors import RecipeError
    from hpc_tools.submission import fit_violations, plan_submission

    try:
        plan = plan_submission(args.recipe, args.overrides, args.profile, "auto", check_fit=False, dry_run=True)
    except RecipeError as exc:
        return None, "local", [str(v) for v in exc.violations]
    return plan.recipe, plan.executor, [str(v) for v in fit_violations(plan.recipe)]
