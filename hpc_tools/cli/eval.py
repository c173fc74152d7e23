"""``eval RUN_OR_HF_DIR --tasks T1,T2``: lm-evaluation-harness on a run's checkpoints (exported first) or a model
folder; results under ``<run>/eval/`` (docs/evaluate-and-quantize.md)."""

from __future__ import annotations

import argparse

from hpc_tools.cli._common import COUNT, RUN_REF, add_json, add_runs_dir, emit_json, say

NAME = "eval"
ORDER = 62
HELP = ("evaluate a run's checkpoints (or a Hugging Face folder) with lm-evaluation-harness; results in the run's "
        "eval/ folder, status and the report")
DESCRIPTION = """\
Exports the run's newest verified checkpoint (or each of --iterations) as a Hugging Face folder under <run>/exports/
(shared with quantize and serve), runs lm-evaluation-harness's Hugging Face backend on it offline (HF_HUB_OFFLINE
and HF_DATASETS_OFFLINE default to 1) and writes lm-eval's results JSON as <run>/eval/iter_NNNNNNN.json. A model
folder (an export, or a quantize output) is evaluated as it is; a quantized folder's results go to its run beside
the unquantized ones (iter_NNNNNNN-SCHEME.json). Local tasks: lm-eval YAML files under --include-path over local
files; a site's dataset cache: HF_DATASETS_CACHE. With --executor slurm, the checkpoints are one job array (one task
each); --render writes its script without submitting it.
"""


def iteration_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of iterations "
                                         "(e.g. --iterations 10,20,30)") from None
    if not values or any(v < 0 for v in values) or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"{text!r}: give distinct checkpoint iterations of 0 or more, e.g. "
                                         "--iterations 10,20,30")
    return values


def batch_size(text: str) -> int | str:
    """--batch-size: a count, or lm-eval's ``auto``."""
    return "auto" if text == "auto" else COUNT(text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", metavar="RUN_OR_HF_DIR", help=f"{RUN_REF}, or a Hugging Face model folder")
    p.add_argument("--tasks", required=True, help="lm-eval task names, comma-separated (e.g. hellaswag,arc_easy)")
    p.add_argument("--include-path", default=None, metavar="DIR",
                   help="lm-eval's --include-path: a folder of task YAML files (local tasks over local data)")
    p.add_argument("--limit", type=COUNT, default=None, metavar="N", help="at most N examples per task")
    p.add_argument("--iterations", type=iteration_list, default=None, metavar="I1,I2,...",
                   help="evaluate these checkpoints of the run (default: the newest verified one)")
    p.add_argument("--executor", choices=["local", "slurm"], default="local",
                   help="local: evaluate here, one checkpoint after another; slurm: one job array (default local)")
    p.add_argument("--batch-size", type=batch_size, default=None, metavar="N|auto",
                   help="lm-eval's batch size: N, or auto (the largest that fits; default auto on GPUs, 1 on CPU)")
    p.add_argument("--render", action="store_true",
                   help="with --executor slurm: write the job array's script under <run>/eval/, submit nothing")
    add_runs_dir(p)
    add_json(p)


def run(args: argparse.Namespace) -> int:
    from hpc_tools.evaluate.evaljob import EvalRequest, plan, run_local, submit_array

    req = EvalRequest(args.run, args.tasks, args.include_path, args.limit, args.iterations, args.executor,
                      args.batch_size, args.runs_dir, args.render)
    p = plan(req)
    if args.executor == "slurm":
        out = submit_array(p)
        if args.json:
            emit_json({"ok": True, **out})
        else:
            what = f"submitted job array {out['job_id']}" if out["job_id"] else "rendered job array"
            say(f"{what}: {len(out['iterations'])} checkpoint(s) ({', '.join(map(str, out['iterations']))}) -> "
                f"{out['script']}")
        return 0
    import contextlib
    import sys

    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed, transformers and lm-eval print; stdout is for --json
        done = run_local(p)
    if args.json:
        emit_json({"ok": True, "evaluated": done})
        return 0
    for d in done:
        scores = "; ".join(f"{task} " + ", ".join(f"{k.split(',')[0]} {v:.4f}" for k, v in m.items()
                                                  if isinstance(v, float) and "_stderr" not in k)
                           for task, m in d["results"].items())
        say(f"iteration {d['iteration']}{' ' + d['scheme'] if d['scheme'] else ''}: {scores} -> {d['file']}")
    return 0
