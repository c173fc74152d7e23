"""``export RUN --out DIR``: a trained Megatron, DeepSpeed, FSDP or Horovod run -> a plain Hugging Face model folder."""

from __future__ import annotations

import argparse
import contextlib
import sys

from hpc_tools import backends
from hpc_tools.cli._common import STEP, add_json, add_run_ref, add_runs_dir, emit_json, say

NAME = "export"
# Read from the source for the command list: a literal (tests/unit/test_cli_help.py checks it names every backend
# kind whose row has an exporter).
HELP = ("write a trained megatron, deepspeed, fsdp or horovod run as a Hugging Face model folder (from_pretrained "
        "loads it)")
EXPORTERS = ", ".join(backends.with_feature("hf_export"))
DESCRIPTION = """\
Writes the run's newest verified checkpoint (or --step) as a folder that
transformers.AutoModelForCausalLM.from_pretrained(DIR) and AutoTokenizer.from_pretrained(DIR) load: config.json,
generation_config.json, fp32 model.safetensors and the run's tokenizer (a local tokenizer folder is copied; the byte
tokenizer is written as an equivalent byte-level tokenizer.json). Megatron runs of any TP/PP/VPP layout become
GPT2LMHeadModel (model.family: gpt) or LlamaForCausalLM (family: llama); DeepSpeed runs are consolidated through
zero_to_fp32 (ZeRO 0-3) or layer by layer (pipeline); FSDP runs (full_shard, hybrid_shard, ddp) and Horovod runs
are assembled from their torch Distributed Checkpoint, whatever rank count saved it. The folder is written beside
--out and renamed at the end. Mapping and tolerances: docs/hf-conversion.md.
""" + f"Backend kinds with an exporter (the backend table's hf_export): {EXPORTERS}."
ORDER = 60


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_run_ref(p)
    p.add_argument("--out", required=True, help="folder for the model (new or empty, unless --overwrite)")
    p.add_argument("--step", type=STEP, default=None, help="export this checkpoint step (default: the newest)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out (once the new folder is done)")
    add_runs_dir(p)
    add_json(p)


def run(args: argparse.Namespace) -> int:
    from hpc_tools.registry import find_run, runs_root

    found = find_run(args.run, runs_root(args.runs_dir))
    # DeepSpeed and transformers print to stdout when imported; stdout stays clean for --json.
    with contextlib.redirect_stdout(sys.stderr):
        from hpc_tools.hf.export import export_run

        summary = export_run(found.path, args.out, args.step, overwrite=args.overwrite)
    if args.json:
        emit_json({"ok": True, **summary})
    else:
        say(f"exported {summary['run_id']} step {summary['step']} ({summary['parameters']:,} parameters) "
            f"-> {summary['folder']}")
    return 0
