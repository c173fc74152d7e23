"""plan: predicted memory per GPU and step time of a recipe, the layout search, and calibration from measured runs."""

from __future__ import annotations

import argparse
from pathlib import Path

from hpc_tools.cli._common import (
    COUNT,
    add_json,
    add_recipe_args,
    add_runs_dir,
    emit_json,
    real_number,
    say,
    whole_number,
)
from hpc_tools.errors import UserError

NAME = "plan"
ORDER = 15
HELP = "predict memory per GPU, step time, tokens/s and MFU; search layouts (--search); calibrate (--calibrate)"
DESCRIPTION = HELP + """

  python -m hpc_tools plan recipes/gpt_3d.yaml                 breakdown with the assumption behind every term
  python -m hpc_tools plan recipes/gpt_3d.yaml --search --top 5   fastest layouts that fit, and why the next lose
  python -m hpc_tools plan recipes/llama_fsdp.yaml --search --backends all   rank megatron, deepspeed and fsdp together
  python -m hpc_tools plan recipes/gpt_3d.yaml --search --measure 3   run the top 3 for a few steps; rank by measured
  python -m hpc_tools plan --calibrate runs/RUN_A runs/RUN_B      predicted vs measured; fit and store efficiency

Exit status: 0 when the plan fits (or there is no GPU memory to check), 1 when it does not, 2 for bad input.
GB = 1e9 bytes. The efficiency factor comes from --efficiency, else the stored calibration for the recipe's
cluster (gpu_type@partition) and backend kind, else the default of the layers the backend runs (0.6 Megatron-core;
0.30 Hugging Face eager layers, 0.35 compiled: docs/formulas.md, "Efficiency")."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_recipe_args(p, nargs="?")
    add_json(p)
    from hpc_tools.planner.dimensions import searched_text

    p.add_argument("--search", action="store_true",
                   help=f"enumerate {searched_text()} (the model, cluster and global batch held); rank what fits "
                        "and keeps the recipe rules by predicted step time")
    p.add_argument("--backends", default=None, metavar="KINDS",
                   help="with --search: rank these backend kinds together (a comma list, e.g. megatron,deepspeed,fsdp, "
                        "or all), each checked with the recipe rules; default: the recipe's backend.kind only")
    p.add_argument("--top", type=COUNT, default=5, metavar="K", help="configurations to show with --search (default 5)")
    p.add_argument("--losers", type=whole_number(0, what="runners-up"), default=5, metavar="N",
                   help="runners-up to explain after the top K with --search (default 5)")
    p.add_argument("--calibrate", nargs="+", metavar="RUN", default=None,
                   help="run folders to compare with their predictions; fits and stores the efficiency per cluster "
                        "and backend kind")
    p.add_argument("--calibration", type=Path, default=None, metavar="PATH",
                   help="calibration file (default $HPC_TOOLS_CALIBRATION or ~/.config/hpc_tools/calibration.json)")
    p.add_argument("--no-calibration", action="store_true", help="ignore the stored calibration")
    p.add_argument("--no-save", action="store_true", help="with --calibrate: report the fit without storing it")
    p.add_argument("--headroom", type=real_number(0.0, what="GB"), default=None, metavar="GB",
                   help="GPU memory to keep free beyond the plan (allocator fragmentation, NCCL buffers); sets "
                        "cluster.memory_headroom_gb (default 5%% of the GPU memory + 1 GB)")
    p.add_argument("--efficiency", type=real_number(0.0, 1.0, "a fraction of peak", above=True), default=None,
                   metavar="E",
                   help="fraction of peak FLOP/s the compute reaches (overrides calibration)")
    p.add_argument("--measure", type=COUNT, default=None, metavar="K",
                   help="with --search: run the top K as a short sweep (a Slurm job array, or locally one after "
                        "another with the local profile), rank them by measured step time, show predicted vs "
                        "measured and store the fitted efficiency (unless --no-save)")
    p.add_argument("--measure-steps", type=COUNT, default=None, metavar="N",
                   help="measured steps per candidate with --measure, after profiling.warmup_steps warm-up steps "
                        "(default 5)")
    p.add_argument("--executor", choices=["auto", "slurm", "local"], default="auto",
                   help="with --measure: where the candidates run (default auto: Slurm if it answers, else local)")
    add_runs_dir(p)


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

    if args.headroom is not None:
        if args.headroom < 0:
            raise UserError(f"--headroom {args.headroom} must be >= 0 (GB of GPU memory kept free, e.g. 4)")
        args.overrides = [*(args.overrides or []), f"cluster.memory_headroom_gb={args.headroom}"]
    if args.backends is not None and (not args.search or args.measure is not None):
        raise UserError("--backends ranks backend kinds in the analytic search: use it with --search and without "
                        "--measure (e.g. plan RECIPE --search --backends all)")
    if args.measure is not None or args.measure_steps is not None:
        return _measure(args)
    # --search turns the layout, so the recipe's own layout may break rules; the search checks its candidates.
    recipe = load_recipe(args.recipe, args.overrides, args.profile, check=not args.search)
    if args.search:
        return _search(recipe, args)
    from hpc_tools.planner import fit_violations, plan_recipe
    from hpc_tools.planner.report import print_plan

    plan = plan_recipe(recipe, args.efficiency, args.calibration, not args.no_calibration)
    violations = fit_violations(recipe)
    fewer = _elastic(recipe)
    if args.json:
        emit_json({"ok": plan.fits is not False, **plan.as_dict(), "violations": [v.as_dict() for v in violations],
                   **({"elastic": fewer.to_json()} if fewer else {})})
    else:
        _fit_width()
        print_plan(plan)
        if fewer:  # cluster.min_nodes: the layouts the run would continue in (docs/elastic.md)
            for k in sorted(fewer.layouts, reverse=True):
                print(f"elastic: on {k} node(s): {fewer.labels[k]}")
            for k, why in sorted(fewer.unplanned.items(), reverse=True):
                print(f"elastic: not on {k} node(s): {why}")
        for v in violations:
            say(f"error: {args.recipe}: {v}")
        from hpc_tools.cli._screen import echo
        from hpc_tools.planner.report import verdict_line

        echo(verdict_line(plan, args.recipe))
    return 1 if plan.fits is False else 0


def _fit_width() -> None:
    """The tables to the terminal's width (``cli._screen``), at most the planner report's own ``WIDTH``."""
    from hpc_tools.cli._screen import PIPE_WIDTH, width
    from hpc_tools.planner.report import WIDTH, set_width

    columns = width()
    set_width(min(columns, WIDTH), None if columns >= PIPE_WIDTH else columns)


def changed_overrides(recipe, overrides: list[str]) -> list[str]:
    """The ``--set KEY=VALUE`` strings of ``overrides`` that change ``recipe`` (a value already set is left out)."""
    import yaml

    out = []
    for o in overrides:
        key, _, text = o.partition("=")
        current = recipe.model_dump(mode="json")
        for part in key.split("."):
            current = current.get(part) if isinstance(current, dict) else None
        try:
            wanted = yaml.safe_load(text)
        except yaml.YAMLError:
            wanted = text
        if current != wanted and str(current) != str(wanted):
            out.append(o)
    return out


def _elastic(recipe):
    """The elastic plan of a recipe with ``cluster.min_nodes`` (None otherwise: also where the rules refuse it)."""
    from hpc_tools import backends
    from hpc_tools.planner.elastic import plan_elastic

    return plan_elastic(recipe) if recipe.cluster.elastic and backends.of(recipe).elastic else None


def _search(recipe, args: argparse.Namespace) -> int:
    from hpc_tools.planner.report import print_search, search_dict
    from hpc_tools.planner.search import parse_kinds, search, search_across

    if args.backends is not None:
        result = search_across(recipe, parse_kinds(args.backends), top=args.top, losers=args.losers,
                               efficiency=args.efficiency, use_calibration=not args.no_calibration)
    else:
        result = search(recipe, top=args.top, losers=args.losers, efficiency=args.efficiency,
                        use_calibration=not args.no_calibration)
    if result.best is None:  # which constraint emptied the search, and what would admit a layout
        from hpc_tools.planner.empty import explain_search

        result.why_none = explain_search(recipe, result, parse_kinds(args.backends) if args.backends else None,
                                         args.efficiency, not args.no_calibration)
    if args.json:
        apply = changed_overrides(recipe, result.overrides(result.best)) if result.best is not None else []
        emit_json({"ok": result.best is not None, **search_dict(result), "apply": apply})
    else:
        _fit_width()
        print_search(result, recipe.name, changed_overrides(recipe, result.overrides(result.best))
                     if result.best is not None else None)
    return 0 if result.best is not None else 1


def _calibrate(args: argparse.Namespace) -> int:
    from hpc_tools.planner.calibrate import calibrate
    from hpc_tools.planner.report import print_calibration

    report = calibrate(args.calibrate, store=args.calibration, save=not args.no_save, efficiency=args.efficiency)
    if args.json:
        emit_json({"ok": True, **report})
    else:
        _fit_width()
        print_calibration(report)
    return 0


def _measure(args: argparse.Namespace) -> int:
    from hpc_tools.sweep.measure import DEFAULT_MEASURE_STEPS, measured_search, print_measure

    if args.measure is None or not args.search:
        raise UserError("--measure K runs the layout search's top K: use it with --search "
                        "(e.g. plan RECIPE --search --measure 3)")
    steps = DEFAULT_MEASURE_STEPS if args.measure_steps is None else args.measure_steps
    report = measured_search(args.recipe, args.measure, args.overrides, args.profile, args.executor, steps,
                             args.runs_dir, args.efficiency, not args.no_calibration, args.calibration,
                             not args.no_save, say=say)
    if args.json:
        emit_json({"ok": report.winner is not None, **report.as_dict()})
    else:
        print_measure(report)
    return 0 if report.winner is not None else 1
