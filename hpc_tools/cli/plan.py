"""plan: predicted memory per GPU and step time of a recipe, the layout search, and calibration from measured runs."""

from __future__ import annotations

import argparse
from pathlib import Path

from hpc_tools.cli._common import add_json, add_recipe_args, emit_json
from hpc_tools.errors import UserError

NAME = "plan"
ORDER = 15
HELP = "predict memory per GPU, step time, tokens/s and MFU; search layouts (--search); calibrate (--calibrate)"
DESCRIPTION = HELP + """

  python -m hpc_tools plan recipes/gpt_3d.yaml                 breakdown with the assumption behind every term
  python -m hpc_tools plan recipes/gpt_3d.yaml --search --top 5   fastest layouts that fit, and why the next lose
  python -m hpc_tools plan --calibrate runs/RUN_A runs/RUN_B      predicted vs measured; fit and store efficiency

Exit status: 0 when the plan fits (or there is no GPU memory to check), 1 when it does not, 2 for bad input.
GB = 1e9 bytes. The efficiency factor comes from --efficiency, else the stored calibration for the recipe's
cluster (gpu_type@partition), else the default 0.6."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_recipe_args(p, nargs="?")
    add_json(p)
    p.add_argument("--search", action="store_true", help="enumerate TP/PP/VPP/DP, micro batch, recompute, "
                   "optimizer sharding and offload; rank what fits by predicted step time")
    p.add_argument("--top", type=int, default=5, metavar="K", help="configurations to show with --search (default 5)")
    p.add_argument("--losers", type=int, default=5, metavar="N",
                   help="runners-up to explain after the top K with --search (default 5)")
    p.add_argument("--calibrate", nargs="+", metavar="RUN", default=None,
                   help="run folders to compare with their predictions; fits and stores the efficiency per cluster")
    p.add_argument("--calibration", type=Path, default=None, metavar="PATH",
                   help="calibration file (default $HPC_TOOLS_CALIBRATION or ~/.config/hpc_tools/calibration.json)")
    p.add_argument("--no-calibration", action="store_true", help="ignore the stored calibration")
    p.add_argument("--no-save", action="store_true", help="with --calibrate: report the fit without storing it")
    p.add_argument("--efficiency", type=float, default=None, metavar="E",
                   help="fraction of peak FLOP/s the compute reaches (overrides calibration)")


def run(args: argparse.Namespace) -> int:
    if args.efficiency is not None and not 0 < args.efficiency <= 1:
        raise UserError(f"--efficiency {args.efficiency} must be in (0, 1] (a fraction of peak, e.g. 0.5)")
    if args.top < 1 or args.losers < 0:
        raise UserError("--top must be >= 1 and --losers >= 0")
    if args.calibrate:
        return _calibrate(args)
    if not args.recipe:
        raise UserError("plan needs a recipe (e.g. python -m hpc_tools plan recipes/gpt_3d.yaml) or --calibrate RUN...")
    from hpc_tools.recipe.load import load_recipe

    # --search turns the layout, so the recipe's own layout may break rules; the search checks its candidates.
    recipe = load_recipe(args.recipe, args.overrides, args.profile, check=not args.search)
    if args.search:
        return _search(recipe, args)
    from hpc_tools.planner import fit_violations, plan_recipe
    from hpc_tools.planner.report import print_plan

    plan = plan_recipe(recipe, args.efficiency, args.calibration, not args.no_calibration)
    violations = fit_violations(recipe)
    if args.json:
        emit_json({"ok": plan.fits is not False, **plan.as_dict(), "violations": [v.as_dict() for v in violations]})
    else:
        print_plan(plan)
        for v in violations:
            print(f"error: {args.recipe}: {v}")
    return 1 if plan.fits is False else 0


def _search(recipe, args: argparse.Namespace) -> int:
    from hpc_tools.planner.report import print_search, search_dict
    from hpc_tools.planner.search import search

    result = search(recipe, top=args.top, losers=args.losers, efficiency=args.efficiency,
                    use_calibration=not args.no_calibration)
    if args.json:
        emit_json({"ok": result.best is not None, **search_dict(result)})
    else:
        print_search(result, recipe.name)
    return 0 if result.best is not None else 1


def _calibrate(args: argparse.Namespace) -> int:
    from hpc_tools.planner.calibrate import calibrate
    from hpc_tools.planner.report import print_calibration

    report = calibrate(args.calibrate, store=args.calibration, save=not args.no_save, efficiency=args.efficiency)
    if args.json:
        emit_json({"ok": True, **report})
    else:
        print_calibration(report)
    return 0
