"""``quantize RUN_OR_HF_DIR --scheme int8|fp8 --out DIR``: a smaller Hugging Face folder (torchao weight-only)."""

from __future__ import annotations

import argparse

from hpc_tools.cli._common import RUN_REF, add_json, add_runs_dir, emit_json, say

NAME = "quantize"
ORDER = 63
HELP = ("quantize a run's newest checkpoint (or a Hugging Face folder) to weight-only int8 or fp8 with torchao; "
        "a folder that eval, transformers and vLLM load")
DESCRIPTION = """\
A run is exported first (its newest verified checkpoint, under <run>/exports/, shared with eval and serve).
Schemes: int8 (torchao Int8WeightOnlyConfig) and fp8 (Float8WeightOnlyConfig), both on every nn.Linear, both
runnable on CPU. The folder carries hpc_tools_quantize.json: the linear weights' bytes before (as bf16) and after,
and the folder's size; `eval` on it writes its scores beside the unquantized ones in the run's eval/ folder.
docs/evaluate-and-quantize.md.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", metavar="RUN_OR_HF_DIR", help=f"{RUN_REF}, or a Hugging Face model folder")
    p.add_argument("--scheme", required=True, choices=["int8", "fp8"], help="int8 or fp8 weight-only")
    p.add_argument("--out", required=True, help="folder for the quantized model (new or empty, unless --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out (once the new folder is done)")
    add_runs_dir(p)
    add_json(p)


def run(args: argparse.Namespace) -> int:
    import contextlib
    import sys

    from hpc_tools.evaluate.quantize import quantize
    from hpc_tools.evaluate.target import resolve

    target = resolve(args.run, args.runs_dir)
    with contextlib.redirect_stdout(sys.stderr):
        summary = quantize(target, args.scheme, args.out, args.overwrite)
    if args.json:
        emit_json({"ok": True, **summary})
    else:
        say(f"quantized {summary['linear_modules']} linear layers to {args.scheme}: {summary['linear_bytes_after']:,}"
            f" B = {100 * summary['ratio_vs_bf16']:.1f} % of their {summary['linear_bytes_bf16']:,} B as bf16; "
            f"folder {summary['folder_bytes_before']:,} -> {summary['folder_bytes_after']:,} B -> {summary['folder']}")
    return 0
