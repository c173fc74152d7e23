"""validate: check recipes against the schema, the layout rules and the planner's memory fit; write nothing."""

from __future__ import annotations

import argparse

from hpc_tools.cli._common import add_json, add_recipe_args, emit_json, say
from hpc_tools.errors import RecipeError, UserError
from hpc_tools.recipe.text import printable

NAME = "validate"
ORDER = 10
HELP = ("check recipes (schema, layout arithmetic, backend rules, memory fit, the files they name and the live "
        "Slurm cluster); report every violation")
DESCRIPTION = HELP + """

Each violation is one line on stderr: FIELD=VALUE RULE (FIX); each valid recipe an `ok:` line on stdout.
Exit 0 when valid, 2 otherwise. An unknown key that Megatron-LM, Megatron-core, torchtitan or DeepSpeed
uses (tensor_model_parallel_size, parallelism.tensor_parallel_degree, zero_optimization.stage, ...) is named
with the field that holds it here.
A recipe with a `local:` profile is checked as written and with the profile applied
(--set local.SECTION.KEY=VALUE sets a value of that profile); a field and value refused both ways is
one line, marked "(and its local profile)".

A recipe that passes its own rules is then checked against the world (skip with --offline):
  files here     data.paths, data.blend prefixes (.bin/.idx), data.tokenizer, checkpoint.load_path,
                 a container image file (.sqsh, .sif); relative paths are read from the current folder
  live Slurm     when sinfo answers within 3 s: the partition exists (or a default one), nodes, GPUs and
                 CPUs per node, the time limit; otherwise not checked (--verbose says why)
  topology       --topology FILE (`scontrol show topology` output), else the live cluster's when Slurm
                 answers: a warning line (exit 0) for each TP, CP or EP group kind that must span leaf
                 switches, with its cost in the plan, and for a cluster.switches too small (docs/topology.md)

The reference, without a recipe:
  python -m hpc_tools validate --explain parallel.tensor_size   a field: type, default, bounds, doc, rules reading it
  python -m hpc_tools validate --explain parallel               a section: its fields
  python -m hpc_tools validate --explain recipe                 the sections
  python -m hpc_tools validate --explain heads_shape            a cross-field rule: its doc and the fields it reads
  python -m hpc_tools validate --explain expert_model_parallel_size   another library's name: the field it is here
  python -m hpc_tools validate --rules                          every cross-field rule"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_recipe_args(p, nargs="*")
    add_json(p)
    p.add_argument("--no-fit", action="store_true", help="skip the planner's memory-fit check")
    p.add_argument("--offline", action="store_true",
                   help="check the recipe alone: not the files it names, not the live Slurm cluster")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="also say what the world checks covered (the Slurm partitions, or why Slurm was not checked)")
    p.add_argument("--topology", metavar="FILE", default=None,
                   help="check where the parallel groups fall on this network (`scontrol show topology` output, "
                        "tree or block plugin) instead of the live cluster's")
    p.add_argument("--rules", action="store_true", help="list the layout and backend rules and exit (no recipe needed)")
    p.add_argument("--explain", metavar="NAME", default=None,
                   help="print the reference of a field (parallel.tensor_size), a section (parallel, or recipe for "
                        "all) or a rule (heads_shape) and exit (no recipe needed)")


def check(path: str, overrides: list[str], profile: str | None, fit: bool, world: bool = False,
          notes: list[str] | None = None, topology=None, summaries: list[str] | None = None) -> list[dict]:
    """Violations (as dicts) of one recipe under one profile. With ``world``, a recipe that passes its own rules
    and the fit is checked against the files it names and the live Slurm cluster (``hpc_tools/world.py``). The notes
    of a valid recipe (``recipe.rules.NOTES``: valid but unusual choices) are added to ``notes``."""
    from hpc_tools.planner import fit_violations  # the planner's fit, without submit's machinery (jinja2, runs)
    from hpc_tools.recipe.load import read_yaml, resolve

    try:
        # without the profile, --set local.… values are not checked here: the profile's own check (next) reports them
        recipe = resolve(read_yaml(path), overrides, profile, path, check_profile=False)
        violations = fit_violations(recipe) if fit else []
    except RecipeError as exc:
        violations = exc.violations
    if world and not violations:
        from hpc_tools.world import world_violations

        violations = world_violations(recipe)
    if not violations and notes is not None:
        from hpc_tools.recipe.rules import recipe_notes

        notes += [n for n in recipe_notes(recipe) if n not in notes]
        if topology is not None:  # where the groups fall on the network: warnings, never errors
            from hpc_tools.planner.placement import placement_summary, placement_warnings

            where = printable(path) + (f" (profile {profile})" if profile else "")
            notes += [n for n in placement_warnings(recipe, topology, where) if n not in notes]
            if summaries is not None:
                summaries.append(f"note: {where}: {placement_summary(recipe, topology)}")
    return [v.as_dict() for v in violations]


def run(args: argparse.Namespace) -> int:
    if args.explain is not None:
        return _explain(args.explain, args.json)
    if args.rules:
        return _rules(args.json)
    if not args.recipe:
        raise UserError("validate needs recipe files (e.g. python -m hpc_tools validate recipes/*.yaml), "
                        "or --explain NAME / --rules")
    from hpc_tools.recipe.load import read_yaml

    results, notes, summaries = [], [], []
    topology, topology_why = _topology(args.topology, args.offline)
    for path in args.recipe:
        profiles = [args.profile] if args.profile else \
            [None] + (["local"] if _has_local(read_yaml(path), args.overrides) else [])
        for profile in profiles:
            results.append({"recipe": path, "profile": profile,
                            "errors": check(path, args.overrides, profile, not args.no_fit, not args.offline,
                                            notes, topology, summaries)})
    ok = all(not r["errors"] for r in results)
    slurm = _slurm_note(args.offline)
    if args.json:
        emit_json({"ok": ok, "results": results, "slurm": slurm, "notes": notes,
                   "topology": summaries if topology is not None else topology_why})
    else:
        for r, errors in _one_line_per_field(results):
            where = printable(r["recipe"]) + (f" (profile {r['profile']})" if r["profile"] else "")
            if r["errors"]:
                for e, also_local in errors:
                    say(f"error: {where}{' (and its local profile)' if also_local else ''}: "
                        f"{printable(e['message'])}")
            else:
                print(f"ok: {where}")
        for line in notes:  # valid but unusual choices: one line each, on stderr, exit 0
            say(line)
        if args.verbose:
            for line in summaries if topology is not None else \
                    [f"note: topology not checked: {topology_why}"] if topology_why else []:
                say(line)
        if args.verbose or slurm["unreachable"]:  # Slurm installed but silent: worth one line; absent: normal
            say(f"note: {slurm['summary']}" + ("; --offline, or HPC_TOOLS_SLURM=off where this Slurm client has no "
                                                "cluster, skips the check" if slurm["unreachable"] else ""))
    if not ok:
        return UserError.exit_code
    return 0


def _one_line_per_field(results: list[dict]) -> list[tuple[dict, list[tuple[dict, bool]]]]:
    """Each result with the error lines to print, each with whether the local profile fails on it too: a field and
    value refused both as written and with the profile (a --set value both take, a rule the profile does not
    change) is one line, not two (the profile's figures can differ: the cause is the same value)."""
    written = {(r["recipe"], e["path"], e["value"]) for r in results if r["profile"] is None for e in r["errors"]}
    local = {(r["recipe"], e["path"], e["value"]) for r in results if r["profile"] == "local" for e in r["errors"]}
    out = []
    for r in results:
        if r["profile"] is None:
            out.append((r, [(e, (r["recipe"], e["path"], e["value"]) in local) for e in r["errors"]]))
        else:
            out.append((r, [(e, False) for e in r["errors"] if r["profile"] != "local" or
                            (r["recipe"], e["path"], e["value"]) not in written]))
    return out


def _topology(path: str | None, offline: bool):
    """(the network to check the layouts on, or None; why there is none, "" when the Slurm note says it already):
    ``--topology FILE``, else the live cluster's when Slurm answered sinfo (not with ``--offline``). A file that is
    not ``scontrol show topology`` output is a UserError."""
    from hpc_tools.topology import TopologyError, parse_topology

    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                return parse_topology(f.read(1 << 24)), ""
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"--topology {printable(path)}: cannot read it ({type(exc).__name__}) -- give a file "
                            "holding `scontrol show topology` output") from None
        except TopologyError as exc:
            raise UserError(f"--topology {printable(path)}: {exc} -- give `scontrol show topology` output "
                            "(SwitchName= or BlockName= lines)") from None
    if offline:
        return None, ""  # the Slurm note says --offline
    from hpc_tools.world import live_topology, slurm_view

    if not slurm_view().checked:  # no Slurm here, or it did not answer sinfo: the Slurm note says so, once
        return None, ""
    live = live_topology()
    return (None, live) if isinstance(live, str) else (live, "")


