"""``eval``'s work: check everything (target, checkpoints, tasks, include path), then evaluate each model in turn
(the local executor) or render and submit one Slurm job array for them. Nothing is written before every check has
passed."""

from __future__ import annotations

import datetime as dt
import json
import logging
from dataclasses import dataclass
from typing import Any

from hpc_tools.errors import UserError
from hpc_tools.evaluate import results as res
from hpc_tools.evaluate.target import Model, Target, ensure_exported, models, resolve
from hpc_tools.evaluate.tasks import check_include_path, check_tasks, parse_tasks
from hpc_tools.registry import atomic_write

log = logging.getLogger("hpc_tools.evaluate")


@dataclass
class EvalRequest:
    ref: str
    tasks: str
    include_path: str | None = None
    limit: int | None = None
    iterations: list[int] | None = None
    executor: str = "local"
    batch_size: int | str | None = None  # None: lm-eval's auto on GPUs, 1 on CPU
    runs_dir: str | None = None
    render_only: bool = False


@dataclass
class Plan:
    request: EvalRequest
    target: Target
    models: list[Model]
    tasks: list[str]
    include_path: str | None


def plan(req: EvalRequest) -> Plan:
    """Every check, nothing written: the target, its checkpoints, the tasks, the executor."""
    if req.executor == "slurm" and not req.render_only:  # the one executor rule, asked first, as every command does
        from hpc_tools.submission import choose_executor

        choose_executor("slurm")
    tasks = parse_tasks(req.tasks)
    include = check_include_path(req.include_path)
    target = resolve(req.ref, req.runs_dir)
    chosen = models(target, req.iterations)
    if req.executor == "slurm":
        if target.run is None or target.folder is not None:
            raise UserError(f"--executor slurm evaluates a run's checkpoints as a job array, but {req.ref} is a "
                            "model folder (evaluate it with --executor local, or give its run)")
    elif req.render_only:
        raise UserError("--render writes a Slurm job array's script (add --executor slurm, or leave --render out)")
    check_tasks(tasks, include)
    return Plan(req, target, chosen, tasks, include)


def run_local(p: Plan) -> list[dict[str, Any]]:
    """Each model in turn: export when needed, lm-eval, its results JSON under the target's eval/."""
    from hpc_tools.evaluate.harness import evaluate_folder

    done = []
    for model in p.models:
        folder = ensure_exported(model, p.target.run) if p.target.run is not None else model.folder
        out = evaluate_folder(folder, p.tasks, p.include_path, p.request.limit, p.request.batch_size,
                              precision=run_precision(p.target, model))
        out[res.META_KEY] = {"iteration": model.iteration, "tokens": model.tokens, "scheme": model.scheme,
                             "model_folder": str(folder), "tasks": p.tasks, "limit": p.request.limit,
                             "include_path": p.include_path, "finished": _now()}
        path = p.target.eval_dir / res.results_name(model.iteration, model.scheme)
        path.parent.mkdir(parents=True, exist_ok=True)
        out = res.keep_other_tasks(path, out)
        atomic_write(path, json.dumps(out, indent=2, sort_keys=True))
        done.append({"file": str(path), "iteration": model.iteration, "scheme": model.scheme,
                     "results": out.get("results", {})})
    return done


def run_precision(target: Target, model: Model) -> str | None:
    """The precision a model is evaluated in on GPUs: its run's ``training.precision`` (exports are fp32 on disk),
    None (the folder's own dtype) for a quantized or foreign folder."""
    if target.run is None or model.scheme is not None or target.meta.get("kind") == res.QUANTIZE_META:
        return None
    from hpc_tools.hf.export import run_recipe

    try:
        return run_recipe(target.run).training.precision
    except (OSError, ValueError, UserError):
        return None


def array_gpus(recipe) -> int:
    """GPUs per array task: the fewest of the node's that hold the model in the run's precision (lm-eval spreads it
    over them); 0 for CPU ranks. A model no node holds is refused in one line."""
    import math

    from hpc_tools.evaluate.harness import BYTES, DTYPES, OVERHEAD
    from hpc_tools.planner.arch import arch_for, total_parameters
    from hpc_tools.planner.hardware import hardware_for

    c = recipe.cluster
    if not c.uses_gpus:
        return 0
    mem = hardware_for(c, recipe.training.precision).mem_bytes
    if not mem:
        return 1
    count = total_parameters(arch_for(recipe))
    need = OVERHEAD * count * BYTES[DTYPES[recipe.training.precision]]
    gpus = max(1, math.ceil(need / mem))
    if gpus > c.gpus_per_node:
        raise UserError(f"the model needs about {need / 1e9:.3g} GB of GPU memory to evaluate ({count / 1e9:.3g}B "
                        f"parameters in {recipe.training.precision} x {OVERHEAD}) and a node of {c.gpus_per_node} "
                        f"{c.gpu_type} holds {c.gpus_per_node * mem / 1e9:.3g} GB (evaluate on larger nodes, or "
                        "quantize the export first)")
    return gpus


def eval_args(p: Plan) -> list[str]:
    """The options an array task passes on to its own ``eval``."""
    args = ["--tasks", ",".join(p.tasks)]
    if p.request.batch_size is not None:
        args += ["--batch-size", str(p.request.batch_size)]
    if p.include_path:
        args += ["--include-path", p.include_path]
    if p.request.limit is not None:
        args += ["--limit", str(p.request.limit)]
    return args


def submit_array(p: Plan) -> dict[str, Any]:
    """Render the job array into ``<run>/eval/eval-<stamp>.sbatch``; submit it unless ``render_only``."""
    from hpc_tools.hf.export import run_recipe
    from hpc_tools.render.batch import render_eval_array

    run = p.target.run
    iterations = [m.iteration for m in p.models]
    recipe = run_recipe(run)
    text = render_eval_array(recipe, run.path, iterations, eval_args(p), array_gpus(recipe))
    script = p.target.eval_dir / f"eval-{dt.datetime.now(dt.timezone.utc).strftime('%Y%m%d-%H%M%S')}.sbatch"
    (p.target.eval_dir / "logs").mkdir(parents=True, exist_ok=True)
    atomic_write(script, text)
    job_id = None
    if not p.request.render_only:
        from hpc_tools.executors.slurm import sbatch_script

        try:  # from here, as `submit` does: the tasks start where hpc_tools is
            job_id = sbatch_script(script, {}, what="the evaluation array",
                                   fix="fix the recipe's cluster section, or run with --executor local")
        except UserError:
            script.unlink(missing_ok=True)  # no script of an array that never queued
            raise
    return {"script": str(script), "job_id": job_id, "iterations": iterations}


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
