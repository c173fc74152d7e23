"""``data prepare INPUT... --out DIR``: local corpora -> Megatron indexed datasets for ``data.source: indexed``."""

from __future__ import annotations

import argparse
import contextlib
import sys
import time

from hpc_tools.cli._common import COUNT, add_json, emit_json, say

NAME = "data"
HELP = "prepare training data: local jsonl/parquet/text files -> Megatron indexed datasets (.bin/.idx)"
DESCRIPTION = """\
`data prepare` tokenizes local jsonl, parquet or text files, or folders written by datasets' save_to_disk (nothing
is downloaded), and writes one Megatron indexed dataset per input: OUT/<input stem>.bin and .idx (megatron.core's
IndexedDatasetBuilder; EOS after every document) plus a small .meta.json. A text file is one document. Tokenizing runs
in --workers processes; output appears under its final name only when complete. Train on the result with
data.source: indexed and data.blend: [{path: OUT/<stem>, weight: 1}] (see docs/data.md).

With --executor slurm --recipe RECIPE the same prepare runs as one Slurm job (submitit): one node, one task with
--workers CPUs, the recipe's partition (or --partition), account, qos and environment set-up; the inputs are checked
before anything is queued, the command waits for the job (--no-wait: prints its id) and its logs are in OUT/.slurm/.
"""
ORDER = 25


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    prep = sub.add_parser("prepare", help="tokenize local files into OUT/<stem>.bin/.idx", description=DESCRIPTION,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    prep.add_argument("inputs", nargs="+", metavar="INPUT",
                      help="local .jsonl/.json, .parquet, .txt/.md files or saved-dataset folders")
    prep.add_argument("--out", required=True, help="folder for the prepared datasets (created if missing)")
    prep.add_argument("--tokenizer", default=None,
                      help="`byte` or a local Hugging Face tokenizer folder (default: the --recipe's data.tokenizer, "
                           "else byte)")
    prep.add_argument("--text-field", default="text", help="jsonl/parquet/dataset field holding the text (text)")
    prep.add_argument("--workers", type=COUNT, default=1, help="tokenizer processes (default 1)")
    prep.add_argument("--recipe", default=None,
                      help="recipe to check against: its tokenizer by default, and model.vocab_size must hold it")
    prep.add_argument("--overwrite", action="store_true", help="replace prepared datasets of the same name")
    prep.add_argument("--executor", choices=("local", "slurm"), default="local",
                      help="local (default: here, now) or slurm: one CPU job with --workers CPUs on the --recipe's "
                           "cluster (its partition, account, qos and set-up; submitit), logs in OUT/.slurm/")
    prep.add_argument("--partition", default=None,
                      help="Slurm partition for --executor slurm (default: the recipe's cluster.partition; a CPU "
                           "partition is the usual choice)")
    prep.add_argument("--time-min", type=COUNT, default=120, help="time limit of the Slurm job in minutes (120)")
    prep.add_argument("--no-wait", action="store_true",
                      help="with --executor slurm: print the job id and return instead of waiting for the job")
    add_json(prep)


def run(args: argparse.Namespace) -> int:
    from hpc_tools.data.prepare import prepare

    tokenizer, max_vocab = args.tokenizer, None
    if args.recipe:
        from hpc_tools.recipe.load import load_recipe

        recipe = load_recipe(args.recipe)
        tokenizer = tokenizer or recipe.data.tokenizer
        max_vocab = recipe.model.vocab_size
    if args.executor == "slurm":
        return _run_on_slurm(args, recipe if args.recipe else None, tokenizer or "byte", max_vocab)
    t0 = time.perf_counter()
    # megatron/transformers may print when imported: stdout stays clean for --json
    with contextlib.redirect_stdout(sys.stderr):
        done = prepare(args.inputs, args.out, tokenizer=tokenizer or "byte", text_field=args.text_field,
                       workers=args.workers, overwrite=args.overwrite, max_vocab=max_vocab)
    wall = time.perf_counter() - t0
    documents, tokens = sum(d.documents for d in done), sum(d.tokens for d in done)
    busy = max(sum(d.seconds for d in done), 1e-9)  # reading, tokenizing, writing: not the library imports
    if args.json:
        emit_json({"ok": True, "datasets": [d.as_dict() for d in done], "documents": documents, "tokens": tokens,
                   "seconds": round(busy, 3), "wall_s": round(wall, 3), "tokens_per_s": round(tokens / busy, 1),
                   "workers": args.workers})
        return 0
    for d in done:
        say(f"{d.prefix}.bin/.idx: {d.documents:,} documents, {d.tokens:,} tokens "
            f"({d.tokens / max(d.seconds, 1e-9):,.0f} tokens/s)")
    say(f"prepared {len(done)} dataset(s): {documents:,} documents, {tokens:,} tokens, {tokens / busy:,.0f} tokens/s "
        f"with {args.workers} worker(s) ({wall:.1f} s in all)")
    return 0


def _run_on_slurm(args: argparse.Namespace, recipe, tokenizer: str, max_vocab: int | None) -> int:
    """``--executor slurm``: check the inputs here, queue the same prepare as one job, wait for it (or not)."""
    from hpc_tools.errors import UserError
    from hpc_tools.executors.prepare_job import submit_prepare

    if recipe is None:
        raise UserError("data prepare --executor slurm needs --recipe RECIPE (its cluster section gives the "
                        "partition, account and environment set-up of the job)")
    if args.time_min < 1:
        raise UserError(f"--time-min={args.time_min} must be at least 1")
    if args.workers < 1:
        raise UserError(f"--workers={args.workers} must be at least 1")
    job = submit_prepare(recipe, args.inputs, args.out, partition=args.partition, time_min=args.time_min,
                         tokenizer=tokenizer, text_field=args.text_field, workers=args.workers,
                         overwrite=args.overwrite, max_vocab=max_vocab)
    if args.no_wait:
        if args.json:
            emit_json({"ok": True, "job_id": job.job_id, "logs": job.paths.stdout.parent.as_posix()})
        else:
            say(f"queued data prepare as Slurm job {job.job_id}; logs in {job.paths.stdout.parent}")
        return 0
    say(f"data prepare running as Slurm job {job.job_id}; waiting (Ctrl-C stops waiting, not the job)")
    try:
        datasets = job.result()
    except Exception as e:  # noqa: BLE001 - the job's own error, as one line
        first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise UserError(f"Slurm job {job.job_id} failed: {first[:300]} (log: {job.paths.stderr})") from None
    documents, tokens = sum(d["documents"] for d in datasets), sum(d["tokens"] for d in datasets)
    if args.json:
        emit_json({"ok": True, "job_id": job.job_id, "datasets": datasets, "documents": documents,
                   "tokens": tokens, "workers": args.workers})
        return 0
    say(f"prepared {len(datasets)} dataset(s) in Slurm job {job.job_id}: {documents:,} documents, {tokens:,} tokens")
    return 0
