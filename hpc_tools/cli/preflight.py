"""preflight: check an allocation as a job of its own and print the per-node table (docs/preflight.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hpc_tools.cli._common import add_json, add_recipe_args, add_runs_dir, emit_json, say

NAME = "preflight"
ORDER = 35
HELP = "check the nodes a recipe would train on (GEMM, memory, collectives, transport) and print a per-node table"
DESCRIPTION = HELP + """

Runs the checks a training job runs before step 1 when cluster.preflight is on, as a job of its own: each rank
times a GEMM at the recipe's precision and a memory copy, all ranks time the collectives the layout uses (all-reduce,
all-gather, all-to-all with expert parallelism) as bus bandwidth, a search over halves of the nodes finds a slow
link in at most ceil(log2 N) + 1 rounds, and each node's transport (gloo's interface; NCCL's IB or Socket) is
compared with what the recipe says. A node below 0.7x the node median, or with the wrong transport, is named with
the figure and the reason. The table is printed and kept in the run folder (preflight.json).

--executor local (the default) runs the recipe's ranks on this machine (its local profile when it has one), each
rank standing for a node of its own so that the table has a row per rank. --executor slurm submits the checks as a
job on the recipe's Slurm resources (its nodes, set-up and container; no in-job restarts) and waits for it: a row per
Slurm node. GPU ranks judge the
job's all-reduce by the planner's expected bus bandwidth for the link (its hardware table, or the recipe's
cluster.inter_node_bw_gbps / intra_node_bw_gbps), which `submit` and this command record in the run's manifest.
Exit 0 when every node is healthy, 1 when a node or the job is named, 2 for bad input."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_recipe_args(p)
    p.add_argument("--executor", choices=["local", "slurm"], default="local",
                   help="where to run the checks (local: one process per rank on this machine, each standing for a "
                        "node; slurm: a job on the recipe's nodes, waited for)")
    add_runs_dir(p)
    add_json(p)


def run(args: argparse.Namespace) -> int:
    from hpc_tools.executors.local import run_local
    from hpc_tools.layout import ParallelLayout
    from hpc_tools.runtime.preflight.run import RANKS_PER_NODE_ENV
    from hpc_tools.runtime.preflight.verdict import failure_line, read_report, rows_from_dict, table_lines
    from hpc_tools.submission import checked_runs_root, new_run, plan_submission

    checked_runs_root(args.runs_dir)
    plan = plan_submission(args.recipe, args.overrides, args.profile, args.executor, check_fit=False)
    recipe = plan.recipe
    world = ParallelLayout.from_recipe(recipe).world_size
    run = new_run(recipe, args.runs_dir, plan.executor, plan.source, {"profile": plan.profile, "kind": "preflight"})
    if plan.executor == "slurm":
        from hpc_tools.executors.slurm import submit_preflight
        from hpc_tools.runstate import wait

        job = submit_preflight(run, recipe)
        if not args.json:
            say(f"preflight: Slurm job {job.job_id} on {recipe.cluster.nodes} node(s); waiting for it")
        state = wait(run)["slurm_state"]
        code = 0 if state == "COMPLETED" else 1
    else:
        code = run_local(run, world, echo=None, extra_env={RANKS_PER_NODE_ENV: "1"}, rank_args=("--preflight-only",))
    data = read_report(run.path)
    if data is None:
        import glob

        logs = sorted(run.logs_dir.glob("rank*.out")) + sorted(  # a Slurm job's: submitit's files (log_glob)
            Path(p) for p in glob.glob(run.manifest().get("log_glob") or ""))
        told = [ln.split("ERROR hpc_tools: ", 1)[-1] for p in logs
                for ln in p.read_text(errors="replace").splitlines() if "preflight (cluster.preflight=" in ln]
        line = told[0] if told else (f"preflight ran no checks to the end (ranks exit {code}); see "
                                     f"{run.logs_dir}")
        if args.json:
            emit_json({"ok": False, "run_dir": str(run.path), "error": line})
        else:
            say(f"error: {line}")
        return 1
    rows = rows_from_dict(data)
    if args.json:
        emit_json({"ok": bool(data["healthy"]), "run_dir": str(run.path), **data})
    else:
        sys.stdout.write("\n".join(table_lines(rows)) + "\n")
        for note in data.get("notes", []):
            say(note)
        verdict = "healthy" if data["healthy"] else failure_line(rows, data.get("problems", []), "strict")
        say(f"preflight of {world} rank(s) in {data['seconds']:.1f} s (budget {data['budget_s']:g} s): {verdict}; "
            f"table in {run.path}/preflight.json")
    return 0 if data["healthy"] else 1