def _slurm_note(offline: bool) -> dict:
    """What the world checks knew of Slurm (they ask it once per process), for --verbose and --json."""
    if offline:
        return {"checked": False, "unreachable": False, "summary": "not checked against the world (--offline)"}
    from hpc_tools.world import slurm_view

    view = slurm_view()
    return {"checked": view.checked, "unreachable": not view.checked and not view.absent,
            "summary": view.summary(),
            "partitions": [p.name for p in view.partitions] if view.checked else None}


def _explain(name: str, as_json: bool) -> int:
    from hpc_tools.recipe.explain import explain, format_text

    info = explain(name)
    if as_json:
        emit_json(info)
    else:
        print(format_text(info))
    return 0


def _rules(as_json: bool) -> int:
    from hpc_tools.recipe.rules import RULES

    if as_json:
        emit_json([{"name": r.name, "doc": r.doc, "reads": sorted(r.reads)} for r in RULES])
        return 0
    for r in RULES:
        print(f"{r.name}: {r.doc}")
    print("(`python -m hpc_tools validate --explain RULE` shows the fields a rule reads)")
    return 0


def _has_local(raw: dict, overrides: list[str]) -> bool:
    """Whether the recipe has a local profile, in its file or made by --set local.SECTION.KEY=VALUE."""
    from hpc_tools.recipe.load import apply_overrides, split_profile_overrides

    return apply_overrides(raw, split_profile_overrides(overrides)[0]).get("local") is not None
