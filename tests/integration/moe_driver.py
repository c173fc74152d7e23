"""Mixture-of-experts layouts of a tiny dropless MoE GPT in ONE launch of 4 gloo ranks.

    python tests/integration/moe_driver.py --out results.json [--only NAME ...]
    python tests/integration/moe_driver.py --out results.json --device cuda   # the GPU tier (NCCL, TE)

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

With ``--device cuda`` (tests/integration/test_moe_gpu.py) it runs GPU_CASES instead on min(2, GPUs) ranks over NCCL
with Transformer Engine layers in bf16: context parallelism (CP2, TE's ring attention) against CP1, expert parallelism
with grouped GEMM, and FP8 (each TE recipe the GPU has) against bf16, each from one shared initial checkpoint.
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


GPU_BASE = {
    "name": "mg_moe_gpu",
    "model": {"family": "llama", "num_layers": 2, "hidden_size": 128, "num_attention_heads": 4, "seq_length": 256,
              "vocab_size": 1024, "ffn_hidden_size": 256, "hidden_dropout": 0.0, "attention_dropout": 0.0},
    "parallel": {"tensor_size": 1, "pipeline_size": 1, "data_size": -1},
    "training": {"micro_batch_size": 1, "global_batch_size": 4, "train_iters": STEPS, "lr": 2e-3, "min_lr": 2e-4,
                 "lr_warmup_iters": 1, "precision": "bf16", "seed": 1234, "clip_grad": 1.0},
    "backend": {"kind": "megatron",
                "megatron": {"distributed_optimizer": True, "transformer_impl": "transformer_engine"}},
    "data": {"source": "synthetic"},
    "cluster": {"nodes": 1, "gpus_per_node": 2, "gpu_type": "H100-SXM", "cpus_per_task": 1},
}
MOE = ["model.num_experts=4", "model.moe_router_topk=2"]
# name -> (overrides, the least GPUs it needs); the reference of a name "X ..." is "X ref".
GPU_CASES: dict[str, tuple[list[str], int]] = {
    "cp ref": ([], 2),
    "cp CP2": (["parallel.context_size=2"], 2),
    "ep ref": (MOE, 2),
    "ep EP2 grouped gemm": ([*MOE, "parallel.expert_size=2", "model.moe_grouped_gemm=true"], 2),
    "fp8 ref": ([], 1),
    "fp8 hybrid delayed": (["training.fp8=hybrid", "training.fp8_recipe=delayed"], 1),
    "fp8 e4m3 tensorwise": (["training.fp8=e4m3", "training.fp8_recipe=tensorwise"], 1),
    "fp8 e4m3 mxfp8": (["training.fp8=e4m3", "training.fp8_recipe=mxfp8"], 1),
}
FP8_CAPABILITY = {"delayed": (8, 9), "tensorwise": (8, 9), "blockwise": (9, 0), "mxfp8": (10, 0)}
"""The least CUDA compute capability of each FP8 recipe (Ada/Hopper FP8 tensor cores; MXFP8 on Blackwell)."""
DEVICE = "cpu"


def make_recipe(sets: list[str]):
    from hpc_tools.recipe.load import resolve

    if DEVICE == "cuda":
        return resolve(GPU_BASE, sets, source="moe_driver")
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
        router = engine.router_load() or {}
        out["aux_loss"].append(router.get("moe_aux_loss"))
        out["tokens_per_expert"].append(router.get("moe_tokens_per_expert"))
        out["imbalance"].append(router.get("moe_load_imbalance"))
    return out


def build(case: str):
    from hpc_tools.layout import ParallelLayout
    from hpc_tools.train.megatron.engine import MegatronCore

    if DEVICE == "cuda":
        import torch.distributed as dist

        world = dist.get_world_size()
        recipe = make_recipe([*GPU_CASES[case][0], f"cluster.gpus_per_node={world}"])
        device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
    else:
        recipe, device = make_recipe(CASES[case]), "cpu"
    layout = ParallelLayout.from_recipe(recipe)
    return MegatronCore(recipe, layout, device), recipe, layout


def gpu_cases(world: int) -> list[str]:
    """The GPU cases this machine can run: enough GPUs, and for FP8 the compute capability of its recipe."""
    import torch

    capability = torch.cuda.get_device_capability()
    out = []
    for name, (sets, gpus) in GPU_CASES.items():
        recipe = next((s.split("=")[1] for s in sets if s.startswith("training.fp8_recipe=")), None)
        if world >= gpus and (recipe is None or capability >= FP8_CAPABILITY[recipe]):
            out.append(name)
    return out


def gpu_main(out: Path) -> None:
    """GPU_CASES, each from the shared initial checkpoint of its family (``X ref``'s model)."""
    import torch
    import torch.distributed as dist

    from hpc_tools.checkpoints.dirs import CheckpointDirs
    from hpc_tools.train.checkpointing.saver import save_once
    from hpc_tools.train.megatron import checkpoint

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    from hpc_tools.runtime.distenv import join_world

    join_world("nccl")
    work = Path(os.environ["MG_DRIVER_WORK"])
    results: dict[str, dict] = {}
    inits: dict[str, CheckpointDirs] = {}
    for case in gpu_cases(dist.get_world_size()):
        family = case.split()[0]
        engine, recipe, layout = build(case)
        if family not in inits:  # the reference comes first: its fresh model is the family's start
            inits[family] = CheckpointDirs(work / f"init_{family}")
            save_once(checkpoint.Shards(engine), inits[family], 0)
        checkpoint.load(engine, inits[family].final_path(0))
        results[case] = {**run_steps(engine, recipe, layout, 1, STEPS), "layout": layout.describe(),
                         "plan": engine.plan.describe(), "config_fp8": engine.config.fp8,
                         "config_cp": engine.config.context_parallel_size,
                         "grouped_gemm": bool(getattr(engine.config, "moe_grouped_gemm", False))}
        engine.close()
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results, indent=2))
    dist.barrier()
    dist.destroy_process_group()


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
    init = CheckpointDirs(work / "init")
    engine, _, _ = build("EP1 (DP4)")
    save_once(checkpoint.Shards(engine), init, 0)
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
        save_once(checkpoint.Shards(engine), dirs, RESUME_AT)
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
    """Start the ranks of this script (WORLD on CPU, min(2, GPUs) on CUDA) and wait for them; returns the first
    non-zero exit code (124: timed out)."""
    from hpc_tools.testing.spawn import spawn_exit_code

    world = WORLD
    if DEVICE == "cuda":
        import torch

        world = max(1, min(2, torch.cuda.device_count()))
    with tempfile.TemporaryDirectory(prefix="moe_driver_") as work:
        args = [sys.executable, __file__, "--out", str(out), "--device", DEVICE,
                *sum((["--only", o] for o in only), [])]
        return spawn_exit_code(args, world, env={"MG_DRIVER_WORK": work, "PYTHONWARNINGS": "ignore"},
                               timeout_s=timeout_s)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file for the results (written by rank 0)")
    parser.add_argument("--only", action="append", default=[], help="run only these cases (repeatable)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu (gloo, default) or cuda (NCCL)")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    if "RANK" not in os.environ:
        return launch(args.out, args.only)
    if DEVICE == "cuda":
        gpu_main(args.out)
    else:
        rank_main(args.out, args.only)
    return 0


if __name__ == "__main__":  # the guard matters: dist_checkpointing starts a spawn Manager that re-imports __main__
    sys.exit(main())
