"""``export RUN --out DIR``: a trained DeepSpeed run -> a plain Hugging Face model folder."""

from __future__ import annotations

import argparse
import contextlib
import sys

from hpc_tools.cli._common import add_json, add_runs_dir, emit_json, say

NAME = "export"
HELP = "write a trained DeepSpeed run as a Hugging Face model folder (from_pretrained loads it)"
DESCRIPTION = """\
Consolidates the run's newest complete checkpoint (or --step) into fp32 weights and writes a folder that
transformers.AutoModelForCausalLM.from_pretrained(DIR) loads: ZeRO stages 0-3 through DeepSpeed's zero_to_fp32,
pipeline checkpoints layer by layer. A local tokenizer folder (data.tokenizer) is copied alongside.
"""
ORDER = 60


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="run folder, run id (or unique prefix), or Slurm job id")
    p.add_argument("--out", required=True, help="new, empty folder for the model")
    p.add_argument("--step", type=int, default=None, help="export this checkpoint step (default: the newest)")
    add_runs_dir(p)
    add_json(p)


def run(args: argparse.Namespace) -> int:
    from hpc_tools.registry import find_run, runs_root

    found = find_run(args.run, runs_root(args.runs_dir))
    # DeepSpeed and transformers print to stdout when imported; stdout stays clean for --json.
    with contextlib.redirect_stdout(sys.stderr):
        from hpc_tools.train.deepspeed.export import export_run

        summary = export_run(found.path, args.out, args.step)
    if args.json:
        emit_json({"ok": True, **summary})
    else:
        say(f"exported {summary['run_id']} step {summary['step']} ({summary['parameters']:,} parameters) "
            f"-> {summary['folder']}")
    return 0
