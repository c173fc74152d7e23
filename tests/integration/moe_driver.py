"""Mixture-of-experts layouts of a tiny dropless MoE GPT in ONE launch of 4 gloo ranks.

    python tests/integration/moe_driver.py --out results.json [--only NAME ...]

Without RANK in the environment it starts 4 copies of itself (``hpc_tools.testing.spawn``) and waits. Each rank then,
in one torch.distributed world:

1. builds the EP1 model and saves it (model only) as the shared initial checkpoint (the expert weights are sharded
   tensors keyed by the global expert index, so every EP size loads the same experts);
2. for every case of CASES: re-initialises Megatron's parallel state for the case's layout (expert-parallel size
   included), loads that checkpoint, trains STEPS steps and records the global-batch loss of each step, the router's
   aux loss and the tokens routed to each expert;
3. the resume case: trains RESUME_AT steps at EP2, saves a full checkpoint, builds an EP4 engine, loads it (the
   distributed checkpoint reshards the experts) and trains the remaining steps.

Rank 0 writes ``{case: {"losses": [...], ...}}`` as JSON; tests/integration/test_megatron_moe.py asserts on it.
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
STEPS = 4
RESUME_AT = 2

BASE = {
    "name": "mg_moe",
    "model": {"family": "gpt", "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 16,
              "vocab_size": 512, "ffn_hidden_size": 64, "hidden_dropout": 0.0, "attention_dropout": 0.0,
              "add_bias_linear": False, "num_experts": 4, "moe_router_topk": 2},
    "parallel": {"tensor_size": 1, "pipeline_size": 1, "data_size": -1, "expert_size": 1},
    "training": {"micro_batch_size": 1, "global_batch_size": 8, "train_iters": STEPS, "lr": 2e-3, "min_lr": 2e-4,
                 "lr_warmup_iters": 1, "precision": "fp32", "seed": 1234, "clip_grad": 1.0},
    "backend": {"kind": "megatron", "megatron": {"distributed_optimizer": False}},
    "data": {"source": "synthetic"},
    "cluster": {"nodes": 1, "gpus_per_node": WORLD, "gpu_type": "cpu", "cpus_per_task": 1},
}

# name -> --set style overrides; "EP1 (DP4)" is the reference.
CASES: dict[str, list[str]] = {
    "EP1 (DP4)": [],
    "EP2": ["parallel.expert_size=2"],
    "EP4": ["parallel.expert_size=4"],
    "EP2 distributed optimizer": ["parallel.expert_size=2", "backend.megatron.distributed_optimizer=true"],
    "EP2xTP2": ["parallel.expert_size=2", "parallel.tensor_size=2", "parallel.sequence_parallel=true"],
}
RESUMES: dict[str, tuple[str, str]] = {"resume EP2 -> EP4": ("EP2", "EP4")}


def make_recipe(sets: list[str]):
    from hpc_tools.recipe.load import resolve

    return resolve(BASE, sets, source="moe_driver")


def run_steps(engine, recipe, layout, first: int, last: int) -> dict[str, list]:
    """Train steps first..last; every rank returns the global losses and the router figures of each step."""
    import torch.distributed as dist

    from hpc_tools.train.data import build_samples, microbatches_for_step

    samples = build_samples(recipe)
    out: dict[str, list] = {"losses": [], "aux_loss": [], "tokens_per_expert": [], "imbalance": [], "step_s": []}
    for step in range(first, last + 1):
        t0 = time.perf_counter()
        result = engine.train_step(step, microbatches_for_step(samples, step, engine.coords.dp_rank, layout))
        out["step_s"].append(time.perf_counter() - t0)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, result.loss)
        out["losses"].append(next(x for x in gathered if x is not None))
        router = engine.router_load()
        out["aux_loss"].append(router["moe_aux_loss"])
        out["tokens_per_expert"].append(router["moe_tokens_per_expert"])
        out["imbalance"].append(router["moe_load_imbalance"])
    return out


def build(case: str):
    from hpc_tools.layout import ParallelLayout
    from hpc_tools.train.megatron.engine import Engine

    recipe = make_recipe(CASES[case])
    layout = ParallelLayout.from_recipe(recipe)
    return Engine(recipe, layout, "cpu"), recipe, layout


def rank_main(out: Path, only: list[str]) -> None:
    import torch.distributed as dist

    from hpc_tools.checkpoints.dirs import CheckpointDirs
    from hpc_tools.train.megatron import checkpoint
    from hpc_tools.train.megatron.trainer import _quiet_megatron

    _quiet_megatron()
    dist.init_process_group("gloo")
    work = Path(os.environ["MG_DRIVER_WORK"])
    results: dict[str, dict] = {}
    init = CheckpointDirs(work / "init")
    engine, _, _ = build("EP1 (DP4)")
    checkpoint.save(engine, init, 0, model_only=True)
    engine.close()

    for case in CASES:
        if only and case not in only:
            continue
        engine, recipe, layout = build(case)
        checkpoint.load(engine, init.final_path(0))
        results[case] = {**run_steps(engine, recipe, layout, 1, STEPS), "layout": layout.describe()}
        engine.close()

    for name, (before, after) in RESUMES.items():
        if only and name not in only:
            continue
        dirs = CheckpointDirs(work / "resume")
        engine, recipe, layout = build(before)
        checkpoint.load(engine, init.final_path(0))
        first = run_steps(engine, recipe, layout, 1, RESUME_AT)
        checkpoint.save(engine, dirs, RESUME_AT)
        engine.close()
        engine, recipe, layout = build(after)
        step = checkpoint.load(engine, dirs.newest())
        rest = run_steps(engine, recipe, layout, step + 1, STEPS)
        engine.close()
        results[name] = {"losses": first["losses"] + rest["losses"], "resumed_at": step,
                         "layout": layout.describe(), "reference": before}

    if dist.get_rank() == 0:
        out.write_text(json.dumps(results, indent=2))
    dist.barrier()
    dist.destroy_process_group()


def launch(out: Path, only: list[str], timeout_s: float = 600) -> int:
    """Start WORLD ranks of this script and wait for them; returns the first non-zero exit code (124: timed out)."""
    from hpc_tools.testing.spawn import RanksFailed, spawn_ranks

    with tempfile.TemporaryDirectory(prefix="moe_driver_") as work:
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
