"""Many Megatron-core layouts in ONE launch of 4 gloo ranks (each launch costs ~10 s here).

    python tests/integration/megatron_driver.py --out results.json [--only NAME ...]

Without RANK in the environment it starts 4 copies of itself (``hpc_tools.testing.spawn``: the local executor's rank
environment) and waits. Each rank then, in one torch.distributed world:

1. builds the TP1xPP1 model of each model family and saves it (model only) as the shared initial checkpoint;
2. for every case of CASES: re-initialises Megatron's parallel state for the case's layout, loads that checkpoint,
   trains STEPS steps, records the global-batch loss of each step and the step times;
3. resume cases: trains K steps, saves a full checkpoint (optimizer, RNG), tears the engine down, builds a new one
   (the same or another layout), loads it and trains the remaining steps.

Rank 0 writes ``{case: {"losses": [...], "step_s": [...], "layout": ...}}`` as JSON. The assertions live in
tests/integration/test_megatron_layouts.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import _checkout  # noqa: F401  (this checkout on sys.path, before any hpc_tools import)

WORLD = 4
STEPS = 6
RESUME_AT = 3

BASE = {
    "name": "mg_layouts",
    "model": {"family": "gpt", "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
              "vocab_size": 512, "hidden_dropout": 0.0, "attention_dropout": 0.0},
    "parallel": {"tensor_size": 1, "pipeline_size": 1, "data_size": -1, "virtual_pipeline_size": None,
                 "sequence_parallel": False},
    "training": {"micro_batch_size": 1, "global_batch_size": 8, "train_iters": STEPS, "lr": 2e-3, "min_lr": 2e-4,
                 "lr_warmup_iters": 2, "precision": "fp32", "seed": 1234, "clip_grad": 1.0},
    "backend": {"kind": "megatron", "megatron": {"distributed_optimizer": True}},
    "data": {"source": "synthetic"},
    "cluster": {"nodes": 1, "gpus_per_node": WORLD, "gpu_type": "cpu", "cpus_per_task": 1},
}
LLAMA = {"model": {"family": "llama", "num_query_groups": 2, "ffn_hidden_size": 160}}
# Each case's Megatron groups outlive its engine (~50 gloo threads per rank, hpc_tools/train/groups.py), so every case
# added here loads the machine for the rest of the launch: interleaved uneven stages are checked against Megatron-core's
# own layer assignment in tests/unit/test_uneven_stages.py instead of by a 6-layer family here.
FAMILIES = {"gpt": "TP1xPP1 (DP4)", "llama": "llama TP1xPP1 (DP4)"}
"""family -> its reference case (TP1xPP1), whose model every case of the family loads as its initial checkpoint."""

# name -> (family overrides, --set style overrides). "ref" of a family is TP1xPP1 with the plain optimizer.
CASES: dict[str, tuple[dict, list[str]]] = {
    "TP1xPP1 (DP4)": ({}, []),
    "TP2xPP2": ({}, ["parallel.tensor_size=2", "parallel.pipeline_size=2"]),
    "TP1xPP4": ({}, ["parallel.pipeline_size=4"]),
    "TP2xDP2": ({}, ["parallel.tensor_size=2"]),
    "PP2xDP2": ({}, ["parallel.pipeline_size=2"]),
    "PP2xVPP2xDP2": ({}, ["parallel.pipeline_size=2", "parallel.virtual_pipeline_size=2"]),
    "TP2xPP2 +SP": ({}, ["parallel.tensor_size=2", "parallel.pipeline_size=2", "parallel.sequence_parallel=true"]),
    "TP2xPP2 recompute selective": ({}, ["parallel.tensor_size=2", "parallel.pipeline_size=2",
                                         "training.recompute_granularity=selective"]),
    "TP2xPP2 recompute full": ({}, ["parallel.tensor_size=2", "parallel.pipeline_size=2",
                                    "training.recompute_granularity=full", "training.recompute_num_layers=1"]),
    "TP2xPP2 plain optimizer": ({}, ["parallel.tensor_size=2", "parallel.pipeline_size=2",
                                     "backend.megatron.distributed_optimizer=false"]),
    "TP2xPP2 bf16": ({}, ["parallel.tensor_size=2", "parallel.pipeline_size=2", "training.precision=bf16"]),
    # uneven pipeline stages (Megatron-core's num_layers_in_first/last_pipeline_stage): 1 + 3 and 3 + 1 layers
    "PP2xDP2 uneven (first 1)": ({}, ["parallel.pipeline_size=2", "parallel.num_layers_in_first_pipeline_stage=1"]),
    "TP2xPP2 uneven (last 1)": ({}, ["parallel.tensor_size=2", "parallel.pipeline_size=2",
                                     "parallel.num_layers_in_last_pipeline_stage=1"]),
    "llama TP1xPP1 (DP4)": (LLAMA, []),
    "llama TP2xPP2 +SP": (LLAMA, ["parallel.tensor_size=2", "parallel.pipeline_size=2",
                                  "parallel.sequence_parallel=true"]),
}
# name -> (first layout, layout after the restart); both must reproduce the uninterrupted case named first (bit for
# bit when the layout is the same).
RESUMES: dict[str, tuple[str, str]] = {
    "resume TP2xPP2 -> TP2xPP2": ("TP2xPP2", "TP2xPP2"),
    "resume PP2xDP2 uneven (first 1) -> same": ("PP2xDP2 uneven (first 1)", "PP2xDP2 uneven (first 1)"),
    "resume TP2xPP2 plain -> TP1xPP4 plain": ("TP2xPP2 plain optimizer", "TP1xPP4 plain"),
    "resume TP2xPP2 plain -> TP2xDP2 plain": ("TP2xPP2 plain optimizer", "TP2xDP2 plain"),
}
EXTRA = {
    "TP1xPP4 plain": ({}, ["parallel.pipeline_size=4", "backend.megatron.distributed_optimizer=false"]),
    "TP2xDP2 plain": ({}, ["parallel.tensor_size=2", "backend.megatron.distributed_optimizer=false"]),
}


def make_recipe(family: dict, sets: list[str]):
    from hpc_tools.recipe.load import deep_merge, resolve

    return resolve(deep_merge(BASE, family), sets, source="megatron_driver")


def family_of(case: str) -> str:
    return "llama" if case.startswith("llama") else "gpt"


def run_steps(engine, recipe, layout, first: int, last: int) -> tuple[list[float], list[float]]:
    """Train steps first..last; every rank returns the global losses (from the last stage) and step times."""
    import torch.distributed as dist

    from hpc_tools.train.data import build_samples, microbatches_for_step

    samples = build_samples(recipe)
    losses, times = [], []
    for step in range(first, last + 1):
        t0 = time.perf_counter()
        result = engine.train_step(step, microbatches_for_step(samples, step, engine.coords.dp_rank, layout))
        times.append(time.perf_counter() - t0)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, result.loss)
        losses.append(next(x for x in gathered if x is not None))
    return losses, times


def layer_numbers(engine) -> list[list[int]]:
    """Every rank's transformer layers (1-based global numbers, Megatron-core's layer_number), by rank."""
    import torch.distributed as dist

    from hpc_tools.train.megatron.model import unwrap

    mine = [layer.layer_number for chunk in engine.chunks for layer in unwrap(chunk).decoder.layers]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return gathered


def build(case: str):
    from hpc_tools.layout import ParallelLayout
    from hpc_tools.train.megatron.engine import MegatronCore

    family, sets = {**CASES, **EXTRA}[case]
    recipe = make_recipe(family, sets)
    layout = ParallelLayout.from_recipe(recipe)
    return MegatronCore(recipe, layout, "cpu"), recipe, layout


def thread_count() -> int:
    """This process's threads (Linux): a closed engine's process groups must take their gloo threads with them."""
    return len(os.listdir("/proc/self/task"))


def rank_main(out: Path, only: list[str]) -> None:
    import torch.distributed as dist

    from hpc_tools.checkpoints.dirs import CheckpointDirs
    from hpc_tools.train.checkpointing.saver import save_once
    from hpc_tools.train.megatron import checkpoint
    from hpc_tools.train.megatron.trainer import _quiet_megatron

    _quiet_megatron()
    from hpc_tools.runtime.distenv import join_world

    join_world("gloo")
    work = Path(os.environ["MG_DRIVER_WORK"])
    results: dict[str, dict] = {}
    init_dirs = {fam: CheckpointDirs(work / f"init_{fam}") for fam in FAMILIES}
    for fam, case in FAMILIES.items():
        engine, _, _ = build(case)
        save_once(checkpoint.Shards(engine), init_dirs[fam], 0)
        engine.close()

    def selected(name: str) -> bool:
        return not only or name in only

    for case in CASES:
        if not selected(case):
            continue
        t0 = time.perf_counter()
        engine, recipe, layout = build(case)
        t1 = time.perf_counter()
        checkpoint.load(engine, init_dirs[family_of(case)].final_path(0))
        t2 = time.perf_counter()
        losses, times = run_steps(engine, recipe, layout, 1, STEPS)
        layers = layer_numbers(engine)
        engine.close()
        del engine
        results[case] = {"losses": losses, "step_s": times, "build_s": t1 - t0, "load_s": t2 - t1,
                         "layout": layout.describe(), "layers": layers, "threads": thread_count()}

    for name, (before, after) in RESUMES.items():
        if not selected(name):
            continue
        dirs = CheckpointDirs(work / name.replace(" ", "_").replace(">", ""))
        engine, recipe, layout = build(before)
        checkpoint.load(engine, init_dirs["gpt"].final_path(0))
        first_losses, _ = run_steps(engine, recipe, layout, 1, RESUME_AT)
        save_once(checkpoint.Shards(engine), dirs, RESUME_AT)
        engine.close()
        engine, recipe, layout = build(after)
        step = checkpoint.load(engine, dirs.newest())
        rest, _ = run_steps(engine, recipe, layout, step + 1, STEPS)
        engine.close()
        results[name] = {"losses": first_losses + rest, "resumed_at": step, "layout": layout.describe(),
                         "reference": before}

    if dist.get_rank() == 0:
        out.write_text(json.dumps(results, indent=2))
    dist.barrier()
    dist.destroy_process_group()


def launch(out: Path, only: list[str], timeout_s: float = 900) -> int:
    """Start WORLD ranks of this script and wait for them; returns the first non-zero exit code (124: timed out)."""
    from hpc_tools.testing.spawn import RanksFailed, spawn_ranks

    with tempfile.TemporaryDirectory(prefix="mg_driver_") as work:
        args = [sys.executable, __file__, "--out", str(out), *sum((["--only", o] for o in only), [])]
        try:
            ranks = spawn_ranks(args, WORLD, env={"MG_DRIVER_WORK": work, "PYTHONWARNINGS": "ignore"},
                                timeout_s=timeout_s, check=True)
        except RanksFailed as failed:
            print(failed, file=sys.stderr)
            culprit = failed.ranks[failed.culprit]
            return 124 if culprit.timed_out else culprit.returncode
        print(ranks[0].log)
        return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file for the results (written by rank 0)")
    parser.add_argument("--only", action="append", default=[], help="run only these cases (repeatable)")
    args = parser.parse_args()
    if "RANK" not in os.environ:
        return launch(args.out, args.only)
    rank_main(args.out, args.only)
    return 0


if __name__ == "__main__":  # the guard matters: dist_checkpointing starts a spawn Manager that re-imports __main__
    sys.exit(main())
