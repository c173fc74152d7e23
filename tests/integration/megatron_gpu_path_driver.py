"""The GPU path's checkpoint cases, run on CPU in ONE launch of 2 gloo ranks (data-parallel size 2).

    python tests/integration/megatron_gpu_path_driver.py --out results.json

1. ``te <name>``: megatron-core as it is when Transformer Engine imports (its optimizer is TE's ``FusedAdam``; here
   ``hpc_tools.testing.te_fused_adam.FusedAdamDouble``, the same state contract on CPU): train 4 steps without a
   break, and 2 steps + save + a fresh engine + load + 2 steps; both loss curves are recorded.
2. ``overlap``: ``overlap_param_gather`` on. The weights a checkpoint written right after an optimizer step holds
   must be the gathered ones, i.e. those of the same training with the gather done synchronously in the step
   (overlap off); and resuming with overlap on must reproduce the uninterrupted run.

With ``--device cuda`` (the GPU tier, tests/integration/test_gpu_tier.py) the same cases run over NCCL on this
node's GPUs (up to 2; the overlap case needs 2) with megatron-core's real optimizer (TE's FusedAdam when TE imports)
instead of the double.

Rank 0 writes JSON; the assertions live in tests/integration/test_megatron_gpu_path.py (CPU) and test_gpu_tier.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path

import _checkout  # noqa: F401  (this checkout on sys.path, before any hpc_tools import)

WORLD = 2
STEPS = 4
RESUME_AT = 2
DEVICE = os.environ.get("MG_DEVICE", "cpu")


def small() -> list[str]:
    world = int(os.environ.get("WORLD_SIZE", WORLD))
    gpu = ["cluster.gpu_type=H100-SXM"] if DEVICE == "cuda" else []
    return ["model.num_layers=2", "training.global_batch_size=8", f"training.train_iters={STEPS}",
            f"cluster.gpus_per_node={world}", *gpu]


OVERLAP = ["backend.megatron.overlap_grad_reduce=true", "backend.megatron.overlap_param_gather=true"]
TE_CASES = {
    "te distributed bf16": ["training.precision=bf16"],
    "te plain fp32": ["backend.megatron.distributed_optimizer=false"],
    "te distributed fp32 overlap": OVERLAP,
}


def build(sets: list[str]):
    from megatron_driver import make_recipe

    from hpc_tools.layout import ParallelLayout
    from hpc_tools.train.megatron.engine import MegatronCore

    recipe = make_recipe({}, small() + sets)
    layout = ParallelLayout.from_recipe(recipe)
    device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if DEVICE == "cuda" else "cpu"
    return MegatronCore(recipe, layout, device), recipe, layout


def train(sets: list[str], first: int, last: int, engine=None):
    """Steps first..last on a new engine (or ``engine``); returns (losses, engine)."""
    from megatron_driver import run_steps

    if engine is None:
        engine, recipe, layout = build(sets)
    else:
        recipe, layout = engine.recipe, engine.layout
    losses, _ = run_steps(engine, recipe, layout, first, last)
    return losses, engine


def weights(engine) -> dict:
    from hpc_tools.train.megatron.model import unwrap

    return {k: v.detach().float().cpu().clone() for k, v in unwrap(engine.chunks[0]).state_dict().items()
            if hasattr(v, "detach") and v.is_floating_point()}


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def resume_case(sets: list[str], work: Path) -> dict:
    """Uninterrupted vs saved-and-resumed losses, with the layer plan and the attention Transformer Engine chose
    (None without TE)."""
    from hpc_tools.checkpoints.dirs import CheckpointDirs
    from hpc_tools.train.checkpointing.saver import save_once
    from hpc_tools.train.megatron import checkpoint
    from hpc_tools.train.megatron.layers import te_attention_choice

    straight, engine = train(sets, 1, STEPS)
    engine.close()
    dirs = CheckpointDirs(work)
    first, engine = train(sets, 1, RESUME_AT)
    save_once(checkpoint.Shards(engine), dirs, RESUME_AT)
    engine.close()
    engine, _, _ = build(sets)
    saved_layers = CheckpointDirs.read_meta(dirs.newest())["layout"]["layers"]
    step = checkpoint.load(engine, dirs.newest())
    steps_after_load = sorted({g.get("step") for opt in checkpoint.inner_optimizers(engine.optimizer)
                               for g in opt.optimizer.param_groups if "step" in g})
    rest, engine = train(sets, step + 1, STEPS, engine)
    optimizer = type(checkpoint.inner_optimizers(engine.optimizer)[0].optimizer).__name__
    plan = engine.plan.describe()
    engine.close()
    return {"straight": straight, "resumed": first + rest, "group_steps_after_load": steps_after_load,
            "optimizer": optimizer, "plan": plan, "te_attention": te_attention_choice(), "saved_layers": saved_layers}


def overlap_case(work: Path) -> dict:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from hpc_tools.checkpoints.dirs import CheckpointDirs
    from hpc_tools.train.checkpointing.saver import save_once
    from hpc_tools.train.megatron import checkpoint
    from hpc_tools.train.megatron.model import unwrap

    _, engine = train([], 1, RESUME_AT)  # overlap off: the gather runs inside the optimizer step
    gathered = weights(engine)
    engine.close()
    dirs = CheckpointDirs(work)
    first, engine = train(OVERLAP, 1, RESUME_AT)
    save_once(checkpoint.Shards(engine), dirs, RESUME_AT)
    live_after_save = weights(engine)  # the hooks are back and the live weights untouched by the save
    rest, engine = train(OVERLAP, RESUME_AT + 1, STEPS, engine)  # training goes on after the save
    engine.close()
    engine, _, _ = build(OVERLAP)
    loaded = dist_checkpointing.load(checkpoint.model_state(engine), str(dirs.newest()))
    unwrap(engine.chunks[0]).load_state_dict(loaded["model0"], strict=True)
    saved = weights(engine)
    engine.close()
    diffs = [None] * dist.get_world_size()
    dist.all_gather_object(diffs, {"saved_vs_gathered": max_diff(saved, gathered),
                                   "live_vs_gathered": max_diff(live_after_save, gathered)})
    return {"per_rank": diffs, "saved_midway": first + rest, **resume_case(OVERLAP, work / "resume")}


def rank_main(out: Path) -> None:
    import torch.distributed as dist

    from hpc_tools.testing.te_fused_adam import megatron_uses_fused_adam_double
    from hpc_tools.train.megatron.trainer import _quiet_megatron

    _quiet_megatron(DEVICE)
    if DEVICE == "cuda":
        import torch

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    from hpc_tools.runtime.distenv import join_world

    join_world("nccl" if DEVICE == "cuda" else "gloo")
    work = Path(os.environ["MG_DRIVER_WORK"])
    results: dict[str, dict] = {"device": DEVICE, "world": dist.get_world_size()}
    for name, sets in TE_CASES.items():
        if DEVICE == "cuda" and dist.get_world_size() < 2 and "overlap" in name:
            continue
        with megatron_uses_fused_adam_double() if DEVICE == "cpu" else contextlib.nullcontext():
            results[name] = resume_case(sets, work / name.replace(" ", "_"))
    if dist.get_world_size() >= 2:
        results["overlap"] = overlap_case(work / "overlap")
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results, indent=2))
    dist.barrier()
    dist.destroy_process_group()


def world_for(device: str) -> int:
    """2 gloo ranks on CPU; on CUDA one rank per GPU, at most 2."""
    if device != "cuda":
        return WORLD
    import torch

    return max(1, min(WORLD, torch.cuda.device_count()))


def launch(out: Path, device: str = "cpu", timeout_s: float = 600) -> int:
    from hpc_tools.testing.spawn import spawn_exit_code

    with tempfile.TemporaryDirectory(prefix="mg_gpu_path_") as work:
        env = {"MG_DRIVER_WORK": work, "PYTHONWARNINGS": "ignore", "MG_DEVICE": device}
        return spawn_exit_code([sys.executable, __file__, "--out", str(out), "--device", device], world_for(device),
                               env=env, timeout_s=timeout_s)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file for the results (written by rank 0)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu (gloo, default) or cuda (NCCL)")
    args = parser.parse_args()
    if "RANK" not in os.environ:
        return launch(args.out, args.device)
    rank_main(args.out)
    return 0


if __name__ == "__main__":  # dist_checkpointing may spawn a Manager that re-imports __main__
    sys.exit(main())
